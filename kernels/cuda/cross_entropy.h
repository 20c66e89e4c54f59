#ifndef SHARDD_KERNELS_CUDA_CROSS_ENTROPY_H_
#define SHARDD_KERNELS_CUDA_CROSS_ENTROPY_H_

// LM head fused with cross-entropy on the GPU, the CUDA counterpart of
// kernels/cpu/cross_entropy.h (same formulas, ignore_index and loss_scale
// conventions):
//
//   logits[t, :] = hidden[t, :] @ weight^T     hidden [T, D], weight [V, D]
//   loss_t       = logsumexp(logits[t, :]) - logits[t, targets[t]]
//
// With options.softcap = c > 0 the logits are first soft-capped (Gemma's
// final_logit_softcapping), y = c * tanh(x / c) in fp32, and the logits
// gradient is multiplied by dy/dx = 1 - (y / c)^2, as kernels/cpu does.
//
// Rows are processed in blocks of `block_rows`: per block one cublasGemmEx
// writes fp32 logits [block_rows, V] into the workspace, one kernel computes
// each row's log-sum-exp by an online softmax (fp32 max and sum, log and
// loss in double) and, for the backward, the logits gradient; the backward
// GEMMs follow. Memory is bounded by block_rows * V, independent of T.
//
// hidden, weight and dhidden are fp32 or bf16 (uint16_t bit patterns, one
// type per call); logits, the softmax and loss are fp32/double; dweight is
// fp32. With bf16 the logits gradient is rounded to bf16 before the backward
// GEMMs (bf16 storage, fp32 accumulation).
//
// Targets live on the device: a target that is neither ignore_index nor in
// [0, V) cannot fail the call without a synchronization, so it is counted in
// `invalid_targets` of the result and contributes neither loss nor gradient;
// callers treat a non-zero count as the CPU path's INVALID_ARGUMENT.
//
// The result goes to device memory (no host synchronization); the per-row
// losses are summed in double in a fixed order, so it is deterministic.
// Asynchronous on `stream`; the cuBLAS handle is bound to it
// (BindCublasHandle, row_major_gemm.h); no allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

inline constexpr int64_t kDefaultCudaCrossEntropyBlockRows = 256;

struct CrossEntropyDims {
  int64_t tokens = 0;  // T >= 0
  int64_t dim = 0;     // D >= 1
  int64_t vocab = 0;   // V >= 1
};

struct CudaCrossEntropyOptions {
  // Targets equal to this are skipped (any value; usually -1 or -100).
  int32_t ignore_index = -1;
  // Rows per logits block (>= 1); scratch is about block_rows * V * 4 bytes
  // (* 6 with bf16 gradients).
  int64_t block_rows = kDefaultCudaCrossEntropyBlockRows;
  // > 0: logits are soft-capped, softcap * tanh(logits / softcap), before
  // the softmax; 0: not. Finite and >= 0.
  float softcap = 0.0f;
};

// Written (not added to) by every call, in device memory.
struct CrossEntropyDeviceResult {
  double loss_sum = 0.0;        // sum over counted tokens of the loss
  int64_t count = 0;            // targets that are not ignore_index
                                // (and valid)
  int64_t invalid_targets = 0;  // targets outside [0, V), not ignore_index
  double mean_loss = 0.0;       // loss_sum / count, 0 when count == 0
};

// Device workspace of a forward (with_grad false) or backward (true) with
// these arguments. 0 for invalid arguments.
size_t CrossEntropyWorkspaceBytes(const CrossEntropyDims& dims, DType dtype,
                                  const CudaCrossEntropyOptions& options,
                                  bool with_grad);

// Forward only. hidden [T, D], weight [V, D], targets [T] (device int32);
// result: device CrossEntropyDeviceResult.
// Errors: INVALID_ARGUMENT for T < 0, D or V < 1, sizes beyond int,
// block_rows < 1, a negative or non-finite softcap, null pointers (hidden,
// weight and targets only with T > 0), a null handle, or a missing, small
// or misaligned workspace; cuBLAS and launch errors via
// CublasStatus/CudaStatus.
absl::Status LmHeadCrossEntropyForward(
    const CrossEntropyDims& dims, const float* hidden, const float* weight,
    const int32_t* targets, CrossEntropyDeviceResult* result, void* workspace,
    size_t workspace_bytes, const CudaCrossEntropyOptions& options,
    cublasHandle_t handle, cudaStream_t stream);
