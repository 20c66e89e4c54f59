#ifndef SHARDD_KERNELS_CPU_RMS_NORM_H_
#define SHARDD_KERNELS_CPU_RMS_NORM_H_

// RMSNorm over the last dimension (fp32, row-major):
//   y[r, :] = x[r, :] * inv_rms[r] * weight[:],
//   inv_rms[r] = 1 / sqrt(mean_d(x[r, d]^2) + eps).
// Row sums accumulate in double so the result does not depend on how the
// compiler orders the reduction.

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {

// Shapes: x [rows, dim], weight [dim], y [rows, dim], inv_rms [rows].
// Writes y (overwrite) and inv_rms (saved for the backward). y may alias x.
// Errors: INVALID_ARGUMENT for rows < 0, dim < 1, eps < 0 or not finite, or
// null pointers with rows > 0.
absl::Status RmsNormForward(const float* x, const float* weight, int64_t rows,
                            int64_t dim, float eps, float* y, float* inv_rms);

// Backward of RmsNormForward, given the saved inv_rms (and the original x).
// With g = dy * weight and xhat = x * inv_rms:
//   dx[r, d] = inv_rms[r] * (g[r, d] - xhat[r, d] * mean_k(g[r, k] xhat[r, k]))
//   dweight[d] += sum_r dy[r, d] * xhat[r, d]
// dx is an ACTIVATION gradient: overwritten, or added to when
// `accumulate_dx` is true (e.g. the residual stream already holds a
// gradient). dx must not alias any input.
// dweight is a PARAMETER gradient: always accumulated (+=).
// Shapes: dy, x, dx [rows, dim]; weight, dweight [dim]; inv_rms [rows].
// Errors: INVALID_ARGUMENT for rows < 0, dim < 1 or null pointers.
absl::Status RmsNormBackward(const float* dy, const float* x,
                             const float* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, float* dx,
                             float* dweight, bool accumulate_dx = false);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_RMS_NORM_H_
