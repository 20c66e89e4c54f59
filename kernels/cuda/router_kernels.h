#ifndef SHARDD_KERNELS_CUDA_ROUTER_KERNELS_H_
#define SHARDD_KERNELS_CUDA_ROUTER_KERNELS_H_

// Launchers of the router's elementwise kernels (router_kernels.cu); the
// GEMMs and argument checks are in router.cc. tokens >= 1,
// 1 <= experts <= 1024, 1 <= top_k <= min(experts, 32).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

inline constexpr int64_t kRouterMaxExperts = 1024;
inline constexpr int64_t kRouterMaxTopK = 32;

// probs [T, E] holds the logits on entry and the softmax on exit. Writes
// indices and weights [T, K], saved_indices [T, K] and denom [T].
cudaError_t LaunchRouterSoftmaxTopK(float* probs, int64_t tokens,
                                    int64_t experts, int64_t top_k,
                                    bool renormalize, int32_t* indices,
                                    float* weights, int32_t* saved_indices,
                                    float* denom, cudaStream_t stream);

// d_logits [T, E] (fp32 or bf16) from the saved probs, indices and denom and
// d_weights [T, K].
cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                int64_t tokens, int64_t experts, int64_t top_k,
                                float* d_logits, cudaStream_t stream);
cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                int64_t tokens, int64_t experts, int64_t top_k,
                                uint16_t* d_logits, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_KERNELS_H_
