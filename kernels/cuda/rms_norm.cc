#include "kernels/cuda/rms_norm.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/rms_norm_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();

absl::Status ValidateShape(int64_t rows, int64_t dim, const char* op) {
  SHARDD_RETURN_IF_ERROR(CheckInRange(rows, 0, kMaxSize, "rows", op));
  return CheckInRange(dim, 1, kMaxSize, "dim", op);
}

template <typename T>
absl::Status Forward(const T* x, const T* weight, int64_t rows, int64_t dim,
                     float eps, T* y, float* inv_rms, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RmsNormForward";
  SHARDD_RETURN_IF_ERROR(ValidateShape(rows, dim, kOp));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": eps must be finite and >= 0, got ", eps));
  }
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(weight, "weight", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(y, "y", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(inv_rms, "inv_rms", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRmsNormForward(x, weight, rows, dim, eps, y, inv_rms, stream), kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const T* dy, const T* x, const T* weight,
                      const float* inv_rms, int64_t rows, int64_t dim, T* dx,
                      bool accumulate_dx, float* dweight, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RmsNormBackward";
  SHARDD_RETURN_IF_ERROR(ValidateShape(rows, dim, kOp));
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(dy, "dy", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(weight, "weight", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(inv_rms, "inv_rms", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(dx, "dx", kOp));
  if (dweight != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        CheckWorkspace(workspace, workspace_bytes,
                       RmsNormBackwardWorkspaceBytes(rows, dim), kOp));
  }
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRmsNormBackward(dy, x, weight, inv_rms, rows, dim, dx,
                            accumulate_dx, dweight,
                            static_cast<float*>(workspace), stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace

absl::Status RmsNormForward(const float* x, const float* weight, int64_t rows,
                            int64_t dim, float eps, float* y, float* inv_rms,
                            cudaStream_t stream) {
  return Forward(x, weight, rows, dim, eps, y, inv_rms, stream);
}

absl::Status RmsNormForward(const uint16_t* x, const uint16_t* weight,
                            int64_t rows, int64_t dim, float eps, uint16_t* y,
                            float* inv_rms, cudaStream_t stream) {
  return Forward(x, weight, rows, dim, eps, y, inv_rms, stream);
}

size_t RmsNormBackwardWorkspaceBytes(int64_t rows, int64_t dim) {
  if (rows < 1 || dim < 1) return 0;
  const int64_t per_chunk = RmsNormRowsPerChunk(rows);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
  return AlignWorkspaceBytes(static_cast<size_t>(chunks) *
                             static_cast<size_t>(dim) * sizeof(float));
}

absl::Status RmsNormBackward(const float* dy, const float* x,
                             const float* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, float* dx,
                             bool accumulate_dx, float* dweight,
                             void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  return Backward(dy, x, weight, inv_rms, rows, dim, dx, accumulate_dx, dweight,
                  workspace, workspace_bytes, stream);
}

absl::Status RmsNormBackward(const uint16_t* dy, const uint16_t* x,
                             const uint16_t* weight, const float* inv_rms,
                             int64_t rows, int64_t dim, uint16_t* dx,
                             bool accumulate_dx, float* dweight,
                             void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  return Backward(dy, x, weight, inv_rms, rows, dim, dx, accumulate_dx, dweight,
                  workspace, workspace_bytes, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
