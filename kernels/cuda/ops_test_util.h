#ifndef SHARDD_KERNELS_CUDA_OPS_TEST_UTIL_H_
#define SHARDD_KERNELS_CUDA_OPS_TEST_UTIL_H_

// Test helpers for the CUDA op tests: GPU presence (tests skip without one),
// owning device buffers, random inputs and tolerance checks against the CPU
// reference kernels. Tests may synchronize; the ops themselves never do.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "testing/gpu.h"  // SHARDD_SKIP_WITHOUT_GPU

namespace shardd {
namespace kernels {
namespace cuda {
namespace ops_testing {

// True when a CUDA device is usable; otherwise `reason` says why.
inline bool GpuAvailable(std::string* reason) {
  return testing_util::GpuCount(reason) > 0;
}

// Device memory for n elements of T, freed on destruction. Upload/Download
// are synchronous (tests only).
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : size_(n) {
    void* raw = nullptr;
    if (n > 0 && cudaMalloc(&raw, n * sizeof(T)) == cudaSuccess) {
      data_ = static_cast<T*>(raw);
    } else if (n > 0) {
      ADD_FAILURE() << "cudaMalloc of " << n * sizeof(T) << " bytes failed";
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host)
      : DeviceBuffer(host.size()) {
    Upload(host);
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  size_t size() const { return size_; }

  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), size_);
    if (size_ == 0) return;
    ASSERT_EQ(cudaMemcpy(data_, host.data(), size_ * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> Download() const {
    std::vector<T> host(size_);
    if (size_ == 0) return host;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, size_ * sizeof(T),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

// Raw device bytes (workspaces).
using DeviceBytes = DeviceBuffer<unsigned char>;

// A stream and a cuBLAS handle for one test.
class GpuContext {
 public:
  GpuContext() {
    EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    EXPECT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  ~GpuContext() {
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

  cudaStream_t stream() const { return stream_; }
  cublasHandle_t handle() const { return handle_; }
  void Sync() const { EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

inline std::vector<float> RandomVector(size_t n, float lo, float hi,
                                       uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Values already representable in bf16, so the CPU reference sees exactly
// what the bf16 GPU path stores.
inline std::vector<float> RoundedToBf16(std::vector<float> v) {
  for (float& x : v) x = RoundToBf16(x);
  return v;
}

inline std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Fp32ToBf16(v[i]);
  return out;
}

inline std::vector<float> FromBf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16ToFp32(v[i]);
  return out;
}

// Storage helpers for tests templated on the storage type (float or bf16).
template <typename T>
std::vector<T> ToStorage(const std::vector<float>& v);
template <>
inline std::vector<float> ToStorage<float>(const std::vector<float>& v) {
  return v;
}
template <>
inline std::vector<uint16_t> ToStorage<uint16_t>(const std::vector<float>& v) {
  return ToBf16(v);
}
inline std::vector<float> ToFloat(const std::vector<float>& v) { return v; }
inline std::vector<float> ToFloat(const std::vector<uint16_t>& v) {
  return FromBf16(v);
}

// |actual - expected| <= atol + rtol * |expected| elementwise, where atol is
// `atol_of_max` times the largest |expected| (so values that cancel to near
// zero are judged on the scale of the tensor). NaNs must match NaNs.
inline void ExpectAllClose(const std::vector<float>& actual,
                           const std::vector<float>& expected, double rtol,
                           double atol_of_max, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double max_abs = 0.0;
  for (float e : expected) {
    if (std::isfinite(e)) max_abs = std::max(max_abs, std::fabs(double{e}));
  }
  const double atol = atol_of_max * max_abs;
  int failures = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (std::isnan(e) || std::isnan(a)) {
      if (std::isnan(e) != std::isnan(a) && ++failures <= 10) {
        ADD_FAILURE() << what << "[" << i << "]: actual " << a << " expected "
                      << e;
      }
      continue;
    }
    if (std::isinf(e) || std::isinf(a)) {
      if (a != e && ++failures <= 10) {
        ADD_FAILURE() << what << "[" << i << "]: actual " << a << " expected "
                      << e;
      }
      continue;
    }
    if (std::fabs(a - e) > atol + rtol * std::fabs(e) && ++failures <= 10) {
      ADD_FAILURE() << what << "[" << i << "]: actual " << a << " expected "
                    << e << " (rtol " << rtol << ", atol " << atol << ")";
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << actual.size()
                         << " elements out of tolerance";
}

// ||actual - expected||_2 <= tol * ||expected||_2, and no NaN: the
// normwise bound of results whose summands are rounded to bf16 (tensor-core
// attention), where an elementwise bound would need each sum's terms.
inline void ExpectRelL2Close(const std::vector<float>& actual,
                             const std::vector<float>& expected, double tol,
                             const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double err = 0.0, ref = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_FALSE(std::isnan(actual[i])) << what << "[" << i << "]";
    const double d = static_cast<double>(actual[i]) - expected[i];
    err += d * d;
    ref += static_cast<double>(expected[i]) * expected[i];
  }
  EXPECT_GT(ref, 0.0) << what;
  EXPECT_LE(std::sqrt(err), tol * std::sqrt(ref))
      << what << ": relative L2 error " << std::sqrt(err / ref);
}

}  // namespace ops_testing
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_OPS_TEST_UTIL_H_
