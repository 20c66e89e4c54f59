#ifndef SHARDD_KERNELS_CPU_ROUTER_SELECT_H_
#define SHARDD_KERNELS_CPU_ROUTER_SELECT_H_

// The router's per-token selection rules (kernels/cpu/router.h describes
// the scorings), as host-and-device inline functions: the CPU router and
// the CUDA router (kernels/cuda/router_kernels.cu, one thread per token for
// these steps) share this one definition, so their tie and NaN rules cannot
// drift apart. Dependency-free so that nvcc can include it.

#include <cmath>
#include <cstdint>

#include "kernels/cpu/host_device.h"
#include "kernels/cpu/ieee_ops.h"


namespace shardd {
namespace kernels {

enum class RouterScoring {
  kSoftmaxThenTopK,      // Mixtral, Qwen3, NeMo
  kTopKThenSoftmax,      // GPT-OSS
  kSigmoidGroupLimited,  // DeepSeek-V3
};

// Floor of a renormalisation denominator (HF adds it, Mixtral clamps to it).
inline constexpr float kRouterMinDenominator = 1e-20f;

SHARDD_HOST_DEVICE inline float RouterExp(float x) { return LibExp(x); }

// sigmoid(x) as DeepSeek-V3's router scores it.
SHARDD_HOST_DEVICE inline float RouterSigmoid(float x) {
  return 1.0f / (1.0f + RouterExp(-x));
}

// In-place softmax of one row of n values.
SHARDD_HOST_DEVICE inline void RouterSoftmaxRow(float* row, int64_t n) {
  float max_v = row[0];
  for (int64_t e = 1; e < n; ++e) max_v = row[e] > max_v ? row[e] : max_v;
  float sum = 0.0f;
  for (int64_t e = 0; e < n; ++e) {
    row[e] = RouterExp(row[e] - max_v);
    sum += row[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < n; ++e) row[e] *= inv;
}

// Writes the k largest of v[0..n) into idx/val, largest first. Insertion
// only on a strictly larger value keeps lower indices ahead of equal ones.
// The first k entries are always taken in, so idx is always k distinct
// valid indices even when v holds NaN.
SHARDD_HOST_DEVICE inline void RouterTopKRow(const float* v, int64_t n,
                                                    int64_t k, int32_t* idx,
                                                    float* val) {
  int64_t count = 0;
  for (int64_t e = 0; e < n; ++e) {
    const float p = v[e];
    if (count == k && !(p > val[k - 1])) continue;
    int64_t pos = count < k ? count : k - 1;
    while (pos > 0 && p > val[pos - 1]) {
      val[pos] = val[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    val[pos] = p;
    idx[pos] = static_cast<int32_t>(e);
    if (count < k) ++count;
  }
}

// kSigmoidGroupLimited's choice among `choice` [experts] (score + selection
// bias): each of `groups` groups of consecutive experts is scored by its 2
// largest choices, the top_groups best groups are kept (ties: lower group),
// the other groups' choices are set to 0 IN PLACE (Hugging Face's
// masked_fill(..., 0.0), not -inf), and the top_k of the row are written to
// idx/val. Scratch: group_score [groups], kept_val and kept [top_groups].
SHARDD_HOST_DEVICE inline void RouterGroupLimitedSelect(
    float* choice, int64_t experts, int64_t groups, int64_t top_groups,
    int64_t top_k, float* group_score, float* kept_val, int32_t* kept,
    int32_t* idx, float* val) {
  const int64_t size = experts / groups;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t best2[2];
    float val2[2];
    RouterTopKRow(choice + g * size, size, 2, best2, val2);
    group_score[g] = val2[0] + val2[1];
  }
  RouterTopKRow(group_score, groups, top_groups, kept, kept_val);
  for (int64_t e = 0; e < experts; ++e) {
    bool keep = false;
    for (int64_t j = 0; j < top_groups; ++j) keep |= kept[j] == e / size;
    if (!keep) choice[e] = 0.0f;
  }
  RouterTopKRow(choice, experts, top_k, idx, val);
}

// kSigmoidGroupLimited's weights from the selected scores [k]: as HF,
// divide by their sum + 1e-20 (renormalize), then multiply by `scale`.
// Returns the denominator, or -1 when not renormalised.
SHARDD_HOST_DEVICE inline float RouterGroupLimitedWeights(
    const float* selected, int64_t k, bool renormalize, float scale,
    float* weights) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) sum += selected[j];
  const float denom = renormalize ? sum + kRouterMinDenominator : -1.0f;
  for (int64_t j = 0; j < k; ++j) {
    weights[j] =
        renormalize ? selected[j] / denom * scale : selected[j] * scale;
  }
  return denom;
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROUTER_SELECT_H_
