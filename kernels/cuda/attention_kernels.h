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
  // [B, T] packed rows' first visible keys (PackedFirstKey), or null.
  const int32_t* key_begin = nullptr;
};

// The largest head_dim / v_head_dim the kernels take (DiffusionGemma's
// full-attention layers use 512).
inline constexpr int64_t kMaxAttentionHeadDim = 512;

// Dynamic shared memory per block of the largest generic kernel a call with
// these dims launches (forward or backward): at head dims 512 about 199 KB,
// which fits Hopper's 227 KiB but not an A100's 163 KiB.
size_t AttentionSharedMemoryBytes(const AttentionLaunch& a);

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

// The tensor-core path (attention_mma_kernels.cu), which the uint16_t (bf16)
// launchers above take when it supports the call: head_dim 64 or 128 with
// v_head_dim equal to it, kv_len > 0, 16-byte aligned tensors (d_out may be
// null for the forward).
bool AttentionMmaSupports(const AttentionLaunch& a, const void* q,
                          const void* k, const void* v, const void* out,
                          const void* d_out);
cudaError_t LaunchAttentionMmaForward(const AttentionLaunch& a,
                                      const uint16_t* q, const uint16_t* k,
                                      const uint16_t* v, uint16_t* out,
                                      float* lse, cudaStream_t stream);
// dq, dk, dv are added to (each may be null); delta as computed by the
// generic backward's first kernel.
cudaError_t LaunchAttentionMmaBackward(const AttentionLaunch& a,
                                       const uint16_t* q, const uint16_t* k,
                                       const uint16_t* v, const uint16_t* d_out,
                                       const float* lse, const float* delta,
                                       float* dq, float* dk, float* dv,
                                       cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ATTENTION_KERNELS_H_
