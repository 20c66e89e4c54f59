#ifndef SHARDD_WORKER_DATA_ORDER_K_SOURCE_H_
#define SHARDD_WORKER_DATA_ORDER_K_SOURCE_H_

// Synthetic data of order k whose best reachable loss is known exactly, and
// on which a model that sees only the previous token (no attention) is held
// to a known, higher floor: the README's main job uses it to show that
// attention works.
//
// Token t is a pair (a_t, b_t), id a_t * V_b + b_t, of two independent
// streams:
//   a: a first-order MarkovChain over V_a states (markov_source.h), the
//      first one drawn from its stationary distribution;
//   b: b_t uniform for t < k, then b_t = (sigma(b_{t-k}) + d_t) mod V_b
//      with sigma a seeded permutation of [0, V_b) and d_t i.i.d. from q:
//      q(0) = keep, q(d) = (1 - keep) / (V_b - 1) otherwise.
// So b is k interleaved chains (t mod k), each uniform at every step (a
// permutation plus a shift keeps the uniform distribution).
//
// Losses per sequence of S + 1 tokens (S targets, t = 1..S):
//   best: the a-part costs the chain's entropy rate H_a per target; b_t
//     costs H(q) when its lag partner b_{t-k} is in the sequence (t >= k)
//     and log V_b otherwise (t < k: fresh and uniform), so
//     BestLoss(S) = H_a + ((k - 1) log V_b + (S - k + 1) H(q)) / S
//     (for S >= k); the entropy rate is H_a + H(q).
//   one previous token: b_{t-1} belongs to another of the k chains
//     (k >= 2), so given x_{t-1} the lag partner is still uniform and b_t
//     is uniform: OneTokenLoss(S) = H_a + log V_b.
// Sequence i is drawn from its own stream, so sequences are independent and
// random-access by i.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/markov_source.h"
#include "worker/data/sequence_source.h"

namespace shardd {
namespace data {

struct OrderKOptions {
  int32_t order = 3;            // k, in [2, 64].
  int64_t markov_vocab = 8;     // V_a, in [2, 256].
  int32_t markov_branching = 2; // The a-chain's successors per state.
  int64_t lag_vocab = 8;        // V_b, in [2, 256].
  double keep = 0.8;            // q(0), in [0, 1].
  uint64_t seed = 0;
};

class OrderKSource : public SequenceSource {
 public:
  // Errors: INVALID_ARGUMENT naming the option out of range; those of
  // MarkovChain::Generate.
  static absl::StatusOr<std::unique_ptr<OrderKSource>> Create(
      const OrderKOptions& options);

  int64_t vocab_size() const override;
  // Errors: INVALID_ARGUMENT for a negative index or an empty `out`.
  absl::Status Fill(int64_t index, absl::Span<int32_t> out) const override;
  uint64_t Fingerprint() const override;
  std::string Describe() const override;
  // As above; seq_len < k counts every b target as uniform.
  double BestLoss(int64_t seq_len) const override;
  double OneTokenLoss(int64_t seq_len) const override;

  // H_a + H(q), nats.
  double entropy_rate() const;
  // H(q), nats.
  double lag_entropy() const { return lag_entropy_; }
  const MarkovChain& chain() const { return *chain_; }
  const std::vector<int32_t>& permutation() const { return sigma_; }

 private:
  OrderKSource() = default;

  OrderKOptions options_;
  std::shared_ptr<const MarkovChain> chain_;
  std::vector<int32_t> sigma_;
  double lag_entropy_ = 0.0;
  // 2^64 * keep, compared with one draw (no library distribution code).
  uint64_t keep_threshold_ = 0;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_ORDER_K_SOURCE_H_
