#ifndef SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_KERNELS_H_
#define SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_KERNELS_H_

// Launchers of expert_permute_kernels.cu (expert_permute.h checks the
// arguments). No absl: nvcc compiles the .cu side. T is fp32 or bf16 bits.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

template <typename T>
cudaError_t LaunchPackRows(const T* src, const float* weights,
                           const int32_t* indices, const int64_t* order,
                           int64_t rows, int k, int64_t d,
                           int64_t local_experts, float* send,
                           cudaStream_t stream);

template <typename T>
cudaError_t LaunchUnpackDispatchRows(const float* recv, int64_t received,
                                     int64_t d, T* x_r, int32_t* ids_r,
                                     float* w_r, cudaStream_t stream);

cudaError_t LaunchPackCombineGradRows(const float* dx_r, const float* dw_r,
                                      int64_t received, int64_t d, float* send,
                                      cudaStream_t stream);

template <typename T>
cudaError_t LaunchCombineRows(const float* back, const int64_t* position,
                              int64_t t, int k, int64_t width, int64_t d, T* y,
                              float* d_weights, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_KERNELS_H_
