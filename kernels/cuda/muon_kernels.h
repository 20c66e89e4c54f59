#ifndef SHARDD_KERNELS_CUDA_MUON_KERNELS_H_
#define SHARDD_KERNELS_CUDA_MUON_KERNELS_H_

// Launchers of muon_kernels.cu (muon.h checks the arguments). No absl:
// nvcc compiles the .cu side.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// Nesterov: out non-null (momentum read only); else the momentum step.
cudaError_t LaunchMuonMomentum(const float* grad, float* momentum, int64_t n,
                               float beta, float* out, cudaStream_t stream);

cudaError_t LaunchMuonApply(float* param, const float* update, int64_t n,
                            float decay, float step, cudaStream_t stream);

// x[i] /= MuonNormDenominator(*sum_of_squares, eps).
cudaError_t LaunchMuonNormalize(float* x, int64_t n,
                                const double* sum_of_squares, float eps,
                                cudaStream_t stream);

// x[i] *= scale (one fp32 rounding, as kernels::ScaleInPlace).
cudaError_t LaunchMuonScale(float* x, int64_t n, float scale,
                            cudaStream_t stream);
// out [cols, rows] = in [rows, cols]^T.
cudaError_t LaunchTranspose(const float* in, int64_t rows, int64_t cols,
                            float* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_MUON_KERNELS_H_
