#include "kernels/cuda/dense_mlp.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dense_mlp_kernels.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

absl::Status Validate(const DenseMlpDims& d, GatedActivation activation,
                      const char* op) {
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.tokens, 0, kMaxInt, "tokens", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.dim, 1, kMaxInt, "dim", op));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(d.intermediate, 1, kMaxInt, "intermediate", op));
  if (activation != GatedActivation::kSwiGLU &&
      activation != GatedActivation::kGeGLU) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": activation must be kSwiGLU or kGeGLU"));
  }
  return absl::OkStatus();
}

GateKind KindOf(GatedActivation activation) {
  return activation == GatedActivation::kSwiGLU ? GateKind::kSilu
                                                : GateKind::kGeluTanh;
}

// `count` [T, I] matrices of `dtype`, back to back (aligned).
template <typename T>
struct Matrices {
  T* m[3] = {nullptr, nullptr, nullptr};
  size_t bytes = 0;
};

template <typename T>
Matrices<T> LayOut(const void* base, const DenseMlpDims& d, int count) {
  WorkspaceCarver carver(const_cast<void*>(base));
  Matrices<T> out;
  for (int i = 0; i < count; ++i) {
    out.m[i] = carver.Take<T>(static_cast<size_t>(d.tokens * d.intermediate));
  }
  out.bytes = carver.used();
  return out;
}

size_t Bytes(const DenseMlpDims& d, DType dtype, int count) {
  if (!Validate(d, GatedActivation::kSwiGLU, "").ok()) return 0;
  return dtype == DType::kFloat32 ? LayOut<float>(nullptr, d, count).bytes
                                  : LayOut<uint16_t>(nullptr, d, count).bytes;
}

template <typename T>
absl::Status Forward(const DenseMlpDims& dims, GatedActivation activation,
                     const T* x, const T* gate_proj, const T* up_proj,
                     const T* down_proj, T* y, bool accumulate_y, void* saved,
                     size_t saved_bytes, void* workspace,
                     size_t workspace_bytes, cublasHandle_t handle,
                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda DenseMlpForward";
  SHARDD_RETURN_IF_ERROR(Validate(dims, activation, kOp));
  if (dims.tokens == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(gate_proj, "gate_proj", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(up_proj, "up_proj", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(down_proj, "down_proj", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(y, "y", kOp));
  const Matrices<T> s = LayOut<T>(saved, dims, 2);
  const Matrices<T> w = LayOut<T>(workspace, dims, 1);
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(saved, saved_bytes, s.bytes, absl::StrCat(kOp, " saved")));
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes, w.bytes, kOp));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, kOp));
  constexpr DType kType = DTypeOf<T>::value;
  const int64_t t = dims.tokens, d = dims.dim, in = dims.intermediate;
  T* g = s.m[0];
  T* u = s.m[1];
  T* a = w.m[0];
  SHARDD_RETURN_IF_ERROR(
      RowMajorGemm(handle, t, in, d, 1.0f, {x, kType, d, false},
                   {gate_proj, kType, d, true}, 0.0f, g, kType, in, kOp));
  SHARDD_RETURN_IF_ERROR(
      RowMajorGemm(handle, t, in, d, 1.0f, {x, kType, d, false},
                   {up_proj, kType, d, true}, 0.0f, u, kType, in, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchGatedActivationForward(KindOf(activation), g, u, t * in, a, stream),
      kOp);
  return RowMajorGemm(handle, t, d, in, 1.0f, {a, kType, in, false},
                      {down_proj, kType, in, true}, accumulate_y ? 1.0f : 0.0f,
                      y, kType, d, kOp);
}

