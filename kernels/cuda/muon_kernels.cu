#include <algorithm>
#include <cstdint>

#include "kernels/cpu/muon_element.h"
#include "kernels/cuda/muon_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

int Grid(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>(std::max<int64_t>((n + kThreads - 1) / kThreads, 1),
                        kMaxBlocks));
}

__global__ void __launch_bounds__(kThreads)
    MomentumKernel(const float* __restrict__ grad, float* momentum, int64_t n,
                   float beta, float one_minus_beta, float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float m = MuonMomentum(momentum[i], grad[i], beta, one_minus_beta);
    if (out != nullptr) {
      out[i] = MuonNesterov(grad[i], m, beta, one_minus_beta);
    } else {
      momentum[i] = m;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    ApplyKernel(float* __restrict__ param, const float* __restrict__ update,
                int64_t n, MuonApplyScalars s) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    param[i] = MuonParamUpdate(param[i], update[i], s);
  }
}

__global__ void __launch_bounds__(kThreads)
    NormalizeKernel(float* __restrict__ x, int64_t n,
                    const double* __restrict__ sum_of_squares, float eps) {
  const float denom = MuonNormDenominator(*sum_of_squares, eps);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = RnDiv(x[i], denom);
  }
}

__global__ void __launch_bounds__(kThreads)
    ScaleKernel(float* __restrict__ x, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __fmul_rn(x[i], scale);
  }
}

// 32 x 32 tiles through shared memory (padded against bank conflicts).
__global__ void TransposeKernel(const float* __restrict__ in, int64_t rows,
                                int64_t cols, float* __restrict__ out) {
  __shared__ float tile[32][33];
  const int64_t c0 = blockIdx.x * int64_t{32}, r0 = blockIdx.y * int64_t{32};
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t r = r0 + dy, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[dy][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t c = c0 + dy, r = r0 + threadIdx.x;
    if (c < cols && r < rows) out[c * rows + r] = tile[threadIdx.x][dy];
  }
}

}  // namespace

cudaError_t LaunchMuonMomentum(const float* grad, float* momentum, int64_t n,
                               float beta, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  MomentumKernel<<<Grid(n), kThreads, 0, stream>>>(
      grad, momentum, n, beta, RnSub(1.0f, beta), out);
  return cudaGetLastError();
}

cudaError_t LaunchMuonApply(float* param, const float* update, int64_t n,
                            float decay, float step, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ApplyKernel<<<Grid(n), kThreads, 0, stream>>>(param, update, n,
                                                MuonApplyScalars{decay, step});
  return cudaGetLastError();
}

cudaError_t LaunchMuonNormalize(float* x, int64_t n,
                                const double* sum_of_squares, float eps,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  NormalizeKernel<<<Grid(n), kThreads, 0, stream>>>(x, n, sum_of_squares, eps);
  return cudaGetLastError();
}

cudaError_t LaunchMuonScale(float* x, int64_t n, float scale,
                            cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ScaleKernel<<<Grid(n), kThreads, 0, stream>>>(x, n, scale);
  return cudaGetLastError();
}

cudaError_t LaunchTranspose(const float* in, int64_t rows, int64_t cols,
                            float* out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32),
                  static_cast<unsigned>((rows + 31) / 32));
  TransposeKernel<<<grid, dim3(32, 8), 0, stream>>>(in, rows, cols, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
