#ifndef SHARDD_KERNELS_CPU_EXPERT_PERMUTE_ELEMENT_H_
#define SHARDD_KERNELS_CPU_EXPERT_PERMUTE_ELEMENT_H_

// Expert parallelism's row permutation, per element: what goes into each
// exchanged row and how the rows that come back are summed per token
// (worker/model/expert_exchange.h describes the exchange). One definition
// for the host exchange (expert_exchange.cc) and the device kernels
// (kernels/cuda/expert_permute_kernels.cu), so a GPU rank packs and
// combines exactly as a CPU rank does: the same rows in the same order, a
// token's slots summed in slot order with each addition rounded once.
// Dependency-free so that nvcc can include it.
//
// Layouts (route order = rows grouped by destination rank, then token, then
// slot; `order[j]` is the slot, token * k + s, of route row j and
// `position[slot]` its inverse):
//   dispatch row   [x of the slot's token (d) | local expert id | weight]
//   combine row    [y (d)]                     (coming back)
//   grad row       [dy of the slot's token (d)]
//   combine-grad   [dx (d) | d weight]          (coming back)

#include <cstdint>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// Values after the d activations in a dispatched row.
inline constexpr int64_t kDispatchRowExtras = 2;
// Values after the d gradients in a combine-grad row.
inline constexpr int64_t kCombineGradRowExtras = 1;

// The id among the receiving rank's `local` experts, carried as a float
// (exact: expert counts are far below 2^24).
SHARDD_HOST_DEVICE_INLINE float LocalExpertTag(int32_t expert, int64_t local) {
  return static_cast<float>(expert % local);
}

SHARDD_HOST_DEVICE_INLINE int32_t LocalExpertFromTag(float tag) {
  return static_cast<int32_t>(tag);
}

// The token whose activations (dispatch) or gradients (dispatch-grad) route
// row j carries: columns [0, d) of the row are that token's row, copied.
SHARDD_HOST_DEVICE_INLINE int64_t RouteRowToken(const int64_t* order, int k,
                                                int64_t j) {
  return order[j] / k;
}

// Column c (< d) of token i's sum over its k returned rows (each `width`
// values wide, route order), in slot order: y = ((r_0 + r_1) + r_2) + ...
SHARDD_HOST_DEVICE_INLINE float CombineValue(const float* back,
                                             const int64_t* position, int k,
                                             int64_t width, int64_t i,
                                             int64_t c) {
  float sum = back[position[i * k] * width + c];
  for (int s = 1; s < k; ++s) {
    sum = RnAdd(sum, back[position[i * k + s] * width + c]);
  }
  return sum;
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_EXPERT_PERMUTE_ELEMENT_H_
