#include <algorithm>
#include <cstdint>

#include "kernels/cuda/bf16_cast_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;
constexpr int64_t kVector = 8;  // elements per 16-byte bf16 vector

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int Blocks(int64_t work) {
  return static_cast<int>(std::min<int64_t>(
      std::max<int64_t>((work + kThreads - 1) / kThreads, 1), kMaxBlocks));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16Bits(lo)) |
         (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16);
}

// Elements [0, vectors * 8) in 8-element vectors (two float4 in, one uint4
// out), then the tail [vectors * 8, n) one by one.
__global__ void Fp32ToBf16Kernel(const float* __restrict__ in,
                                 uint16_t* __restrict__ out, int64_t n,
                                 int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float4* in4 = reinterpret_cast<const float4*>(in);
  uint4* out8 = reinterpret_cast<uint4*>(out);
  for (int64_t v = first; v < vectors; v += stride) {
    const float4 a = in4[2 * v];
    const float4 b = in4[2 * v + 1];
    uint4 packed;
    packed.x = PackBf16(a.x, a.y);
    packed.y = PackBf16(a.z, a.w);
    packed.z = PackBf16(b.x, b.y);
    packed.w = PackBf16(b.z, b.w);
    out8[v] = packed;
  }
  for (int64_t i = vectors * kVector + first; i < n; i += stride) {
    out[i] = FloatToBf16Bits(in[i]);
  }
}

__device__ __forceinline__ float LowBf16(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float HighBf16(uint32_t pair) {
  return __uint_as_float(pair & 0xFFFF0000u);
}

__global__ void Bf16ToFp32Kernel(const uint16_t* __restrict__ in,
                                 float* __restrict__ out, int64_t n,
                                 int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first =
      static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint4* in8 = reinterpret_cast<const uint4*>(in);
  float4* out4 = reinterpret_cast<float4*>(out);
  for (int64_t v = first; v < vectors; v += stride) {
    const uint4 packed = in8[v];
    out4[2 * v] = make_float4(LowBf16(packed.x), HighBf16(packed.x),
                              LowBf16(packed.y), HighBf16(packed.y));
    out4[2 * v + 1] = make_float4(LowBf16(packed.z), HighBf16(packed.z),
                                  LowBf16(packed.w), HighBf16(packed.w));
  }
  for (int64_t i = vectors * kVector + first; i < n; i += stride) {
    out[i] = Bf16BitsToFloat(in[i]);
  }
}

}  // namespace

cudaError_t LaunchFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                             cudaStream_t stream) {
  const int64_t vectors = Aligned16(in) && Aligned16(out) ? n / kVector : 0;
  const int64_t work = std::max(vectors, n - vectors * kVector);
  Fp32ToBf16Kernel<<<Blocks(work), kThreads, 0, stream>>>(in, out, n, vectors);
  return cudaGetLastError();
}

cudaError_t LaunchBf16ToFp32(const uint16_t* in, float* out, int64_t n,
                             cudaStream_t stream) {
  const int64_t vectors = Aligned16(in) && Aligned16(out) ? n / kVector : 0;
  const int64_t work = std::max(vectors, n - vectors * kVector);
  Bf16ToFp32Kernel<<<Blocks(work), kThreads, 0, stream>>>(in, out, n, vectors);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
