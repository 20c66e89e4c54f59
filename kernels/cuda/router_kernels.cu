#include <algorithm>
#include <cstdint>

#include "kernels/cpu/router_grad_element.h"
#include "kernels/cpu/router_select.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/router_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr float kMinDenominator = 1e-20f;  // as kernels/cpu/router.cc
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 32 * kWarpsPerBlock;
constexpr int kPerLane = kRouterMaxExperts / 32;
constexpr int64_t kMaxBlocks = 65535;

int GridFor(int64_t tokens) {
  return static_cast<int>(std::min<int64_t>(
      (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks));
}

// Selection key: probabilities are in [0, 1], so NaN ranks below every real
// one (-1) and taken experts below that (-2). Among equal keys the lower
// expert wins, so with finite probabilities the selection equals the CPU's
// stable insertion, and an all-NaN row selects experts 0..K-1 as the CPU does.
__device__ __forceinline__ float SelectionKey(float p) {
  return isnan(p) ? -1.0f : p;
}

__device__ __forceinline__ bool Better(float key_a, int index_a, float key_b,
                                       int index_b) {
  return key_a > key_b || (key_a == key_b && index_a < index_b);
}

// One warp per token; lane l holds experts l, l + 32, ... in registers.
__global__ void __launch_bounds__(kThreads) RouterSoftmaxTopKKernel(
    float* __restrict__ probs, int64_t tokens, int experts, int top_k,
    bool renormalize, int32_t* __restrict__ indices,
    float* __restrict__ weights,
    int32_t* __restrict__ saved_indices, float* __restrict__ denom) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                   (threadIdx.x >> 5);
       t < tokens; t += warp_stride) {
    float* row = probs + t * experts;
    float v[kPerLane];
    float max_v = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      v[j] = e < experts ? row[e] : -INFINITY;
      max_v = fmaxf(max_v, v[j]);
    }
    max_v = WarpMax(max_v);
    // A NaN logit makes the CPU's sum, hence every probability, NaN; fmaxf
    // skips NaN, and the exp below then propagates it the same way.
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      v[j] = e < experts ? expf(v[j] - max_v) : 0.0f;
      sum += v[j];
    }
    sum = WarpSum(sum);
    const float inv_sum = 1.0f / sum;
    uint32_t taken = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      v[j] *= inv_sum;
      if (e < experts) {
        row[e] = v[j];
      } else {
        taken |= 1u << j;  // padding is never selected
      }
    }

    // K rounds of a warp argmax; lane k keeps the k-th pick.
    int my_index = 0;
    float my_value = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      float best_key = -2.0f;
      int best_index = INT32_MAX;
      float best_value = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (!(taken & (1u << j))) {
          const float key = SelectionKey(v[j]);
          if (Better(key, e, best_key, best_index)) {
            best_key = key;
            best_index = e;
            best_value = v[j];
          }
        }
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_key = __shfl_xor_sync(0xFFFFFFFFu, best_key, offset);
        const int other_index =
            __shfl_xor_sync(0xFFFFFFFFu, best_index, offset);
        const float other_value =
            __shfl_xor_sync(0xFFFFFFFFu, best_value, offset);
        if (Better(other_key, other_index, best_key, best_index)) {
          best_key = other_key;
          best_index = other_index;
          best_value = other_value;
        }
      }
      if ((best_index & 31) == lane) taken |= 1u << (best_index >> 5);
      if (lane == k) {
        my_index = best_index;
        my_value = best_value;
      }
    }

    // Renormalize; the sum runs in pick order like the CPU loop.
    float picked_sum = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      picked_sum += __shfl_sync(0xFFFFFFFFu, my_value, k);
    }
    // Without renormalization the saved denominator is -1 (the backward
    // then treats the weights as the probabilities themselves).
    const float d = !renormalize                ? -1.0f
                    : picked_sum > kMinDenominator ? picked_sum
                                                   : kMinDenominator;
    const float inv_d = renormalize ? 1.0f / d : 1.0f;
    if (lane < top_k) {
      const int64_t slot = t * top_k + lane;
      indices[slot] = my_index;
      saved_indices[slot] = my_index;
      weights[slot] = my_value * inv_d;
    }
    if (lane == 0) denom[t] = d;
  }
}

