#include "kernels/cpu/softcap.h"

#include "kernels/cpu/cross_entropy_element.h"

namespace shardd {
namespace kernels {

void SoftcapForward(float* x, int64_t n, float cap) {
  const float inv = SoftcapInverse(cap);
  for (int64_t i = 0; i < n; ++i) x[i] = SoftcapValue(x[i], cap, inv);
}

void SoftcapBackward(const float* y, float* dy, int64_t n, float cap) {
  const float inv = SoftcapInverse(cap);
  for (int64_t i = 0; i < n; ++i) dy[i] = RnMul(dy[i], SoftcapSlope(y[i], inv));
}

}  // namespace kernels
}  // namespace shardd
