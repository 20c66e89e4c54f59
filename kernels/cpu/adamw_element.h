#ifndef SHARDD_KERNELS_CPU_ADAMW_ELEMENT_H_
#define SHARDD_KERNELS_CPU_ADAMW_ELEMENT_H_

// AdamW's per-element update, one definition for the CPU kernel (adamw.cc,
// its SIMD clones) and the CUDA kernel (kernels/cuda/adamw_kernels.cu):
// PyTorch's order of operations on fp32 tensors, each operation rounded once
// (ieee_ops.h), so both give the same bits. The scalars come from
// AdamWScalarsFor (adamw.h). Dependency-free so that nvcc can include it.

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// The update's fp32 constants for one step t.
struct AdamWScalars {
  float decay;            // 1 - lr * weight_decay
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;        // lr / (1 - beta1^t)
  float bc2_sqrt;         // sqrt(1 - beta2^t)
  float eps;
};

//   p = p * decay
//   m = beta1 m + (1 - beta1) g
//   v = beta2 v + ((1 - beta2) g) g
//   p = p - step_size (m / (sqrt(v) / bc2_sqrt + eps))
SHARDD_HOST_DEVICE_INLINE void AdamWElement(float& p, float g, float& m, float& v,
                                     const AdamWScalars& s) {
  p = RnMul(p, s.decay);
  m = RnAdd(RnMul(s.beta1, m), RnMul(s.one_minus_beta1, g));
  v = RnAdd(RnMul(s.beta2, v), RnMul(RnMul(s.one_minus_beta2, g), g));
  const float denom = RnAdd(RnDiv(RnSqrt(v), s.bc2_sqrt), s.eps);
  p = RnSub(p, RnMul(s.step_size, RnDiv(m, denom)));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ADAMW_ELEMENT_H_