// One warp per token. With w_j = p_j / S (S the clamped sum of the picks):
//   dp_j = (dw_j - sum_i dw_i w_i) / S  (S constant when it was clamped),
//   dlogit_e = p_e (dp_e - sum_j p_j dp_j),
// evaluated in the CPU kernel's order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RouterDLogitsKernel(const float* __restrict__ probs,
                        const int32_t* __restrict__ saved_indices,
                        const float* __restrict__ denom,
                        const float* __restrict__ d_weights,
                        const float* __restrict__ extra_d_logits,
                        int64_t tokens, int experts, int top_k,
                        T* __restrict__ d_logits) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                   (threadIdx.x >> 5);
       t < tokens; t += warp_stride) {
    const float* p = probs + t * experts;
    const int32_t* idx = saved_indices + t * top_k;
    const float* dwt = d_weights + t * top_k;
    const bool renormalized = denom[t] > 0.0f;
    const float inv = RouterRenormInverse(denom[t]);
    const bool varies =
        renormalized && RouterPickedSum(p, idx, top_k) > kMinDenominator;
    const float dot = RouterRenormDot(p, idx, dwt, top_k, inv, varies);
    const float inner = RouterRenormInner(p, idx, dwt, top_k, dot, inv);
    T* dl = d_logits + t * experts;
    for (int e = lane; e < experts; e += 32) {
      const float pe = p[e];
      float value = RnMul(-pe, inner);
      for (int j = 0; j < top_k; ++j) {
        if (idx[j] == e) {
          value = RnAdd(value, RouterRenormPickGrad(pe, dwt[j], dot, inv));
        }
      }
      if (extra_d_logits != nullptr) {
        value = RnAdd(value, extra_d_logits[t * experts + e]);
      }
      StoreFromFloat(dl + e, value);
    }
  }
}

template <typename T>
cudaError_t DLogits(const float* probs, const int32_t* saved_indices,
                    const float* denom, const float* d_weights,
                    const float* extra_d_logits, int64_t tokens,
                    int64_t experts, int64_t top_k, T* d_logits,
                    cudaStream_t stream) {
  RouterDLogitsKernel<T><<<GridFor(tokens), kThreads, 0, stream>>>(
      probs, saved_indices, denom, d_weights, extra_d_logits, tokens,
      static_cast<int>(experts), static_cast<int>(top_k), d_logits);
  return cudaGetLastError();
}

// kTopKThenSoftmax and kSigmoidGroupLimited forward: one warp per token.
// The lanes stage the row (logits, or sigmoid + selection bias) in shared
// memory and write the kept softmax; lane 0 then runs the CPU's serial
// selection on it (router_select.h), so indices follow the CPU's tie and
// NaN rules exactly for equal inputs.
constexpr int kSelectWarps = 4;
constexpr int kSelectThreads = 32 * kSelectWarps;
constexpr int kMaxGroups = kRouterMaxExperts / 2;  // groups of >= 2 experts

int SelectGridFor(int64_t tokens) {
  return static_cast<int>(std::min<int64_t>(
      (tokens + kSelectWarps - 1) / kSelectWarps, kMaxBlocks));
}

