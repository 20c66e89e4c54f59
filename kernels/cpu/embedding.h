#ifndef SHARDD_KERNELS_CPU_EMBEDDING_H_
#define SHARDD_KERNELS_CPU_EMBEDDING_H_

// Token embedding lookup and its gradient (fp32, row-major).

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {

// out[t, :] = table[ids[t], :] for t in [0, num_tokens).
// Shapes: table [vocab_size, dim], ids [num_tokens], out [num_tokens, dim].
// Errors: INVALID_ARGUMENT for negative sizes, null pointers with non-zero
// sizes, or an id outside [0, vocab_size) (the message names the id, its
// position and vocab_size). Every id is checked before anything is written,
// so on error `out` is untouched.
absl::Status EmbeddingForward(const float* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, float* out);

// dtable[ids[t], :] += dout[t, :] for t in [0, num_tokens), in token order
// (deterministic; repeated ids accumulate in that order).
// dtable is a PARAMETER gradient: it accumulates (+=), never overwritten.
// Shapes: dout [num_tokens, dim], ids [num_tokens], dtable [vocab_size, dim].
// Tokens whose id is `padding_id` add nothing (torch.nn.Embedding's
// padding_idx; -1: none).
// Errors: as EmbeddingForward; on error `dtable` is untouched.
absl::Status EmbeddingBackward(const float* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable,
                               int64_t padding_id = -1);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_EMBEDDING_H_
