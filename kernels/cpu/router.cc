#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/router_grad_element.h"
#include "kernels/cpu/router_select.h"

namespace shardd {
namespace kernels {
namespace {

constexpr float kMinDenominator = kRouterMinDenominator;
constexpr int64_t kMaxBlasInt = std::numeric_limits<int>::max();

template <typename T>
void GrowTo(std::vector<T>& v, size_t n) {
  // Never shrink: resize() would value-initialize the tail again next time.
  if (v.size() < n) v.resize(n);
}

template <typename T>
size_t CapacityBytes(const std::vector<T>& v) {
  return v.capacity() * sizeof(T);
}

absl::Status ValidateDims(const RouterDims& d) {
  if (d.tokens < 0 || d.tokens > kMaxBlasInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router tokens must be in [0, ", kMaxBlasInt, "], got ", d.tokens));
  }
  if (d.dim < 1 || d.dim > kMaxBlasInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router dim must be in [1, ", kMaxBlasInt, "], got ", d.dim));
  }
  if (d.experts < 1 || d.experts > kMaxBlasInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router experts must be in [1, ", kMaxBlasInt, "], got ", d.experts));
  }
  if (d.top_k < 1 || d.top_k > d.experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router top_k must be in [1, experts=", d.experts, "], got ", d.top_k));
  }
  if (d.scoring == RouterScoring::kSigmoidGroupLimited) {
    if (d.groups < 1 || d.experts % d.groups != 0 ||
        d.experts / d.groups < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "router groups must split experts=", d.experts,
          " into equal groups of at least 2, got ", d.groups));
    }
    if (d.top_groups < 1 || d.top_groups > d.groups) {
      return absl::InvalidArgumentError(
          absl::StrCat("router top_groups must be in [1, groups=", d.groups,
                       "], got ", d.top_groups));
    }
    if (d.top_k > d.top_groups * (d.experts / d.groups)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "router top_k=", d.top_k, " exceeds the ",
          d.top_groups * (d.experts / d.groups),
          " experts of the kept groups"));
    }
    if (!std::isfinite(d.scale)) {
      return absl::InvalidArgumentError(
          absl::StrCat("router scale must be finite, got ", d.scale));
    }
  }
  return absl::OkStatus();
}

bool SameDims(const RouterDims& a, const RouterDims& b) {
  return a.tokens == b.tokens && a.dim == b.dim && a.experts == b.experts &&
         a.top_k == b.top_k && a.scoring == b.scoring &&
         a.groups == b.groups && a.top_groups == b.top_groups &&
         a.scale == b.scale;
}

// One token of kSigmoidGroupLimited: `logits` [E] in; `scratch` holds
// 2E + groups + top_groups + 2 floats and `iscratch` top_groups + 2 ints.
// Writes the K selected experts, their weights and scores and returns the
// denominator (-1 when not renormalised).
float SigmoidGroupLimitedRow(const RouterDims& d, const float* logits,
                             const float* selection_bias, float* scratch,
                             int32_t* iscratch, int32_t* idx, float* wt,
                             float* selected) {
  const int64_t e_count = d.experts;
  float* scores = scratch;
  float* choice = scores + e_count;
  float* group_score = choice + e_count;
  float* kept_val = group_score + d.groups;
  for (int64_t e = 0; e < e_count; ++e) {
    scores[e] = RouterSigmoid(logits[e]);
    choice[e] = scores[e] + (selection_bias ? selection_bias[e] : 0.0f);
  }
  RouterGroupLimitedSelect(choice, e_count, d.groups, d.top_groups, d.top_k,
                           group_score, kept_val, iscratch, idx, wt);
  for (int64_t j = 0; j < d.top_k; ++j) selected[j] = scores[idx[j]];
  return RouterGroupLimitedWeights(selected, d.top_k, d.renormalize, d.scale,
                                   wt);
}

}  // namespace

