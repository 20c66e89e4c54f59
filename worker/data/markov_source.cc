#include "worker/data/markov_source.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/fingerprint.h"
#include "common/status_macros.h"

namespace shardd {
namespace data {
namespace {

constexpr double kStationaryTolerance = 1e-13;
constexpr int kMaxPowerIterations = 200000;
constexpr double kRowSumTolerance = 1e-9;
// 2^64 as a double, for scaling cumulative probabilities.
constexpr double kTwoTo64 = 18446744073709551616.0;

uint64_t ScaleToU64(double cumulative) {
  if (!(cumulative < 1.0)) return UINT64_MAX;
  if (cumulative <= 0.0) return 0;
  // cumulative < 1 so the product is below 2^64 and converts exactly.
  return static_cast<uint64_t>(cumulative * kTwoTo64);
}

uint64_t DoubleBits(double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Index of the first threshold above u in [begin, end), or end - 1: the
// last threshold of a table is UINT64_MAX, which u == UINT64_MAX does not
// pass, so the last entry takes that value.
int64_t PickFromTable(const uint64_t* thresholds, int64_t begin, int64_t end,
                      uint64_t u) {
  if (end - begin <= 16) {
    for (int64_t k = begin; k + 1 < end; ++k) {
      if (u < thresholds[k]) return k;
    }
    return end - 1;
  }
  const uint64_t* first = thresholds + begin;
  const uint64_t* last = thresholds + end - 1;
  return std::upper_bound(first, last, u) - thresholds;
}

// Every state reachable from 0 and 0 reachable from every state.
absl::Status CheckIrreducible(int64_t vocab_size,
                              const std::vector<int64_t>& row_begin,
                              const std::vector<int32_t>& next) {
  std::vector<std::vector<int32_t>> reverse(vocab_size);
  for (int64_t i = 0; i < vocab_size; ++i) {
    for (int64_t k = row_begin[i]; k < row_begin[i + 1]; ++k) {
      reverse[next[k]].push_back(static_cast<int32_t>(i));
    }
  }
  for (int direction = 0; direction < 2; ++direction) {
    std::vector<char> seen(vocab_size, 0);
    std::vector<int32_t> stack = {0};
    seen[0] = 1;
    while (!stack.empty()) {
      int32_t s = stack.back();
      stack.pop_back();
      auto visit = [&](int32_t t) {
        if (!seen[t]) {
          seen[t] = 1;
          stack.push_back(t);
        }
      };
      if (direction == 0) {
        for (int64_t k = row_begin[s]; k < row_begin[s + 1]; ++k) {
          visit(next[k]);
        }
      } else {
        for (int32_t t : reverse[s]) visit(t);
      }
    }
    for (int64_t i = 0; i < vocab_size; ++i) {
      if (seen[i]) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "transitions: the chain must be irreducible, but state ", i,
          direction == 0 ? " is not reachable from state 0"
                         : " cannot reach state 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MarkovChain> MarkovChain::Generate(
    const MarkovOptions& options) {
  const int64_t v = options.vocab_size;
  if (v < kMinVocab || v > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab_size must be in [", kMinVocab, ", ", kMaxVocab, "], got ", v));
  }
  const int64_t max_branching = std::min<int64_t>(v, kMaxBranching);
  if (options.branching < 1 || options.branching > max_branching) {
    return absl::InvalidArgumentError(
        absl::StrCat("branching must be in [1, min(vocab_size, ", kMaxBranching,
                     ") = ", max_branching, "], got ", options.branching));
  }
  const double mix = options.mix_probability;
  if (!(mix > 0.0 && mix <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mix_probability must be in (0, 1] (it keeps the chain irreducible "
        "and aperiodic), got ",
        mix));
  }

  MarkovChain chain;
  chain.vocab_size_ = v;
  chain.row_begin_.reserve(v + 1);
  chain.row_begin_.push_back(0);
  const int32_t k_succ = options.branching;
  std::vector<int32_t> successors;
  std::vector<double> cuts;
  std::vector<std::pair<int32_t, double>> row;
  for (int64_t i = 0; i < v; ++i) {
    SplitMix64 rng(StreamSeed(options.seed, kChainDomain, i));
    successors.clear();
    if (k_succ == v) {
      for (int32_t j = 0; j < v; ++j) successors.push_back(j);
    } else {
      while (static_cast<int32_t>(successors.size()) < k_succ) {
        int32_t s = static_cast<int32_t>(rng.NextBelow(v));
        if (std::find(successors.begin(), successors.end(), s) ==
            successors.end()) {
          successors.push_back(s);
        }
      }
    }
    // Flat Dirichlet weights as spacings of K - 1 sorted uniforms. Every
    // uniform is a multiple of 2^-53 in [0, 1), so the spacings are exact
    // and sum to exactly 1.
    cuts.clear();
    cuts.push_back(0.0);
    for (int32_t c = 0; c + 1 < k_succ; ++c) cuts.push_back(rng.NextDouble());
    cuts.push_back(1.0);
    std::sort(cuts.begin(), cuts.end());

    row.clear();
    for (int32_t c = 0; c < k_succ; ++c) {
      row.emplace_back(successors[c], (1.0 - mix) * (cuts[c + 1] - cuts[c]));
    }
    row.emplace_back(static_cast<int32_t>(i), 0.5 * mix);
    row.emplace_back(static_cast<int32_t>((i + 1) % v), 0.5 * mix);
    std::sort(row.begin(), row.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    double total = 0.0;
    for (size_t a = 0; a < row.size();) {
      size_t b = a;
      double p = 0.0;
      while (b < row.size() && row[b].first == row[a].first)
        p += row[b++].second;
      if (p > 0.0) {
        chain.next_.push_back(row[a].first);
        chain.probability_.push_back(p);
        total += p;
      }
      a = b;
    }
    // Rounding can leave the sum a few ulps off 1; rescale so the table's
    // probabilities and the entropy use the same numbers.
    for (int64_t k = chain.row_begin_.back();
         k < static_cast<int64_t>(chain.probability_.size()); ++k) {
      chain.probability_[k] /= total;
    }
    chain.row_begin_.push_back(static_cast<int64_t>(chain.next_.size()));
  }
  SHARDD_RETURN_IF_ERROR(chain.Finish());
  return chain;
}

absl::StatusOr<MarkovChain> MarkovChain::FromRows(
    const std::vector<std::vector<Transition>>& rows) {
  const int64_t v = static_cast<int64_t>(rows.size());
  if (v < kMinVocab || v > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transitions: the number of rows (vocab_size) must be in [", kMinVocab,
        ", ", kMaxVocab, "], got ", v));
  }
  MarkovChain chain;
  chain.vocab_size_ = v;
  chain.row_begin_.push_back(0);
  std::vector<Transition> row;
  for (int64_t i = 0; i < v; ++i) {
    row.clear();
    double total = 0.0;
    for (const Transition& t : rows[i]) {
      if (t.next < 0 || t.next >= v) {
        return absl::InvalidArgumentError(
            absl::StrCat("transitions[", i, "]: successor ", t.next,
                         " is outside [0, ", v, ")"));
      }
      if (!std::isfinite(t.probability) || t.probability < 0.0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "transitions[", i, "]: probability of successor ", t.next,
            " must be finite and >= 0, got ", t.probability));
      }
      total += t.probability;
      if (t.probability > 0.0) row.push_back(t);
    }
    if (std::fabs(total - 1.0) > kRowSumTolerance) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transitions[", i, "]: probabilities must sum to 1, got ",
          absl::StrFormat("%.17g", total)));
    }
    std::sort(row.begin(), row.end(),
              [](const Transition& a, const Transition& b) {
                return a.next < b.next;
              });
    for (size_t k = 0; k < row.size(); ++k) {
      if (k > 0 && row[k].next == row[k - 1].next) {
        return absl::InvalidArgumentError(
            absl::StrCat("transitions[", i, "]: successor ", row[k].next,
                         " is listed more than once"));
      }
      chain.next_.push_back(row[k].next);
      chain.probability_.push_back(row[k].probability / total);
    }
    chain.row_begin_.push_back(static_cast<int64_t>(chain.next_.size()));
  }
  SHARDD_RETURN_IF_ERROR(CheckIrreducible(v, chain.row_begin_, chain.next_));
  SHARDD_RETURN_IF_ERROR(chain.Finish());
  return chain;
}

absl::Status MarkovChain::Finish() {
  const int64_t v = vocab_size_;
  // Sampling tables.
  threshold_.resize(next_.size());
  for (int64_t i = 0; i < v; ++i) {
    double cumulative = 0.0;
    for (int64_t k = row_begin_[i]; k < row_begin_[i + 1]; ++k) {
      cumulative += probability_[k];
      threshold_[k] = ScaleToU64(cumulative);
    }
    threshold_[row_begin_[i + 1] - 1] = UINT64_MAX;
  }

  // Stationary distribution by power iteration on the lazy chain.
  std::vector<double> pi(v, 1.0 / static_cast<double>(v));
  std::vector<double> pushed(v);
  double residual = 0.0;
  bool converged = false;
  for (int iteration = 0; iteration < kMaxPowerIterations; ++iteration) {
    std::fill(pushed.begin(), pushed.end(), 0.0);
    for (int64_t i = 0; i < v; ++i) {
      const double mass = pi[i];
      for (int64_t k = row_begin_[i]; k < row_begin_[i + 1]; ++k) {
        pushed[next_[k]] += mass * probability_[k];
      }
    }
    residual = 0.0;
    for (int64_t i = 0; i < v; ++i) residual += std::fabs(pushed[i] - pi[i]);
    if (residual < kStationaryTolerance) {
      converged = true;
      break;
    }
    double total = 0.0;
    for (int64_t i = 0; i < v; ++i) {
      pi[i] = 0.5 * (pi[i] + pushed[i]);
      total += pi[i];
    }
    for (int64_t i = 0; i < v; ++i) pi[i] /= total;
  }
  if (!converged) {
    return absl::InternalError(absl::StrCat(
        "stationary distribution did not converge in ", kMaxPowerIterations,
        " iterations (L1 residual ", residual, ")"));
  }
  stationary_ = std::move(pi);
  stationary_residual_ = residual;
  stationary_threshold_.resize(v);
  double cumulative = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    cumulative += stationary_[i];
    stationary_threshold_[i] = ScaleToU64(cumulative);
  }
  stationary_threshold_[v - 1] = UINT64_MAX;

