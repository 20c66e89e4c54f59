#include "worker/data/order_k_source.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace shardd {
namespace data {
namespace {

using ::shardd::StatusIs;
using ::testing::HasSubstr;

constexpr int kSequences = 20000;
constexpr int kSeq = 32;  // Targets per sequence.

TEST(OrderKSourceTest, DeterministicPerIndex) {
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, OrderKSource::Create({}));
  EXPECT_EQ(source->vocab_size(), 64);
  std::vector<int32_t> a(kSeq + 1), b(kSeq + 1), c(kSeq + 1);
  SHARDD_ASSERT_OK(source->Fill(7, absl::MakeSpan(a)));
  SHARDD_ASSERT_OK(source->Fill(7, absl::MakeSpan(b)));
  SHARDD_ASSERT_OK(source->Fill(8, absl::MakeSpan(c)));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (int32_t x : a) {
    EXPECT_GE(x, 0);
    EXPECT_LT(x, 64);
  }
}

// The true predictor's mean loss on sampled sequences estimates BestLoss;
// the plug-in conditional entropy of a token given the previous one
// estimates OneTokenLoss. Both within 5 standard errors (plus the plug-in
// estimator's bias, at most cells / (2 n) nats).
TEST(OrderKSourceTest, LossesMatchSampledSequences) {
  OrderKOptions options;
  options.seed = 3;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto source, OrderKSource::Create(options));
  const int64_t vb = options.lag_vocab, k = options.order;
  const std::vector<int32_t>& sigma = source->permutation();
  const double q_other = (1.0 - options.keep) / (vb - 1);
  std::vector<int32_t> seq(kSeq + 1);
  double sum = 0, sum_sq = 0;
  int64_t n = 0;
  const int64_t v = source->vocab_size();
  std::vector<int64_t> pairs(v * v, 0), firsts(v, 0), b_counts(vb, 0);
  for (int i = 0; i < kSequences; ++i) {
    SHARDD_ASSERT_OK(source->Fill(i, absl::MakeSpan(seq)));
    for (int t = 1; t <= kSeq; ++t) {
      const int32_t a = seq[t] / vb, b = seq[t] % vb;
      const int32_t a_prev = seq[t - 1] / vb;
      double p = source->chain().Probability(a_prev, a);
      if (t < k) {
        p /= vb;
      } else {
        const int32_t want = sigma[seq[t - k] % vb];
        p *= b == want ? options.keep : q_other;
      }
      ASSERT_GT(p, 0.0) << "sequence " << i << " token " << t;
      const double loss = -std::log(p);
      sum += loss;
      sum_sq += loss * loss;
      ++n;
      ++pairs[seq[t - 1] * v + seq[t]];
      ++firsts[seq[t - 1]];
      ++b_counts[b];
    }
  }
  const double mean = sum / n;
  const double se = std::sqrt((sum_sq / n - mean * mean) / n);
  EXPECT_NEAR(mean, source->BestLoss(kSeq), 5 * se);
  EXPECT_LT(source->BestLoss(kSeq), source->OneTokenLoss(kSeq) - 0.5);
  EXPECT_NEAR(source->BestLoss(1000000), source->entropy_rate(), 1e-4);

  double conditional = 0;
  for (int64_t x = 0; x < v; ++x) {
    for (int64_t y = 0; y < v; ++y) {
      const int64_t c = pairs[x * v + y];
      if (c > 0) conditional -= c * std::log(static_cast<double>(c) / firsts[x]);
    }
  }
  conditional /= n;
  // Plug-in bias: at most (cells - rows) / (2 n); the spread of the
  // estimate is about that of one loss sample over sqrt(n).
  const double bias = static_cast<double>(v * v - v) / (2.0 * n);
  EXPECT_NEAR(conditional, source->OneTokenLoss(kSeq), bias + 5 * se);
  // b is uniform at every position: counts within 5 binomial deviations.
  for (int64_t b = 0; b < vb; ++b) {
    const double expect = static_cast<double>(n) / vb;
    EXPECT_NEAR(b_counts[b], expect, 5 * std::sqrt(expect)) << "b = " << b;
  }
}

TEST(OrderKSourceTest, RefusesBadOptions) {
  OrderKOptions options;
  options.order = 1;
  EXPECT_THAT(OrderKSource::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("order")));
  options = OrderKOptions();
  options.keep = 1.5;
  EXPECT_THAT(OrderKSource::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("keep")));
  options = OrderKOptions();
  options.lag_vocab = 1;
  EXPECT_THAT(OrderKSource::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lag_vocab")));
}

}  // namespace
}  // namespace data
}  // namespace shardd