template <typename T>
absl::Status Backward(const DenseMlpDims& dims, GatedActivation activation,
                      const T* x, const T* gate_proj, const T* up_proj,
                      const T* down_proj, const T* dy, const void* saved,
                      size_t saved_bytes, T* dx, bool accumulate_dx,
                      float* d_gate_proj, float* d_up_proj, float* d_down_proj,
                      void* workspace, size_t workspace_bytes,
                      cublasHandle_t handle, cudaStream_t stream) {
  constexpr const char* kOp = "cuda DenseMlpBackward";
  SHARDD_RETURN_IF_ERROR(Validate(dims, activation, kOp));
  const bool need_dh =
      dx != nullptr || d_gate_proj != nullptr || d_up_proj != nullptr;
  if (dims.tokens == 0 || (!need_dh && d_down_proj == nullptr)) {
    return absl::OkStatus();
  }
  SHARDD_RETURN_IF_ERROR(CheckNotNull(dy, "dy", kOp));
  if (need_dh) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(down_proj, "down_proj", kOp));
  }
  if (dx != nullptr) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(gate_proj, "gate_proj", kOp));
    SHARDD_RETURN_IF_ERROR(CheckNotNull(up_proj, "up_proj", kOp));
  }
  if (d_gate_proj != nullptr || d_up_proj != nullptr) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  }
  const Matrices<T> s = LayOut<T>(saved, dims, 2);
  const Matrices<T> w = LayOut<T>(workspace, dims, 3);
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(saved, saved_bytes, s.bytes, absl::StrCat(kOp, " saved")));
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes, w.bytes, kOp));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, kOp));
  constexpr DType kType = DTypeOf<T>::value;
  const int64_t t = dims.tokens, d = dims.dim, in = dims.intermediate;
  const GateKind kind = KindOf(activation);
  const T* g = s.m[0];
  const T* u = s.m[1];
  T* a = w.m[0];
  T* du = w.m[1];  // dA first, dU in place after
  T* dg = w.m[2];

  if (d_down_proj != nullptr) {
    // dW_down[D, I] += dy^T @ A, with A recomputed from the saved G and U.
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchGatedActivationForward(kind, g, u, t * in, a, stream), kOp);
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, d, in, t, 1.0f, {dy, kType, d, true}, {a, kType, in, false},
        1.0f, d_down_proj, DType::kFloat32, in, kOp));
  }
  if (!need_dh) return absl::OkStatus();
  // dA[T, I] = dy @ down_proj
  SHARDD_RETURN_IF_ERROR(
      RowMajorGemm(handle, t, in, d, 1.0f, {dy, kType, d, false},
                   {down_proj, kType, in, false}, 0.0f, du, kType, in, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchGatedActivationBackward(kind, g, u, t * in, du, dg, stream), kOp);
  // dW_gate += dG^T @ x, dW_up += dU^T @ x   [I, D]
  if (d_gate_proj != nullptr) {
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, in, d, t, 1.0f, {dg, kType, in, true}, {x, kType, d, false},
        1.0f, d_gate_proj, DType::kFloat32, d, kOp));
  }
  if (d_up_proj != nullptr) {
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, in, d, t, 1.0f, {du, kType, in, true}, {x, kType, d, false},
        1.0f, d_up_proj, DType::kFloat32, d, kOp));
  }
  // dx = dG @ gate_proj + dU @ up_proj   [T, D]
  if (dx != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        RowMajorGemm(handle, t, d, in, 1.0f, {dg, kType, in, false},
                     {gate_proj, kType, d, false}, accumulate_dx ? 1.0f : 0.0f,
                     dx, kType, d, kOp));
    SHARDD_RETURN_IF_ERROR(
        RowMajorGemm(handle, t, d, in, 1.0f, {du, kType, in, false},
                     {up_proj, kType, d, false}, 1.0f, dx, kType, d, kOp));
  }
  return absl::OkStatus();
}

}  // namespace

size_t DenseMlpSavedBytes(const DenseMlpDims& dims, DType dtype) {
  return Bytes(dims, dtype, 2);
}

size_t DenseMlpForwardWorkspaceBytes(const DenseMlpDims& dims, DType dtype) {
  return Bytes(dims, dtype, 1);
}

size_t DenseMlpBackwardWorkspaceBytes(const DenseMlpDims& dims, DType dtype) {
  return Bytes(dims, dtype, 3);
}

absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             GatedActivation activation, const float* x,
                             const float* gate_proj, const float* up_proj,
                             const float* down_proj, float* y,
                             bool accumulate_y, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes,
                             cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, activation, x, gate_proj, up_proj, down_proj, y,
                 accumulate_y, saved, saved_bytes, workspace, workspace_bytes,
                 handle, stream);
}

absl::Status DenseMlpForward(const DenseMlpDims& dims,
                             GatedActivation activation, const uint16_t* x,
                             const uint16_t* gate_proj, const uint16_t* up_proj,
                             const uint16_t* down_proj, uint16_t* y,
                             bool accumulate_y, void* saved, size_t saved_bytes,
                             void* workspace, size_t workspace_bytes,
                             cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, activation, x, gate_proj, up_proj, down_proj, y,
                 accumulate_y, saved, saved_bytes, workspace, workspace_bytes,
                 handle, stream);
}

absl::Status DenseMlpBackward(const DenseMlpDims& dims,
                              GatedActivation activation, const float* x,
                              const float* gate_proj, const float* up_proj,
                              const float* down_proj, const float* dy,
                              const void* saved, size_t saved_bytes, float* dx,
                              bool accumulate_dx, float* d_gate_proj,
                              float* d_up_proj, float* d_down_proj,
                              void* workspace, size_t workspace_bytes,
                              cublasHandle_t handle, cudaStream_t stream) {
  return Backward(dims, activation, x, gate_proj, up_proj, down_proj, dy, saved,
                  saved_bytes, dx, accumulate_dx, d_gate_proj, d_up_proj,
                  d_down_proj, workspace, workspace_bytes, handle, stream);
}

absl::Status DenseMlpBackward(
    const DenseMlpDims& dims, GatedActivation activation, const uint16_t* x,
    const uint16_t* gate_proj, const uint16_t* up_proj,
    const uint16_t* down_proj, const uint16_t* dy, const void* saved,
    size_t saved_bytes, uint16_t* dx, bool accumulate_dx, float* d_gate_proj,
    float* d_up_proj, float* d_down_proj, void* workspace,
    size_t workspace_bytes, cublasHandle_t handle, cudaStream_t stream) {
  return Backward(dims, activation, x, gate_proj, up_proj, down_proj, dy, saved,
                  saved_bytes, dx, accumulate_dx, d_gate_proj, d_up_proj,
                  d_down_proj, workspace, workspace_bytes, handle, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