  entropy_rate_ = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    entropy_rate_ += stationary_[i] * RowEntropy(static_cast<int32_t>(i));
  }

  Fingerprint64 fp;
  fp.AddString("markov_chain");
  fp.AddInt(v);
  for (int64_t i = 0; i <= v; ++i) fp.AddInt(row_begin_[i]);
  for (size_t k = 0; k < next_.size(); ++k) {
    fp.AddInt(next_[k]);
    fp.AddInt(static_cast<int64_t>(DoubleBits(probability_[k])));
  }
  fingerprint_ = fp.value();
  return absl::OkStatus();
}

absl::Span<const int32_t> MarkovChain::Successors(int32_t state) const {
  if (state < 0 || state >= vocab_size_) return {};
  return absl::MakeConstSpan(next_.data() + row_begin_[state],
                             row_begin_[state + 1] - row_begin_[state]);
}

absl::Span<const double> MarkovChain::SuccessorProbabilities(
    int32_t state) const {
  if (state < 0 || state >= vocab_size_) return {};
  return absl::MakeConstSpan(probability_.data() + row_begin_[state],
                             row_begin_[state + 1] - row_begin_[state]);
}

double MarkovChain::Probability(int32_t from, int32_t to) const {
  if (from < 0 || from >= vocab_size_) return 0.0;
  const int32_t* first = next_.data() + row_begin_[from];
  const int32_t* last = next_.data() + row_begin_[from + 1];
  const int32_t* it = std::lower_bound(first, last, to);
  if (it == last || *it != to) return 0.0;
  return probability_[it - next_.data()];
}

