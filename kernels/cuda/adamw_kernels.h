#ifndef SHARDD_KERNELS_CUDA_ADAMW_KERNELS_H_
#define SHARDD_KERNELS_CUDA_ADAMW_KERNELS_H_

// Launchers of the optimizer kernels (adamw_kernels.cu); arguments are
// validated by adamw.cc. n >= 1 everywhere.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/adamw_element.h"

namespace shardd {
namespace kernels {
namespace cuda {

// grad_scale (device, may be null) multiplies each gradient as it is read;
// param_bf16 (may be null) receives the updated parameters rounded to bf16.
cudaError_t LaunchAdamW(float* param, const float* grad, float* exp_avg,
                        float* exp_avg_sq, int64_t n,
                        const AdamWScalars& scalars, const float* grad_scale,
                        uint16_t* param_bf16, cudaStream_t stream);

// Number of per-block partial sums (doubles of scratch) SumOfSquares uses
// for n elements; depends on n only, so the result is deterministic.
int64_t SumOfSquaresPartials(int64_t n);

// *result = (accumulate ? *result : 0) + sum_i x[i]^2 (double).
cudaError_t LaunchSumOfSquares(const float* x, int64_t n, double* partials,
                               double* result, bool accumulate,
                               cudaStream_t stream);

// x[i] *= *scale.
cudaError_t LaunchScaleByDevice(float* x, int64_t n, const float* scale,
                                cudaStream_t stream);

// One thread: total_norm = sqrt(*sum_of_squares) (if non-null),
// *coefficient = float(ClipCoefficient(total_norm, max_norm)).
cudaError_t LaunchClipCoefficient(const double* sum_of_squares, double max_norm,
                                  float* coefficient, double* total_norm,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ADAMW_KERNELS_H_
