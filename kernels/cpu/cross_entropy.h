#ifndef SHARDD_KERNELS_CPU_CROSS_ENTROPY_H_
#define SHARDD_KERNELS_CPU_CROSS_ENTROPY_H_

// LM head fused with cross-entropy, fp32, row-major:
//
//   logits[t, :] = hidden[t, :] @ weight^T          hidden [T, D], weight [V,
//   D] loss_t       = logsumexp(logits[t, :]) - logits[t, targets[t]]
//
// `weight` is the LM head in the HF (out, in) layout, or the embedding table
// itself when the embeddings are tied (same [V, D] layout).
//
// Logits are never materialised for all tokens: rows are processed in blocks
// of `block_rows` (default kDefaultCrossEntropyBlockRows = 128), so the
// scratch is block_rows * V floats (128 * 32000 * 4 B = 16 MiB for a 32k
// vocabulary), independent of T. The log-sum-exp subtracts the row maximum
// and sums in double. GEMMs run on OpenBLAS (cblas_sgemm).
//
// Targets equal to `ignore_index` contribute neither loss nor gradient;
// every other target must lie in [0, V).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardd {
namespace kernels {

inline constexpr int64_t kDefaultCrossEntropyBlockRows = 128;

struct CrossEntropyOptions {
  // Targets equal to this are skipped (PyTorch's ignore_index). Any value;
  // the usual ones are -1 and -100.
  int32_t ignore_index = -1;
  // Rows per logits block (>= 1); scratch is block_rows * V floats.
  int64_t block_rows = kDefaultCrossEntropyBlockRows;
  // > 0: the logits are soft-capped, cap * tanh(logits / cap), before the
  // softmax (Gemma's final_logit_softcapping); 0: not.
  float softcap = 0.0f;
};

struct CrossEntropyResult {
  // Sum over counted tokens of -log softmax(logits)[target], in double. The
  // global mean loss is the sum of loss_sum over micro-batches and ranks
  // divided by the sum of count.
  double loss_sum = 0.0;
  // Number of targets not equal to ignore_index.
  int64_t count = 0;
  // loss_sum / count, or 0 when count == 0 (this call's local mean).
  double mean_loss = 0.0;
};

// Forward only (passes without gradients, evaluation).
// Shapes: hidden [tokens, dim], weight [vocab, dim], targets [tokens].
// Errors: INVALID_ARGUMENT for tokens < 0, dim or vocab < 1, sizes beyond
// cblas' int, block_rows < 1, null pointers with tokens > 0, or a target
// outside [0, vocab) that is not ignore_index (the message names the target,
// its position and vocab).
absl::StatusOr<CrossEntropyResult> LmHeadCrossEntropyForward(
    const float* hidden, const float* weight, int64_t tokens, int64_t dim,
    int64_t vocab, const int32_t* targets,
    const CrossEntropyOptions& options = {});

// Forward and backward in one sweep (the logits are recomputed per block, so
// nothing from a separate forward is needed). Returns the same result as
// LmHeadCrossEntropyForward.
//
// Gradients are of  loss_scale * loss_sum  (NOT of this call's mean):
//   dlogits[t, :] = loss_scale * (softmax(logits[t, :]) - onehot(targets[t]))
//   for counted t, 0 for ignored t.
// The caller passes loss_scale = 1 / (number of counted targets in the whole
// global batch, over all micro-batches and ranks). Then the gradients summed
// over micro-batches and ranks (the reduce-scatter with SUM) equal exactly
// the gradient of the global mean loss, however the batch is split; a local
// 1 / count would weight micro-batches with different counts wrongly.
// (If the reduce-scatter averages over N ranks instead, multiply loss_scale
// by N.) Use loss_scale = 1 / result.count for a standalone local mean.
//
//   dhidden [tokens, dim]: ACTIVATION gradient, overwritten (or added to when
//     `accumulate_dhidden` is true); null to skip.
//   dweight [vocab, dim]: PARAMETER gradient, ADDED to (accumulates across
//     passes and micro-batches; with tied embeddings pass the embedding
//     table's gradient buffer); null to skip (frozen head).
// Errors: as the forward, plus INVALID_ARGUMENT for a non-finite loss_scale.
// Every target is checked before any output is written.
absl::StatusOr<CrossEntropyResult> LmHeadCrossEntropyBackward(
    const float* hidden, const float* weight, int64_t tokens, int64_t dim,
    int64_t vocab, const int32_t* targets, float loss_scale, float* dhidden,
    float* dweight, bool accumulate_dhidden = false,
    const CrossEntropyOptions& options = {});

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_CROSS_ENTROPY_H_
