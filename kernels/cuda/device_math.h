#ifndef SHARDD_KERNELS_CUDA_DEVICE_MATH_H_
#define SHARDD_KERNELS_CUDA_DEVICE_MATH_H_

// Device helpers shared by the op kernels (.cu files only; nvcc).
//
// bf16 is handled as uint16_t bit patterns rounded by kernels/cpu/bf16.h's
// own Fp32ToBf16 (round to nearest even, NaN kept quiet with its sign and
// top payload bits), so a value rounded here equals the CPU's bit for bit.
// Block reductions use a fixed tree, so results do not depend on scheduling.

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/bf16.h"

namespace shardd {
namespace kernels {
namespace cuda {

__device__ __forceinline__ float Bf16BitsToFloat(uint16_t value) {
  return Bf16ToFp32(value);
}

__device__ __forceinline__ uint16_t FloatToBf16Bits(float value) {
  return Fp32ToBf16(value);
}

__device__ __forceinline__ float LoadAsFloat(const float* p) { return *p; }
__device__ __forceinline__ float LoadAsFloat(const uint16_t* p) {
  return Bf16BitsToFloat(*p);
}
__device__ __forceinline__ void StoreFromFloat(float* p, float value) {
  *p = value;
}
__device__ __forceinline__ void StoreFromFloat(uint16_t* p, float value) {
  *p = FloatToBf16Bits(value);
}

template <typename T>
__device__ __forceinline__ T WarpSum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  }
  return value;
}

__device__ __forceinline__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  return value;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `scratch`
// holds 32 values of T in shared memory. Every thread gets the result.
template <typename T>
__device__ __forceinline__ T BlockSum(T value, T* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  value = WarpSum(value);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  T total = lane < warps ? scratch[lane] : T(0);
  return WarpSum(total);
}

// Max over the block (blockDim.x a multiple of 32, at most 1024). `scratch`
// holds 32 floats in shared memory. NaNs are dropped (fmaxf). Every thread
// gets the result.
__device__ __forceinline__ float BlockMax(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = WarpMax(value);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  return WarpMax(lane < (blockDim.x >> 5) ? scratch[lane] : -INFINITY);
}

// The segment of row r given segment offsets [segments + 1] (ascending,
// offsets[0] <= r < offsets[segments]): the largest s with offsets[s] <= r,
// which is never an empty segment. Binary search, O(log segments).
__device__ __forceinline__ int64_t SegmentOfRow(const int32_t* offsets,
                                                int64_t segments, int64_t r) {
  int64_t lo = 0, hi = segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_DEVICE_MATH_H_
