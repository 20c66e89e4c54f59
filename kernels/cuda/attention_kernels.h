#ifndef SHARDD_KERNELS_CUDA_ATTENTION_KERNELS_H_
#define SHARDD_KERNELS_CUDA_ATTENTION_KERNELS_H_

// Launchers of the attention kernels (attention_kernels.cu); arguments are
// validated by attention.cc. Plain types only (nvcc compiles this).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/attention_mask.h"

namespace shardd {
namespace kernels {
namespace cuda {

struct AttentionLaunch {
  int64_t batch, q_len, kv_len, q_heads, kv_heads, head_dim, v_head_dim;
  float scale;
  MaskRule rule;
  const float* sinks;  // [Hq] or null
};

// The largest head_dim / v_head_dim the kernels take.
inline constexpr int64_t kMaxAttentionHeadDim = 256;

template <typename T>
cudaError_t LaunchAttentionForward(const AttentionLaunch& a, const T* q,
                                   const T* k, const T* v, T* out, float* lse,
                                   cudaStream_t stream);

// delta and sink_part: [B, Hq, T] floats each (the workspace).
template <typename T>
cudaError_t LaunchAttentionBackward(const AttentionLaunch& a, const T* q,
                                    const T* k, const T* v, const T* out,
                                    const float* lse, const T* d_out, float* dq,
                                    float* dk, float* dv, float* d_sinks,
                                    float* delta, float* sink_part,
                                    cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ATTENTION_KERNELS_H_
