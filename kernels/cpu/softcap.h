#ifndef SHARDD_KERNELS_CPU_SOFTCAP_H_
#define SHARDD_KERNELS_CPU_SOFTCAP_H_

// Gemma's logit soft-capping, fp32, elementwise:
//   y = cap * tanh(x / cap),   dy/dx = 1 - (y / cap)^2.
// The backward reads the capped values, so a caller needs to keep only y.

#include <cstdint>

namespace shardd {
namespace kernels {

// x [n] becomes cap * tanh(x / cap) in place. cap > 0.
void SoftcapForward(float* x, int64_t n, float cap);

// dy [n] becomes dy * (1 - (y / cap)^2) in place, y the forward's output.
void SoftcapBackward(const float* y, float* dy, int64_t n, float cap);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_SOFTCAP_H_
