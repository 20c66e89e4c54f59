#include "kernels/cuda/muon.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/muon.h"
#include "kernels/cpu/muon_element.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/muon_kernels.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
// The transpose's grid: (dim + 31) / 32 blocks along y, at most 65535.
constexpr int64_t kMaxTransposeRows = int64_t{65535} * 32;

absl::Status CheckBeta(float beta, const char* op) {
  if (!(beta >= 0.0f && beta < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": beta must be in [0, 1), got ", beta));
  }
  return absl::OkStatus();
}

// Workspace layout: X, next (r x c each), A, B (r x r each), then the
// norm's double and SumOfSquares' scratch, each region 256-byte aligned.
struct Layout {
  size_t next, a, b, sum, scratch, scratch_bytes, total;
};

Layout LayoutFor(int64_t rows, int64_t cols) {
  const int64_t r = std::min(rows, cols), c = std::max(rows, cols);
  const size_t rc = static_cast<size_t>(r * c) * sizeof(float);
  const size_t rr = static_cast<size_t>(r * r) * sizeof(float);
  Layout l;
  l.next = AlignWorkspaceBytes(rc);
  l.a = l.next + AlignWorkspaceBytes(rc);
  l.b = l.a + AlignWorkspaceBytes(rr);
  l.sum = l.b + AlignWorkspaceBytes(rr);
  l.scratch = l.sum + AlignWorkspaceBytes(sizeof(double));
  l.scratch_bytes = SumOfSquaresWorkspaceBytes(r * c);
  l.total = l.scratch + AlignWorkspaceBytes(l.scratch_bytes);
  return l;
}

GemmOperand Operand(const float* data, int64_t ld, bool transpose) {
  GemmOperand o;
  o.data = data;
  o.ld = ld;
  o.transpose = transpose;
  return o;
}

}  // namespace

absl::Status MuonMomentumStep(const float* grad, float* momentum, int64_t n,
                              float beta, cudaStream_t stream) {
  constexpr const char* kOp = "cuda MuonMomentumStep";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxInt64, "n", kOp));
  SHARDD_RETURN_IF_ERROR(CheckBeta(beta, kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(grad, "grad", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(momentum, "momentum", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchMuonMomentum(grad, momentum, n, beta, nullptr, stream), kOp);
  return absl::OkStatus();
}

absl::Status MuonNesterovUpdate(const float* grad, const float* momentum,
                                int64_t n, float beta, float* out,
                                cudaStream_t stream) {
  constexpr const char* kOp = "cuda MuonNesterovUpdate";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxInt64, "n", kOp));
  SHARDD_RETURN_IF_ERROR(CheckBeta(beta, kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(grad, "grad", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(momentum, "momentum", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(out, "out", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchMuonMomentum(grad, const_cast<float*>(momentum), n, beta, out,
                         stream),
      kOp);
  return absl::OkStatus();
}

absl::Status MuonApply(float* param, const float* update, int64_t n, double lr,
                       double weight_decay, cudaStream_t stream) {
  constexpr const char* kOp = "cuda MuonApply";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxInt64, "n", kOp));
  if (!(lr >= 0) || !std::isfinite(lr) || !(weight_decay >= 0) ||
      !std::isfinite(weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": lr and weight_decay must be finite and >= 0, got ",
                     lr, " and ", weight_decay));
  }
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(param, "param", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(update, "update", kOp));
  const MuonApplyScalars s = MuonApplyScalarsFor(lr, weight_decay);
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchMuonApply(param, update, n, s.decay, s.step, stream), kOp);
  return absl::OkStatus();
}

absl::Status MuonScale(float* x, int64_t n, float scale, cudaStream_t stream) {
  constexpr const char* kOp = "cuda MuonScale";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxInt64, "n", kOp));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": scale must be finite, got ", scale));
  }
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchMuonScale(x, n, scale, stream), kOp);
  return absl::OkStatus();
}

size_t NewtonSchulzWorkspaceBytes(int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1) return 0;
  return LayoutFor(rows, cols).total;
}

absl::Status NewtonSchulz(cublasHandle_t handle, float* x, int64_t rows,
                          int64_t cols, int steps, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kOp = "cuda NewtonSchulz";
  SHARDD_RETURN_IF_ERROR(CheckInRange(rows, 1, kMaxInt, "rows", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(cols, 1, kMaxInt, "cols", kOp));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(rows * cols, 1, kMaxInt, "rows * cols", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(std::max(rows, cols), 1,
                                      kMaxTransposeRows,
                                      "the larger of rows and cols", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(steps, 1, 100, "steps", kOp));
  if (handle == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": handle is null"));
  }
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  const Layout l = LayoutFor(rows, cols);
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes, l.total, kOp));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, kOp));

  const bool transpose = rows > cols;
  const int64_t r = std::min(rows, cols), c = std::max(rows, cols);
  char* base = static_cast<char*>(workspace);
  float* X = reinterpret_cast<float*>(base);
  float* next = reinterpret_cast<float*>(base + l.next);
  float* A = reinterpret_cast<float*>(base + l.a);
  float* B = reinterpret_cast<float*>(base + l.b);
  double* sum = reinterpret_cast<double*>(base + l.sum);
  const size_t rc_bytes = static_cast<size_t>(r * c) * sizeof(float);
  const size_t rr_bytes = static_cast<size_t>(r * r) * sizeof(float);

  // The wide orientation: X is r x c with r <= c.
  if (transpose) {
    SHARDD_CUDA_RETURN_IF_ERROR(LaunchTranspose(x, rows, cols, X, stream), kOp);
  } else {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(X, x, rc_bytes, cudaMemcpyDeviceToDevice, stream), kOp);
  }
  SHARDD_RETURN_IF_ERROR(SumOfSquares(X, r * c, sum, /*accumulate=*/false,
                                      base + l.scratch, l.scratch_bytes,
                                      stream));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchMuonNormalize(X, r * c, sum, kNewtonSchulzEps, stream), kOp);
  for (int s = 0; s < steps; ++s) {
    // A = X X^T.
    SHARDD_RETURN_IF_ERROR(
        RowMajorGemm(handle, r, r, c, 1.0f, Operand(X, c, false),
                     Operand(X, c, true), 0.0f, A, DType::kFloat32, r, kOp));
    // B = b A + c A A.
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(B, A, rr_bytes, cudaMemcpyDeviceToDevice, stream), kOp);
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, r, r, r, kNewtonSchulzC, Operand(A, r, false),
        Operand(A, r, false), kNewtonSchulzB, B, DType::kFloat32, r, kOp));
    // X = a X + B X.
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(next, X, rc_bytes, cudaMemcpyDeviceToDevice, stream),
        kOp);
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, r, c, r, 1.0f, Operand(B, r, false), Operand(X, c, false),
        kNewtonSchulzA, next, DType::kFloat32, c, kOp));
    std::swap(X, next);
  }
  if (transpose) {
    SHARDD_CUDA_RETURN_IF_ERROR(LaunchTranspose(X, r, c, x, stream), kOp);
  } else {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(x, X, rc_bytes, cudaMemcpyDeviceToDevice, stream), kOp);
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
