#include "worker/data/markov_source.h"

#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace data {
namespace {

using ::testing::HasSubstr;
using Rows = std::vector<std::vector<MarkovChain::Transition>>;

// -sum p log p of a distribution given explicitly.
double Entropy(std::initializer_list<double> ps) {
  double h = 0.0;
  for (double p : ps) h -= p * std::log(p);
  return h;
}

// ||pi P - pi||_1 computed from the public accessors.
double StationaryResidual(const MarkovChain& chain) {
  const int64_t v = chain.vocab_size();
  std::vector<double> pushed(v, 0.0);
  for (int32_t i = 0; i < v; ++i) {
    auto next = chain.Successors(i);
    auto prob = chain.SuccessorProbabilities(i);
    for (size_t k = 0; k < next.size(); ++k) {
      pushed[next[k]] += chain.stationary()[i] * prob[k];
    }
  }
  double residual = 0.0;
  for (int32_t i = 0; i < v; ++i) {
    residual += std::fabs(pushed[i] - chain.stationary()[i]);
  }
  return residual;
}

TEST(MarkovChainTest, TwoStateChainMatchesClosedForm) {
  // P = [[1-a, a], [b, 1-b]]: pi = (b, a) / (a + b) and
  // H = pi_0 h(a) + pi_1 h(b) with h the binary entropy.
  const double a = 0.3;
  const double b = 0.1;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      MarkovChain chain,
      MarkovChain::FromRows(Rows{{{0, 1 - a}, {1, a}}, {{0, b}, {1, 1 - b}}}));
  ASSERT_EQ(chain.vocab_size(), 2);
  EXPECT_NEAR(chain.stationary()[0], 0.25, 1e-12);
  EXPECT_NEAR(chain.stationary()[1], 0.75, 1e-12);
  const double expected =
      0.25 * Entropy({a, 1 - a}) + 0.75 * Entropy({b, 1 - b});
  EXPECT_NEAR(chain.entropy_rate(), expected, 1e-12);
  EXPECT_NEAR(chain.RowEntropy(0), Entropy({0.3, 0.7}), 1e-15);
  EXPECT_DOUBLE_EQ(chain.Probability(1, 0), b);
  EXPECT_LT(StationaryResidual(chain), 1e-13);
}

TEST(MarkovChainTest, PeriodicCycleHasZeroEntropyAndUniformPi) {
  // Deterministic 3-cycle: periodic, so plain power iteration would not
  // settle from a non-uniform start; the lazy chain does.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      MarkovChain chain,
      MarkovChain::FromRows(Rows{{{1, 1.0}}, {{2, 1.0}}, {{0, 1.0}}}));
  EXPECT_DOUBLE_EQ(chain.entropy_rate(), 0.0);
  for (double p : chain.stationary()) EXPECT_NEAR(p, 1.0 / 3, 1e-13);
}

TEST(MarkovChainTest, NonUniformPiFromPeriodicChain) {
  // 0 -> 1 always; 1 -> 0 or 2 half each; 2 -> 1 always. Period 2.
  // Balance: pi_1 = pi_0 + pi_2, pi_0 = pi_2 = pi_1 / 2 -> (1/4, 1/2, 1/4);
  // only state 1 is random: H = 1/2 * log 2.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      MarkovChain chain, MarkovChain::FromRows(Rows{
                             {{1, 1.0}}, {{0, 0.5}, {2, 0.5}}, {{1, 1.0}}}));
  EXPECT_NEAR(chain.stationary()[0], 0.25, 1e-13);
  EXPECT_NEAR(chain.stationary()[1], 0.5, 1e-13);
  EXPECT_NEAR(chain.stationary()[2], 0.25, 1e-13);
  EXPECT_NEAR(chain.entropy_rate(), 0.5 * std::log(2.0), 1e-13);
}

TEST(MarkovChainTest, DoublyStochasticChainHasUniformPi) {
  // Columns also sum to 1, so pi is uniform and H is the mean row entropy;
  // every row is a permutation of (0.5, 0.3, 0.2).
  SHARDD_ASSERT_OK_AND_ASSIGN(MarkovChain chain,
                              MarkovChain::FromRows(Rows{
                                  {{0, 0.5}, {1, 0.3}, {2, 0.2}},
                                  {{0, 0.2}, {1, 0.5}, {2, 0.3}},
                                  {{0, 0.3}, {1, 0.2}, {2, 0.5}},
                              }));
  for (double p : chain.stationary()) EXPECT_NEAR(p, 1.0 / 3, 1e-13);
  EXPECT_NEAR(chain.entropy_rate(), Entropy({0.5, 0.3, 0.2}), 1e-13);
}

