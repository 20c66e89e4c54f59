#ifndef SHARDD_TESTING_GPU_H_
#define SHARDD_TESTING_GPU_H_

// GPU presence for tests tagged "gpu": they skip, saying why, where no CUDA
// device is usable (CI, CPU machines).

#include <cuda_runtime_api.h>

#include <string>

#include "gtest/gtest.h"

namespace shardd {
namespace testing_util {

// The number of usable CUDA devices; 0, with the reason in `reason`, when
// there are none.
inline int GpuCount(std::string* reason) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    *reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(error);
    cudaGetLastError();  // Clear it for later calls.
    return 0;
  }
  if (count == 0) *reason = "no CUDA device visible";
  return count;
}

}  // namespace testing_util
}  // namespace shardd

// Skips the calling test when there is no GPU (GTEST_SKIP returns from it).
#define SHARDD_SKIP_WITHOUT_GPU()                                        \
  do {                                                                   \
    std::string shardd_no_gpu_reason_;                                   \
    if (::shardd::testing_util::GpuCount(&shardd_no_gpu_reason_) == 0) { \
      GTEST_SKIP() << "no GPU: " << shardd_no_gpu_reason_;               \
    }                                                                    \
  } while (false)

#endif  // SHARDD_TESTING_GPU_H_
