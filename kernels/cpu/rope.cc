#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/rope_element.h"

namespace shardd {
namespace kernels {

absl::StatusOr<RopeTable> BuildRopeTable(absl::Span<const float> inv_freq,
                                         int64_t positions,
                                         float attention_factor) {
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  if (half < 1) {
    return absl::InvalidArgumentError("rope inv_freq: need at least one");
  }
  if (positions < 1 || positions > (int64_t{1} << 31) / half) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope positions: must be in [1, 2^31 / frequencies], got ", positions));
  }
  if (!std::isfinite(attention_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope attention_factor: must be finite, got ", attention_factor));
  }
  for (int64_t i = 0; i < half; ++i) {
    if (!std::isfinite(inv_freq[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope inv_freq[", i, "]: must be finite, got ", inv_freq[i]));
    }
  }
  RopeTable table;
  table.rotary_dim = 2 * half;
  table.positions = positions;
  table.cos.resize(positions * half);
  table.sin.resize(positions * half);
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      // The fp32 product, as the model's float positions times float
      // frequencies; cos/sin of it rounded once to fp32.
      const float angle = static_cast<float>(p) * inv_freq[i];
      table.cos[p * half + i] =
          static_cast<float>(std::cos(static_cast<double>(angle))) *
          attention_factor;
      table.sin[p * half + i] =
          static_cast<float>(std::sin(static_cast<double>(angle))) *
          attention_factor;
    }
  }
  return table;
}

absl::Status RopeRotate(const RopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        float* x, bool inverse) {
  if (shape.tokens < 0 || shape.heads < 1 || shape.token_stride < 0 ||
      shape.head_stride < 0 || shape.dim_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope shape: need tokens >= 0, heads >= 1 and non-negative strides; "
        "got tokens ",
        shape.tokens, ", heads ", shape.heads));
  }
  if (shape.tokens == 0) return absl::OkStatus();
  if (positions == nullptr || x == nullptr) {
    return absl::InvalidArgumentError("rope: positions and x must not be null");
  }
  const int64_t half = table.rotary_dim / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  const bool interleaved = layout == RopeLayout::kInterleaved;
  for (int64_t t = 0; t < shape.tokens; ++t) {
    const int64_t p = positions[t];
    if (p < 0 || p >= table.positions) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope positions[", t, "]: ", p,
                       " outside the table's [0, ", table.positions, ")"));
    }
  }
  const int64_t grain = RowGrain(std::max<int64_t>(1, shape.heads * 2 * half));
  ParallelFor(shape.tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = positions[t];
      const float* c = table.cos.data() + p * half;
      const float* s = table.sin.data() + p * half;
      for (int64_t h = 0; h < shape.heads; ++h) {
        float* head = x + t * shape.token_stride + h * shape.head_stride +
                      shape.dim_offset;
        for (int64_t i = 0; i < half; ++i) {
          int64_t first, second;
          RopePairOffsets(interleaved, i, half, &first, &second);
          RopeRotatePair(c[i], sign * s[i], head + first, head + second);
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
