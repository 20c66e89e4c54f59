#ifndef SHARDD_KERNELS_CUDA_MUON_H_
#define SHARDD_KERNELS_CUDA_MUON_H_

// Muon's pieces on the GPU, the device counterparts of kernels/cpu/muon.h:
// the element-wise momentum, Nesterov update and decoupled step are the CPU
// kernel's own functions (kernels/cpu/muon_element.h, each operation
// rounded once), so they give the CPU's bits; Newton-Schulz runs the same
// quintic with cuBLAS GEMMs in fp32 (CUBLAS_COMPUTE_32F_PEDANTIC, never
// TF32), its Frobenius norm summed in double on the device. fp32 device
// buffers; asynchronous on `stream`; no synchronization and no allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// momentum[i] = beta * momentum[i] + (1 - beta) * grad[i].
// Errors: INVALID_ARGUMENT for n < 0, beta outside [0, 1), null pointers
// with n > 0; launch errors via CudaStatus.
absl::Status MuonMomentumStep(const float* grad, float* momentum, int64_t n,
                              float beta, cudaStream_t stream);

// out[i] = (1 - beta) * grad[i] + beta * m_new[i], m_new as
// MuonMomentumStep computes it; momentum is not written. Errors as
// MuonMomentumStep.
absl::Status MuonNesterovUpdate(const float* grad, const float* momentum,
                                int64_t n, float beta, float* out,
                                cudaStream_t stream);

// param[i] = param[i] * (1 - lr * wd) - lr * update[i] (factors rounded to
// fp32 once, on the host). Errors: INVALID_ARGUMENT for n < 0, lr or wd
// negative or not finite, null pointers with n > 0; launch errors.
absl::Status MuonApply(float* param, const float* update, int64_t n,
                       double lr, double weight_decay, cudaStream_t stream);

// x[i] *= scale: the shape scale of an orthogonalised update, rounded as
// kernels::ScaleInPlace. Errors: INVALID_ARGUMENT for n < 0, a scale that
// is not finite, null x with n > 0; launch errors.
absl::Status MuonScale(float* x, int64_t n, float scale, cudaStream_t stream);

// Device scratch NewtonSchulz needs for a rows x cols matrix: the CPU's
// NewtonSchulzWorkspace floats, the norm's double and its partial sums.
size_t NewtonSchulzWorkspaceBytes(int64_t rows, int64_t cols);

// x (rows x cols, row-major) becomes its Newton-Schulz orthogonalisation,
// as kernels/cpu/muon.h's NewtonSchulz: transposed when rows > cols,
// divided by ||X||_F + 1e-7, `steps` times A = X X^T, B = b A + c A A,
// X = a X + B X, transposed back. The handle is bound to `stream`.
// Errors: INVALID_ARGUMENT for rows or cols < 1 or beyond a cuBLAS int,
// steps outside [1, 100], a null handle, x or workspace, or a workspace
// smaller than NewtonSchulzWorkspaceBytes; CUDA and cuBLAS errors.
absl::Status NewtonSchulz(cublasHandle_t handle, float* x, int64_t rows,
                          int64_t cols, int steps, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_MUON_H_
