#include "kernels/cuda/router.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/router_kernels.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

absl::Status ValidateDims(const RouterDims& d, const char* op) {
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.tokens, 0, kMaxInt, "tokens", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.dim, 1, kMaxInt, "dim", op));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(d.experts, 1, kRouterMaxExperts, "experts", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(
      d.top_k, 1, std::min(d.experts, kRouterMaxTopK), "top_k", op));
  if (d.tokens * d.experts > kMaxInt || d.tokens * d.top_k > kMaxInt) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": tokens * experts must fit an int, got ", d.tokens * d.experts));
  }
  return absl::OkStatus();
}

struct SavedLayout {
  float* probs = nullptr;
  float* denom = nullptr;
  int32_t* indices = nullptr;
  size_t bytes = 0;
};

SavedLayout LayOutSaved(const void* base, const RouterDims& d) {
  WorkspaceCarver carver(const_cast<void*>(base));
  SavedLayout layout;
  layout.probs = carver.Take<float>(d.tokens * d.experts);
  layout.denom = carver.Take<float>(d.tokens);
  layout.indices = carver.Take<int32_t>(d.tokens * d.top_k);
  layout.bytes = carver.used();
  return layout;
}

template <typename T>
absl::Status Forward(const RouterDims& dims, const T* x, const T* w,
                     int32_t* indices, float* weights, void* saved,
                     size_t saved_bytes, cublasHandle_t handle,
                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterForward";
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, kOp));
  if (dims.tokens == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(w, "w", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(indices, "indices", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(weights, "weights", kOp));
  const SavedLayout layout = LayOutSaved(saved, dims);
  SHARDD_RETURN_IF_ERROR(CheckWorkspace(saved, saved_bytes, layout.bytes,
                                        absl::StrCat(kOp, " saved")));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, kOp));
  constexpr DType kType = DTypeOf<T>::value;
  // logits[T, E] = x[T, D] @ w[E, D]^T, written where the probs go.
  SHARDD_RETURN_IF_ERROR(
      RowMajorGemm(handle, dims.tokens, dims.experts, dims.dim, 1.0f,
                   {x, kType, dims.dim, false}, {w, kType, dims.dim, true},
                   0.0f, layout.probs, DType::kFloat32, dims.experts, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterSoftmaxTopK(layout.probs, dims.tokens, dims.experts,
                              dims.top_k, dims.renormalize, indices, weights,
                              layout.indices, layout.denom, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const RouterDims& dims, const T* x, const T* w,
                      const float* d_weights, const void* saved,
                      size_t saved_bytes, T* dx, bool accumulate_dx, float* dw,
                      void* workspace, size_t workspace_bytes,
                      cublasHandle_t handle, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterBackward";
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, kOp));
  if (dims.tokens == 0 || (dx == nullptr && dw == nullptr)) {
    return absl::OkStatus();
  }
  SHARDD_RETURN_IF_ERROR(CheckNotNull(d_weights, "d_weights", kOp));
  if (dx != nullptr) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(w, "w (needed for dx)", kOp));
  }
  if (dw != nullptr) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(x, "x (needed for dw)", kOp));
  }
  const SavedLayout layout = LayOutSaved(saved, dims);
  SHARDD_RETURN_IF_ERROR(CheckWorkspace(saved, saved_bytes, layout.bytes,
                                        absl::StrCat(kOp, " saved")));
  constexpr DType kType = DTypeOf<T>::value;
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes,
                     RouterBackwardWorkspaceBytes(dims, kType), kOp));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, kOp));
  T* d_logits = static_cast<T*>(workspace);
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterDLogits(layout.probs, layout.indices, layout.denom, d_weights,
                          dims.tokens, dims.experts, dims.top_k, d_logits,
                          stream),
      kOp);
  if (dx != nullptr) {
    // dx[T, D] = d_logits[T, E] @ w[E, D]
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, dims.tokens, dims.dim, dims.experts, 1.0f,
        {d_logits, kType, dims.experts, false}, {w, kType, dims.dim, false},
        accumulate_dx ? 1.0f : 0.0f, dx, kType, dims.dim, kOp));
  }
  if (dw != nullptr) {
    // dw[E, D] += d_logits^T[E, T] @ x[T, D]
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, dims.experts, dims.dim, dims.tokens, 1.0f,
        {d_logits, kType, dims.experts, true}, {x, kType, dims.dim, false},
        1.0f, dw, DType::kFloat32, dims.dim, kOp));
  }
  return absl::OkStatus();
}

}  // namespace

size_t RouterSavedBytes(const RouterDims& dims) {
  if (!ValidateDims(dims, "").ok()) return 0;
  return LayOutSaved(nullptr, dims).bytes;
}

size_t RouterBackwardWorkspaceBytes(const RouterDims& dims, DType dtype) {
  if (!ValidateDims(dims, "").ok()) return 0;
  return AlignWorkspaceBytes(static_cast<size_t>(dims.tokens * dims.experts) *
                             DTypeSize(dtype));
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, x, w, indices, weights, saved, saved_bytes, handle,
                 stream);
}

absl::Status RouterForward(const RouterDims& dims, const uint16_t* x,
                           const uint16_t* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, x, w, indices, weights, saved, saved_bytes, handle,
                 stream);
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, float* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, saved, saved_bytes, dx, accumulate_dx,
                  dw, workspace, workspace_bytes, handle, stream);
}

absl::Status RouterBackward(const RouterDims& dims, const uint16_t* x,
                            const uint16_t* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, uint16_t* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, saved, saved_bytes, dx, accumulate_dx,
                  dw, workspace, workspace_bytes, handle, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
