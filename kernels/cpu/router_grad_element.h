#ifndef SHARDD_KERNELS_CPU_ROUTER_GRAD_ELEMENT_H_
#define SHARDD_KERNELS_CPU_ROUTER_GRAD_ELEMENT_H_

// The router's backward per token, from d_weights [k] to d_logits
// (kernels/cpu/router.h describes the scorings): one definition for the
// CPU router (router.cc) and the CUDA one (kernels/cuda/router_kernels.cu),
// each fp32 operation rounded once (ieee_ops.h), so neither side contracts
// a product into an FMA the other does not. Sums over the k picks run in
// pick order on both sides. Dependency-free so that nvcc can include it.

#include <cstdint>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// ---- kTopKThenSoftmax: w = softmax(selected logits).
// sum_j w_j dw_j.
SHARDD_HOST_DEVICE inline float RouterPickedSoftmaxDot(const float* w,
                                                       const float* dwt,
                                                       int64_t k) {
  float dot = 0.0f;
  for (int64_t j = 0; j < k; ++j) dot = RnAdd(dot, RnMul(w[j], dwt[j]));
  return dot;
}

// dlogit of pick j: w_j (dw_j - dot); zero elsewhere.
SHARDD_HOST_DEVICE_INLINE float RouterPickedSoftmaxGrad(float w, float dwt,
                                                        float dot) {
  return RnMul(w, RnSub(dwt, dot));
}

// ---- kSigmoidGroupLimited: w_j = c s_j / D (D <= 0: unnormalised).
// sum_j dw_j s_j / D (0 when unnormalised).
SHARDD_HOST_DEVICE inline float RouterSigmoidDot(const float* s,
                                                 const float* dwt, int64_t k,
                                                 float denom) {
  float dot = 0.0f;
  if (denom > 0.0f) {
    for (int64_t j = 0; j < k; ++j) {
      dot = RnAdd(dot, RnDiv(RnMul(dwt[j], s[j]), denom));
    }
  }
  return dot;
}

// c / D, or c unnormalised.
SHARDD_HOST_DEVICE_INLINE float RouterSigmoidMult(float scale, float denom) {
  return denom > 0.0f ? RnDiv(scale, denom) : scale;
}

// dlogit of pick j: ((mult (dw_j - dot)) s_j) (1 - s_j); zero elsewhere.
SHARDD_HOST_DEVICE_INLINE float RouterSigmoidGrad(float mult, float dwt,
                                                  float dot, float s) {
  return RnMul(RnMul(RnMul(mult, RnSub(dwt, dot)), s), RnSub(1.0f, s));
}

// ---- kSoftmaxThenTopK: p = softmax(logits), w_j = p_j / S with S the
// (clamped) sum of the picks when renormalised (denom > 0).
SHARDD_HOST_DEVICE_INLINE float RouterRenormInverse(float denom) {
  return denom > 0.0f ? RnDiv(1.0f, denom) : 1.0f;
}

// sum_j p_{idx_j}: whether the renormalisation's sum was above the clamp.
SHARDD_HOST_DEVICE inline float RouterPickedSum(const float* p,
                                                const int32_t* idx,
                                                int64_t k) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) sum = RnAdd(sum, p[idx[j]]);
  return sum;
}

// sum_j dw_j p_{idx_j} / S, when S varies with p (renormalised, unclamped);
// else 0.
SHARDD_HOST_DEVICE inline float RouterRenormDot(const float* p,
                                                const int32_t* idx,
                                                const float* dwt, int64_t k,
                                                float inv, bool varies) {
  float dot = 0.0f;
  if (varies) {
    for (int64_t j = 0; j < k; ++j) {
      dot = RnAdd(dot, RnMul(RnMul(dwt[j], p[idx[j]]), inv));
    }
  }
  return dot;
}

// p_j dL/dp_j for pick j: p_j (dw_j - dot) / S.
SHARDD_HOST_DEVICE_INLINE float RouterRenormPickGrad(float pj, float dwt,
                                                     float dot, float inv) {
  return RnMul(RnMul(pj, RnSub(dwt, dot)), inv);
}

// sum_j p_j dL/dp_j over the picks (the softmax backward's inner product).
SHARDD_HOST_DEVICE inline float RouterRenormInner(const float* p,
                                                  const int32_t* idx,
                                                  const float* dwt, int64_t k,
                                                  float dot, float inv) {
  float inner = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    inner = RnAdd(inner, RouterRenormPickGrad(p[idx[j]], dwt[j], dot, inv));
  }
  return inner;
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROUTER_GRAD_ELEMENT_H_