double MarkovChain::RowEntropy(int32_t state) const {
  double h = 0.0;
  for (double p : SuccessorProbabilities(state)) h -= p * std::log(p);
  return h;
}

int32_t MarkovChain::SampleStationary(SplitMix64& rng) const {
  return static_cast<int32_t>(
      PickFromTable(stationary_threshold_.data(), 0, vocab_size_, rng.Next()));
}

int32_t MarkovChain::SampleNext(int32_t state, SplitMix64& rng) const {
  return next_[PickFromTable(threshold_.data(), row_begin_[state],
                             row_begin_[state + 1], rng.Next())];
}

absl::StatusOr<std::unique_ptr<MarkovSource>> MarkovSource::Create(
    const MarkovOptions& options) {
  SHARDD_ASSIGN_OR_RETURN(MarkovChain chain, MarkovChain::Generate(options));
  return std::make_unique<MarkovSource>(
      std::make_shared<const MarkovChain>(std::move(chain)), options.seed);
}

MarkovSource::MarkovSource(std::shared_ptr<const MarkovChain> chain,
                           uint64_t seed)
    : chain_(std::move(chain)), seed_(seed) {
  description_ = absl::StrFormat(
      "markov(vocab=%d, transitions=%d, entropy_rate=%.6f nats, seed=%d)",
      chain_->vocab_size(), chain_->num_transitions(), chain_->entropy_rate(),
      seed_);
}

absl::Status MarkovSource::Fill(int64_t index, absl::Span<int32_t> out) const {
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence index must be >= 0, got ", index));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError("sequence length must be >= 1, got 0");
  }
  SplitMix64 rng(
      StreamSeed(seed_, kSequenceDomain, static_cast<uint64_t>(index)));
  int32_t state = chain_->SampleStationary(rng);
  out[0] = state;
  for (size_t t = 1; t < out.size(); ++t) {
    state = chain_->SampleNext(state, rng);
    out[t] = state;
  }
  return absl::OkStatus();
}

uint64_t MarkovSource::Fingerprint() const {
  Fingerprint64 fp;
  fp.AddString("markov_source");
  fp.AddInt(static_cast<int64_t>(chain_->fingerprint()));
  fp.AddInt(static_cast<int64_t>(seed_));
  return fp.value();
}

std::string MarkovSource::Describe() const { return description_; }

}  // namespace data
}  // namespace shardd
