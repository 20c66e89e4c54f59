#ifndef SHARDD_KERNELS_CPU_RMS_NORM_ELEMENT_H_
#define SHARDD_KERNELS_CPU_RMS_NORM_ELEMENT_H_

// RMSNorm's per-element arithmetic, one definition for the CPU kernel
// (rms_norm.cc) and the CUDA kernel (kernels/cuda/rms_norm_kernels.cu), each
// operation rounded once (ieee_ops.h). The row reductions (sum of squares,
// the dot product of the backward) are each side's own: the CPU sums in
// double, the GPU in fp32 over a block; their results enter here as `inv`
// and `mean_dot` (RmsNormInverse and RmsNormMeanDot turn them into the
// factors the same way on both sides). Dependency-free so that nvcc can include it.

#include <cmath>
#include <cstdint>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// inv_rms = 1 / sqrt(sum_sq / dim + eps) from a row's sum of squares, in
// double, rounded to fp32 once: from the same sum both sides give the same
// bits (IEEE division and square root).
SHARDD_HOST_DEVICE_INLINE float RmsNormInverse(double sum_sq, int64_t dim,
                                               float eps) {
  const double mean = sum_sq / static_cast<double>(dim) +
                      static_cast<double>(eps);
#ifdef __CUDA_ARCH__
  return static_cast<float>(1.0 / sqrt(mean));
#else
  return static_cast<float>(1.0 / std::sqrt(mean));
#endif
}

// mean(dy * w * xhat) from the row's dot product, divided in double.
SHARDD_HOST_DEVICE_INLINE float RmsNormMeanDot(double dot, int64_t dim) {
  return static_cast<float>(dot / static_cast<double>(dim));
}

// y = (x * inv_rms) * w, in that order, as the HF reference computes it.
SHARDD_HOST_DEVICE_INLINE float RmsNormOut(float x, float inv, float w) {
  return RnMul(RnMul(x, inv), w);
}

// xhat = x * inv_rms.
SHARDD_HOST_DEVICE_INLINE float RmsNormHat(float x, float inv) {
  return RnMul(x, inv);
}

// dx = inv * (dy * w - xhat * mean(dy * w * xhat)).
SHARDD_HOST_DEVICE_INLINE float RmsNormInputGrad(float dy, float x, float w,
                                                 float inv, float mean_dot) {
  return RnMul(inv, RnSub(RnMul(dy, w), RnMul(RmsNormHat(x, inv), mean_dot)));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_RMS_NORM_ELEMENT_H_
