#include <algorithm>
#include <cstdint>

#include "kernels/cpu/rms_norm_element.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/rms_norm_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kColumnThreads = 256;
constexpr int64_t kMaxBlocks = 65535;
constexpr int64_t kMinRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 1024;

int GridFor(int64_t items) {
  return static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(items, 1), kMaxBlocks));
}

// One block per row (grid-stride over rows).
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    RmsNormForwardKernel(const T* x, const T* __restrict__ weight, int64_t rows,
                         int64_t dim, float eps, T* y,
                         float* __restrict__ inv_rms) {
  // x and y may alias: each element is read and written by one thread.
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    float sum_sq = 0.0f;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const float v = LoadAsFloat(xr + d);
      sum_sq += v * v;
    }
    sum_sq = BlockSum(sum_sq, scratch);
    // The row's fp32 block sum, turned into inv_rms as on the CPU.
    const float inv = RmsNormInverse(sum_sq, dim, eps);
    if (threadIdx.x == 0) inv_rms[r] = inv;
    // (x * inv_rms) * weight, in that order, as the CPU kernel computes it.
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      StoreFromFloat(yr + d, RmsNormOut(LoadAsFloat(xr + d), inv,
                                        LoadAsFloat(weight + d)));
    }
  }
}

// dx of one row per block:
//   dx = inv * (dy * w - xhat * mean(dy * w * xhat)),  xhat = x * inv.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    RmsNormDxKernel(const T* __restrict__ dy, const T* __restrict__ x,
                    const T* __restrict__ weight,
                    const float* __restrict__ inv_rms, int64_t rows,
                    int64_t dim, T* __restrict__ dx, bool accumulate_dx) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* dyr = dy + r * dim;
    const T* xr = x + r * dim;
    T* dxr = dx + r * dim;
    const float inv = inv_rms[r];
    float dot = 0.0f;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const float xhat = RmsNormHat(LoadAsFloat(xr + d), inv);
      dot += LoadAsFloat(dyr + d) * LoadAsFloat(weight + d) * xhat;
    }
    dot = BlockSum(dot, scratch);
    const float mean_dot = RmsNormMeanDot(dot, dim);
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      const float grad =
          RmsNormInputGrad(LoadAsFloat(dyr + d), LoadAsFloat(xr + d),
                           LoadAsFloat(weight + d), inv, mean_dot);
      StoreFromFloat(dxr + d, accumulate_dx
                                  ? __fadd_rn(LoadAsFloat(dxr + d), grad)
                                  : grad);
    }
  }
}

// partials[c, d] = sum over the rows of chunk c of dy[r, d] * xhat[r, d].
// Grid: (column blocks, chunks); a thread owns one column.
template <typename T>
__global__ void __launch_bounds__(kColumnThreads)
    RmsNormDweightPartialKernel(const T* __restrict__ dy,
                                const T* __restrict__ x,
                                const float* __restrict__ inv_rms, int64_t rows,
                                int64_t dim, int64_t rows_per_chunk,
                                float* __restrict__ partials) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (d >= dim) return;
  const int64_t begin = chunk * rows_per_chunk;
  const int64_t end = min(begin + rows_per_chunk, rows);
  float sum = 0.0f;
  for (int64_t r = begin; r < end; ++r) {
    const float xhat = RmsNormHat(LoadAsFloat(x + r * dim + d), inv_rms[r]);
    sum += LoadAsFloat(dy + r * dim + d) * xhat;
  }
  partials[chunk * dim + d] = sum;
}

// dweight[d] += sum over chunks (in chunk order) of partials[c, d].
__global__ void __launch_bounds__(kColumnThreads)
    RmsNormDweightReduceKernel(const float* __restrict__ partials,
                               int64_t chunks, int64_t dim,
                               float* __restrict__ dweight) {
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  float sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) sum += partials[c * dim + d];
  dweight[d] += sum;
}

template <typename T>
cudaError_t Backward(const T* dy, const T* x, const T* weight,
                     const float* inv_rms, int64_t rows, int64_t dim, T* dx,
                     bool accumulate_dx, float* dweight, float* partials,
                     cudaStream_t stream) {
  RmsNormDxKernel<T><<<GridFor(rows), kRowThreads, 0, stream>>>(
      dy, x, weight, inv_rms, rows, dim, dx, accumulate_dx);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || dweight == nullptr) return error;
  const int64_t rows_per_chunk = RmsNormRowsPerChunk(rows);
  const int64_t chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  const int64_t column_blocks = (dim + kColumnThreads - 1) / kColumnThreads;
  const dim3 grid(static_cast<unsigned>(column_blocks),
                  static_cast<unsigned>(chunks));
  RmsNormDweightPartialKernel<T><<<grid, kColumnThreads, 0, stream>>>(
      dy, x, inv_rms, rows, dim, rows_per_chunk, partials);
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  RmsNormDweightReduceKernel<<<static_cast<unsigned>(column_blocks),
                               kColumnThreads, 0, stream>>>(partials, chunks,
                                                            dim, dweight);
  return cudaGetLastError();
}

}  // namespace

int64_t RmsNormRowsPerChunk(int64_t rows) {
  return std::max(kMinRowsPerChunk, (rows + kMaxChunks - 1) / kMaxChunks);
}

cudaError_t LaunchRmsNormForward(const float* x, const float* weight,
                                 int64_t rows, int64_t dim, float eps, float* y,
                                 float* inv_rms, cudaStream_t stream) {
  RmsNormForwardKernel<float><<<GridFor(rows), kRowThreads, 0, stream>>>(
      x, weight, rows, dim, eps, y, inv_rms);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormForward(const uint16_t* x, const uint16_t* weight,
                                 int64_t rows, int64_t dim, float eps,
                                 uint16_t* y, float* inv_rms,
                                 cudaStream_t stream) {
  RmsNormForwardKernel<uint16_t><<<GridFor(rows), kRowThreads, 0, stream>>>(
      x, weight, rows, dim, eps, y, inv_rms);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormBackward(const float* dy, const float* x,
                                  const float* weight, const float* inv_rms,
                                  int64_t rows, int64_t dim, float* dx,
                                  bool accumulate_dx, float* dweight,
                                  float* partials, cudaStream_t stream) {
  return Backward(dy, x, weight, inv_rms, rows, dim, dx, accumulate_dx, dweight,
                  partials, stream);
}

cudaError_t LaunchRmsNormBackward(const uint16_t* dy, const uint16_t* x,
                                  const uint16_t* weight, const float* inv_rms,
                                  int64_t rows, int64_t dim, uint16_t* dx,
                                  bool accumulate_dx, float* dweight,
                                  float* partials, cudaStream_t stream) {
  return Backward(dy, x, weight, inv_rms, rows, dim, dx, accumulate_dx, dweight,
                  partials, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
