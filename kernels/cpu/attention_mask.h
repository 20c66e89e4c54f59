#ifndef SHARDD_KERNELS_CPU_ATTENTION_MASK_H_
#define SHARDD_KERNELS_CPU_ATTENTION_MASK_H_

// Which keys a query may see (kernels/cpu/attention.h describes the masks),
// as host-and-device inline functions: the CPU and the CUDA attention share
// this one definition. Dependency-free so that nvcc can include it.

#include <cstdint>

#include "kernels/cpu/host_device.h"


namespace shardd {
namespace kernels {

enum class AttentionMask {
  kBidirectional,
  kCausal,
  kSlidingWindow,
  kBlockCausal
};

struct MaskRule {
  AttentionMask mask = AttentionMask::kCausal;
  int64_t q_offset = 0;  // Query i sits at key position i + q_offset.
  int64_t window = 0;    // kSlidingWindow, >= 1
  int64_t block = 0;     // kBlockCausal, >= 1
};

// Whether key j is visible from the query at key position `pos`.
SHARDD_HOST_DEVICE inline bool MaskAllows(const MaskRule& r, int64_t pos,
                                          int64_t j) {
  switch (r.mask) {
    case AttentionMask::kBidirectional:
      return true;
    case AttentionMask::kCausal:
      return j <= pos;
    case AttentionMask::kSlidingWindow:
      return j <= pos && pos - j < r.window;
    case AttentionMask::kBlockCausal:
      return j / r.block <= pos / r.block;
  }
  return false;
}

// Packed sequences (AttentionOptions.key_begin, [batch, q_len]): the first
// key query i of sequence b may see besides the mask (its example's first
// token in the row); 0 without packing (key_begin null).
SHARDD_HOST_DEVICE inline int64_t PackedFirstKey(const int32_t* key_begin,
                                                 int64_t q_len, int64_t b,
                                                 int64_t i) {
  return key_begin == nullptr ? 0 : key_begin[b * q_len + i];
}

// MaskAllows for a query whose first visible key is `first`.
SHARDD_HOST_DEVICE inline bool MaskAllowsFrom(const MaskRule& r, int64_t pos,
                                              int64_t j, int64_t first) {
  return j >= first && MaskAllows(r, pos, j);
}

// The keys [*begin, *end) of kv_len that some query at positions [p0, p1]
// may see (every key outside is masked for all of them).
SHARDD_HOST_DEVICE inline void MaskKeyRange(const MaskRule& r, int64_t p0,
                                            int64_t p1, int64_t kv_len,
                                            int64_t* begin, int64_t* end) {
  int64_t b = 0, e = kv_len;
  switch (r.mask) {
    case AttentionMask::kBidirectional:
      break;
    case AttentionMask::kCausal:
      e = p1 + 1 < kv_len ? p1 + 1 : kv_len;
      break;
    case AttentionMask::kSlidingWindow:
      b = p0 - r.window + 1 > 0 ? p0 - r.window + 1 : 0;
      e = p1 + 1 < kv_len ? p1 + 1 : kv_len;
      break;
    case AttentionMask::kBlockCausal: {
      const int64_t last = (p1 / r.block + 1) * r.block;
      e = last < kv_len ? last : kv_len;
      break;
    }
  }
  *begin = b < e ? b : e;
  *end = e;
}

// The queries [*begin, *end) of q_len that may see some key in [j0, j1].
SHARDD_HOST_DEVICE inline void MaskQueryRange(const MaskRule& r, int64_t j0,
                                              int64_t j1, int64_t q_len,
                                              int64_t* begin, int64_t* end) {
  int64_t first_pos = 0;  // Smallest query position that sees key j0..j1.
  int64_t last_pos = q_len - 1 + r.q_offset;
  switch (r.mask) {
    case AttentionMask::kBidirectional:
      break;
    case AttentionMask::kCausal:
      first_pos = j0;
      break;
    case AttentionMask::kSlidingWindow:
      first_pos = j0;
      last_pos = j1 + r.window - 1 < last_pos ? j1 + r.window - 1 : last_pos;
      break;
    case AttentionMask::kBlockCausal:
      first_pos = (j0 / r.block) * r.block;
      break;
  }
  int64_t b = first_pos - r.q_offset, e = last_pos - r.q_offset + 1;
  if (b < 0) b = 0;
  if (e > q_len) e = q_len;
  *begin = b < e ? b : e;
  *end = e > *begin ? e : *begin;
}

}  // namespace kernels
}  // namespace shardd


#endif  // SHARDD_KERNELS_CPU_ATTENTION_MASK_H_
