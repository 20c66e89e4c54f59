#include <algorithm>
#include <cstdint>

#include "kernels/cpu/bias_element.h"
#include "kernels/cuda/bias_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kAddThreads = 256;
constexpr int64_t kMaxBlocks = 65535;
// Column sums: 32 columns by kRowLanes strided row partials per block.
constexpr int kRowLanes = 8;
constexpr int64_t kMaxGridY = 65535;

template <typename B, typename Y>
__global__ void __launch_bounds__(kAddThreads)
    AddRowBiasKernel(const B* __restrict__ b, Y* __restrict__ y, int64_t rows,
                     int64_t cols, const int32_t* __restrict__ offsets,
                     int64_t segments, const float* __restrict__ row_scale) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t s = offsets == nullptr ? 0 : SegmentOfRow(offsets, segments, r);
    const B* bias = b + s * cols;
    Y* row = y + r * cols;
    if (row_scale == nullptr) {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        StoreFromFloat(row + c,
                       AddBiasValue(LoadAsFloat(row + c), LoadAsFloat(bias + c)));
      }
    } else {
      const float scale = row_scale[r];
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        StoreFromFloat(row + c, AddScaledBiasValue(LoadAsFloat(row + c), scale,
                                                   LoadAsFloat(bias + c)));
      }
    }
  }
}

__device__ __forceinline__ float LoadAcc(const float* p, float) { return *p; }
__device__ __forceinline__ float LoadAcc(const uint16_t* p, float) {
  return Bf16BitsToFloat(*p);
}
__device__ __forceinline__ double LoadAcc(const float* p, double) {
  return static_cast<double>(*p);
}

// Block (32, kRowLanes); blockIdx.x picks 32 columns, blockIdx.y segments.
template <typename In, typename Acc>
__global__ void ColumnSumsKernel(const In* __restrict__ in, int64_t rows,
                                 int64_t cols,
                                 const int32_t* __restrict__ offsets,
                                 int64_t segments,
                                 const float* __restrict__ row_scale,
                                 Acc* __restrict__ out) {
  __shared__ Acc partial[kRowLanes][32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  for (int64_t s = blockIdx.y; s < segments; s += gridDim.y) {
    const int64_t begin = offsets == nullptr ? 0 : offsets[s];
    const int64_t end = offsets == nullptr ? rows : offsets[s + 1];
    Acc acc = 0;
    if (c < cols) {
      for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
        Acc v = LoadAcc(in + r * cols + c, Acc{0});
        if (row_scale != nullptr) v = row_scale[r] * v;
        acc += v;
      }
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols && end > begin) {
      Acc sum = 0;
      for (int i = 0; i < kRowLanes; ++i) sum += partial[i][threadIdx.x];
      out[s * cols + c] += sum;
    }
    __syncthreads();  // partial is rewritten for the next segment
  }
}

// One block per row (grid-stride); the block sum is a fixed tree.
template <typename T>
__global__ void __launch_bounds__(kAddThreads)
    AddRowBiasDotKernel(const T* __restrict__ in, const T* __restrict__ b,
                        int64_t rows, int64_t cols,
                        const int32_t* __restrict__ offsets, int64_t segments,
                        float* __restrict__ row_out) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t s = offsets == nullptr ? 0 : SegmentOfRow(offsets, segments, r);
    const T* bias = b + s * cols;
    const T* row = in + r * cols;
    float partial = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      partial += LoadAsFloat(row + c) * LoadAsFloat(bias + c);
    }
    const float sum = BlockSum(partial, scratch);
    if (threadIdx.x == 0) row_out[r] += sum;
  }
}

template <typename B, typename Y>
cudaError_t AddRowBiasTyped(const void* b, void* y, int64_t rows, int64_t cols,
                            const int32_t* offsets, int64_t segments,
                            const float* row_scale, cudaStream_t stream) {
  const int grid = static_cast<int>(std::min<int64_t>(rows, kMaxBlocks));
  AddRowBiasKernel<B, Y><<<grid, kAddThreads, 0, stream>>>(
      static_cast<const B*>(b), static_cast<Y*>(y), rows, cols, offsets,
      segments, row_scale);
  return cudaGetLastError();
}

template <typename In, typename Acc>
cudaError_t ColumnSumsTyped(const In* in, int64_t rows, int64_t cols,
                            const int32_t* offsets, int64_t segments,
                            const float* row_scale, Acc* out,
                            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32),
                  static_cast<unsigned>(std::min(segments, kMaxGridY)));
  ColumnSumsKernel<In, Acc><<<grid, dim3(32, kRowLanes), 0, stream>>>(
      in, rows, cols, offsets, segments, row_scale, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAddRowBias(DType b_type, const void* b, DType y_type,
                             void* y, int64_t rows, int64_t cols,
                             const int32_t* offsets, int64_t segments,
                             const float* row_scale, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (y_type == DType::kFloat32) {
    return b_type == DType::kFloat32
               ? AddRowBiasTyped<float, float>(b, y, rows, cols, offsets,
                                               segments, row_scale, stream)
               : AddRowBiasTyped<uint16_t, float>(b, y, rows, cols, offsets,
                                                  segments, row_scale, stream);
  }
  return b_type == DType::kFloat32
             ? AddRowBiasTyped<float, uint16_t>(b, y, rows, cols, offsets,
                                                segments, row_scale, stream)
             : AddRowBiasTyped<uint16_t, uint16_t>(b, y, rows, cols, offsets,
                                                   segments, row_scale, stream);
}

cudaError_t LaunchColumnSums(DType in_type, const void* in, int64_t rows,
                             int64_t cols, const int32_t* offsets,
                             int64_t segments, const float* row_scale,
                             float* out, cudaStream_t stream) {
  if (cols == 0 || segments == 0 || (offsets == nullptr && rows == 0)) {
    return cudaSuccess;
  }
  if (in_type == DType::kFloat32) {
    return ColumnSumsTyped(static_cast<const float*>(in), rows, cols, offsets,
                           segments, row_scale, out, stream);
  }
  return ColumnSumsTyped(static_cast<const uint16_t*>(in), rows, cols, offsets,
                         segments, row_scale, out, stream);
}

cudaError_t LaunchAddRowBiasDot(DType type, const void* in, const void* b,
                                int64_t rows, int64_t cols,
                                const int32_t* offsets, int64_t segments,
                                float* row_out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>(rows, kMaxBlocks));
  if (type == DType::kFloat32) {
    AddRowBiasDotKernel<float><<<grid, kAddThreads, 0, stream>>>(
        static_cast<const float*>(in), static_cast<const float*>(b), rows,
        cols, offsets, segments, row_out);
  } else {
    AddRowBiasDotKernel<uint16_t><<<grid, kAddThreads, 0, stream>>>(
        static_cast<const uint16_t*>(in), static_cast<const uint16_t*>(b),
        rows, cols, offsets, segments, row_out);
  }
  return cudaGetLastError();
}

cudaError_t LaunchColumnSumsDouble(const float* in, int64_t rows, int64_t cols,
                                   double* out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  return ColumnSumsTyped(in, rows, cols, /*offsets=*/nullptr, /*segments=*/1,
                         /*row_scale=*/nullptr, out, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
