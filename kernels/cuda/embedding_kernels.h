#ifndef SHARDD_KERNELS_CUDA_EMBEDDING_KERNELS_H_
#define SHARDD_KERNELS_CUDA_EMBEDDING_KERNELS_H_

// Launchers of the embedding kernels (embedding_kernels.cu); arguments are
// validated by embedding.cc. Out-of-range ids count into *bad_id_count when it
// is non-null.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// out row t = table row ids[t] (a bit copy of row_bytes bytes), or zeros for
// an out-of-range id. tokens >= 1, row_bytes >= 1.
cudaError_t LaunchEmbeddingForward(const void* table, int64_t vocab_size,
                                   int64_t row_bytes, const int32_t* ids,
                                   int64_t num_tokens, void* out,
                                   int32_t* bad_id_count, cudaStream_t stream);

// dtable[ids[t], :] += dout[t, :] in token order per row, except for tokens
// whose id is padding_id (-1: none). `buckets` holds
// vocab_size + 1 ints and `sorted_tokens` num_tokens ints of scratch.
cudaError_t LaunchEmbeddingBackward(const float* dout, const int32_t* ids,
                                    int64_t num_tokens, int64_t vocab_size,
                                    int64_t dim, float* dtable,
                                    int32_t* buckets, int32_t* sorted_tokens,
                                    int32_t* bad_id_count, int64_t padding_id,
                                    cudaStream_t stream);
cudaError_t LaunchEmbeddingBackward(const uint16_t* dout, const int32_t* ids,
                                    int64_t num_tokens, int64_t vocab_size,
                                    int64_t dim, float* dtable,
                                    int32_t* buckets, int32_t* sorted_tokens,
                                    int32_t* bad_id_count, int64_t padding_id,
                                    cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_EMBEDDING_KERNELS_H_
