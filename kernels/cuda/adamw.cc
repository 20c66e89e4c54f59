#include "kernels/cuda/adamw.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/adamw_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/op_checks.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxN = std::numeric_limits<int64_t>::max() / 16;

}  // namespace

absl::Status AdamWStep(float* param, const float* grad, float* exp_avg,
                       float* exp_avg_sq, int64_t n, int64_t step,
                       const AdamWConfig& config, const float* grad_scale,
                       uint16_t* param_bf16, cudaStream_t stream) {
  constexpr const char* kOp = "cuda AdamWStep";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxN, "n", kOp));
  // The CPU kernel's checks and scalar arithmetic (double, then fp32).
  SHARDD_ASSIGN_OR_RETURN(const AdamWScalars s,
                          AdamWScalarsFor(config, step, kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(param, "param", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(grad, "grad", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(exp_avg, "exp_avg", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(exp_avg_sq, "exp_avg_sq", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchAdamW(param, grad, exp_avg, exp_avg_sq, n,
                                          s, grad_scale, param_bf16, stream),
                              kOp);
  return absl::OkStatus();
}

size_t SumOfSquaresWorkspaceBytes(int64_t n) {
  if (n < 1) return 0;
  return AlignWorkspaceBytes(static_cast<size_t>(SumOfSquaresPartials(n)) *
                             sizeof(double));
}

absl::Status SumOfSquares(const float* x, int64_t n, double* result,
                          bool accumulate, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kOp = "cuda SumOfSquares";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxN, "n", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(result, "result", kOp));
  if (n == 0) {
    if (!accumulate) {
      SHARDD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(result, 0, sizeof(double), stream), kOp);
    }
    return absl::OkStatus();
  }
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckWorkspace(workspace, workspace_bytes,
                                        SumOfSquaresWorkspaceBytes(n), kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchSumOfSquares(x, n, static_cast<double*>(workspace), result,
                         accumulate, stream),
      kOp);
  return absl::OkStatus();
}

absl::Status ScaleInPlace(float* x, int64_t n, const float* scale,
                          cudaStream_t stream) {
  constexpr const char* kOp = "cuda ScaleInPlace";
  SHARDD_RETURN_IF_ERROR(CheckInRange(n, 0, kMaxN, "n", kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(scale, "scale", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchScaleByDevice(x, n, scale, stream), kOp);
  return absl::OkStatus();
}

absl::Status ClipCoefficientFromSumOfSquares(const double* sum_of_squares,
                                             double max_norm,
                                             float* coefficient,
                                             double* total_norm,
                                             cudaStream_t stream) {
  constexpr const char* kOp = "cuda ClipCoefficientFromSumOfSquares";
  SHARDD_RETURN_IF_ERROR(CheckNotNull(sum_of_squares, "sum_of_squares", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(coefficient, "coefficient", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchClipCoefficient(sum_of_squares, max_norm, coefficient, total_norm,
                            stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
