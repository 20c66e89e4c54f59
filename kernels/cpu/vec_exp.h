#ifndef SHARDD_KERNELS_CPU_VEC_EXP_H_
#define SHARDD_KERNELS_CPU_VEC_EXP_H_

#include <cstdint>
#include <cstring>

#include "kernels/cpu/ieee_ops.h"

namespace shardd {
namespace kernels {

// exp(x) that the compiler can vectorize (libm's expf is a call), and that
// the CUDA kernels evaluate to the same bits (each operation rounded once,
// ieee_ops.h): Cody-Waite range reduction x = n ln2 + r and Cephes' degree-6
// polynomial for e^r, within 8.2e-8 relative (1.4 ulp) of exp on [-40, 40].
// x is clamped to that range: beyond it tanh and the upper sigmoid are
// exactly +-1 in fp32 anyway (SiluGate handles the lower side; attention
// selects its masked keys to 0). The compiler evaluates the clamped branch
// in every vector lane, and with a wider clamp such as [-87, 88] that branch
// makes subnormals whose microcode assists made the loop 10x slower. NaN
// maps to -40; callers multiply by g, which carries the NaN on. Include it
// only from libraries built with -ffp-contract=off, so that every SIMD level
// computes the same bits.
SHARDD_HOST_DEVICE_INLINE float VecExp(float x) {
  x = x > -40.0f ? x : -40.0f;
  x = x < 40.0f ? x : 40.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound rounds x
  const float n =
      RnSub(RnAdd(RnMul(x, 1.44269504088896341f), kRound), kRound);
  const float r =
      RnAdd(RnSub(x, RnMul(n, 0.693359375f)), RnMul(n, 2.12194440e-4f));
  float p = 1.9875691500e-4f;
  p = RnAdd(RnMul(p, r), 1.3981999507e-3f);
  p = RnAdd(RnMul(p, r), 8.3334519073e-3f);
  p = RnAdd(RnMul(p, r), 4.1665795894e-2f);
  p = RnAdd(RnMul(p, r), 1.6666665459e-1f);
  p = RnAdd(RnMul(p, r), 5.0000001201e-1f);
  p = RnAdd(RnAdd(RnMul(RnMul(p, r), r), r), 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
#ifdef __CUDA_ARCH__
  const float scale = __int_as_float(bits);
#else
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
#endif
  return RnMul(p, scale);
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_VEC_EXP_H_
