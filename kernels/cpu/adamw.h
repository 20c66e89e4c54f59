#ifndef SHARDD_KERNELS_CPU_ADAMW_H_
#define SHARDD_KERNELS_CPU_ADAMW_H_

// AdamW on an fp32 flat shard, with PyTorch's torch.optim.AdamW semantics
// (single-tensor path, amsgrad=False, maximize=False), plus the pieces of
// global gradient-norm clipping. Each element is updated independently, so a
// flat shard gives bit-identical results to the same elements of the whole
// tensor, whatever the sharding.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/adamw_element.h"

namespace shardd {
namespace kernels {

struct AdamWConfig {
  double lr = 1e-3;            // >= 0
  double beta1 = 0.9;          // in [0, 1)
  double beta2 = 0.999;        // in [0, 1)
  double eps = 1e-8;           // >= 0
  double weight_decay = 0.01;  // >= 0, decoupled
};

// One AdamW step t (1-based: the first step is t = 1) over n elements:
//   p = p * (1 - lr * wd)                         decoupled weight decay
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g^2
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// with bc1 = 1 - beta1^t and bc2 = 1 - beta2^t, which is
//   p -= lr * m_hat / (sqrt(v_hat) + eps),  m_hat = m / bc1, v_hat = v / bc2
// written as PyTorch evaluates it. Scalars (bias corrections, step size) are
// computed in double as Python does; the per-element math is fp32 like
// PyTorch's on fp32 tensors. exp_avg and exp_avg_sq start at zero.
// Shapes: param, grad, exp_avg, exp_avg_sq [n]. grad is read only.
// Errors: INVALID_ARGUMENT for n < 0, step < 1, a hyper-parameter out of the
// ranges above or not finite, or a null pointer with n > 0. Nothing is
// written on error.
absl::Status AdamWStep(float* param, const float* grad, float* exp_avg,
                       float* exp_avg_sq, int64_t n, int64_t step,
                       const AdamWConfig& config);

// The per-element constants of step t (AdamWElement, adamw_element.h): the
// bias corrections and step size in double as Python computes them, then
// fp32. The CPU and CUDA kernels both take them from here. Errors:
// INVALID_ARGUMENT, prefixed with `op`, for step < 1 or a hyper-parameter
// out of the ranges above or not finite.
absl::StatusOr<AdamWScalars> AdamWScalarsFor(const AdamWConfig& config,
                                             int64_t step, const char* op);

// sum_i x[i]^2, accumulated in double in index order (deterministic). The
// global gradient norm is sqrt of the all-reduced (summed) local values.
// n <= 0 gives 0.
double SumOfSquares(const float* x, int64_t n);

// x[i] *= scale for i in [0, n).
void ScaleInPlace(float* x, int64_t n, float scale);

// The factor torch.nn.utils.clip_grad_norm_ multiplies every gradient by:
// min(1, max_norm / (total_norm + 1e-6)). Returns 1 when max_norm <= 0
// (clipping off). A NaN total_norm gives NaN and an infinite one 0, as in
// PyTorch; callers that want to skip such steps check the norm first.
double ClipCoefficient(double total_norm, double max_norm);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ADAMW_H_
