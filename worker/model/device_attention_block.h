#ifndef SHARDD_WORKER_MODEL_DEVICE_ATTENTION_BLOCK_H_
#define SHARDD_WORKER_MODEL_DEVICE_ATTENTION_BLOCK_H_

// The self-attention sublayer on the GPU, the counterpart of
// worker/model/attention_block.h (same computation, same parameters): q/k/v
// projections through cuBLAS (with GPT-OSS's biases, kernels/cuda/bias.h),
// per-head q/k RMSNorm, RoPE, causal or sliding-window GQA attention with
// GPT-OSS's per-head sinks (kernels/cuda/attention.h), o_proj. Storage T
// is float or uint16_t (bf16); parameter gradients are fp32 and added to.
// Everything is enqueued on the model's stream; nothing synchronizes.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/cudnn_attention.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/moe_architecture.h"

namespace shardd {

// The layer's parameters in storage type T (norm weights and biases too;
// the sinks in fp32, as the attention kernel reads them) and their fp32
// gradient buffers (null: frozen, or the layer has none).
struct DeviceAttentionParams {
  const void* wq = nullptr;
  const void* wk = nullptr;
  const void* wv = nullptr;
  const void* wo = nullptr;
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  // attention_bias: q/k/v/o_proj.bias (all or none).
  const void* bq = nullptr;
  const void* bk = nullptr;
  const void* bv = nullptr;
  const void* bo = nullptr;
  const float* sinks = nullptr;  // [Hq], has_sinks
  float* dwq = nullptr;
  float* dwk = nullptr;
  float* dwv = nullptr;
  float* dwo = nullptr;
  float* dq_norm = nullptr;
  float* dk_norm = nullptr;
  float* dbq = nullptr;
  float* dbk = nullptr;
  float* dbv = nullptr;
  float* dbo = nullptr;
  float* dsinks = nullptr;
};

// What one forward keeps for its backward.
struct DeviceAttentionActs {
  DeviceBuffer n;             // [T, D] normed input
  DeviceBuffer q_pre, k_pre;  // before the q/k norms (qk_norm)
  DeviceBuffer q_inv, k_inv;  // fp32 inverse RMS per head row
  DeviceBuffer q, k, v;       // the attention's inputs
  DeviceBuffer o;             // [T, Hq * hd]
  DeviceBuffer lse;           // fp32 [batch, Hq, seq]
  void Reset();
};

class DeviceAttentionBlock {
 public:
  // `arch` and `allocator` outlive the block.
  // The attention itself runs on the kernels SHARDD_ATTENTION names
  // (kernels/cuda/cudnn_attention.h): cuDNN's fused attention for the
  // calls its rule takes, the own kernels for the rest.
  DeviceAttentionBlock(const MoeArchitecture* arch, DeviceAllocator* allocator,
                       cudaStream_t stream, cublasHandle_t cublas);
  ~DeviceAttentionBlock();

  // Uploads the RoPE table for positions [0, seq) when it covers fewer.
  // Errors: INVALID_ARGUMENT for seq beyond max_position_embeddings;
  // allocation and CUDA errors.
  absl::Status Prepare(int64_t seq);

  // n [T, D] is moved into `acts` (kept for the backward); y [T, D] is
  // written. positions: device int32 [T], each token's place in its
  // sequence.
  template <typename T>
  absl::Status Forward(const MoeLayerSpec& layer,
                       const DeviceAttentionParams& params, DeviceBuffer n,
                       int64_t batch, int64_t seq, const int32_t* positions,
                       DeviceAttentionActs* acts, T* y);

  // dy [T, D]: the gradient of y; dn [T, D] is written (the gradient of the
  // normed input); parameter gradients are added.
  template <typename T>
  absl::Status Backward(const MoeLayerSpec& layer,
                        const DeviceAttentionParams& params,
                        const DeviceAttentionActs& acts, int64_t batch,
                        int64_t seq, const int32_t* positions, const T* dy,
                        T* dn);

  // The uploaded table (Prepare), as the CUDA RoPE takes it (the MLA block
  // rotates with it too).
  kernels::cuda::DeviceRopeTable RopeTable() const;

  // Packed rows (docs/sft_data.md): key_begin, device int32 [batch * seq],
  // each token's example start in its row, for the calls that follow (not
  // owned; null: whole rows). cuDNN refuses them, so the own kernels run.
  void SetSegments(const int32_t* key_begin) { key_begin_ = key_begin; }

 private:
  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes);
  // cuDNN's attention for this call, or null for the own kernels.
  // Errors: a bad SHARDD_ATTENTION; with "cudnn", LoadCudnn's.
  absl::StatusOr<kernels::cuda::CudnnAttention*> CudnnFor(
      const kernels::AttentionDims& dims,
      const kernels::AttentionOptions& options, bool bf16);

  const MoeArchitecture* arch_;
  DeviceAllocator* allocator_;
  cudaStream_t stream_;
  cublasHandle_t cublas_;
  DeviceBuffer cos_, sin_;
  int64_t table_positions_ = 0;
  absl::StatusOr<kernels::cuda::AttentionKernels> kernels_;
  std::unique_ptr<kernels::cuda::CudnnAttention> cudnn_;
  const int32_t* key_begin_ = nullptr;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_ATTENTION_BLOCK_H_
