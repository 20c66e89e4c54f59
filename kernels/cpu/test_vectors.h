#ifndef SHARDD_KERNELS_CPU_TEST_VECTORS_H_
#define SHARDD_KERNELS_CPU_TEST_VECTORS_H_

// Random inputs shared by the kernel tests (test-only target).

#include <cstdint>
#include <random>
#include <vector>

namespace shardd {
namespace kernels {
namespace testing_util {

// n floats uniform in [-scale, scale), the same for the same seed.
inline std::vector<float> RandomVector(int64_t n, uint32_t seed,
                                       float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace testing_util
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_TEST_VECTORS_H_
