#ifndef SHARDD_KERNELS_CUDA_RMS_NORM_H_
#define SHARDD_KERNELS_CUDA_RMS_NORM_H_

// RMSNorm over the last dimension on the GPU, the CUDA counterpart of
// kernels/cpu/rms_norm.h (same formulas and argument conventions):
//   y[r, :] = (x[r, :] * inv_rms[r]) * weight[:],
//   inv_rms[r] = 1 / sqrt(mean_d(x[r, d]^2) + eps).
// x, weight, y, dy and dx are fp32 or bf16 (uint16_t bit patterns, one type
// per call); inv_rms and dweight are fp32. Sums are fp32 (the CPU kernel sums
// in double) over a fixed reduction tree, so results are deterministic.
// Device pointers; asynchronous on `stream`; no synchronization or
// allocation.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// Shapes: x, y [rows, dim]; weight [dim]; inv_rms [rows]. y may alias x.
// Errors: INVALID_ARGUMENT for rows < 0, dim < 1, eps < 0 or not finite, or
// null pointers with rows > 0; launch errors via CudaStatus.
absl::Status RmsNormForward(const float* x, const float* weight, int64_t rows,
                            int64_t dim, float eps, float* y, float* inv_rms,
                            cudaStream_t stream);
absl::Status RmsNormForward(const uint16_t* x, const uint16_t* weight,
                            int64_t rows, int64_t dim, float eps, uint16_t* y,
                            float* inv_rms, cudaStream_t stream);

// Device workspace RmsNormBackward needs for the dweight reduction:
// ceil(rows / chunk) * dim floats, with chunk = max(64, ceil(rows / 1024))
// rows. 0 for rows < 1 or dim < 1.
size_t RmsNormBackwardWorkspaceBytes(int64_t rows, int64_t dim);

// Backward, given the saved inv_rms and the forward's x:
//   dx[r, d] = inv_rms[r] * (g[r, d] - xhat[r, d] * mean_k(g[r, k] xhat[r, k]))
//   dweight[d] += sum_r dy[r, d] * xhat[r, d]
// with g = dy * weight, xhat = x * inv_rms. dx is an ACTIVATION gradient:
// overwritten, or added to when `accumulate_dx` is true; it must not alias an
// input. dweight is a PARAMETER gradient (fp32), always accumulated; unlike
// the CPU kernel it may be null (frozen weight), and then no workspace is
// needed. Per-column sums over fixed row chunks are added in chunk order
// (deterministic, no atomics).
// Errors: INVALID_ARGUMENT for rows < 0, dim < 1, null pointers (dweight
// excepted), or a missing, small or misaligned workspace; launch errors via
// CudaStatus.
absl::Status RmsNormBackward(const float* dy, const float* x,
                             const float* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, float* dx,
                             bool accumulate_dx, float* dweight,
                             void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);
absl::Status RmsNormBackward(const uint16_t* dy, const uint16_t* x,
                             const uint16_t* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, uint16_t* dx,
                             bool accumulate_dx, float* dweight,
                             void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_RMS_NORM_H_
