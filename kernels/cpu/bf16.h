#ifndef SHARDD_KERNELS_CPU_BF16_H_
#define SHARDD_KERNELS_CPU_BF16_H_

// fp32 <-> bfloat16 conversion. bf16 values are stored as uint16_t bit
// patterns (the upper half of the fp32 encoding). fp32 -> bf16 rounds to
// nearest, ties to even; this is the copy-in of the unshard path when mixed
// precision is on, and "bf16 compute" means values rounded through it.
// The scalar conversions are __host__ __device__: the CUDA kernels round
// with these same functions (kernels/cuda/device_math.h).

#include <cstdint>
#include <cstring>

#include "kernels/cpu/host_device.h"

namespace shardd {
namespace kernels {

// Rounds one fp32 value to bf16 (round to nearest, ties to even).
// Infinities stay infinities (with their sign); every NaN maps to a quiet NaN
// with the same sign and the top payload bits kept, never to Inf. Finite
// values above the bf16 range round to Inf, as IEEE rounding requires.
SHARDD_HOST_DEVICE_INLINE uint16_t Fp32ToBf16(float value) {
#ifdef __CUDA_ARCH__
  uint32_t bits = __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
#endif
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: truncating could clear every payload bit and yield Inf, so set
    // the quiet bit explicitly.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry out
  // of the mantissa correctly bumps the exponent (up to Inf).
  const uint32_t lsb = (bits >> 16) & 1u;
  bits += 0x7FFFu + lsb;
  return static_cast<uint16_t>(bits >> 16);
}

// Widens a bf16 bit pattern to fp32 (exact).
SHARDD_HOST_DEVICE_INLINE float Bf16ToFp32(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
#endif
}

// Rounds one fp32 value through bf16 and back (the value bf16 storage keeps).
SHARDD_HOST_DEVICE_INLINE float RoundToBf16(float value) {
  return Bf16ToFp32(Fp32ToBf16(value));
}

// out[i] = Fp32ToBf16(in[i]) for i in [0, n). n <= 0 does nothing. `in` and
// `out` must not overlap.
void Fp32ToBf16Array(const float* in, uint16_t* out, int64_t n);

// out[i] = Bf16ToFp32(in[i]) for i in [0, n). n <= 0 does nothing.
void Bf16ToFp32Array(const uint16_t* in, float* out, int64_t n);

// x[i] = RoundToBf16(x[i]) in place: fp32 storage holding bf16 values.
void RoundToBf16InPlace(float* x, int64_t n);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_BF16_H_
