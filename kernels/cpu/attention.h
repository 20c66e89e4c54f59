#ifndef SHARDD_KERNELS_CPU_ATTENTION_H_
#define SHARDD_KERNELS_CPU_ATTENTION_H_

// Scaled dot-product attention on the CPU, forward and backward, fp32 with
// OpenBLAS GEMMs over blocks of queries and keys and an online softmax
// (flash-style: the [T, S] score matrix never exists; the backward
// recomputes each block's probabilities from the saved log-sum-exp).
//
// Per sequence b and query head h (kv head g = h / (Hq / Hkv): multi-head
// when Hkv == Hq, grouped-query when it divides Hq, multi-query when 1):
//
//   s[i, j] = scale * q[b, i, h, :] . k[b, j, g, :]     where mask(i, j)
//   p[i, :] = softmax over the allowed j (and the sink, when given)
//   out[b, i, h, :] = sum_j p[i, j] v[b, j, g, :]
//
// A learned sink (GPT-OSS) is one extra logit per head that joins each row's
// softmax denominator and contributes no value. Query i sits at key position
// pos(i) = i + q_offset (queries after a prefix of keys, e.g. decode queries
// behind the encoder's K/V). Masks:
//   kBidirectional  every key;
//   kCausal         j <= pos(i);
//   kSlidingWindow  j <= pos(i) and pos(i) - j < window (Hugging Face's
//                   sliding_window: the query and window - 1 keys before it);
//   kBlockCausal    j / block <= pos(i) / block (whole blocks see each
//                   other and every earlier block).
// A row with no allowed key and no sink outputs zeros.
//
// Layouts are the projections' natural ones, row-major:
//   q [B, T, Hq, Dh], k [B, S, Hkv, Dh], v [B, S, Hkv, Dv], out [B, T, Hq, Dv]
// and the saved log-sum-exp lse [B, Hq, T]. The (sequence, head) pairs are
// shared out over the compute pool (compute_pool.h), each with one-thread
// GEMMs; the results are deterministic and do not depend on the thread
// count.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/attention_mask.h"  // AttentionMask

namespace shardd {
namespace kernels {

struct AttentionDims {
  int64_t batch = 1;       // B >= 1
  int64_t q_len = 0;       // T >= 0
  int64_t kv_len = 0;      // S >= 0
  int64_t q_heads = 1;     // Hq >= 1
  int64_t kv_heads = 1;    // Hkv >= 1, divides Hq
  int64_t head_dim = 1;    // Dh >= 1 (q and k)
  int64_t v_head_dim = 0;  // Dv (v and out); 0: Dh
};

struct AttentionOptions {
  float scale = 1.0f;  // Usually 1 / sqrt(Dh); finite
  AttentionMask mask = AttentionMask::kCausal;
  int64_t q_offset = 0;  // pos(i) = i + q_offset, >= 0
  int64_t window = 0;    // kSlidingWindow: >= 1
  int64_t block = 0;     // kBlockCausal: >= 1
  // [Hq] learned sink logits, or null for none (device memory for the
  // CUDA kernels).
  const float* sinks = nullptr;
  // Packed sequences: [batch, q_len], the first key each query may see (its
  // example's first token in the row), applied on top of `mask`; null for
  // none (device memory for the CUDA kernels, which take it on their own
  // kernels, not cuDNN's).
  const int32_t* key_begin = nullptr;

  MaskRule rule() const {
    MaskRule r;
    r.mask = mask;
    r.q_offset = q_offset;
    r.window = window;
    r.block = block;
    return r;
  }
};

// Scratch of one call (grown on demand, reused across calls; not
// thread-safe). Nothing in it is needed between the forward and the
// backward.
// Each array holds one block per compute-pool slot (compute_pool.h).
struct AttentionWorkspace {
  std::vector<float> scores;  // [slots, block_q, block_k]: s, then p
  std::vector<float> dp;      // [slots, block_q, block_k]: dp, then ds
  std::vector<float> acc;     // [slots, block_q, Dv]
  std::vector<float> row_max, row_sum, row_delta;  // [slots, block_q]
};

// INVALID_ARGUMENT naming the field for dims or options outside the ranges
// above, or products overflowing int64.
absl::Status ValidateAttention(const AttentionDims& dims,
                               const AttentionOptions& options);

// Forward: writes out [B, T, Hq, Dv] and lse [B, Hq, T] (-inf for a row
// with nothing to attend to). Pointers may be null only for empty arrays.
// Errors: ValidateAttention's; INVALID_ARGUMENT for a required null pointer.
absl::Status AttentionForward(const AttentionDims& dims,
                              const AttentionOptions& options, const float* q,
                              const float* k, const float* v, float* out,
                              float* lse, AttentionWorkspace* ws);

// Backward of the forward that produced `out` and `lse` from q, k, v (passed
// again unchanged). d_out [B, T, Hq, Dv]. dq [B, T, Hq, Dh], dk and dv (in
// k's and v's layouts) are ADDED to (they may be zeroed by the caller, or
// accumulate across calls, e.g. from the encode and the decode of the same
// K/V); d_sinks [Hq] too, when both it and options.sinks are given. Any
// output may be null to skip it.
// Errors: as the forward's.
absl::Status AttentionBackward(const AttentionDims& dims,
                               const AttentionOptions& options, const float* q,
                               const float* k, const float* v, const float* out,
                               const float* lse, const float* d_out, float* dq,
                               float* dk, float* dv, float* d_sinks,
                               AttentionWorkspace* ws);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ATTENTION_H_
