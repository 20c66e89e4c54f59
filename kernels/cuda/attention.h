#ifndef SHARDD_KERNELS_CUDA_ATTENTION_H_
#define SHARDD_KERNELS_CUDA_ATTENTION_H_

// Attention on the GPU with the semantics, layouts and argument conventions
// of kernels/cpu/attention.h (the same AttentionDims and AttentionOptions;
// options.sinks is a device pointer here): flash-style tiles in shared
// memory with an online softmax, and a backward that recomputes the
// probabilities from the saved log-sum-exp. q, k, v, out and d_out are fp32
// or bf16 (uint16_t bit patterns, one type per call); arithmetic, lse, the
// gradients dq, dk, dv and d_sinks are fp32. Deterministic (fixed summation
// orders, no atomics). Device pointers; asynchronous on `stream`; no
// allocation or synchronization.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/attention.h"

namespace shardd {
namespace kernels {
namespace cuda {

// Errors: kernels::ValidateAttention's; INVALID_ARGUMENT for head_dim or
// v_head_dim above 512, head dims whose tiles need more shared memory than
// the current device gives a block (512 needs about 199 KB: Hopper, not
// Ampere), batch or heads above 65535, or a null pointer with q_len > 0;
// launch errors via CudaStatus.
absl::Status AttentionForward(const AttentionDims& dims,
                              const AttentionOptions& options, const float* q,
                              const float* k, const float* v, float* out,
                              float* lse, cudaStream_t stream);
absl::Status AttentionForward(const AttentionDims& dims,
                              const AttentionOptions& options,
                              const uint16_t* q, const uint16_t* k,
                              const uint16_t* v, uint16_t* out, float* lse,
                              cudaStream_t stream);

// Device workspace AttentionBackward needs: 2 * B * Hq * T floats.
size_t AttentionBackwardWorkspaceBytes(const AttentionDims& dims);

// dq, dk, dv (fp32, in q's, k's and v's layouts) and d_sinks are ADDED to;
// any may be null to skip it. Errors: as the forward's, plus a missing,
// small or misaligned workspace.
absl::Status AttentionBackward(const AttentionDims& dims,
                               const AttentionOptions& options, const float* q,
                               const float* k, const float* v, const float* out,
                               const float* lse, const float* d_out, float* dq,
                               float* dk, float* dv, float* d_sinks,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);
absl::Status AttentionBackward(const AttentionDims& dims,
                               const AttentionOptions& options,
                               const uint16_t* q, const uint16_t* k,
                               const uint16_t* v, const uint16_t* out,
                               const float* lse, const uint16_t* d_out,
                               float* dq, float* dk, float* dv, float* d_sinks,
                               void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ATTENTION_H_
