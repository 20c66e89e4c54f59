#include <algorithm>
#include <cstdint>

#include "kernels/cpu/adamw_element.h"
#include "kernels/cuda/adamw_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;
constexpr int64_t kSumElementsPerBlock = kThreads * 8;
constexpr int64_t kMaxSumPartials = 1024;
constexpr int kSumReduceThreads = 1024;

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int Blocks(int64_t work) {
  return static_cast<int>(std::min<int64_t>(
      std::max<int64_t>((work + kThreads - 1) / kThreads, 1), kMaxBlocks));
}

// `vectors` 4-element vectors first (all pointers 16-byte aligned, and
// param_bf16 8-byte aligned), then the tail element by element.
__global__ void __launch_bounds__(kThreads)
    AdamWKernel(float* __restrict__ param, const float* __restrict__ grad,
                float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                int64_t n, int64_t vectors, AdamWScalars s,
                const float* __restrict__ grad_scale,
                uint16_t* __restrict__ param_bf16) {
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  const bool scaled = grad_scale != nullptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t q = first; q < vectors; q += stride) {
    float4 p = reinterpret_cast<float4*>(param)[q];
    float4 g = reinterpret_cast<const float4*>(grad)[q];
    float4 m = reinterpret_cast<float4*>(exp_avg)[q];
    float4 v = reinterpret_cast<float4*>(exp_avg_sq)[q];
    if (scaled) {
      g.x = __fmul_rn(g.x, scale);
      g.y = __fmul_rn(g.y, scale);
      g.z = __fmul_rn(g.z, scale);
      g.w = __fmul_rn(g.w, scale);
    }
    AdamWElement(p.x, g.x, m.x, v.x, s);
    AdamWElement(p.y, g.y, m.y, v.y, s);
    AdamWElement(p.z, g.z, m.z, v.z, s);
    AdamWElement(p.w, g.w, m.w, v.w, s);
    reinterpret_cast<float4*>(param)[q] = p;
    reinterpret_cast<float4*>(exp_avg)[q] = m;
    reinterpret_cast<float4*>(exp_avg_sq)[q] = v;
    if (param_bf16 != nullptr) {
      uint2 packed;
      packed.x = static_cast<uint32_t>(FloatToBf16Bits(p.x)) |
                 (static_cast<uint32_t>(FloatToBf16Bits(p.y)) << 16);
      packed.y = static_cast<uint32_t>(FloatToBf16Bits(p.z)) |
                 (static_cast<uint32_t>(FloatToBf16Bits(p.w)) << 16);
      reinterpret_cast<uint2*>(param_bf16)[q] = packed;
    }
  }
  for (int64_t i = vectors * 4 + first; i < n; i += stride) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    const float g = scaled ? __fmul_rn(grad[i], scale) : grad[i];
    AdamWElement(p, g, m, v, s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (param_bf16 != nullptr) param_bf16[i] = FloatToBf16Bits(p);
  }
}

// Block b sums elements b * kThreads + tid + k * (blocks * kThreads).
__global__ void __launch_bounds__(kThreads)
    SumOfSquaresPartialKernel(const float* __restrict__ x, int64_t n,
                              double* __restrict__ partials) {
  __shared__ double scratch[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  double sum = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const double v = x[i];
    sum += v * v;
  }
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kSumReduceThreads)
    SumOfSquaresFinalKernel(const double* __restrict__ partials, int64_t count,
                            double* result, bool accumulate) {
  __shared__ double scratch[32];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) *result = accumulate ? *result + sum : sum;
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(float* __restrict__ x, int64_t n,
                const float* __restrict__ scale_ptr) {
  const float scale = *scale_ptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    x[i] = __fmul_rn(x[i], scale);
  }
}

// kernels/cpu/adamw.cc ClipCoefficient, on the device.
__global__ void ClipCoefficientKernel(const double* sum_of_squares,
                                      double max_norm, float* coefficient,
                                      double* total_norm) {
  const double norm = sqrt(*sum_of_squares);
  if (total_norm != nullptr) *total_norm = norm;
  double c;
  if (!(max_norm > 0.0)) {
    c = 1.0;
  } else if (isnan(norm)) {
    c = norm;
  } else {
    c = fmin(1.0, max_norm / (norm + 1e-6));
  }
  *coefficient = static_cast<float>(c);
}

}  // namespace

cudaError_t LaunchAdamW(float* param, const float* grad, float* exp_avg,
                        float* exp_avg_sq, int64_t n,
                        const AdamWScalars& scalars, const float* grad_scale,
                        uint16_t* param_bf16, cudaStream_t stream) {
  const bool vector_ok = Aligned16(param) && Aligned16(grad) &&
                         Aligned16(exp_avg) && Aligned16(exp_avg_sq) &&
                         reinterpret_cast<uintptr_t>(param_bf16) % 8 == 0;
  const int64_t vectors = vector_ok ? n / 4 : 0;
  const int64_t work = std::max(vectors, n - vectors * 4);
  AdamWKernel<<<Blocks(work), kThreads, 0, stream>>>(
      param, grad, exp_avg, exp_avg_sq, n, vectors, scalars, grad_scale,
      param_bf16);
  return cudaGetLastError();
}

int64_t SumOfSquaresPartials(int64_t n) {
  return std::min(
      kMaxSumPartials,
      std::max<int64_t>((n + kSumElementsPerBlock - 1) / kSumElementsPerBlock,
                        1));
}

cudaError_t LaunchSumOfSquares(const float* x, int64_t n, double* partials,
                               double* result, bool accumulate,
                               cudaStream_t stream) {
  const int64_t blocks = SumOfSquaresPartials(n);
  SumOfSquaresPartialKernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(
      x, n, partials);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  SumOfSquaresFinalKernel<<<1, kSumReduceThreads, 0, stream>>>(
      partials, blocks, result, accumulate);
  return cudaGetLastError();
}

cudaError_t LaunchScaleByDevice(float* x, int64_t n, const float* scale,
                                cudaStream_t stream) {
  ScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, scale);
  return cudaGetLastError();
}

cudaError_t LaunchClipCoefficient(const double* sum_of_squares, double max_norm,
                                  float* coefficient, double* total_norm,
                                  cudaStream_t stream) {
  ClipCoefficientKernel<<<1, 1, 0, stream>>>(sum_of_squares, max_norm,
                                             coefficient, total_norm);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
