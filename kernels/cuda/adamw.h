#ifndef SHARDD_KERNELS_CUDA_ADAMW_H_
#define SHARDD_KERNELS_CUDA_ADAMW_H_

// AdamW and global gradient-norm clipping on the GPU, over fp32 flat shards:
// the CUDA counterpart of kernels/cpu/adamw.h. The per-element update is the
// CPU expression with one IEEE rounding per operation (no FMA contraction),
// and the scalars (bias corrections, step size) are computed on the host in
// double exactly as the CPU kernel does, so the results equal the CPU's bit
// for bit when the CPU build does not contract FMAs (the default x86-64
// build). Device pointers; asynchronous on `stream`; no synchronization and
// no allocation.
//
// Clipping without a host round trip:
//   SumOfSquares(grad shard, n, &local_sum_sq)   (device double)
//   all-reduce local_sum_sq over the shard group (NCCL, in place)
//   ClipCoefficientFromSumOfSquares(&sum_sq, max_norm, &coefficient)
//   AdamWStep(..., grad_scale = &coefficient, ...)   or ScaleInPlace first.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/adamw.h"  // AdamWConfig

namespace shardd {
namespace kernels {
namespace cuda {

// One AdamW step t (1-based) over n elements; see kernels::AdamWStep for the
// formulas. param, exp_avg, exp_avg_sq are updated in place; grad is read
// only.
//   grad_scale: device float multiplied into every gradient as it is read
//     (the clip coefficient), or null for 1. g * scale rounds exactly as
//     ScaleInPlace followed by the unscaled step, without writing grad.
//   param_bf16: if non-null, [n] receives the updated parameters rounded to
//     bf16 (kernels::Fp32ToBf16), e.g. the next step's gather source.
// 16-byte vector accesses when every pointer is 16-byte aligned (param_bf16
// 8-byte).
// Errors: INVALID_ARGUMENT for n < 0, step < 1, a hyper-parameter out of
// range or not finite (as the CPU kernel), or a null pointer with n > 0;
// launch errors via CudaStatus. Nothing is launched on error.
absl::Status AdamWStep(float* param, const float* grad, float* exp_avg,
                       float* exp_avg_sq, int64_t n, int64_t step,
                       const AdamWConfig& config, const float* grad_scale,
                       uint16_t* param_bf16, cudaStream_t stream);

// Device scratch SumOfSquares needs for n elements (one double per partial
// sum, at most 1024). 0 for n < 1.
size_t SumOfSquaresWorkspaceBytes(int64_t n);

// *result = sum_i x[i]^2 in double (added to *result when `accumulate`, so
// several buffers can sum into one value), left in device memory. The
// partition depends on n only, so the result is deterministic; it can differ
// from the CPU's index-order double sum by rounding (~1e-15 relative).
// n == 0 writes 0 (or leaves *result when accumulating).
// Errors: INVALID_ARGUMENT for n < 0, null x (n > 0) or result, or a
// missing, small or misaligned workspace; launch errors via CudaStatus.
absl::Status SumOfSquares(const float* x, int64_t n, double* result,
                          bool accumulate, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

// x[i] *= *scale for i in [0, n), scale a device float (e.g. the clip
// coefficient).
// Errors: INVALID_ARGUMENT for n < 0 or null pointers with n > 0; launch
// errors via CudaStatus.
absl::Status ScaleInPlace(float* x, int64_t n, const float* scale,
                          cudaStream_t stream);

// On the device: *coefficient = float(kernels::ClipCoefficient(
// sqrt(*sum_of_squares), max_norm)), and *total_norm = sqrt(*sum_of_squares)
// when total_norm is non-null (for logging; read it after a later sync).
// Errors: INVALID_ARGUMENT for null sum_of_squares or coefficient; launch
// errors via CudaStatus.
absl::Status ClipCoefficientFromSumOfSquares(const double* sum_of_squares,
                                             double max_norm,
                                             float* coefficient,
                                             double* total_norm,
                                             cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ADAMW_H_
