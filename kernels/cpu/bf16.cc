#include "kernels/cpu/bf16.h"

namespace shardd {
namespace kernels {

void Fp32ToBf16Array(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fp32ToBf16(in[i]);
}

void Bf16ToFp32Array(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFp32(in[i]);
}

void RoundToBf16InPlace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundToBf16(x[i]);
}

}  // namespace kernels
}  // namespace shardd
