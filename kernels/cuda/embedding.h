#ifndef SHARDD_KERNELS_CUDA_EMBEDDING_H_
#define SHARDD_KERNELS_CUDA_EMBEDDING_H_

// Token embedding lookup and its gradient on the GPU, the CUDA counterpart
// of kernels/cpu/embedding.h. Row-major; device pointers; asynchronous on
// `stream` (no synchronization, no allocation). The table and activations
// are fp32 or bf16 (uint16_t bit patterns); the table gradient is fp32.
//
// Token ids live on the device, so they cannot be checked before launching
// without a synchronization. Instead an id outside [0, vocab_size) gives a
// zero output row (forward) or no gradient (backward), and is counted into
// `*bad_id_count` (device memory, added to; may be null), which the caller
// reads at its next synchronization point and treats as the CPU path's
// INVALID_ARGUMENT.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// out[t, :] = table[ids[t], :] for t in [0, num_tokens): a bit copy, so fp32
// results equal the CPU's exactly. Shapes: table [vocab_size, dim], ids
// [num_tokens], out [num_tokens, dim].
// Errors: INVALID_ARGUMENT for negative sizes, vocab_size or num_tokens
// beyond int32, or null pointers with non-zero sizes; launch errors via
// CudaStatus.
absl::Status EmbeddingForward(const float* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, float* out,
                              int32_t* bad_id_count, cudaStream_t stream);
absl::Status EmbeddingForward(const uint16_t* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, uint16_t* out,
                              int32_t* bad_id_count, cudaStream_t stream);

// Device workspace EmbeddingBackward needs: (vocab_size + 1) + num_tokens
// int32 (each piece aligned to kWorkspaceAlignment). 0 for negative sizes.
size_t EmbeddingBackwardWorkspaceBytes(int64_t vocab_size, int64_t num_tokens);

// dtable[ids[t], :] += dout[t, :] for t in [0, num_tokens), except for tokens
// whose id is `padding_id` (torch.nn.Embedding's padding_idx; -1: none).
// dtable is a
// PARAMETER gradient (fp32): it accumulates, never overwritten. Deterministic:
// the tokens are stably bucketed by id (a counting sort in the workspace), and
// each table row adds its tokens' rows in token order, exactly as the CPU
// kernel does, so fp32 results equal the CPU's bit for bit (bf16 `dout` is
// widened exactly). The bucketing runs in one thread block (O(vocab_size +
// num_tokens * 1024) work); the accumulation is parallel over ids and dim.
// `workspace` is device memory of at least
// EmbeddingBackwardWorkspaceBytes(vocab_size, num_tokens) bytes, aligned to
// kWorkspaceAlignment (cudaMalloc's alignment suffices).
// Errors: as EmbeddingForward, plus INVALID_ARGUMENT for a missing, small or
// misaligned workspace.
absl::Status EmbeddingBackward(const float* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable, void* workspace,
                               size_t workspace_bytes, int32_t* bad_id_count,
                               cudaStream_t stream, int64_t padding_id = -1);
absl::Status EmbeddingBackward(const uint16_t* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable, void* workspace,
                               size_t workspace_bytes, int32_t* bad_id_count,
                               cudaStream_t stream, int64_t padding_id = -1);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_EMBEDDING_H_
