#include "kernels/cpu/softcap.h"

#include <cmath>

namespace shardd {
namespace kernels {

void SoftcapForward(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

void SoftcapBackward(const float* y, float* dy, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) {
    const float t = y[i] * inv;  // tanh(x / cap)
    dy[i] *= 1.0f - t * t;
  }
}

}  // namespace kernels
}  // namespace shardd
