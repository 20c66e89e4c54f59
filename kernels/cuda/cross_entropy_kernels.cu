#include <algorithm>
#include <cstdint>

#include "kernels/cpu/cross_entropy_element.h"
#include "kernels/cuda/cross_entropy_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kRowThreads = 512;
constexpr int kReduceThreads = 1024;
constexpr int64_t kMaxBlocks = 65535;

// Mirrors CrossEntropyDeviceResult (cross_entropy.h), which .cu files cannot
// include (absl); cross_entropy.cc static_asserts the two layouts agree.
struct DeviceResult {
  double loss_sum;
  int64_t count;
  int64_t invalid_targets;
  double mean_loss;
};

// Gemma's soft cap with the CPU's rounding steps (cross_entropy_element.h);
// inv = 1 / cap rounded on the host.
struct Softcap {
  float cap;
  float inv;
};

Softcap MakeSoftcap(float cap) {
  return {cap, cap > 0 ? SoftcapInverse(cap) : 0.0f};
}

template <bool kCapped>
__device__ __forceinline__ float Capped(float x, Softcap c) {
  if (!kCapped) return x;
  return SoftcapValue(x, c.cap, c.inv);
}

using MaxSum = OnlineSoftmax;

__device__ MaxSum BlockMerge(MaxSum acc, MaxSum* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other;
    other.max = __shfl_xor_sync(0xFFFFFFFFu, acc.max, offset);
    other.sum = __shfl_xor_sync(0xFFFFFFFFu, acc.sum, offset);
    acc = OnlineSoftmaxMerge(acc, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = acc;
  __syncthreads();
  acc = lane < (blockDim.x >> 5) ? scratch[lane] : OnlineSoftmaxEmpty();
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other;
    other.max = __shfl_xor_sync(0xFFFFFFFFu, acc.max, offset);
    other.sum = __shfl_xor_sync(0xFFFFFFFFu, acc.sum, offset);
    acc = OnlineSoftmaxMerge(acc, other);
  }
  return acc;
}

// One block per row (grid-stride). The log-sum-exp is an online softmax in
// one read of the row; the gradient pass reads it once more. Each element is
// read and written by one thread, so d_logits may alias logits. The soft cap
// is recomputed from the raw logit on each read rather than stored: another
// thread reads row[target], and the gradient pass overwrites in place.
template <typename DL, bool kCapped>
__global__ void __launch_bounds__(kRowThreads)
    CrossEntropyRowsKernel(const float* logits, int64_t rows, int64_t vocab,
                           const int32_t* __restrict__ targets,
                           int32_t ignore_index, Softcap cap,
                           double* __restrict__ row_loss,
                           int32_t* __restrict__ row_flag, float loss_scale,
                           DL* d_logits) {
  __shared__ MaxSum scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    const int32_t target = targets[r];
    const bool ignored = target == ignore_index;
    if (ignored || target < 0 || target >= vocab) {
      if (threadIdx.x == 0) {
        row_loss[r] = 0.0;
        row_flag[r] = ignored ? kCeRowIgnored : kCeRowInvalid;
      }
      if (d_logits != nullptr) {
        DL* dl = d_logits + r * vocab;
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
          StoreFromFloat(dl + j, 0.0f);
        }
      }
      continue;
    }
    // Read before any overwrite.
    const float target_logit = Capped<kCapped>(row[target], cap);
    MaxSum acc = OnlineSoftmaxEmpty();
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      OnlineSoftmaxAdd(Capped<kCapped>(row[j], cap), acc);
    }
    acc = BlockMerge(acc, scratch);
    if (threadIdx.x == 0) {
      row_loss[r] = CrossEntropyRowLoss(acc.max, acc.sum, target_logit);
      row_flag[r] = kCeRowCounted;
    }
    if (d_logits != nullptr) {
      DL* dl = d_logits + r * vocab;
      const float scale = CrossEntropyGradScale(loss_scale, acc.sum);
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float y = Capped<kCapped>(row[j], cap);
        float g = CrossEntropyLogitGrad(SoftmaxTerm(y, acc.max), scale,
                                        j == target, loss_scale);
        // The CPU's order: (softmax - onehot) * loss_scale, then the cap's
        // slope.
        if (kCapped) g = RnMul(g, SoftcapSlope(y, cap.inv));
        StoreFromFloat(dl + j, g);
      }
    }
  }
}

