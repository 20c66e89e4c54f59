#include "worker/shards/device_shard_kernels.h"

#include "kernels/cpu/bf16.h"

namespace shardd {
namespace device_kernels {
namespace {

__device__ __forceinline__ float Load(const void* p, bool bf16, int64_t i) {
  if (bf16) {
    return kernels::Bf16ToFp32(static_cast<const uint16_t*>(p)[i]);
  }
  return static_cast<const float*>(p)[i];
}

// Round to nearest even; NaN stays a quiet NaN with its sign.
__device__ __forceinline__ uint16_t ToBf16(float x) {
  return kernels::Fp32ToBf16(x);
}

__global__ void AddIntoKernel(const void* src, bool src_bf16, void* dst,
                              bool dst_bf16, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = Load(src, src_bf16, i);
    const float sum = __fadd_rn(Load(dst, dst_bf16, i),
                                scale == 1.0f ? value : __fmul_rn(scale, value));
    if (dst_bf16) {
      static_cast<uint16_t*>(dst)[i] = ToBf16(sum);
    } else {
      static_cast<float*>(dst)[i] = sum;
    }
  }
}

__global__ void DoubleToFloatKernel(const double* src, float* dst) {
  *dst = static_cast<float>(*src);
}

__global__ void FloatToDoubleKernel(const float* src, double* dst) {
  *dst = static_cast<double>(*src);
}

}  // namespace

cudaError_t LaunchAddInto(const void* src, bool src_bf16, void* dst,
                          bool dst_bf16, int64_t n, cudaStream_t stream,
                          float scale) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks64 = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(blocks64 < 4096 ? blocks64 : 4096);
  AddIntoKernel<<<blocks, kThreads, 0, stream>>>(src, src_bf16, dst, dst_bf16,
                                                 n, scale);
  return cudaGetLastError();
}

cudaError_t LaunchDoubleToFloat(const double* src, float* dst,
                                cudaStream_t stream) {
  DoubleToFloatKernel<<<1, 1, 0, stream>>>(src, dst);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToDouble(const float* src, double* dst,
                                cudaStream_t stream) {
  FloatToDoubleKernel<<<1, 1, 0, stream>>>(src, dst);
  return cudaGetLastError();
}

}  // namespace device_kernels
}  // namespace shardd