TEST(MarkovChainTest, FromRowsDropsZerosAndSortsSuccessors) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      MarkovChain chain,
      MarkovChain::FromRows(Rows{{{1, 0.6}, {0, 0.4}}, {{1, 0.0}, {0, 1.0}}}));
  EXPECT_THAT(chain.Successors(0), ::testing::ElementsAre(0, 1));
  EXPECT_THAT(chain.Successors(1), ::testing::ElementsAre(0));
  EXPECT_EQ(chain.num_transitions(), 3);
  EXPECT_EQ(chain.Probability(1, 1), 0.0);
  EXPECT_EQ(chain.Probability(5, 0), 0.0);
}

TEST(MarkovChainTest, FromRowsRejectsBadInput) {
  EXPECT_THAT(MarkovChain::FromRows(Rows{{{0, 1.0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("number of rows")));
  EXPECT_THAT(MarkovChain::FromRows(Rows{{{2, 1.0}}, {{0, 1.0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("transitions[0]: successor 2")));
  EXPECT_THAT(MarkovChain::FromRows(Rows{{{0, 1.5}, {1, -0.5}}, {{0, 1.0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(">= 0")));
  EXPECT_THAT(
      MarkovChain::FromRows(Rows{{{0, 0.5}, {1, 0.4}}, {{0, 1.0}}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must sum to 1")));
  EXPECT_THAT(MarkovChain::FromRows(Rows{{{1, 0.5}, {1, 0.5}}, {{0, 1.0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("more than once")));
  EXPECT_THAT(
      MarkovChain::FromRows(Rows{{{0, NAN}, {1, 1.0}}, {{0, 1.0}}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("finite")));
  // Two absorbing states: pi is not unique.
  EXPECT_THAT(
      MarkovChain::FromRows(Rows{{{0, 1.0}}, {{1, 1.0}}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("irreducible")));
  // 1 is reachable from 0 but never returns.
  EXPECT_THAT(MarkovChain::FromRows(Rows{{{0, 0.5}, {1, 0.5}}, {{1, 1.0}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cannot reach state 0")));
}

TEST(MarkovChainTest, GenerateRejectsBadOptions) {
  auto generate = [](int64_t v, int32_t k, double mix) {
    MarkovOptions options;
    options.vocab_size = v;
    options.branching = k;
    options.mix_probability = mix;
    return MarkovChain::Generate(options);
  };
  EXPECT_THAT(generate(1, 1, 0.01),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("vocab_size must be in [2, 65536]")));
  EXPECT_THAT(
      generate(65537, 4, 0.01),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab_size")));
  EXPECT_THAT(
      generate(256, 0, 0.01),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("branching")));
  EXPECT_THAT(
      generate(256, 65, 0.01),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("branching")));
  EXPECT_THAT(generate(8, 9, 0.01),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("branching must be in [1, min(vocab_size")));
  EXPECT_THAT(generate(256, 4, 0.0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("mix_probability")));
  EXPECT_THAT(generate(256, 4, 1.5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("mix_probability")));
  EXPECT_THAT(generate(256, 4, NAN),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("mix_probability")));
}

TEST(MarkovChainTest, GeneratedChainHasDocumentedStructure) {
  MarkovOptions options;  // V = 256, K = 4, mix = 0.01.
  options.seed = 11;
  SHARDD_ASSERT_OK_AND_ASSIGN(MarkovChain chain,
                              MarkovChain::Generate(options));
  const int64_t v = options.vocab_size;
  double pi_total = 0.0;
  double entropy = 0.0;
  for (int32_t i = 0; i < v; ++i) {
    auto next = chain.Successors(i);
    auto prob = chain.SuccessorProbabilities(i);
    EXPECT_LE(next.size(), static_cast<size_t>(options.branching + 2));
    double row_total = 0.0;
    for (size_t k = 0; k < next.size(); ++k) {
      if (k > 0) {
        EXPECT_LT(next[k - 1], next[k]);
      }
      EXPECT_GT(prob[k], 0.0);
      row_total += prob[k];
      entropy -= chain.stationary()[i] * prob[k] * std::log(prob[k]);
    }
    EXPECT_NEAR(row_total, 1.0, 1e-15);
    // The self-loop and the cycle edge carry at least mix / 2 each.
    EXPECT_GE(chain.Probability(i, i), 0.005 * (1 - 1e-12));
    EXPECT_GE(chain.Probability(i, (i + 1) % v), 0.005 * (1 - 1e-12));
    EXPECT_GT(chain.stationary()[i], 0.0);
    pi_total += chain.stationary()[i];
  }
  EXPECT_NEAR(pi_total, 1.0, 1e-12);
  EXPECT_LT(StationaryResidual(chain), 1e-12);
  EXPECT_NEAR(chain.entropy_rate(), entropy, 1e-12);
  // Flat Dirichlet rows of K = 4 have mean entropy H_4 - 1 = 13/12 nats;
  // the pi-weighted mean over 256 rows varies by a few hundredths and the
  // mixing adds about 0.06. Far below log 256 = 5.55.
  EXPECT_GT(chain.entropy_rate(), 0.9);
  EXPECT_LT(chain.entropy_rate(), 1.4);
}

// Mean row entropy of the Dirichlet part over many rows against the closed
// form E[H] = H_K - 1 for a flat Dirichlet (H_K the harmonic number). Tiny
// mix so the self-loop and cycle edge barely move it.
TEST(MarkovChainTest, RowEntropiesMatchFlatDirichletExpectation) {
  for (int32_t k : {2, 4, 8}) {
    MarkovOptions options;
    options.vocab_size = 4096;
    options.branching = k;
    options.mix_probability = 1e-9;
    options.seed = 3;
    SHARDD_ASSERT_OK_AND_ASSIGN(MarkovChain chain,
                                MarkovChain::Generate(options));
    double mean = 0.0;
    for (int32_t i = 0; i < options.vocab_size; ++i) {
      mean += chain.RowEntropy(i);
    }
    mean /= options.vocab_size;
    double harmonic = 0.0;
    for (int j = 1; j <= k; ++j) harmonic += 1.0 / j;
    // Per-row standard deviation is below 0.4, so the mean of 4096 rows
    // is within ~0.006 (1 sigma).
    EXPECT_NEAR(mean, harmonic - 1.0, 0.03) << "branching " << k;
  }
}

TEST(MarkovChainTest, FullBranchingUsesEveryState) {
  MarkovOptions options;
  options.vocab_size = 8;
  options.branching = 8;
  SHARDD_ASSERT_OK_AND_ASSIGN(MarkovChain chain,
                              MarkovChain::Generate(options));
  for (int32_t i = 0; i < 8; ++i) {
    EXPECT_THAT(chain.Successors(i),
                ::testing::ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  }
}

TEST(MarkovChainTest, LargestVocabularyConverges) {
  MarkovOptions options;
  options.vocab_size = MarkovChain::kMaxVocab;
  SHARDD_ASSERT_OK_AND_ASSIGN(MarkovChain chain,
                              MarkovChain::Generate(options));
  EXPECT_LT(chain.stationary_residual(), 1e-13);
  const double total = std::accumulate(chain.stationary().begin(),
                                       chain.stationary().end(), 0.0);
  EXPECT_NEAR(total, 1.0, 1e-12);
  EXPECT_LT(StationaryResidual(chain), 1e-12);
  EXPECT_GT(chain.entropy_rate(), 0.9);
  EXPECT_LT(chain.entropy_rate(), 1.3);
}

TEST(MarkovChainTest, SampleNextFollowsTheRow) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      MarkovChain chain,
      MarkovChain::FromRows(Rows{
          {{0, 0.1}, {1, 0.2}, {2, 0.7}}, {{0, 1.0}}, {{1, 0.5}, {2, 0.5}}}));
  SplitMix64 rng(5);
  const int draws = 200000;
  std::vector<int> counts(3, 0);
  for (int d = 0; d < draws; ++d) ++counts[chain.SampleNext(0, rng)];
  // Binomial standard deviation at most sqrt(0.25 / n) ~ 0.0011.
  EXPECT_NEAR(counts[0] / double{draws}, 0.1, 0.006);
  EXPECT_NEAR(counts[1] / double{draws}, 0.2, 0.006);
  EXPECT_NEAR(counts[2] / double{draws}, 0.7, 0.006);
  for (int d = 0; d < 1000; ++d) EXPECT_EQ(chain.SampleNext(1, rng), 0);
}

TEST(MarkovSourceTest, EmpiricalLossApproachesEntropyRate) {
  MarkovOptions options;
  options.seed = 7;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, MarkovSource::Create(options));
  const MarkovChain& chain = source->chain();
  const int sequences = 2000;
  const int length = 513;
  std::vector<int32_t> tokens(length);
  std::vector<double> visits(chain.vocab_size(), 0.0);
  double loss = 0.0;
  int64_t transitions = 0;
  for (int k = 0; k < sequences; ++k) {
    SHARDD_ASSERT_OK(source->Fill(k, absl::MakeSpan(tokens)));
    for (int t = 0; t < length; ++t) {
      ASSERT_GE(tokens[t], 0);
      ASSERT_LT(tokens[t], chain.vocab_size());
      visits[tokens[t]] += 1.0;
      if (t == 0) continue;
      const double p = chain.Probability(tokens[t - 1], tokens[t]);
      ASSERT_GT(p, 0.0) << "impossible transition " << tokens[t - 1] << "->"
                        << tokens[t];
      loss -= std::log(p);
      ++transitions;
    }
  }
  loss /= transitions;
  // ~1M transitions with per-token loss standard deviation ~1 and short
  // correlations: the standard error is a few 1e-3.
  EXPECT_NEAR(loss, chain.entropy_rate(), 0.01);
  // Sequences start stationary, so visit frequencies follow pi. Expected L1
  // error ~ sqrt(V / N) ~ 0.02.
  double l1 = 0.0;
  const double total = double{sequences} * length;
  for (int64_t i = 0; i < chain.vocab_size(); ++i) {
    l1 += std::fabs(visits[i] / total - chain.stationary()[i]);
  }
  EXPECT_LT(l1, 0.06);
}

TEST(MarkovSourceTest, SequencesAreRandomAccess) {
  MarkovOptions options;
  options.seed = 123;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, MarkovSource::Create(options));
  const int length = 65;
  std::vector<std::vector<int32_t>> run(1000, std::vector<int32_t>(length));
  for (int k = 0; k < 1000; ++k) {
    SHARDD_ASSERT_OK(source->Fill(k, absl::MakeSpan(run[k])));
  }
  // A fresh source (separate chain construction) drawing single sequences
  // in another order sees the same tokens.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto other, MarkovSource::Create(options));
  EXPECT_EQ(other->Fingerprint(), source->Fingerprint());
  EXPECT_EQ(other->chain().entropy_rate(), source->chain().entropy_rate());
  std::vector<int32_t> alone(length);
  for (int k : {537, 0, 999, 1, 537}) {
    SHARDD_ASSERT_OK(other->Fill(k, absl::MakeSpan(alone)));
    EXPECT_EQ(alone, run[k]) << "sequence " << k;
  }
  // A shorter read is a prefix of the longer one (same stream).
  std::vector<int32_t> prefix(10);
  SHARDD_ASSERT_OK(other->Fill(42, absl::MakeSpan(prefix)));
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), run[42].begin()));
  // Different sequences differ (65 tokens from ~1 nat each).
  int equal_neighbours = 0;
  for (int k = 1; k < 1000; ++k) equal_neighbours += run[k] == run[k - 1];
  EXPECT_EQ(equal_neighbours, 0);
}

TEST(MarkovSourceTest, SeedChangesChainAndSequences) {
  MarkovOptions a;
  a.seed = 1;
  MarkovOptions b;
  b.seed = 2;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source_a, MarkovSource::Create(a));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source_b, MarkovSource::Create(b));
  EXPECT_NE(source_a->chain().fingerprint(), source_b->chain().fingerprint());
  EXPECT_NE(source_a->Fingerprint(), source_b->Fingerprint());
  // Same chain, other sequence seed: same chain fingerprint, other data.
  auto chain = std::make_shared<const MarkovChain>(source_a->chain());
  MarkovSource same_chain(chain, 99);
  EXPECT_NE(same_chain.Fingerprint(), source_a->Fingerprint());
  std::vector<int32_t> x(64), y(64);
  SHARDD_ASSERT_OK(source_a->Fill(0, absl::MakeSpan(x)));
  SHARDD_ASSERT_OK(same_chain.Fill(0, absl::MakeSpan(y)));
  EXPECT_NE(x, y);
  EXPECT_THAT(source_a->Describe(), HasSubstr("markov(vocab=256"));
}

TEST(MarkovSourceTest, FillRejectsBadArguments) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, MarkovSource::Create({}));
  std::vector<int32_t> out(4);
  EXPECT_THAT(source->Fill(-1, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sequence index")));
  EXPECT_THAT(source->Fill(0, absl::Span<int32_t>()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sequence length")));
}

TEST(MarkovSourceTest, GeneratesAMillionTokensQuickly) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, MarkovSource::Create({}));
  std::vector<int32_t> tokens(1024);
  int64_t checksum = 0;
  const absl::Time start = absl::Now();
  for (int k = 0; k < 1024; ++k) {  // 1024 x 1024 = 1M tokens.
    SHARDD_ASSERT_OK(source->Fill(k, absl::MakeSpan(tokens)));
    checksum += tokens[k];
  }
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_LT(elapsed, absl::Milliseconds(500)) << "checksum " << checksum;
}

}  // namespace
}  // namespace data
}  // namespace shardd
