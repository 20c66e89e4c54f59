#ifndef SHARDD_KERNELS_CPU_CROSS_ENTROPY_ELEMENT_H_
#define SHARDD_KERNELS_CPU_CROSS_ENTROPY_ELEMENT_H_

// The per-element arithmetic of the LM head's cross-entropy and softmax,
// one definition for the CPU kernels (cross_entropy.cc, softcap.cc, the
// CPU block ops' head softmax) and the CUDA kernels
// (kernels/cuda/cross_entropy_kernels.cu). fp32 operations are rounded once
// each (ieee_ops.h); exp, tanh and log are the math library's on each side
// (LibExp, ...), so host and device may differ in their last bits there.
//
// What stays each side's own is the row reduction: the CPU takes the row's
// max, then sums exp(y - max) in double (two reads); the GPU keeps a running
// (max, sum) in fp32 per thread (one read, OnlineSoftmaxAdd) and merges the
// threads' pairs in a fixed tree (OnlineSoftmaxMerge). Both results enter
// the functions below as (max, sum). Dependency-free so that nvcc can
// include it.

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// Gemma's final-logit soft cap y = cap * tanh(x * inv), with inv = 1 / cap
// rounded once (SoftcapInverse).
SHARDD_HOST_DEVICE_INLINE float SoftcapInverse(float cap) {
  return RnDiv(1.0f, cap);
}

SHARDD_HOST_DEVICE_INLINE float SoftcapValue(float x, float cap, float inv) {
  return RnMul(cap, LibTanh(RnMul(x, inv)));
}

// dy/dx = 1 - (y / cap)^2 from the capped y; t * t rounded before the
// subtraction.
SHARDD_HOST_DEVICE_INLINE float SoftcapSlope(float y, float inv) {
  const float t = RnMul(y, inv);
  return RnSub(1.0f, RnMul(t, t));
}

// exp(y - max): a row's softmax numerator.
SHARDD_HOST_DEVICE_INLINE float SoftmaxTerm(float y, float max) {
  return LibExp(RnSub(y, max));
}

// softmax(y)_j = exp(y_j - max) / sum, divided in double.
SHARDD_HOST_DEVICE_INLINE float SoftmaxProb(float term, double sum) {
  return static_cast<float>(static_cast<double>(term) / sum);
}

// A running softmax denominator: sum of exp(x - max) over the values seen.
struct OnlineSoftmax {
  float max;
  float sum;
};

SHARDD_HOST_DEVICE_INLINE OnlineSoftmax OnlineSoftmaxEmpty() {
  return {-INFINITY, 0.0f};
}

// Adds x. A NaN x makes the sum NaN (exp(NaN)); -inf adds nothing.
SHARDD_HOST_DEVICE_INLINE void OnlineSoftmaxAdd(float x, OnlineSoftmax& acc) {
  if (x > acc.max) {
    acc.sum = RnAdd(RnMul(acc.sum, LibExp(RnSub(acc.max, x))), 1.0f);
    acc.max = x;
  } else if (x != -INFINITY) {
    acc.sum = RnAdd(acc.sum, LibExp(RnSub(x, acc.max)));
  }
}

// The pair of the union of two disjoint sets of values.
SHARDD_HOST_DEVICE_INLINE OnlineSoftmax OnlineSoftmaxMerge(OnlineSoftmax a,
                                                           OnlineSoftmax b) {
  // max is never NaN (OnlineSoftmaxAdd keeps NaN out of it).
  const float m = a.max > b.max ? a.max : b.max;
  if (m == -INFINITY) return {m, RnAdd(a.sum, b.sum)};
  return {m, RnAdd(RnMul(a.sum, LibExp(RnSub(a.max, m))),
                   RnMul(b.sum, LibExp(RnSub(b.max, m))))};
}

// A counted row's loss: log(sum exp(y)) - y_target = max + log(sum) - y_target.
SHARDD_HOST_DEVICE_INLINE double CrossEntropyRowLoss(float max, double sum,
                                                     float target_logit) {
  return static_cast<double>(max) + LibLog(sum) -
         static_cast<double>(target_logit);
}

// loss_scale / sum, the factor that turns a row's exp terms into
// loss_scale * softmax.
SHARDD_HOST_DEVICE_INLINE float CrossEntropyGradScale(float loss_scale,
                                                      double sum) {
  return static_cast<float>(static_cast<double>(loss_scale) / sum);
}

// d loss / d y_j = (softmax_j - [j == target]) * loss_scale, from the row's
// exp term and CrossEntropyGradScale; multiply by SoftcapSlope under a cap.
SHARDD_HOST_DEVICE_INLINE float CrossEntropyLogitGrad(float term, float scale,
                                                      bool is_target,
                                                      float loss_scale) {
  const float g = RnMul(term, scale);
  return is_target ? RnSub(g, loss_scale) : g;
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_CROSS_ENTROPY_ELEMENT_H_
