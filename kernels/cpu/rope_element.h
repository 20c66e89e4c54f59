#ifndef SHARDD_KERNELS_CPU_ROPE_ELEMENT_H_
#define SHARDD_KERNELS_CPU_ROPE_ELEMENT_H_

// The rotary embedding's per-pair arithmetic, one definition for the CPU
// kernel (rope.cc) and the CUDA kernel (kernels/cuda/rope_kernels.cu): where
// a pair sits in a head, and its rotation with each operation rounded once
// (ieee_ops.h). Dependency-free so that nvcc can include it.

#include <cstdint>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// Offsets within a head of pair i's two elements: (i, i + half) in the
// rotate-half layout, (2i, 2i + 1) interleaved.
SHARDD_HOST_DEVICE_INLINE void RopePairOffsets(bool interleaved, int64_t i,
                                               int64_t half, int64_t* first,
                                               int64_t* second) {
  *first = interleaved ? 2 * i : i;
  *second = interleaved ? 2 * i + 1 : i + half;
}

// (x1, x2) rotated by the angle whose cosine and sine are c and s (s
// negated for the inverse rotation): two products, then the sum.
SHARDD_HOST_DEVICE_INLINE void RopeRotatePair(float c, float s, float* x1,
                                              float* x2) {
  const float a = *x1, b = *x2;
  *x1 = RnSub(RnMul(a, c), RnMul(b, s));
  *x2 = RnAdd(RnMul(b, c), RnMul(a, s));
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROPE_ELEMENT_H_