template <bool kGroupLimited>
__global__ void __launch_bounds__(kSelectThreads) RouterSelectKernel(
    float* __restrict__ probs, int64_t tokens, int experts, int top_k,
    bool renormalize, int groups, int top_groups, float scale,
    bool keep_softmax, const float* __restrict__ selection_bias,
    int32_t* __restrict__ indices, float* __restrict__ weights,
    int32_t* __restrict__ saved_indices, float* __restrict__ selected,
    float* __restrict__ denom) {
  // 4 warps x (4 + 3 * 2) KiB = 40 KiB of static shared memory.
  __shared__ float row_sh[kSelectWarps][kRouterMaxExperts];
  __shared__ float group_sh[kSelectWarps][kMaxGroups];
  __shared__ float kept_val_sh[kSelectWarps][kMaxGroups];
  __shared__ int32_t kept_sh[kSelectWarps][kMaxGroups];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* sh = row_sh[warp];
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kSelectWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kSelectWarps + warp;
       t < tokens; t += warp_stride) {
    float* row = probs + t * experts;
    for (int e = lane; e < experts; e += 32) {
      const float logit = row[e];
      sh[e] = kGroupLimited
                  ? RouterSigmoid(logit) +
                        (selection_bias != nullptr ? selection_bias[e] : 0.0f)
                  : logit;
    }
    if (!kGroupLimited && keep_softmax) {
      // As the existing softmax kernel: a NaN logit makes every entry NaN.
      float max_v = -INFINITY;
      for (int e = lane; e < experts; e += 32) max_v = fmaxf(max_v, sh[e]);
      max_v = WarpMax(max_v);
      float sum = 0.0f;
      for (int e = lane; e < experts; e += 32) sum += expf(sh[e] - max_v);
      sum = WarpSum(sum);
      const float inv_sum = 1.0f / sum;
      for (int e = lane; e < experts; e += 32) {
        row[e] = expf(sh[e] - max_v) * inv_sum;
      }
    }
    __syncwarp();
    if (lane == 0) {
      int32_t idx[kRouterMaxTopK];
      float val[kRouterMaxTopK];
      float wt[kRouterMaxTopK];
      float d = -1.0f;
      if (kGroupLimited) {
        RouterGroupLimitedSelect(sh, experts, groups, top_groups, top_k,
                                 group_sh[warp], kept_val_sh[warp],
                                 kept_sh[warp], idx, val);
        // The selected scores, recomputed from the logits exactly as above.
        for (int j = 0; j < top_k; ++j) val[j] = RouterSigmoid(row[idx[j]]);
        d = RouterGroupLimitedWeights(val, top_k, renormalize, scale, wt);
      } else {
        RouterTopKRow(sh, experts, top_k, idx, val);
        RouterSoftmaxRow(val, top_k);
        for (int j = 0; j < top_k; ++j) wt[j] = val[j];
      }
      for (int j = 0; j < top_k; ++j) {
        const int64_t slot = t * top_k + j;
        indices[slot] = idx[j];
        saved_indices[slot] = idx[j];
        selected[slot] = val[j];
        weights[slot] = wt[j];
      }
      denom[t] = d;
    }
    __syncwarp();  // sh is rewritten for this warp's next token
  }
}

// Backward of the two: one warp per token, zero off the selected experts.
//   kTopKThenSoftmax:  dlogit_j = w_j (dw_j - sum_i w_i dw_i)
//   kSigmoidGroupLimited: w_j = c s_j / D, D = sum_i s_i + 1e-20:
//     dlogit_j = c / D (dw_j - sum_i dw_i s_i / D) s_j (1 - s_j), or
//     c dw_j s_j (1 - s_j) unnormalised
// in the CPU kernel's order of operations.
template <typename T, bool kGroupLimited>
__global__ void __launch_bounds__(kThreads) RouterSelectedDLogitsKernel(
    const float* __restrict__ selected,
    const int32_t* __restrict__ saved_indices,
    const float* __restrict__ denom, const float* __restrict__ d_weights,
    const float* __restrict__ extra_d_logits, int64_t tokens, int experts,
    int top_k, float scale, T* __restrict__ d_logits) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                   (threadIdx.x >> 5);
       t < tokens; t += warp_stride) {
    const float* s = selected + t * top_k;
    const int32_t* idx = saved_indices + t * top_k;
    const float* dwt = d_weights + t * top_k;
    float dot = 0.0f, mult = 1.0f;
    if (kGroupLimited) {
      dot = RouterSigmoidDot(s, dwt, top_k, denom[t]);
      mult = RouterSigmoidMult(scale, denom[t]);
    } else {
      dot = RouterPickedSoftmaxDot(s, dwt, top_k);
    }
    T* dl = d_logits + t * experts;
    for (int e = lane; e < experts; e += 32) {
      float value = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        if (idx[j] != e) continue;
        value = kGroupLimited ? RouterSigmoidGrad(mult, dwt[j], dot, s[j])
                              : RouterPickedSoftmaxGrad(s[j], dwt[j], dot);
      }
      if (extra_d_logits != nullptr) {
        value = RnAdd(value, extra_d_logits[t * experts + e]);
      }
      StoreFromFloat(dl + e, value);
    }
  }
}

