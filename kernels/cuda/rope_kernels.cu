#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/rope_element.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/rope_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// One thread per (token, head, pair).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RopeKernel(RopeLaunch r, const int32_t* __restrict__ positions, T* x) {
  const int64_t total = r.tokens * r.heads * r.half;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                     threadIdx.x;
       idx < total; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % r.half;
    const int64_t h = (idx / r.half) % r.heads;
    const int64_t t = idx / (r.half * r.heads);
    const int64_t p = positions[t];
    if (p < 0 || p >= r.positions) continue;
    T* head = x + t * r.token_stride + h * r.head_stride + r.dim_offset;
    int64_t first, second;
    RopePairOffsets(r.interleaved, i, r.half, &first, &second);
    // The CPU kernel's rotation (kernels/cpu/rope_element.h).
    float x1 = LoadAsFloat(head + first), x2 = LoadAsFloat(head + second);
    RopeRotatePair(r.cos[p * r.half + i], r.sign * r.sin[p * r.half + i], &x1,
                   &x2);
    StoreFromFloat(head + first, x1);
    StoreFromFloat(head + second, x2);
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchRope(const RopeLaunch& r, const int32_t* positions, T* x,
                       cudaStream_t stream) {
  const int64_t total = r.tokens * r.heads * r.half;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  RopeKernel<T><<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535),
                  kThreads, 0, stream>>>(r, positions, x);
  return cudaGetLastError();
}

template cudaError_t LaunchRope<float>(const RopeLaunch&, const int32_t*,
                                       float*, cudaStream_t);
template cudaError_t LaunchRope<uint16_t>(const RopeLaunch&, const int32_t*,
                                          uint16_t*, cudaStream_t);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