// probs = softmax(softcap(logits)) per row, one block per row
// (grid-stride), three reads of the row: the max, the double sum of
// exp(y - max), then exp(y - max) / sum (the CPU model's formula). The cap
// and exp are recomputed per read instead of written back, which keeps the
// logits read-only and saves two writes of the row.
template <typename P, bool kCapped>
__global__ void __launch_bounds__(kRowThreads)
    LmHeadSoftmaxRowsKernel(const float* __restrict__ logits, int64_t rows,
                            int64_t vocab, Softcap cap, P* __restrict__ probs) {
  __shared__ float max_scratch[32];
  __shared__ double sum_scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    float top = -INFINITY;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      top = fmaxf(top, Capped<kCapped>(row[j], cap));
    }
    top = BlockMax(top, max_scratch);
    double total = 0.0;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      total += SoftmaxTerm(Capped<kCapped>(row[j], cap), top);
    }
    total = BlockSum(total, sum_scratch);
    P* out = probs + r * vocab;
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      const float e = SoftmaxTerm(Capped<kCapped>(row[j], cap), top);
      StoreFromFloat(out + j, SoftmaxProb(e, total));
    }
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    CrossEntropyReduceKernel(const double* __restrict__ row_loss,
                             const int32_t* __restrict__ row_flag,
                             int64_t tokens, DeviceResult* result) {
  __shared__ double loss_scratch[32];
  __shared__ long long count_scratch[32];
  __shared__ long long invalid_scratch[32];
  double loss = 0.0;
  long long count = 0, invalid = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    loss += row_loss[t];
    count += row_flag[t] == kCeRowCounted;
    invalid += row_flag[t] == kCeRowInvalid;
  }
  loss = BlockSum(loss, loss_scratch);
  count = BlockSum(count, count_scratch);
  invalid = BlockSum(invalid, invalid_scratch);
  if (threadIdx.x == 0) {
    result->loss_sum = loss;
    result->count = count;
    result->invalid_targets = invalid;
    result->mean_loss = count > 0 ? loss / static_cast<double>(count) : 0.0;
  }
}

int RowGrid(int64_t rows) {
  return static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(rows, 1), kMaxBlocks));
}

template <typename DL>
cudaError_t Rows(float* logits, int64_t rows, int64_t vocab,
                 const int32_t* targets, int32_t ignore_index, float softcap,
                 double* row_loss, int32_t* row_flag, float loss_scale,
                 DL* d_logits, cudaStream_t stream) {
  const int grid = RowGrid(rows);
  const Softcap cap = MakeSoftcap(softcap);
  if (softcap > 0) {
    CrossEntropyRowsKernel<DL, true><<<grid, kRowThreads, 0, stream>>>(
        logits, rows, vocab, targets, ignore_index, cap, row_loss, row_flag,
        loss_scale, d_logits);
  } else {
    CrossEntropyRowsKernel<DL, false><<<grid, kRowThreads, 0, stream>>>(
        logits, rows, vocab, targets, ignore_index, cap, row_loss, row_flag,
        loss_scale, d_logits);
  }
  return cudaGetLastError();
}

template <typename P>
cudaError_t SoftmaxRows(const float* logits, int64_t rows, int64_t vocab,
                        float softcap, P* probs, cudaStream_t stream) {
  const int grid = RowGrid(rows);
  const Softcap cap = MakeSoftcap(softcap);
  if (softcap > 0) {
    LmHeadSoftmaxRowsKernel<P, true>
        <<<grid, kRowThreads, 0, stream>>>(logits, rows, vocab, cap, probs);
  } else {
    LmHeadSoftmaxRowsKernel<P, false>
        <<<grid, kRowThreads, 0, stream>>>(logits, rows, vocab, cap, probs);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCrossEntropyRows(float* logits, int64_t rows, int64_t vocab,
                                   const int32_t* targets, int32_t ignore_index,
                                   float softcap, double* row_loss,
                                   int32_t* row_flag, float loss_scale,
                                   float* d_logits, cudaStream_t stream) {
  return Rows(logits, rows, vocab, targets, ignore_index, softcap, row_loss,
              row_flag, loss_scale, d_logits, stream);
}

cudaError_t LaunchCrossEntropyRows(float* logits, int64_t rows, int64_t vocab,
                                   const int32_t* targets, int32_t ignore_index,
                                   float softcap, double* row_loss,
                                   int32_t* row_flag, float loss_scale,
                                   uint16_t* d_logits, cudaStream_t stream) {
  return Rows(logits, rows, vocab, targets, ignore_index, softcap, row_loss,
              row_flag, loss_scale, d_logits, stream);
}

cudaError_t LaunchLmHeadSoftmaxRows(const float* logits, int64_t rows,
                                    int64_t vocab, float softcap, float* probs,
                                    cudaStream_t stream) {
  return SoftmaxRows(logits, rows, vocab, softcap, probs, stream);
}

cudaError_t LaunchLmHeadSoftmaxRows(const float* logits, int64_t rows,
                                    int64_t vocab, float softcap,
                                    uint16_t* probs, cudaStream_t stream) {
  return SoftmaxRows(logits, rows, vocab, softcap, probs, stream);
}

cudaError_t LaunchCrossEntropyReduce(const double* row_loss,
                                     const int32_t* row_flag, int64_t tokens,
                                     void* result, cudaStream_t stream) {
  CrossEntropyReduceKernel<<<1, kReduceThreads, 0, stream>>>(
      row_loss, row_flag, tokens, static_cast<DeviceResult*>(result));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
