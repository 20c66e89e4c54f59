#ifndef SHARDD_KERNELS_CUDA_ROUTER_H_
#define SHARDD_KERNELS_CUDA_ROUTER_H_

// MoE router on the GPU, the CUDA counterpart of kernels/cpu/router.h with
// the same options and semantics (that header describes the three
// scorings; the per-token selection rules of the two newer ones are the
// CPU's own code, kernels/cpu/router_select.h):
//
//   logits[T, E]  = x[T, D] @ W[E, D]^T (+ b[E])     (cublasGemmEx, fp32 out)
//   kSoftmaxThenTopK (Mixtral, Qwen3):
//     probs[t, :]   = softmax(logits[t, :])
//     indices[t, :] = top-k of probs[t, :], largest first, ties to the lower
//                     expert; an all-NaN row picks experts 0..K-1
//     weights[t, k] = probs[t, indices[t, k]] / max(sum_j probs[t, idx_j],
//                     1e-20), or the probabilities (renormalize false)
//   kTopKThenSoftmax (GPT-OSS): top-k of the logits, softmax over the k;
//     keep_softmax also keeps softmax(logits) [T, E] (RouterSoftmax) for the
//     load-balancing loss (router_aux_loss.h)
//   kSigmoidGroupLimited (DeepSeek-V3): sigmoid scores, group-limited choice
//     steered by a selection-only bias [E] (fp32, no gradient), weights
//     renormalised (+ 1e-20) and multiplied by `scale`
//
// x, W and the bias b are fp32 or bf16 (uint16_t bit patterns; all the
// same type); the logits, probs, weights, d_weights, extra_d_logits and the
// selection bias are fp32; dx has x's type, dW and d_bias are fp32 (ADDED
// to). With bf16 the backward's d_logits are rounded to bf16 before its
// GEMMs and the bias column sums (bf16 storage, fp32 accumulation).
//
// kSoftmaxThenTopK runs one warp per token with the row in registers; the
// two other scorings run the CPU's serial per-token selection in one lane
// of a warp per token (simple first; E and K are small for those models).
//
// Limits: 1 <= E <= 1024 and 1 <= K <= min(E, 32). Device pointers;
// asynchronous on `stream`; the cuBLAS handle is bound to `stream`
// (BindCublasHandle in row_major_gemm.h, which also says how to keep cuBLAS
// itself from allocating). No synchronization and no allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/router_select.h"
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

using ::shardd::kernels::RouterScoring;

// The fields and rules of kernels::RouterDims, with the limits above.
struct RouterDims {
  int64_t tokens = 0;       // T >= 0
  int64_t dim = 0;          // D >= 1
  int64_t experts = 0;      // E in [1, 1024]
  int64_t top_k = 0;        // K in [1, min(E, 32)]
  bool renormalize = true;  // As kernels/cpu/router.h.
  RouterScoring scoring = RouterScoring::kSoftmaxThenTopK;
  // kSigmoidGroupLimited: groups divides E into groups of >= 2 experts,
  // top_groups in [1, groups] with K <= top_groups * E / groups; scale
  // (finite) multiplies the weights (routed_scaling_factor).
  int64_t groups = 1;
  int64_t top_groups = 1;
  float scale = 1.0f;
  // kTopKThenSoftmax: also keep softmax(logits) over all E (RouterSoftmax).
  bool keep_softmax = false;
};

// Device bytes RouterForward saves for RouterBackward (probs or logits
// [T, E] fp32, denom [T] fp32, indices [T, K] int32, and for the two newer
// scorings the selected weights or scores [T, K] fp32): the GPU form of the
// CPU's RouterCache. One per router call whose backward is pending. 0 for
// invalid dims.
size_t RouterSavedBytes(const RouterDims& dims);

// Device scratch RouterBackward needs: d_logits [T, E] in `dtype`. 0 for
// invalid dims.
size_t RouterBackwardWorkspaceBytes(const RouterDims& dims, DType dtype);

// Forward. x: [T, D]; w: [E, D]; indices: [T, K] out; weights: [T, K] out;
// saved: RouterSavedBytes(dims) bytes, aligned to kWorkspaceAlignment.
// Errors: INVALID_ARGUMENT for T < 0, D < 1, E or K out of range, sizes
// beyond int, null pointers with T > 0, a null handle, or a missing, small or
// misaligned `saved`; cuBLAS and launch errors via CublasStatus/CudaStatus.
absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream);
absl::Status RouterForward(const RouterDims& dims, const uint16_t* x,
                           const uint16_t* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream);

// The same with a bias b [E] of x's type added to the logits and the
// selection-only bias [E] fp32 (both null: none; selection_bias only with
// kSigmoidGroupLimited, else INVALID_ARGUMENT, as the CPU).
absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream);
absl::Status RouterForward(const RouterDims& dims, const uint16_t* x,
                           const uint16_t* w, const uint16_t* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream);

// softmax(logits) [T, E] fp32 over all experts in `saved` (device memory
// of a forward with `dims`): kSoftmaxThenTopK's probabilities, or
// kTopKThenSoftmax's with keep_softmax; null otherwise, for invalid dims or
// a null `saved`. Pure pointer arithmetic: the caller orders its reads after
// the forward on the stream.
const float* RouterSoftmax(const RouterDims& dims, const void* saved);

// Backward of the RouterForward that filled `saved` (same dims; the caller
// keeps that pairing, which the device cannot check), given
// d_weights = dL/dweights [T, K] fp32.
//   dx [T, D]: overwritten, or added to when `accumulate_dx`. Null skips it.
//   dw [E, D] fp32: always ADDED to. Null skips it (frozen router; x may then
//     be null too).
// Gradients are of the piecewise-smooth function with the top-k selection
// held fixed, with the CPU kernel's clamped-denominator rule.
// Errors: INVALID_ARGUMENT as the forward, for a required null pointer (w
// for dx, x for dw, d_weights), or a missing, small or misaligned `saved` or
// workspace; cuBLAS and launch errors via CublasStatus/CudaStatus.
absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, float* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream);
absl::Status RouterBackward(const RouterDims& dims, const uint16_t* x,
                            const uint16_t* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, uint16_t* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream);

// The same with extra_d_logits [T, E] fp32 (null: none) added to dL/dlogits
// before dx, dW and d_bias are formed (the load-balancing loss's gradient,
// router_aux_loss.h), and d_bias [E] fp32 += dL/db (null skips it).
absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const float* extra_d_logits, const void* saved,
                            size_t saved_bytes, float* dx, bool accumulate_dx,
                            float* dw, float* d_bias, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream);
absl::Status RouterBackward(const RouterDims& dims, const uint16_t* x,
                            const uint16_t* w, const float* d_weights,
                            const float* extra_d_logits, const void* saved,
                            size_t saved_bytes, uint16_t* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            void* workspace, size_t workspace_bytes,
                            cublasHandle_t handle, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_H_
