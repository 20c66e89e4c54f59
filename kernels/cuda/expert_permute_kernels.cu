#include <algorithm>
#include <cstdint>

#include "kernels/cpu/expert_permute_element.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/expert_permute_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

int Grid(int64_t rows) {
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(rows, 1),
                                            kMaxBlocks));
}

// One block per route row (grid-stride). With weights null the row is a
// gradient row of d values; otherwise a dispatch row of d + 2.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    PackRowsKernel(const T* __restrict__ src, const float* __restrict__ weights,
                   const int32_t* __restrict__ indices,
                   const int64_t* __restrict__ order, int64_t rows, int k,
                   int64_t d, int64_t local, float* __restrict__ send) {
  const int64_t width = weights == nullptr ? d : d + kDispatchRowExtras;
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const T* in = src + RouteRowToken(order, k, j) * d;
    float* row = send + j * width;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      row[c] = LoadAsFloat(in + c);
    }
    if (weights != nullptr && threadIdx.x == 0) {
      const int64_t slot = order[j];
      row[d] = LocalExpertTag(indices[slot], local);
      row[d + 1] = weights[slot];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    UnpackDispatchRowsKernel(const float* __restrict__ recv, int64_t received,
                             int64_t d, T* __restrict__ x_r,
                             int32_t* __restrict__ ids_r,
                             float* __restrict__ w_r) {
  const int64_t width = d + kDispatchRowExtras;
  for (int64_t i = blockIdx.x; i < received; i += gridDim.x) {
    const float* row = recv + i * width;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      StoreFromFloat(x_r + i * d + c, row[c]);
    }
    if (threadIdx.x == 0) {
      ids_r[i] = LocalExpertFromTag(row[d]);
      w_r[i] = row[d + 1];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    PackCombineGradRowsKernel(const float* __restrict__ dx_r,
                              const float* __restrict__ dw_r, int64_t received,
                              int64_t d, float* __restrict__ send) {
  const int64_t width = d + kCombineGradRowExtras;
  for (int64_t i = blockIdx.x; i < received; i += gridDim.x) {
    float* row = send + i * width;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      row[c] = dx_r[i * d + c];
    }
    if (threadIdx.x == 0) row[d] = dw_r[i];
  }
}

// One block per token (grid-stride); each thread sums its columns over the
// token's k rows in slot order (CombineValue).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    CombineRowsKernel(const float* __restrict__ back,
                      const int64_t* __restrict__ position, int64_t t, int k,
                      int64_t width, int64_t d, T* __restrict__ y,
                      float* __restrict__ d_weights) {
  for (int64_t i = blockIdx.x; i < t; i += gridDim.x) {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      StoreFromFloat(y + i * d + c, CombineValue(back, position, k, width, i, c));
    }
    if (d_weights != nullptr) {
      for (int s = threadIdx.x; s < k; s += blockDim.x) {
        d_weights[i * k + s] = back[position[i * k + s] * width + d];
      }
    }
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchPackRows(const T* src, const float* weights,
                           const int32_t* indices, const int64_t* order,
                           int64_t rows, int k, int64_t d,
                           int64_t local_experts, float* send,
                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  PackRowsKernel<T><<<Grid(rows), kThreads, 0, stream>>>(
      src, weights, indices, order, rows, k, d, local_experts, send);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchUnpackDispatchRows(const float* recv, int64_t received,
                                     int64_t d, T* x_r, int32_t* ids_r,
                                     float* w_r, cudaStream_t stream) {
  if (received == 0) return cudaSuccess;
  UnpackDispatchRowsKernel<T><<<Grid(received), kThreads, 0, stream>>>(
      recv, received, d, x_r, ids_r, w_r);
  return cudaGetLastError();
}

cudaError_t LaunchPackCombineGradRows(const float* dx_r, const float* dw_r,
                                      int64_t received, int64_t d, float* send,
                                      cudaStream_t stream) {
  if (received == 0) return cudaSuccess;
  PackCombineGradRowsKernel<<<Grid(received), kThreads, 0, stream>>>(
      dx_r, dw_r, received, d, send);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchCombineRows(const float* back, const int64_t* position,
                              int64_t t, int k, int64_t width, int64_t d, T* y,
                              float* d_weights, cudaStream_t stream) {
  if (t == 0) return cudaSuccess;
  CombineRowsKernel<T><<<Grid(t), kThreads, 0, stream>>>(
      back, position, t, k, width, d, y, d_weights);
  return cudaGetLastError();
}

template cudaError_t LaunchPackRows<float>(const float*, const float*,
                                           const int32_t*, const int64_t*,
                                           int64_t, int, int64_t, int64_t,
                                           float*, cudaStream_t);
template cudaError_t LaunchPackRows<uint16_t>(const uint16_t*, const float*,
                                              const int32_t*, const int64_t*,
                                              int64_t, int, int64_t, int64_t,
                                              float*, cudaStream_t);
template cudaError_t LaunchUnpackDispatchRows<float>(const float*, int64_t,
                                                     int64_t, float*, int32_t*,
                                                     float*, cudaStream_t);
template cudaError_t LaunchUnpackDispatchRows<uint16_t>(const float*, int64_t,
                                                        int64_t, uint16_t*,
                                                        int32_t*, float*,
                                                        cudaStream_t);
template cudaError_t LaunchCombineRows<float>(const float*, const int64_t*,
                                              int64_t, int, int64_t, int64_t,
                                              float*, float*, cudaStream_t);
template cudaError_t LaunchCombineRows<uint16_t>(const float*, const int64_t*,
                                                 int64_t, int, int64_t, int64_t,
                                                 uint16_t*, float*,
                                                 cudaStream_t);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
