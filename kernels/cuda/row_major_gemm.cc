#include "kernels/cuda/row_major_gemm.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

cudaDataType_t CublasType(DType dtype) {
  return dtype == DType::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
}

// fp32 inputs compute in PEDANTIC fp32: never TF32, whatever the handle's
// math mode, so fp32 storage means fp32 arithmetic.
cublasComputeType_t ComputeType(DType inputs) {
  return inputs == DType::kFloat32 ? CUBLAS_COMPUTE_32F_PEDANTIC
                                   : CUBLAS_COMPUTE_32F;
}

}  // namespace

absl::Status BindCublasHandle(cublasHandle_t handle, cudaStream_t stream,
                              absl::string_view what) {
  if (handle == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cuBLAS handle is null"));
  }
  // cublasSetStream also resets a workspace given by cublasSetWorkspace, so
  // only call it when the stream actually changes.
  cudaStream_t current_stream = nullptr;
  SHARDD_RETURN_IF_ERROR(
      CublasStatus(cublasGetStream(handle, &current_stream), what));
  if (current_stream != stream) {
    SHARDD_RETURN_IF_ERROR(CublasStatus(cublasSetStream(handle, stream), what));
  }
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_HOST;
  SHARDD_RETURN_IF_ERROR(
      CublasStatus(cublasGetPointerMode(handle, &mode), what));
  if (mode != CUBLAS_POINTER_MODE_HOST) {
    SHARDD_RETURN_IF_ERROR(CublasStatus(
        cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST), what));
  }
  return absl::OkStatus();
}

absl::Status RowMajorGemm(cublasHandle_t handle, int64_t m, int64_t n,
                          int64_t k, float alpha, const GemmOperand& a,
                          const GemmOperand& b, float beta, void* c,
                          DType c_dtype, int64_t ldc, absl::string_view what) {
  if (m < 0 || n < 0 || k < 0 || m > kMaxInt || n > kMaxInt || k > kMaxInt) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": GEMM sizes must be in [0, ", kMaxInt,
                     "], got m=", m, " n=", n, " k=", k));
  }
  if (a.dtype != b.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": GEMM operands must share a dtype, got A ",
                     DTypeName(a.dtype), " and B ", DTypeName(b.dtype)));
  }
  // Stored row lengths: A is [m, k] or [k, m], B is [k, n] or [n, k].
  const int64_t a_row = a.transpose ? m : k;
  const int64_t b_row = b.transpose ? k : n;
  if (a.ld < std::max<int64_t>(a_row, 1) ||
      b.ld < std::max<int64_t>(b_row, 1) || ldc < std::max<int64_t>(n, 1) ||
      a.ld > kMaxInt || b.ld > kMaxInt || ldc > kMaxInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": GEMM leading dimensions too small or too large: lda=", a.ld,
        " (row ", a_row, ") ldb=", b.ld, " (row ", b_row, ") ldc=", ldc,
        " (row ", n, ")"));
  }
  if (m == 0 || n == 0) return absl::OkStatus();
  if (c == nullptr || (k > 0 && (a.data == nullptr || b.data == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": GEMM A, B and C must be non-null"));
  }
  if (handle == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cuBLAS handle is null"));
  }
  // Row-major C[m, n] is column-major C^T[n, m] = op(B)^T op(A)^T, and a
  // row-major stored matrix is its own transpose in column-major, so the
  // operands swap and keep their transpose flags.
  return CublasStatus(
      cublasGemmEx(handle, b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N,
                   a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                   static_cast<int>(m), static_cast<int>(k), &alpha, b.data,
                   CublasType(b.dtype), static_cast<int>(b.ld), a.data,
                   CublasType(a.dtype), static_cast<int>(a.ld), &beta, c,
                   CublasType(c_dtype), static_cast<int>(ldc),
                   ComputeType(a.dtype), CUBLAS_GEMM_DEFAULT),
      what);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
