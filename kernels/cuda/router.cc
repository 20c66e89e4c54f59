#include "kernels/cuda/router.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/bias_kernels.h"
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
  switch (d.scoring) {
    case RouterScoring::kSoftmaxThenTopK:
    case RouterScoring::kTopKThenSoftmax:
      break;
    case RouterScoring::kSigmoidGroupLimited:
      // The CPU router's rules (kernels/cpu/router.cc ValidateDims).
      if (d.groups < 1 || d.experts % d.groups != 0 ||
          d.experts / d.groups < 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": groups must split experts=", d.experts,
            " into equal groups of at least 2, got ", d.groups));
      }
      SHARDD_RETURN_IF_ERROR(
          CheckInRange(d.top_groups, 1, d.groups, "top_groups", op));
      if (d.top_k > d.top_groups * (d.experts / d.groups)) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": top_k=", d.top_k, " exceeds the ",
            d.top_groups * (d.experts / d.groups),
            " experts of the kept groups"));
      }
      if (!std::isfinite(d.scale)) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": scale must be finite, got ", d.scale));
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": unknown scoring ", static_cast<int>(d.scoring)));
  }
  return absl::OkStatus();
}

// The two newer scorings keep the selected weights or scores.
bool KeepsSelected(const RouterDims& d) {
  return d.scoring != RouterScoring::kSoftmaxThenTopK;
}

struct SavedLayout {
  float* probs = nullptr;
  float* denom = nullptr;
  int32_t* indices = nullptr;
  float* selected = nullptr;  // the two newer scorings only
  size_t bytes = 0;
};

SavedLayout LayOutSaved(const void* base, const RouterDims& d) {
  WorkspaceCarver carver(const_cast<void*>(base));
  SavedLayout layout;
  layout.probs = carver.Take<float>(d.tokens * d.experts);
  layout.denom = carver.Take<float>(d.tokens);
  layout.indices = carver.Take<int32_t>(d.tokens * d.top_k);
  if (KeepsSelected(d)) layout.selected = carver.Take<float>(d.tokens * d.top_k);
  layout.bytes = carver.used();
  return layout;
}

template <typename T>
absl::Status Forward(const RouterDims& dims, const T* x, const T* w,
                     const T* bias, const float* selection_bias,
                     int32_t* indices, float* weights, void* saved,
                     size_t saved_bytes, cublasHandle_t handle,
                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterForward";
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, kOp));
  if (selection_bias != nullptr &&
      dims.scoring != RouterScoring::kSigmoidGroupLimited) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": selection_bias is only for the sigmoid group-limited scoring"));
  }
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
  if (bias != nullptr) {
    // + b[E] in fp32 after the GEMM, as the CPU.
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchAddRowBias(kType, bias, DType::kFloat32, layout.probs,
                         dims.tokens, dims.experts, /*offsets=*/nullptr,
                         /*segments=*/1, /*row_scale=*/nullptr, stream),
        absl::StrCat(kOp, " bias"));
  }
  if (!KeepsSelected(dims)) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchRouterSoftmaxTopK(layout.probs, dims.tokens, dims.experts,
                                dims.top_k, dims.renormalize, indices, weights,
                                layout.indices, layout.denom, stream),
        kOp);
    return absl::OkStatus();
  }
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterSelect(
          layout.probs, dims.tokens, dims.experts, dims.top_k,
          dims.scoring == RouterScoring::kSigmoidGroupLimited,
          dims.renormalize, dims.groups, dims.top_groups, dims.scale,
          dims.keep_softmax, selection_bias, indices, weights, layout.indices,
          layout.selected, layout.denom, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const RouterDims& dims, const T* x, const T* w,
                      const float* d_weights, const float* extra_d_logits,
                      const void* saved, size_t saved_bytes, T* dx,
                      bool accumulate_dx, float* dw, float* d_bias,
                      void* workspace, size_t workspace_bytes,
                      cublasHandle_t handle, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterBackward";
  SHARDD_RETURN_IF_ERROR(ValidateDims(dims, kOp));
  if (dims.tokens == 0 ||
      (dx == nullptr && dw == nullptr && d_bias == nullptr)) {
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
  if (KeepsSelected(dims)) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchRouterSelectedDLogits(
            dims.scoring == RouterScoring::kSigmoidGroupLimited,
            layout.selected, layout.indices, layout.denom, d_weights,
            extra_d_logits, dims.tokens, dims.experts, dims.top_k, dims.scale,
            d_logits, stream),
        kOp);
  } else {
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchRouterDLogits(layout.probs, layout.indices, layout.denom,
                            d_weights, extra_d_logits, dims.tokens,
                            dims.experts, dims.top_k, d_logits, stream),
        kOp);
  }
  if (d_bias != nullptr) {
    // d_bias[E] += column sums of d_logits (as stored: bf16 with bf16).
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchColumnSums(kType, d_logits, dims.tokens, dims.experts,
                         /*offsets=*/nullptr, /*segments=*/1,
                         /*row_scale=*/nullptr, d_bias, stream),
        absl::StrCat(kOp, " d_bias"));
  }
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