size_t RouterCache::bytes() const {
  return CapacityBytes(probs) + CapacityBytes(row) + CapacityBytes(row_idx) +
         CapacityBytes(indices) + CapacityBytes(denom) +
         CapacityBytes(d_logits) + CapacityBytes(softmax);
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, int32_t* indices, float* weights,
                           RouterCache* cache) {
  return RouterForward(dims, x, w, /*bias=*/nullptr, indices, weights, cache);
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias, int32_t* indices,
                           float* weights, RouterCache* cache) {
  return RouterForward(dims, x, w, bias, /*selection_bias=*/nullptr, indices,
                       weights, cache);
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, RouterCache* cache) {
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims));
  if (selection_bias != nullptr &&
      dims.scoring != RouterScoring::kSigmoidGroupLimited) {
    return absl::InvalidArgumentError(
        "router selection_bias is only for the sigmoid group-limited scoring");
  }
  if (cache == nullptr) {
    return absl::InvalidArgumentError("router cache must not be null");
  }
  const int64_t t_count = dims.tokens, d = dims.dim, e_count = dims.experts,
                k = dims.top_k;
  if (t_count > 0 && (x == nullptr || w == nullptr || indices == nullptr ||
                      weights == nullptr)) {
    return absl::InvalidArgumentError(
        "router x, w, indices and weights must not be null when tokens > 0");
  }
  cache->has_forward = false;
  GrowTo(cache->probs, static_cast<size_t>(t_count * e_count));
  GrowTo(cache->indices, static_cast<size_t>(t_count * k));
  GrowTo(cache->denom, static_cast<size_t>(t_count));
  float* probs = cache->probs.data();
  if (t_count > 0) {
    Sgemm(CblasNoTrans, CblasTrans,
                static_cast<int>(t_count), static_cast<int>(e_count),
                static_cast<int>(d), 1.0f, x, static_cast<int>(d), w,
                static_cast<int>(d), 0.0f, probs, static_cast<int>(e_count));
    if (bias != nullptr) {
      for (int64_t t = 0; t < t_count; ++t) {
        for (int64_t e = 0; e < e_count; ++e) probs[t * e_count + e] += bias[e];
      }
    }
  }
  if (dims.scoring == RouterScoring::kSigmoidGroupLimited) {
    // probs holds the logits; row t's selected scores replace its first
    // T * K entries once the row is read into the scratch.
    GrowTo(cache->row, static_cast<size_t>(2 * e_count + dims.groups +
                                           dims.top_groups + 2 + k));
    GrowTo(cache->row_idx, static_cast<size_t>(dims.top_groups + 2));
    float* selected = cache->row.data() + cache->row.size() - k;
    for (int64_t t = 0; t < t_count; ++t) {
      int32_t* idx = indices + t * k;
      cache->denom[t] = SigmoidGroupLimitedRow(
          dims, probs + t * e_count, selection_bias, cache->row.data(),
          cache->row_idx.data(), idx, weights + t * k, selected);
      for (int64_t j = 0; j < k; ++j) {
        cache->indices[t * k + j] = idx[j];
        probs[t * k + j] = selected[j];
      }
    }
    cache->dims = dims;
    cache->has_forward = true;
    return absl::OkStatus();
  }
  if (dims.scoring == RouterScoring::kTopKThenSoftmax) {
    // probs holds the logits; the weights replace its first T * K entries
    // once every row is read (row t's weights land at or before row t).
    if (dims.keep_softmax) {
      GrowTo(cache->softmax, static_cast<size_t>(t_count * e_count));
    }
    for (int64_t t = 0; t < t_count; ++t) {
      int32_t* idx = indices + t * k;
      float* wt = weights + t * k;
      if (dims.keep_softmax) {
        float* row = cache->softmax.data() + t * e_count;
        std::copy(probs + t * e_count, probs + (t + 1) * e_count, row);
        RouterSoftmaxRow(row, e_count);
      }
      RouterTopKRow(probs + t * e_count, e_count, k, idx, wt);
      RouterSoftmaxRow(wt, k);
      for (int64_t j = 0; j < k; ++j) {
        cache->indices[t * k + j] = idx[j];
        probs[t * k + j] = wt[j];
      }
      cache->denom[t] = -1.0f;
    }
    cache->dims = dims;
    cache->has_forward = true;
    return absl::OkStatus();
  }
  for (int64_t t = 0; t < t_count; ++t) {
    float* p = probs + t * e_count;
    RouterSoftmaxRow(p, e_count);
    int32_t* idx = indices + t * k;
    float* wt = weights + t * k;
    RouterTopKRow(p, e_count, k, idx, wt);
    if (dims.renormalize) {
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += wt[j];
      const float denom = sum > kMinDenominator ? sum : kMinDenominator;
      const float inv = 1.0f / denom;
      for (int64_t j = 0; j < k; ++j) wt[j] *= inv;
      cache->denom[t] = denom;
    } else {
      cache->denom[t] = -1.0f;  // The weights are the probabilities.
    }
    for (int64_t j = 0; j < k; ++j) cache->indices[t * k + j] = idx[j];
  }
  cache->dims = dims;
  cache->has_forward = true;
  return absl::OkStatus();
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights, float* dx,
                            bool accumulate_dx, float* dw, RouterCache* cache) {
  return RouterBackward(dims, x, w, d_weights, dx, accumulate_dx, dw,
                        /*d_bias=*/nullptr, cache);
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights, float* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            RouterCache* cache) {
  return RouterBackward(dims, x, w, d_weights, /*extra_d_logits=*/nullptr, dx,
                        accumulate_dx, dw, d_bias, cache);
}

