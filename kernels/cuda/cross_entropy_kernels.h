#ifndef SHARDD_KERNELS_CUDA_CROSS_ENTROPY_KERNELS_H_
#define SHARDD_KERNELS_CUDA_CROSS_ENTROPY_KERNELS_H_

// Launchers of the cross-entropy and LM-head softmax row kernels
// (cross_entropy_kernels.cu); the GEMMs, the block loop and argument checks
// are in cross_entropy.cc.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// Row flags written per token.
inline constexpr int32_t kCeRowIgnored = 0;
inline constexpr int32_t kCeRowCounted = 1;
inline constexpr int32_t kCeRowInvalid = 2;

// For `rows` rows of logits [rows, vocab] (fp32) with targets [rows]: the
// per-row loss (double) and flag. With a non-null d_logits ([rows, vocab],
// fp32 -- it may be `logits` itself -- or bf16) also writes
//   d_logits = loss_scale * (softmax - onehot(target)), 0 for ignored or
// invalid rows. softcap > 0 first caps each logit, y = cap * tanh(x / cap),
// and multiplies the gradient by dy/dx = 1 - (y / cap)^2 (the logits buffer
// keeps the uncapped values). rows >= 1, vocab >= 1, softcap >= 0.
cudaError_t LaunchCrossEntropyRows(float* logits, int64_t rows, int64_t vocab,
                                   const int32_t* targets, int32_t ignore_index,
                                   float softcap, double* row_loss,
                                   int32_t* row_flag, float loss_scale,
                                   float* d_logits, cudaStream_t stream);
cudaError_t LaunchCrossEntropyRows(float* logits, int64_t rows, int64_t vocab,
                                   const int32_t* targets, int32_t ignore_index,
                                   float softcap, double* row_loss,
                                   int32_t* row_flag, float loss_scale,
                                   uint16_t* d_logits, cudaStream_t stream);

// probs[r, :] = softmax(softcap(logits[r, :])) for `rows` rows of fp32
// logits [rows, vocab] (softcap 0: none): fp32 cap, max and exp, the row sum
// in double, each exp(y - max) / sum rounded to float and then stored as
// fp32 or bf16 (round to nearest even). rows >= 1, vocab >= 1,
// softcap >= 0.
cudaError_t LaunchLmHeadSoftmaxRows(const float* logits, int64_t rows,
                                    int64_t vocab, float softcap, float* probs,
                                    cudaStream_t stream);
cudaError_t LaunchLmHeadSoftmaxRows(const float* logits, int64_t rows,
                                    int64_t vocab, float softcap,
                                    uint16_t* probs, cudaStream_t stream);

// Sums row_loss and counts the flags of `tokens` rows (tokens >= 0) in a
// fixed order and writes {loss_sum, count, invalid_targets, mean_loss} to
// the device struct at `result` (laid out as CrossEntropyDeviceResult).
cudaError_t LaunchCrossEntropyReduce(const double* row_loss,
                                     const int32_t* row_flag, int64_t tokens,
                                     void* result, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_CROSS_ENTROPY_KERNELS_H_
