#ifndef SHARDD_KERNELS_CPU_BIAS_ELEMENT_H_
#define SHARDD_KERNELS_CPU_BIAS_ELEMENT_H_

// A bias added to a row, per element, one definition for the CPU kernels
// (linear.cc's AddBias, grouped_experts.cc's per-expert down bias scaled by
// the routing weight) and the CUDA bias kernels (bias_kernels.cu): each
// operation rounded once, so the scaled form is never an FMA on one side
// only. Dependency-free so that nvcc can include it.

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// y + b.
SHARDD_HOST_DEVICE_INLINE float AddBiasValue(float y, float b) {
  return RnAdd(y, b);
}

// y + w * b (Hugging Face's (A W_d + b_d) * w with w folded into A).
SHARDD_HOST_DEVICE_INLINE float AddScaledBiasValue(float y, float w, float b) {
  return RnAdd(y, RnMul(w, b));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_BIAS_ELEMENT_H_
