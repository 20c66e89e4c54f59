#include "kernels/cpu/bf16.h"

#include <cstring>

namespace shardd {
namespace kernels {

void Fp32ToBf16Array(const float* in, uint16_t* out, int64_t n) {
  // Branch-free form of Fp32ToBf16 so the loop vectorises: both the rounded
  // and the NaN results are computed and one is selected by mask.
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t nan = (bits >> 16) | 0x0040u;
    const uint32_t is_nan =
        0u - static_cast<uint32_t>((bits & 0x7FFFFFFFu) > 0x7F800000u);
    out[i] = static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
  }
}

void Bf16ToFp32Array(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFp32(in[i]);
}

void RoundToBf16InPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundToBf16(x[i]);
}

}  // namespace kernels
}  // namespace shardd
