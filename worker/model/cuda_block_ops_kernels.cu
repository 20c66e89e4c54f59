#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_math.h"
#include "worker/model/cuda_block_ops_kernels.h"

namespace shardd {
namespace device_model {
namespace {

using ::shardd::kernels::cuda::LoadAsFloat;
using ::shardd::kernels::cuda::StoreFromFloat;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>(
      std::max<int64_t>((n + kThreads - 1) / kThreads, 1), kMaxBlocks));
}

template <typename T>
__global__ void ResidualAddKernel(const T* x, const T* __restrict__ a,
                                  const T* __restrict__ b, T* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float delta = LoadAsFloat(a + i);
    if (b != nullptr) delta = __fadd_rn(delta, LoadAsFloat(b + i));
    StoreFromFloat(out + i, __fadd_rn(LoadAsFloat(x + i), delta));
  }
}

template <typename T>
__global__ void AddScaledKernel(T* x, const T* __restrict__ h, float scale,
                                int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    StoreFromFloat(x + i, __fadd_rn(LoadAsFloat(x + i),
                                    __fmul_rn(scale, LoadAsFloat(h + i))));
  }
}

template <typename T>
__global__ void ScaleKernel(T* x, float scale, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    StoreFromFloat(x + i, __fmul_rn(LoadAsFloat(x + i), scale));
  }
}

template <typename T>
__global__ void SumTimesScalarKernel(const T* a, const T* b,
                                     const T* __restrict__ s, T* out,
                                     int64_t n) {
  const float scale = LoadAsFloat(s);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float v = LoadAsFloat(a + i);
    if (b != nullptr) v = __fadd_rn(v, LoadAsFloat(b + i));
    StoreFromFloat(out + i, __fmul_rn(v, scale));
  }
}

__global__ void AccumulateStepLossKernel(const double* mean_loss,
                                         const int64_t* count,
                                         const int64_t* invalid_targets,
                                         double weight, DeviceStepLoss* acc) {
  acc->loss_sum += __dmul_rn(weight, *mean_loss);
  acc->tokens += *count;
  acc->invalid_targets += *invalid_targets;
}

__global__ void AddCountKernel(int64_t* counter, int64_t value) {
  *counter += value;
}

__global__ void DoubleToFloatKernel(const double* __restrict__ in,
                                    float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    out[i] = __double2float_rn(in[i]);
  }
}

__global__ void FloatToDoubleKernel(const float* __restrict__ in,
                                    double* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    out[i] = static_cast<double>(in[i]);
  }
}

__global__ void AccumulateAuxLossKernel(const double* value, double coef,
                                        DeviceStepLoss* acc) {
  acc->loss_sum += __dmul_rn(coef, *value);
}

__global__ void ScaleByCountKernel(float* x, int64_t n, const int64_t* count) {
  const float scale = static_cast<float>(*count);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    x[i] = __fmul_rn(x[i], scale);
  }
}

template <typename T>
cudaError_t ResidualAdd(const T* x, const T* a, const T* b, T* out, int64_t n,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ResidualAddKernel<T><<<Blocks(n), kThreads, 0, stream>>>(x, a, b, out, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t AddScaled(T* x, const T* h, float scale, int64_t n,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddScaledKernel<T><<<Blocks(n), kThreads, 0, stream>>>(x, h, scale, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Scale(T* x, float scale, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleKernel<T><<<Blocks(n), kThreads, 0, stream>>>(x, scale, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t SumTimesScalar(const T* a, const T* b, const T* s, T* out,
                           int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  SumTimesScalarKernel<T><<<Blocks(n), kThreads, 0, stream>>>(a, b, s, out, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchScale(float* x, float scale, int64_t n, cudaStream_t stream) {
  return Scale(x, scale, n, stream);
}
cudaError_t LaunchScale(uint16_t* x, float scale, int64_t n,
                        cudaStream_t stream) {
  return Scale(x, scale, n, stream);
}

cudaError_t LaunchSumTimesScalar(const float* a, const float* b, const float* s,
                                 float* out, int64_t n, cudaStream_t stream) {
  return SumTimesScalar(a, b, s, out, n, stream);
}
cudaError_t LaunchSumTimesScalar(const uint16_t* a, const uint16_t* b,
                                 const uint16_t* s, uint16_t* out, int64_t n,
                                 cudaStream_t stream) {
  return SumTimesScalar(a, b, s, out, n, stream);
}

cudaError_t LaunchResidualAdd(const float* x, const float* a, const float* b,
                              float* out, int64_t n, cudaStream_t stream) {
  return ResidualAdd(x, a, b, out, n, stream);
}
cudaError_t LaunchResidualAdd(const uint16_t* x, const uint16_t* a,
                              const uint16_t* b, uint16_t* out, int64_t n,
                              cudaStream_t stream) {
  return ResidualAdd(x, a, b, out, n, stream);
}

cudaError_t LaunchAddScaled(float* x, const float* h, float scale, int64_t n,
                            cudaStream_t stream) {
  return AddScaled(x, h, scale, n, stream);
}
cudaError_t LaunchAddScaled(uint16_t* x, const uint16_t* h, float scale,
                            int64_t n, cudaStream_t stream) {
  return AddScaled(x, h, scale, n, stream);
}

cudaError_t LaunchAccumulateStepLoss(const double* mean_loss,
                                     const int64_t* count,
                                     const int64_t* invalid_targets,
                                     double weight, DeviceStepLoss* acc,
                                     cudaStream_t stream) {
  AccumulateStepLossKernel<<<1, 1, 0, stream>>>(mean_loss, count,
                                                invalid_targets, weight, acc);
  return cudaGetLastError();
}

cudaError_t LaunchAddCount(int64_t* counter, int64_t value,
                           cudaStream_t stream) {
  AddCountKernel<<<1, 1, 0, stream>>>(counter, value);
  return cudaGetLastError();
}

cudaError_t LaunchDoubleToFloat(const double* in, float* out, int64_t n,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  DoubleToFloatKernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToDouble(const float* in, double* out, int64_t n,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  FloatToDoubleKernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchAccumulateAuxLoss(const double* value, double coef,
                                    DeviceStepLoss* acc, cudaStream_t stream) {
  AccumulateAuxLossKernel<<<1, 1, 0, stream>>>(value, coef, acc);
  return cudaGetLastError();
}

cudaError_t LaunchScaleByCount(float* x, int64_t n, const int64_t* count,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ScaleByCountKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, count);
  return cudaGetLastError();
}

}  // namespace device_model
}  // namespace shardd
