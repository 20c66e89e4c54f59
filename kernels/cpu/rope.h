#ifndef SHARDD_KERNELS_CPU_ROPE_H_
#define SHARDD_KERNELS_CPU_ROPE_H_

// Rotary position embeddings applied in place to query/key heads, forward
// and backward (the inverse rotation), for every RoPE variant: the variants
// differ only in their frequencies and attention factor, which the model
// computes from its config and hands over as a table.
//
// For position p and frequency f_i (i < R/2), angle a = p * f_i (fp32, as
// Hugging Face computes it) and c = cos(a) * attention_factor, s = sin(a) *
// attention_factor; each pair (x1, x2) becomes (x1 c - x2 s, x2 c + x1 s).
// The pairs are (i, i + R/2) in kHalf layout (Hugging Face's rotate_half)
// or (2i, 2i + 1) in kInterleaved layout. Dims [R, head_dim) of a head are
// left alone (partial rotary).
//
// Element (t, h, d) of x is x[t * token_stride + h * head_stride +
// dim_offset + d] for d < R: heads may sit inside wider rows (MLA's rope
// part after the no-rope part of each head).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardd {
namespace kernels {

enum class RopeLayout { kHalf, kInterleaved };

struct RopeTable {
  int64_t rotary_dim = 0;  // R, even
  int64_t positions = 0;   // Positions [0, positions) are covered.
  std::vector<float> cos;  // [positions, R / 2]
  std::vector<float> sin;  // [positions, R / 2]
};

// The table for positions [0, positions) from fp32 frequencies (R / 2 of
// them). Errors: INVALID_ARGUMENT for no frequencies, a non-finite
// frequency or factor, positions < 1 or a table beyond 2^31 entries.
absl::StatusOr<RopeTable> BuildRopeTable(absl::Span<const float> inv_freq,
                                         int64_t positions,
                                         float attention_factor);

struct RopeShape {
  int64_t tokens = 0;        // T >= 0
  int64_t heads = 1;         // >= 1
  int64_t token_stride = 0;  // Elements between tokens
  int64_t head_stride = 0;   // Elements between heads
  int64_t dim_offset = 0;    // Where the rotary dims start in a head
};

// Rotates x in place (forward), or by the inverse rotation (`inverse`:
// the backward, applied to the gradient). positions [T], each in
// [0, table.positions). Errors: INVALID_ARGUMENT for a position outside the
// table (naming it), negative sizes, or a null pointer with T > 0.
absl::Status RopeRotate(const RopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        float* x, bool inverse = false);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROPE_H_
