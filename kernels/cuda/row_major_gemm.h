#ifndef SHARDD_KERNELS_CUDA_ROW_MAJOR_GEMM_H_
#define SHARDD_KERNELS_CUDA_ROW_MAJOR_GEMM_H_

// Row-major GEMM on cuBLAS (which is column-major), for the CUDA ops:
//
//   C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C[m, n]
//
// with op(X) = X or X^T and leading dimensions in elements of the row-major
// layout (the row length of the stored matrix). Inputs are fp32 or bf16 (both
// the same type); C is fp32 or bf16; arithmetic is fp32: fp32 inputs run in
// CUBLAS_COMPUTE_32F_PEDANTIC (never TF32, whatever the handle's math mode),
// bf16 inputs in CUBLAS_COMPUTE_32F.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

struct GemmOperand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t ld = 0;  // row length of the stored (row-major) matrix
  bool transpose = false;
};

// Points `handle` at `stream` and host pointer mode (alpha and beta are host
// scalars), touching each setting only if it differs. Every op that runs
// cuBLAS calls this first and leaves the handle so. cublasSetStream resets a
// workspace given by cublasSetWorkspace: to keep cuBLAS from allocating,
// set the stream first, then the workspace; ops on that stream keep both.
// Errors: INVALID_ARGUMENT for a null handle; cuBLAS errors via CublasStatus.
absl::Status BindCublasHandle(cublasHandle_t handle, cudaStream_t stream,
                              absl::string_view what);

// Runs on the handle's current stream (the ops set it first). m, n or k of 0
// is a no-op except that k == 0 scales C by beta, as in BLAS.
// Errors: INVALID_ARGUMENT (prefixed with `what`) for negative or
// int-overflowing sizes, a leading dimension smaller than the stored row,
// A and B of different dtypes, or null pointers; cuBLAS errors via
// CublasStatus.
absl::Status RowMajorGemm(cublasHandle_t handle, int64_t m, int64_t n,
                          int64_t k, float alpha, const GemmOperand& a,
                          const GemmOperand& b, float beta, void* c,
                          DType c_dtype, int64_t ldc, absl::string_view what);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROW_MAJOR_GEMM_H_
