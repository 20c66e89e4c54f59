#ifndef SHARDD_WORKER_MODEL_DEVICE_MLA_BLOCK_H_
#define SHARDD_WORKER_MODEL_DEVICE_MLA_BLOCK_H_

// DeepSeek-V3's multi-head latent attention on the GPU, the counterpart of
// worker/model/mla_block.h (same computation, same parameters, the formulas
// there): the q (LoRA or plain) and kv latent projections through cuBLAS,
// the latent RMSNorms, RoPE on the rope dims of every query head and of the
// one shared key (kernels/cuda/rope.h, interleaved pairs), per-head keys
// assembled from [k_nope ; shared k_rope] (device_mla_kernels.h), causal
// attention with head dims nope + rope for q and k and v_head_dim for v
// (kernels/cuda/attention.h), o_proj. Storage T is float or uint16_t (bf16);
// parameter gradients are fp32 and added to. Everything is enqueued on the
// model's stream; nothing synchronizes.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/rope.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/moe_architecture.h"

namespace shardd {

// The layer's parameters in storage type T and their fp32 gradient buffers
// (null: frozen). With q_lora_rank 0, wq replaces wqa / q_a_norm / wqb.
struct DeviceMlaParams {
  const void* wq = nullptr;
  const void* wqa = nullptr;
  const void* q_a_norm = nullptr;
  const void* wqb = nullptr;
  const void* wkva = nullptr;
  const void* kv_a_norm = nullptr;
  const void* wkvb = nullptr;
  const void* wo = nullptr;
  // attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj biases.
  const void* bqa = nullptr;
  const void* bkva = nullptr;
  const void* bo = nullptr;
  float* dwq = nullptr;
  float* dwqa = nullptr;
  float* dq_a_norm = nullptr;
  float* dwqb = nullptr;
  float* dwkva = nullptr;
  float* dkv_a_norm = nullptr;
  float* dwkvb = nullptr;
  float* dwo = nullptr;
  float* dbqa = nullptr;
  float* dbkva = nullptr;
  float* dbo = nullptr;
};

// What one forward keeps for its backward (as MlaActs).
struct DeviceMlaActs {
  DeviceBuffer n;                 // [T, D] normed input
  DeviceBuffer qa, qa_inv, qa_n;  // q_a_proj out, fp32 inverse RMS, normed
  DeviceBuffer c, c_inv, c_n;     // latent kv, fp32 inverse RMS, normed
  DeviceBuffer q, k, v;           // the attention's inputs
  DeviceBuffer o;                 // [T, H * Dv]
  DeviceBuffer lse;               // fp32 [batch, H, seq]
  void Reset();
};

class DeviceMlaBlock {
 public:
  // `arch` (with arch->mla) and `allocator` outlive the block.
  DeviceMlaBlock(const MoeArchitecture* arch, DeviceAllocator* allocator,
                 cudaStream_t stream, cublasHandle_t cublas)
      : arch_(arch), allocator_(allocator), stream_(stream), cublas_(cublas) {}

  // n [T, D] is moved into `acts`; y [T, D] is written. positions: device
  // int32 [T], each token's place in its sequence; `rope`: the model's
  // uploaded RoPE table covering them (DeviceAttentionBlock::Prepare).
  // Errors: allocation, cuBLAS and kernel errors.
  template <typename T>
  absl::Status Forward(const MoeLayerSpec& layer, const DeviceMlaParams& params,
                       DeviceBuffer n, int64_t batch, int64_t seq,
                       const int32_t* positions,
                       const kernels::cuda::DeviceRopeTable& rope,
                       DeviceMlaActs* acts, T* y);

  // dy [T, D]: the gradient of y; dn [T, D] is written (the gradient of the
  // normed input); parameter gradients are added.
  template <typename T>
  absl::Status Backward(const MoeLayerSpec& layer,
                        const DeviceMlaParams& params,
                        const DeviceMlaActs& acts, int64_t batch, int64_t seq,
                        const int32_t* positions,
                        const kernels::cuda::DeviceRopeTable& rope, const T* dy,
                        T* dn);

  // Packed rows (docs/sft_data.md): key_begin, device int32 [batch * seq],
  // each token's example start in its row, for the calls that follow (not
  // owned; null: whole rows).
  void SetSegments(const int32_t* key_begin) { key_begin_ = key_begin; }

 private:
  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes);
  // The layer's self-attention options with the packed rows.
  kernels::AttentionOptions OptionsOf(const MoeArchitecture& a,
                                      const MoeLayerSpec& layer) const;

  const MoeArchitecture* arch_;
  DeviceAllocator* allocator_;
  cudaStream_t stream_;
  cublasHandle_t cublas_;
  const int32_t* key_begin_ = nullptr;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_MLA_BLOCK_H_