const float* RouterSoftmax(const RouterCache& cache) {
  if (!cache.has_forward) return nullptr;
  switch (cache.dims.scoring) {
    case RouterScoring::kSoftmaxThenTopK:
      return cache.probs.data();
    case RouterScoring::kTopKThenSoftmax:
      return cache.dims.keep_softmax ? cache.softmax.data() : nullptr;
    default:
      return nullptr;
  }
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const float* extra_d_logits, float* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            RouterCache* cache) {
  if (cache == nullptr || !cache->has_forward) {
    return absl::FailedPreconditionError(
        "RouterBackward needs a cache filled by RouterForward");
  }
  if (!SameDims(dims, cache->dims)) {
    return absl::FailedPreconditionError(
        "RouterBackward dims differ from the forward's");
  }
  const int64_t t_count = dims.tokens, d = dims.dim, e_count = dims.experts,
                k = dims.top_k;
  if (t_count == 0) return absl::OkStatus();
  if (d_weights == nullptr) {
    return absl::InvalidArgumentError("router d_weights must not be null");
  }
  if (dx != nullptr && w == nullptr) {
    return absl::InvalidArgumentError("router w is needed to compute dx");
  }
  if (dw != nullptr && x == nullptr) {
    return absl::InvalidArgumentError("router x is needed to compute dw");
  }
  if (dx == nullptr && dw == nullptr && d_bias == nullptr) {
    return absl::OkStatus();
  }

  GrowTo(cache->d_logits, static_cast<size_t>(t_count * e_count));
  float* d_logits = cache->d_logits.data();
  for (int64_t t = 0;
       t < t_count && dims.scoring == RouterScoring::kTopKThenSoftmax; ++t) {
    // w = softmax(selected logits): dlogit_j = w_j (dw_j - sum_i w_i dw_i)
    // on the selected experts, zero elsewhere.
    const float* wt = cache->probs.data() + t * k;
    const int32_t* idx = cache->indices.data() + t * k;
    const float* dwt = d_weights + t * k;
    const float dot = RouterPickedSoftmaxDot(wt, dwt, k);
    float* dl = d_logits + t * e_count;
    std::fill(dl, dl + e_count, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      dl[idx[j]] = RouterPickedSoftmaxGrad(wt[j], dwt[j], dot);
    }
  }
  for (int64_t t = 0;
       t < t_count && dims.scoring == RouterScoring::kSigmoidGroupLimited;
       ++t) {
    // w_j = c s_j / D with D = sum_i s_i + 1e-20: dL/ds_j = c / D (dw_j -
    // sum_i dw_i s_i / D), or c dw_j unnormalised; then sigmoid' = s (1 - s).
    // Unselected experts (and the selection bias) get nothing.
    const float* s = cache->probs.data() + t * k;
    const int32_t* idx = cache->indices.data() + t * k;
    const float* dwt = d_weights + t * k;
    const float denom = cache->denom[t];
    float* dl = d_logits + t * e_count;
    std::fill(dl, dl + e_count, 0.0f);
    const float dot = RouterSigmoidDot(s, dwt, k, denom);
    const float mult = RouterSigmoidMult(dims.scale, denom);
    for (int64_t j = 0; j < k; ++j) {
      dl[idx[j]] = RouterSigmoidGrad(mult, dwt[j], dot, s[j]);
    }
  }
  for (int64_t t = 0;
       t < t_count && dims.scoring == RouterScoring::kSoftmaxThenTopK; ++t) {
    const float* p = cache->probs.data() + t * e_count;
    const int32_t* idx = cache->indices.data() + t * k;
    const float* dwt = d_weights + t * k;
    const float denom = cache->denom[t];
    const bool renormalized = denom > 0.0f;
    const float inv = RouterRenormInverse(denom);
    // w_j = p_j / S: dL/dp_j = (dw_j - sum_i dw_i w_i) / S, unless S was
    // clamped, in which case S is a constant; without renormalization
    // w_j = p_j and dL/dp_j = dw_j.
    const bool varies =
        renormalized && RouterPickedSum(p, idx, k) > kMinDenominator;
    const float dot = RouterRenormDot(p, idx, dwt, k, inv, varies);
    // Softmax backward: dlogit_e = p_e (dp_e - sum_j p_j dp_j), where dp is
    // non-zero only on the selected experts.
    const float inner = RouterRenormInner(p, idx, dwt, k, dot, inv);
    float* dl = d_logits + t * e_count;
    for (int64_t e = 0; e < e_count; ++e) dl[e] = RnMul(-p[e], inner);
    for (int64_t j = 0; j < k; ++j) {
      dl[idx[j]] =
          RnAdd(dl[idx[j]], RouterRenormPickGrad(p[idx[j]], dwt[j], dot, inv));
    }
  }
  if (extra_d_logits != nullptr) {
    for (int64_t i = 0; i < t_count * e_count; ++i) {
      d_logits[i] = RnAdd(d_logits[i], extra_d_logits[i]);
    }
  }
  if (dx != nullptr) {
    // dx[T, D] = d_logits[T, E] @ W[E, D].
    Sgemm(CblasNoTrans, CblasNoTrans,
                static_cast<int>(t_count), static_cast<int>(d),
                static_cast<int>(e_count), 1.0f, d_logits,
                static_cast<int>(e_count), w, static_cast<int>(d),
                accumulate_dx ? 1.0f : 0.0f, dx, static_cast<int>(d));
  }
  if (d_bias != nullptr) {
    for (int64_t t = 0; t < t_count; ++t) {
      for (int64_t e = 0; e < e_count; ++e) {
        d_bias[e] += d_logits[t * e_count + e];
      }
    }
  }
  if (dw != nullptr) {
    // dW[E, D] += d_logits^T[E, T] @ x[T, D].
    Sgemm(CblasTrans, CblasNoTrans,
                static_cast<int>(e_count), static_cast<int>(d),
                static_cast<int>(t_count), 1.0f, d_logits,
                static_cast<int>(e_count), x, static_cast<int>(d), 1.0f, dw,
                static_cast<int>(d));
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