template <typename T>
cudaError_t SelectedDLogits(bool group_limited, const float* selected,
                            const int32_t* saved_indices, const float* denom,
                            const float* d_weights,
                            const float* extra_d_logits, int64_t tokens,
                            int64_t experts, int64_t top_k, float scale,
                            T* d_logits, cudaStream_t stream) {
  if (group_limited) {
    RouterSelectedDLogitsKernel<T, true>
        <<<GridFor(tokens), kThreads, 0, stream>>>(
            selected, saved_indices, denom, d_weights, extra_d_logits, tokens,
            static_cast<int>(experts), static_cast<int>(top_k), scale,
            d_logits);
  } else {
    RouterSelectedDLogitsKernel<T, false>
        <<<GridFor(tokens), kThreads, 0, stream>>>(
            selected, saved_indices, denom, d_weights, extra_d_logits, tokens,
            static_cast<int>(experts), static_cast<int>(top_k), scale,
            d_logits);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRouterSoftmaxTopK(float* probs, int64_t tokens,
                                    int64_t experts, int64_t top_k,
                                    bool renormalize, int32_t* indices,
                                    float* weights, int32_t* saved_indices,
                                    float* denom, cudaStream_t stream) {
  RouterSoftmaxTopKKernel<<<GridFor(tokens), kThreads, 0, stream>>>(
      probs, tokens, static_cast<int>(experts), static_cast<int>(top_k),
      renormalize, indices, weights, saved_indices, denom);
  return cudaGetLastError();
}

cudaError_t LaunchRouterSelect(float* probs, int64_t tokens, int64_t experts,
                               int64_t top_k, bool group_limited,
                               bool renormalize, int64_t groups,
                               int64_t top_groups, float scale,
                               bool keep_softmax, const float* selection_bias,
                               int32_t* indices, float* weights,
                               int32_t* saved_indices, float* selected,
                               float* denom, cudaStream_t stream) {
  if (group_limited) {
    RouterSelectKernel<true><<<SelectGridFor(tokens), kSelectThreads, 0,
                               stream>>>(
        probs, tokens, static_cast<int>(experts), static_cast<int>(top_k),
        renormalize, static_cast<int>(groups), static_cast<int>(top_groups),
        scale, /*keep_softmax=*/false, selection_bias, indices, weights,
        saved_indices, selected, denom);
  } else {
    RouterSelectKernel<false><<<SelectGridFor(tokens), kSelectThreads, 0,
                                stream>>>(
        probs, tokens, static_cast<int>(experts), static_cast<int>(top_k),
        renormalize, /*groups=*/1, /*top_groups=*/1, scale, keep_softmax,
        /*selection_bias=*/nullptr, indices, weights, saved_indices, selected,
        denom);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                const float* extra_d_logits, int64_t tokens,
                                int64_t experts, int64_t top_k,
                                float* d_logits, cudaStream_t stream) {
  return DLogits(probs, saved_indices, denom, d_weights, extra_d_logits,
                 tokens, experts, top_k, d_logits, stream);
}

cudaError_t LaunchRouterDLogits(const float* probs,
                                const int32_t* saved_indices,
                                const float* denom, const float* d_weights,
                                const float* extra_d_logits, int64_t tokens,
                                int64_t experts, int64_t top_k,
                                uint16_t* d_logits, cudaStream_t stream) {
  return DLogits(probs, saved_indices, denom, d_weights, extra_d_logits,
                 tokens, experts, top_k, d_logits, stream);
}

cudaError_t LaunchRouterSelectedDLogits(
    bool group_limited, const float* selected, const int32_t* saved_indices,
    const float* denom, const float* d_weights, const float* extra_d_logits,
    int64_t tokens, int64_t experts, int64_t top_k, float scale,
    float* d_logits, cudaStream_t stream) {
  return SelectedDLogits(group_limited, selected, saved_indices, denom,
                         d_weights, extra_d_logits, tokens, experts, top_k,
                         scale, d_logits, stream);
}

cudaError_t LaunchRouterSelectedDLogits(
    bool group_limited, const float* selected, const int32_t* saved_indices,
    const float* denom, const float* d_weights, const float* extra_d_logits,
    int64_t tokens, int64_t experts, int64_t top_k, float scale,
    uint16_t* d_logits, cudaStream_t stream) {
  return SelectedDLogits(group_limited, selected, saved_indices, denom,
                         d_weights, extra_d_logits, tokens, experts, top_k,
                         scale, d_logits, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