absl::Status LmHeadCrossEntropyForward(
    const CrossEntropyDims& dims, const uint16_t* hidden,
    const uint16_t* weight, const int32_t* targets,
    CrossEntropyDeviceResult* result, void* workspace, size_t workspace_bytes,
    const CudaCrossEntropyOptions& options, cublasHandle_t handle,
    cudaStream_t stream);

// Forward and backward in one sweep; writes the same result. Gradients are
// of loss_scale * loss_sum (see kernels/cpu/cross_entropy.h for choosing
// loss_scale):
//   dhidden [T, D]: ACTIVATION gradient, overwritten (added to when
//     `accumulate_dhidden`); null to skip.
//   dweight [V, D] fp32: PARAMETER gradient, ADDED to; null to skip.
// Errors: as the forward, plus INVALID_ARGUMENT for a non-finite loss_scale.
absl::Status LmHeadCrossEntropyBackward(
    const CrossEntropyDims& dims, const float* hidden, const float* weight,
    const int32_t* targets, float loss_scale, float* dhidden, float* dweight,
    bool accumulate_dhidden, CrossEntropyDeviceResult* result, void* workspace,
    size_t workspace_bytes, const CudaCrossEntropyOptions& options,
    cublasHandle_t handle, cudaStream_t stream);
absl::Status LmHeadCrossEntropyBackward(
    const CrossEntropyDims& dims, const uint16_t* hidden,
    const uint16_t* weight, const int32_t* targets, float loss_scale,
    uint16_t* dhidden, float* dweight, bool accumulate_dhidden,
    CrossEntropyDeviceResult* result, void* workspace, size_t workspace_bytes,
    const CudaCrossEntropyOptions& options, cublasHandle_t handle,
    cudaStream_t stream);

// LM-head softmax for DiffusionGemma's self-conditioning:
//   probs[t, :] = softmax(softcap(hidden[t, :] @ weight^T))
// (softcap as options.softcap; 0: none), written in the storage type of
// hidden (fp32 or bf16, rounded to nearest even). fp32 logits, cap, max and
// exp; the row sum in double; each probability exp(y - max) / sum rounded
// to float, as the CPU model computes it. Blocked by options.block_rows like
// the loss (workspace: block_rows x V fp32 logits); ignore_index is unused.
// No allocation; asynchronous on `stream`.

// Device workspace of LmHeadSoftmax (the dtype does not change it: the
// logits are fp32). 0 for invalid arguments or T = 0.
size_t LmHeadSoftmaxWorkspaceBytes(const CrossEntropyDims& dims, DType dtype,
                                   const CudaCrossEntropyOptions& options);

// hidden [T, D], weight [V, D], probs [T, V] (overwritten).
// Errors: INVALID_ARGUMENT for T < 0, D or V < 1, sizes beyond int,
// block_rows < 1, a negative or non-finite softcap, null hidden, weight or
// probs with T > 0, a null handle, or a missing, small or misaligned
// workspace (T > 0); cuBLAS and launch errors via CublasStatus/CudaStatus.
// With T = 0 nothing is launched (the options are still checked).
absl::Status LmHeadSoftmax(const CrossEntropyDims& dims, const float* hidden,
                           const float* weight, float* probs, void* workspace,
                           size_t workspace_bytes,
                           const CudaCrossEntropyOptions& options,
                           cublasHandle_t cublas, cudaStream_t stream);
absl::Status LmHeadSoftmax(const CrossEntropyDims& dims, const uint16_t* hidden,
                           const uint16_t* weight, uint16_t* probs,
                           void* workspace, size_t workspace_bytes,
                           const CudaCrossEntropyOptions& options,
                           cublasHandle_t cublas, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_CROSS_ENTROPY_H_
