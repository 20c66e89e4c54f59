#include <algorithm>

#include "kernels/cuda/device_math.h"
#include "worker/model/device_mla_kernels.h"

namespace shardd {
namespace device_model {
namespace {

using ::shardd::kernels::cuda::LoadAsFloat;
using ::shardd::kernels::cuda::StoreFromFloat;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

unsigned Blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename S, typename D>
__global__ void StridedCopyKernel(const S* __restrict__ src, int64_t src_stride,
                                  int64_t src_row_div, D* __restrict__ dst,
                                  int64_t dst_stride, int64_t rows,
                                  int64_t width) {
  const int64_t n = rows * width;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    const S* from = src + (r / src_row_div) * src_stride + c;
    if constexpr (sizeof(S) == sizeof(D)) {
      dst[r * dst_stride + c] = *from;  // same type: the bits as they are
    } else {
      StoreFromFloat(dst + r * dst_stride + c, LoadAsFloat(from));
    }
  }
}

__global__ void SumHeadsKernel(const float* __restrict__ x, int64_t tokens,
                               int64_t heads, int64_t head_stride,
                               int64_t width, float* __restrict__ out,
                               int64_t out_stride) {
  const int64_t n = tokens * width;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / width, c = i % width;
    const float* row = x + t * heads * head_stride + c;
    float sum = 0.0f;
    for (int64_t j = 0; j < heads; ++j) sum += row[j * head_stride];
    out[t * out_stride + c] = sum;
  }
}

template <typename S, typename D>
cudaError_t StridedCopy(const S* src, int64_t src_stride, int64_t src_row_div,
                        D* dst, int64_t dst_stride, int64_t rows, int64_t width,
                        cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return cudaSuccess;
  StridedCopyKernel<S, D><<<Blocks(rows * width), kThreads, 0, stream>>>(
      src, src_stride, src_row_div, dst, dst_stride, rows, width);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchStridedCopy(const float* src, int64_t src_stride,
                              int64_t src_row_div, float* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream) {
  return StridedCopy(src, src_stride, src_row_div, dst, dst_stride, rows, width,
                     stream);
}

cudaError_t LaunchStridedCopy(const uint16_t* src, int64_t src_stride,
                              int64_t src_row_div, uint16_t* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream) {
  return StridedCopy(src, src_stride, src_row_div, dst, dst_stride, rows, width,
                     stream);
}

cudaError_t LaunchStridedCopy(const float* src, int64_t src_stride,
                              int64_t src_row_div, uint16_t* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream) {
  return StridedCopy(src, src_stride, src_row_div, dst, dst_stride, rows, width,
                     stream);
}

cudaError_t LaunchSumHeads(const float* x, int64_t tokens, int64_t heads,
                           int64_t head_stride, int64_t width, float* out,
                           int64_t out_stride, cudaStream_t stream) {
  if (tokens <= 0 || width <= 0) return cudaSuccess;
  SumHeadsKernel<<<Blocks(tokens * width), kThreads, 0, stream>>>(
      x, tokens, heads, head_stride, width, out, out_stride);
  return cudaGetLastError();
}

}  // namespace device_model
}  // namespace shardd