const float* RouterSoftmax(const RouterDims& dims, const void* saved) {
  if (saved == nullptr || !ValidateDims(dims, "").ok()) return nullptr;
  const bool kept =
      dims.scoring == RouterScoring::kSoftmaxThenTopK ||
      (dims.scoring == RouterScoring::kTopKThenSoftmax && dims.keep_softmax);
  return kept ? LayOutSaved(saved, dims).probs : nullptr;
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward<float>(dims, x, w, nullptr, nullptr, indices, weights, saved,
                        saved_bytes, handle, stream);
}

absl::Status RouterForward(const RouterDims& dims, const uint16_t* x,
                           const uint16_t* w, int32_t* indices, float* weights,
                           void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward<uint16_t>(dims, x, w, nullptr, nullptr, indices, weights,
                           saved, saved_bytes, handle, stream);
}

absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, x, w, bias, selection_bias, indices, weights, saved,
                 saved_bytes, handle, stream);
}

absl::Status RouterForward(const RouterDims& dims, const uint16_t* x,
                           const uint16_t* w, const uint16_t* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, void* saved, size_t saved_bytes,
                           cublasHandle_t handle, cudaStream_t stream) {
  return Forward(dims, x, w, bias, selection_bias, indices, weights, saved,
                 saved_bytes, handle, stream);
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, float* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, /*extra_d_logits=*/nullptr, saved,
                  saved_bytes, dx, accumulate_dx, dw, /*d_bias=*/nullptr,
                  workspace, workspace_bytes, handle, stream);
}

absl::Status RouterBackward(const RouterDims& dims, const uint16_t* x,
                            const uint16_t* w, const float* d_weights,
                            const void* saved, size_t saved_bytes, uint16_t* dx,
                            bool accumulate_dx, float* dw, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, /*extra_d_logits=*/nullptr, saved,
                  saved_bytes, dx, accumulate_dx, dw, /*d_bias=*/nullptr,
                  workspace, workspace_bytes, handle, stream);
}

absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const float* extra_d_logits, const void* saved,
                            size_t saved_bytes, float* dx, bool accumulate_dx,
                            float* dw, float* d_bias, void* workspace,
                            size_t workspace_bytes, cublasHandle_t handle,
                            cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, extra_d_logits, saved, saved_bytes, dx,
                  accumulate_dx, dw, d_bias, workspace, workspace_bytes, handle,
                  stream);
}

absl::Status RouterBackward(const RouterDims& dims, const uint16_t* x,
                            const uint16_t* w, const float* d_weights,
                            const float* extra_d_logits, const void* saved,
                            size_t saved_bytes, uint16_t* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            void* workspace, size_t workspace_bytes,
                            cublasHandle_t handle, cudaStream_t stream) {
  return Backward(dims, x, w, d_weights, extra_d_logits, saved, saved_bytes, dx,
                  accumulate_dx, dw, d_bias, workspace, workspace_bytes, handle,
                  stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
