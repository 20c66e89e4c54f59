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

// kTopKThenSoftmax (group_limited false) and kSigmoidGroupLimited (true):
// probs [T, E] holds the logits (the bias already added); with
// keep_softmax (kTopKThenSoftmax only) it gets softmax(logits) on exit,
// else it is left as it is. Writes indices and weights [T, K],
// saved_indices [T, K], selected [T, K] (the weights, or the selected
// sigmoid scores) and denom [T] (-1 when not renormalised).
// selection_bias [E] may be null. groups >= 1 divides experts.
cudaError_t LaunchRouterSelect(float* probs, int64_t tokens, int64_t experts,
                               int64_t top_k, bool group_limited,
                               bool renormalize, int64_t groups,
                               int64_t top_groups, float scale,
                               bool keep_softmax, const float* selection_bias,
                               int32_t* indices, float* weights,
                               int32_t* saved_indices, float* selected,
                               float* denom, cudaStream_t stream);

// kSoftmaxThenTopK: d_logits [T, E] (fp32 or bf16) from the saved probs,
// indices and denom and d_weights [T, K], plus extra_d_logits [T, E] fp32
// when not null (added in fp32 before the rounding).
cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                const float* extra_d_logits, int64_t tokens,
                                int64_t experts, int64_t top_k,
                                float* d_logits, cudaStream_t stream);
cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                const float* extra_d_logits, int64_t tokens,
                                int64_t experts, int64_t top_k,
                                uint16_t* d_logits, cudaStream_t stream);

// The two newer scorings: d_logits from the saved selected [T, K], indices
// and denom (zero off the selected experts), plus extra_d_logits.
cudaError_t LaunchRouterSelectedDLogits(
    bool group_limited, const float* selected, const int32_t* saved_indices,
    const float* denom, const float* d_weights, const float* extra_d_logits,
    int64_t tokens, int64_t experts, int64_t top_k, float scale,
    float* d_logits, cudaStream_t stream);
cudaError_t LaunchRouterSelectedDLogits(
    bool group_limited, const float* selected, const int32_t* saved_indices,
    const float* denom, const float* d_weights, const float* extra_d_logits,
    int64_t tokens, int64_t experts, int64_t top_k, float scale,
    uint16_t* d_logits, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_KERNELS_H_
