#include <algorithm>
#include <cstdint>

#include "kernels/cpu/router_aux_loss_element.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/router_aux_loss_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int64_t kMaxBlocks = 65535;

static_assert(sizeof(int64_t) == sizeof(unsigned long long),  // NOLINT
              "int64 counters are updated through 64-bit atomics");

__global__ void __launch_bounds__(kThreads)
    RouterAuxCountKernel(const int32_t* __restrict__ indices, int64_t n,
                         int64_t experts, int64_t* __restrict__ counts,
                         int64_t* __restrict__ invalid_indices) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = indices[i];
    // Integer atomics: the totals are exact whatever the order.
    if (e >= 0 && e < experts) {
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + e),  // NOLINT
                1ull);
    } else if (invalid_indices != nullptr) {
      atomicAdd(reinterpret_cast<unsigned long long*>(  // NOLINT
                    invalid_indices),
                1ull);
    }
  }
}

// One thread: the CPU's loop, term for term.
__global__ void RouterAuxValueKernel(const int64_t* __restrict__ counts,
                                     const double* __restrict__ prob_sums,
                                     const int64_t* __restrict__ total_rows,
                                     int64_t experts, double* value) {
  const int64_t rows = *total_rows;
  if (rows <= 0) {
    *value = 0.0;
    return;
  }
  const double r = static_cast<double>(rows);
  double sum = 0.0;
  for (int64_t e = 0; e < experts; ++e) {
    sum = RnDAdd(sum, RouterAuxLossTerm(counts[e], prob_sums[e], r));
  }
  *value = RnDMul(static_cast<double>(experts), sum);
}

// One warp per row; g[e] is recomputed where needed, as the CPU forms it.
__global__ void __launch_bounds__(kThreads)
    RouterAuxBackwardKernel(const float* __restrict__ probs, int64_t rows,
                            int64_t experts,
                            const int64_t* __restrict__ counts,
                            const int64_t* __restrict__ total_rows,
                            double scale, float* __restrict__ d_logits) {
  const int lane = threadIdx.x & 31;
  const int64_t total = *total_rows;
  const double r = static_cast<double>(total);
  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                   (threadIdx.x >> 5);
       t < rows; t += warp_stride) {
    const float* p = probs + t * experts;
    float* dl = d_logits + t * experts;
    if (total <= 0) {
      for (int64_t e = lane; e < experts; e += 32) dl[e] = 0.0f;
      continue;
    }
    double dot = 0.0;
    for (int64_t e = lane; e < experts; e += 32) {
      dot = RouterAuxDotStep(dot, p[e],
                             RouterAuxProbGrad(scale, experts, counts[e], r));
    }
    dot = WarpSum(dot);  // fixed butterfly: deterministic
    for (int64_t e = lane; e < experts; e += 32) {
      dl[e] = RouterAuxLogitGrad(
          p[e], RouterAuxProbGrad(scale, experts, counts[e], r), dot);
    }
  }
}

int GridFor(int64_t items, int64_t per_block) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min((items + per_block - 1) / per_block,
                                    kMaxBlocks)));
}

}  // namespace

cudaError_t LaunchRouterAuxCount(const int32_t* indices, int64_t n,
                                 int64_t experts, int64_t* counts,
                                 int64_t* invalid_indices,
                                 cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  RouterAuxCountKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(
      indices, n, experts, counts, invalid_indices);
  return cudaGetLastError();
}

cudaError_t LaunchRouterAuxValue(const int64_t* counts, const double* prob_sums,
                                 const int64_t* total_rows, int64_t experts,
                                 double* value, cudaStream_t stream) {
  RouterAuxValueKernel<<<1, 1, 0, stream>>>(counts, prob_sums, total_rows,
                                            experts, value);
  return cudaGetLastError();
}

cudaError_t LaunchRouterAuxBackward(const float* probs, int64_t rows,
                                    int64_t experts, const int64_t* counts,
                                    const int64_t* total_rows, double scale,
                                    float* d_logits, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RouterAuxBackwardKernel<<<GridFor(rows, kWarpsPerBlock), kThreads, 0,
                            stream>>>(probs, rows, experts, counts, total_rows,
                                      scale, d_logits);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
