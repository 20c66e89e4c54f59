#ifndef SHARDD_KERNELS_CUDA_DENSE_MLP_H_
#define SHARDD_KERNELS_CUDA_DENSE_MLP_H_

// Dense gated MLP (SwiGLU / GeGLU) on the GPU, the CUDA counterpart of
// kernels/cpu/dense_mlp.h with the HF (out, in) weight layout:
//
//   G = x @ gate_proj^T, U = x @ up_proj^T      [T, I]   (cublasGemmEx)
//   A = act(G) * U                              [T, I]   (fused kernel)
//   y = A @ down_proj^T                         [T, D]   (cublasGemmEx)
//
// x, the weights, y, dy, dx and the saved G and U are fp32 or bf16 (uint16_t
// bit patterns, one type per call); the weight gradients are fp32. GEMMs
// accumulate in fp32; with bf16, G, U, A and the intermediate gradients are
// stored in bf16 between kernels (bf16 storage, fp32 accumulation).
//
// Unlike the CPU workspace, the saved state holds only G and U (A is
// recomputed in the backward) and the caller passes x again to the
// backward. Device pointers; asynchronous on `stream`; the cuBLAS handle is
// bound to it; no synchronization or allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/grouped_experts.h"  // GatedActivation
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

// The gate's activation: the CPU kernels' enum (SwiGLU or GeGLU), named
// in full so that grouped_experts.h's enum of the same name in this
// namespace never shadows it.
using DenseActivation = ::shardd::kernels::GatedActivation;

struct DenseMlpDims {
  int64_t tokens = 0;        // T >= 0
  int64_t dim = 0;           // D >= 1
  int64_t intermediate = 0;  // I >= 1
};

// Saved by the forward for the backward: G and U, [T, I] each, in `dtype`.
// 0 for invalid dims.
size_t DenseMlpSavedBytes(const DenseMlpDims& dims, DType dtype);
// Forward scratch: A [T, I] in `dtype`.
size_t DenseMlpForwardWorkspaceBytes(const DenseMlpDims& dims, DType dtype);
// Backward scratch: A, dA/dU and dG, [T, I] each, in `dtype`.
size_t DenseMlpBackwardWorkspaceBytes(const DenseMlpDims& dims, DType dtype);

// Forward. x [T, D]; gate_proj, up_proj [I, D]; down_proj [D, I]; y [T, D]
// overwritten, or added to when `accumulate_y`. Writes G and U to `saved`.
// Errors: INVALID_ARGUMENT for T < 0, D or I < 1, sizes beyond int, an
// unknown activation, null pointers with T > 0, a null handle, or a missing,
// small or misaligned saved buffer or workspace; cuBLAS and launch errors via
// CublasStatus/CudaStatus.
absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             DenseActivation activation, const float* x,
                             const float* gate_proj, const float* up_proj,
                             const float* down_proj, float* y,
                             bool accumulate_y, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes,
                             cublasHandle_t handle, cudaStream_t stream);
absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             DenseActivation activation, const uint16_t* x,
                             const uint16_t* gate_proj, const uint16_t* up_proj,
                             const uint16_t* down_proj, uint16_t* y,
                             bool accumulate_y, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes,
                             cublasHandle_t handle, cudaStream_t stream);

// Backward of the forward that filled `saved` (same dims, activation, x and
// weights; the device cannot check the pairing). dy [T, D].
//   dx [T, D]: overwritten, or added to when `accumulate_dx` (with bf16 it
//     is rounded after each of its two GEMMs).
//   d_gate_proj, d_up_proj [I, D], d_down_proj [D, I]: fp32, ADDED to.
// Any output may be null to skip it. x is needed for d_gate_proj/d_up_proj,
// gate_proj and up_proj for dx, down_proj for anything but d_down_proj.
// Errors: as the forward.
absl::Status DenseMlpBackward(const DenseMlpDims& dims,
                              DenseActivation activation, const float* x,
                              const float* gate_proj, const float* up_proj,
                              const float* down_proj, const float* dy,
                              const void* saved, size_t saved_bytes, float* dx,
                              bool accumulate_dx, float* d_gate_proj,
                              float* d_up_proj, float* d_down_proj,
                              void* workspace, size_t workspace_bytes,
                              cublasHandle_t handle, cudaStream_t stream);
absl::Status DenseMlpBackward(
    const DenseMlpDims& dims, DenseActivation activation, const uint16_t* x,
    const uint16_t* gate_proj, const uint16_t* up_proj,
    const uint16_t* down_proj, const uint16_t* dy, const void* saved,
    size_t saved_bytes, uint16_t* dx, bool accumulate_dx, float* d_gate_proj,
    float* d_up_proj, float* d_down_proj, void* workspace,
    size_t workspace_bytes, cublasHandle_t handle, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_DENSE_MLP_H_
