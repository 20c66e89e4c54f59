#ifndef SHARDD_WORKER_DATA_MARKOV_SOURCE_H_
#define SHARDD_WORKER_DATA_MARKOV_SOURCE_H_

// Synthetic training data: a seeded random first-order Markov chain over V
// tokens whose stationary distribution and entropy rate are computed, so the
// best reachable next-token loss is known in advance.
//
// Construction of a generated chain (MarkovChain::Generate). Row i uses its
// own stream SplitMix64(StreamSeed(seed, kChainDomain, i)):
//   1. `branching` = K distinct successors, drawn uniformly from [0, V)
//      (rejecting repeats), all V states when K == V.
//   2. Weights from the flat Dirichlet(1, ..., 1): the spacings of K - 1
//      sorted uniforms on [0, 1). Spacings need no libm call, so the
//      weights are bit-identical on every machine. The expected row entropy
//      is H_K - 1 nats (H_K the K-th harmonic number): 0.5 for K = 2,
//      1.083 for K = 4, 1.718 for K = 8, far below log V.
//   3. Row i = (1 - mix) * weights + mix/2 on the self-loop i -> i
//            + mix/2 on the cycle edge i -> (i + 1) mod V,
//      repeated successors merged, sorted by successor id.
// The cycle through all states makes the chain irreducible and the
// self-loop makes it aperiodic, so the stationary distribution pi is unique
// and every state has pi_i > 0. The defaults (V = 256, K = 4, mix = 0.01)
// give an entropy rate of about 1.1 nats against log 256 = 5.5.
//
// pi is found by power iteration on the lazy chain (I + P) / 2 (same pi,
// converges for every irreducible chain, periodic ones included) in double
// until ||pi P - pi||_1 < 1e-13. The entropy rate is
//   H = -sum_i pi_i sum_j P_ij log P_ij   (nats),
// the mean cross-entropy of the best possible predictor of the next token
// given the current one, i.e. the loss floor of a trained model.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/data/rng.h"
#include "worker/data/sequence_source.h"

namespace shardd {
namespace data {

struct MarkovOptions {
  int64_t vocab_size = 256;  // V, in [2, 65536].
  int32_t branching = 4;     // K, in [1, min(V, kMaxBranching)].
  // Probability mass on the self-loop plus the cycle edge, in (0, 1].
  double mix_probability = 0.01;
  uint64_t seed = 0;
};

class MarkovChain {
 public:
  static constexpr int64_t kMinVocab = 2;
  static constexpr int64_t kMaxVocab = 65536;
  static constexpr int32_t kMaxBranching = 64;

  struct Transition {
    int32_t next = 0;
    double probability = 0.0;
  };

  // A chain built as described at the top of this file. Errors:
  // INVALID_ARGUMENT naming vocab_size, branching or mix_probability when
  // out of range; INTERNAL if the stationary distribution fails to converge
  // (not expected for generated chains).
  static absl::StatusOr<MarkovChain> Generate(const MarkovOptions& options);

  // A chain with the given rows: rows[i] lists the successors of state i.
  // Zero-probability entries are dropped; each row is rescaled to sum to
  // exactly 1. Errors: INVALID_ARGUMENT when the number of rows is outside
  // [2, 65536], a successor is out of range or repeated, a probability is
  // negative or not finite, a row does not sum to 1 within 1e-9, or the
  // chain is not irreducible (pi would not be unique); INTERNAL if power
  // iteration does not converge.
  static absl::StatusOr<MarkovChain> FromRows(
      const std::vector<std::vector<Transition>>& rows);

  int64_t vocab_size() const { return vocab_size_; }
  int64_t num_transitions() const { return static_cast<int64_t>(next_.size()); }

  // Successors of `state` in increasing id order and their probabilities.
  absl::Span<const int32_t> Successors(int32_t state) const;
  absl::Span<const double> SuccessorProbabilities(int32_t state) const;
  // P(to | from); 0 for a missing edge or out-of-range ids.
  double Probability(int32_t from, int32_t to) const;
  // -sum_j P_ij log P_ij in nats.
  double RowEntropy(int32_t state) const;

  absl::Span<const double> stationary() const { return stationary_; }
  // ||pi P - pi||_1 of the computed pi.
  double stationary_residual() const { return stationary_residual_; }
  double entropy_rate() const { return entropy_rate_; }
  // Content fingerprint (V, successors, probability bits).
  uint64_t fingerprint() const { return fingerprint_; }

  // A state drawn from pi, then a successor of `state` drawn from row
  // `state`; each uses exactly one 64-bit draw compared against a
  // cumulative table, so results do not depend on any library's
  // distribution code.
  int32_t SampleStationary(SplitMix64& rng) const;
  int32_t SampleNext(int32_t state, SplitMix64& rng) const;

 private:
  MarkovChain() = default;
  // Builds the sampling tables, pi, H and the fingerprint from the CSR rows.
  absl::Status Finish();

  int64_t vocab_size_ = 0;
  std::vector<int64_t> row_begin_;  // CSR, vocab_size_ + 1 entries.
  std::vector<int32_t> next_;
  std::vector<double> probability_;
  // Cumulative row probabilities scaled to 2^64; the last of a row is
  // UINT64_MAX. Entry k is chosen when u < threshold_[k].
  std::vector<uint64_t> threshold_;
  std::vector<double> stationary_;
  std::vector<uint64_t> stationary_threshold_;
  double stationary_residual_ = 0.0;
  double entropy_rate_ = 0.0;
  uint64_t fingerprint_ = 0;
};

// Sequence k is drawn from its own stream SplitMix64(StreamSeed(seed,
// kSequenceDomain, k)): the first token from pi, each next one from the
// current token's row. So sequences are stationary, independent of each
// other, and random-access by k.
class MarkovSource : public SequenceSource {
 public:
  // Generates the chain from `options` and draws sequences with
  // options.seed. Errors: as MarkovChain::Generate.
  static absl::StatusOr<std::unique_ptr<MarkovSource>> Create(
      const MarkovOptions& options);

  MarkovSource(std::shared_ptr<const MarkovChain> chain, uint64_t seed);

  const MarkovChain& chain() const { return *chain_; }
  uint64_t seed() const { return seed_; }

  int64_t vocab_size() const override { return chain_->vocab_size(); }
  // Errors: INVALID_ARGUMENT for a negative index or an empty `out`.
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override;
  uint64_t Fingerprint() const override;
  std::string Describe() const override;
  // First order: both are the entropy rate.
  double BestLoss(int64_t) const override { return chain_->entropy_rate(); }
  double OneTokenLoss(int64_t) const override {
    return chain_->entropy_rate();
  }

 private:
  std::shared_ptr<const MarkovChain> chain_;
  uint64_t seed_;
  std::string description_;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_MARKOV_SOURCE_H_
