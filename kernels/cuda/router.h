#ifndef SHARDD_KERNELS_CUDA_ROUTER_H_
#define SHARDD_KERNELS_CUDA_ROUTER_H_

// MoE router on the GPU, the CUDA counterpart of kernels/cpu/router.h with
// the same semantics:
//
//   logits[T, E]  = x[T, D] @ W[E, D]^T              (cublasGemmEx, fp32 out)
//   probs[t, :]   = softmax(logits[t, :])
//   indices[t, :] = top-k of probs[t, :], largest first, ties to the lower
//                   expert; an all-NaN row picks experts 0..K-1
//   weights[t, k] = probs[t, indices[t, k]] / max(sum_j probs[t, idx_j], 1e-20)
//
// x and W are fp32 or bf16 (uint16_t bit patterns; both the same type); the
// logits, probs, weights and d_weights are fp32; dx has x's type and dW is
// fp32. With bf16 the backward's d_logits are rounded to bf16 before its
// GEMMs (bf16 storage, fp32 accumulation).
//
// Limits: 1 <= E <= 1024 and 1 <= K <= min(E, 32) (one warp per token holds
// the row in registers). Device pointers; asynchronous on `stream`; the
// cuBLAS handle is bound to `stream` (BindCublasHandle in row_major_gemm.h,
// which also says how to keep cuBLAS itself from allocating). No
// synchronization and no allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

struct RouterDims {
  int64_t tokens = 0;       // T >= 0
  int64_t dim = 0;          // D >= 1
  int64_t experts = 0;      // E in [1, 1024]
  int64_t top_k = 0;        // K in [1, min(E, 32)]
  bool renormalize = true;  // As kernels/cpu/router.h.
};

// Device bytes RouterForward saves for RouterBackward (probs [T, E] fp32,
// denom [T] fp32, indices [T, K] int32): the GPU form of the CPU's
// RouterCache. One per router call whose backward is pending. 0 for invalid
// dims.
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

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_H_
