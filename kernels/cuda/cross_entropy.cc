#include "kernels/cuda/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cross_entropy_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

// The reduce kernel writes this layout through its own mirror struct.
static_assert(sizeof(CrossEntropyDeviceResult) == 32 &&
                  offsetof(CrossEntropyDeviceResult, loss_sum) == 0 &&
                  offsetof(CrossEntropyDeviceResult, count) == 8 &&
                  offsetof(CrossEntropyDeviceResult, invalid_targets) == 16 &&
                  offsetof(CrossEntropyDeviceResult, mean_loss) == 24,
              "CrossEntropyDeviceResult layout changed; update the kernel");

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

absl::Status Validate(const CrossEntropyDims& d,
                      const CudaCrossEntropyOptions& options, const char* op) {
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.tokens, 0, kMaxInt, "tokens", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.dim, 1, kMaxInt, "dim", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(d.vocab, 1, kMaxInt, "vocab", op));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(options.block_rows, 1, kMaxInt, "block_rows", op));
  if (!(options.softcap >= 0.0f) || !std::isfinite(options.softcap)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": softcap must be finite and >= 0, got ", options.softcap));
  }
  return absl::OkStatus();
}

struct Layout {
  float* logits = nullptr;         // [B, V]
  uint16_t* d_logits16 = nullptr;  // [B, V], bf16 backward only
  double* row_loss = nullptr;      // [T]
  int32_t* row_flag = nullptr;     // [T]
  int64_t block = 0;               // B
  size_t bytes = 0;
};

Layout LayOut(void* base, const CrossEntropyDims& d, DType dtype,
              const CudaCrossEntropyOptions& options, bool with_grad) {
  Layout layout;
  layout.block = std::min(options.block_rows, d.tokens);
  const size_t block_elems = static_cast<size_t>(layout.block) * d.vocab;
  WorkspaceCarver carver(base);
  layout.logits = carver.Take<float>(block_elems);
  if (with_grad && dtype == DType::kBFloat16) {
    layout.d_logits16 = carver.Take<uint16_t>(block_elems);
  }
  layout.row_loss = carver.Take<double>(d.tokens);
  layout.row_flag = carver.Take<int32_t>(d.tokens);
  layout.bytes = carver.used();
  return layout;
}

// fp32 gradients are written over the logits in place; bf16 ones go to
// their own buffer.
float* GradBuffer(const Layout& layout, float*) { return layout.logits; }
uint16_t* GradBuffer(const Layout& layout, uint16_t*) {
  return layout.d_logits16;
}

template <typename T>
absl::Status Run(const CrossEntropyDims& dims, const T* hidden, const T* weight,
                 const int32_t* targets, bool with_grad, float loss_scale,
                 T* dhidden, float* dweight, bool accumulate_dhidden,
                 CrossEntropyDeviceResult* result, void* workspace,
                 size_t workspace_bytes, const CudaCrossEntropyOptions& options,
                 cublasHandle_t handle, cudaStream_t stream, const char* op) {
  SHARDD_RETURN_IF_ERROR(Validate(dims, options, op));
  if (with_grad && !std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": loss_scale must be finite, got ", loss_scale));
  }
  SHARDD_RETURN_IF_ERROR(CheckNotNull(result, "result", op));
  constexpr DType kType = DTypeOf<T>::value;
  const Layout layout = LayOut(workspace, dims, kType, options, with_grad);
  if (dims.tokens > 0) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(hidden, "hidden", op));
    SHARDD_RETURN_IF_ERROR(CheckNotNull(weight, "weight", op));
    SHARDD_RETURN_IF_ERROR(CheckNotNull(targets, "targets", op));
    SHARDD_RETURN_IF_ERROR(
        CheckWorkspace(workspace, workspace_bytes, layout.bytes, op));
    SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, op));
  }
  const int64_t d = dims.dim, v = dims.vocab;
  T* d_logits =
      with_grad ? GradBuffer(layout, static_cast<T*>(nullptr)) : nullptr;
  for (int64_t start = 0; start < dims.tokens; start += layout.block) {
    const int64_t rows = std::min(layout.block, dims.tokens - start);
    const T* h = hidden + start * d;
    // logits[rows, V] = h[rows, D] @ weight[V, D]^T
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, rows, v, d, 1.0f, {h, kType, d, false},
        {weight, kType, d, true}, 0.0f, layout.logits, DType::kFloat32, v, op));
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchCrossEntropyRows(layout.logits, rows, v, targets + start,
                               options.ignore_index, options.softcap,
                               layout.row_loss + start, layout.row_flag + start,
                               loss_scale, d_logits, stream),
        op);
    if (!with_grad) continue;
    if (dhidden != nullptr) {
      // dhidden[rows, D] = dlogits[rows, V] @ weight[V, D]
      SHARDD_RETURN_IF_ERROR(RowMajorGemm(
          handle, rows, d, v, 1.0f, {d_logits, kType, v, false},
          {weight, kType, d, false}, accumulate_dhidden ? 1.0f : 0.0f,
          dhidden + start * d, kType, d, op));
    }
    if (dweight != nullptr) {
      // dweight[V, D] += dlogits[rows, V]^T @ h[rows, D]
      SHARDD_RETURN_IF_ERROR(RowMajorGemm(
          handle, v, d, rows, 1.0f, {d_logits, kType, v, true},
          {h, kType, d, false}, 1.0f, dweight, DType::kFloat32, d, op));
    }
  }
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchCrossEntropyReduce(layout.row_loss, layout.row_flag, dims.tokens,
                               result, stream),
      op);
  return absl::OkStatus();
}

// LmHeadSoftmax's workspace: one block of fp32 logits.
struct SoftmaxLayout {
  float* logits = nullptr;  // [B, V]
  int64_t block = 0;        // B
  size_t bytes = 0;
};

SoftmaxLayout LayOutSoftmax(void* base, const CrossEntropyDims& d,
                            const CudaCrossEntropyOptions& options) {
  SoftmaxLayout layout;
  layout.block = std::min(options.block_rows, d.tokens);
  WorkspaceCarver carver(base);
  layout.logits =
      carver.Take<float>(static_cast<size_t>(layout.block) * d.vocab);
  layout.bytes = carver.used();
  return layout;
}

template <typename T>
absl::Status RunSoftmax(const CrossEntropyDims& dims, const T* hidden,
                        const T* weight, T* probs, void* workspace,
                        size_t workspace_bytes,
                        const CudaCrossEntropyOptions& options,
                        cublasHandle_t handle, cudaStream_t stream) {
  constexpr const char* op = "cuda LmHeadSoftmax";
  SHARDD_RETURN_IF_ERROR(Validate(dims, options, op));
  if (dims.tokens == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(hidden, "hidden", op));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(weight, "weight", op));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(probs, "probs", op));
  const SoftmaxLayout layout = LayOutSoftmax(workspace, dims, options);
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes, layout.bytes, op));
  SHARDD_RETURN_IF_ERROR(BindCublasHandle(handle, stream, op));
  constexpr DType kType = DTypeOf<T>::value;
  const int64_t d = dims.dim, v = dims.vocab;
  for (int64_t start = 0; start < dims.tokens; start += layout.block) {
    const int64_t rows = std::min(layout.block, dims.tokens - start);
    // logits[rows, V] = h[rows, D] @ weight[V, D]^T
    SHARDD_RETURN_IF_ERROR(RowMajorGemm(
        handle, rows, v, d, 1.0f, {hidden + start * d, kType, d, false},
        {weight, kType, d, true}, 0.0f, layout.logits, DType::kFloat32, v, op));
    SHARDD_CUDA_RETURN_IF_ERROR(
        LaunchLmHeadSoftmaxRows(layout.logits, rows, v, options.softcap,
                                probs + start * v, stream),
        op);
  }
  return absl::OkStatus();
}

}  // namespace

size_t CrossEntropyWorkspaceBytes(const CrossEntropyDims& dims, DType dtype,
                                  const CudaCrossEntropyOptions& options,
                                  bool with_grad) {
  if (!Validate(dims, options, "").ok()) return 0;
  return LayOut(nullptr, dims, dtype, options, with_grad).bytes;
}

absl::Status LmHeadCrossEntropyForward(
    const CrossEntropyDims& dims, const float* hidden, const float* weight,
    const int32_t* targets, CrossEntropyDeviceResult* result, void* workspace,
    size_t workspace_bytes, const CudaCrossEntropyOptions& options,
    cublasHandle_t handle, cudaStream_t stream) {
  return Run<float>(dims, hidden, weight, targets, false, 0.0f, nullptr,
                    nullptr, false, result, workspace, workspace_bytes, options,
                    handle, stream, "cuda LmHeadCrossEntropyForward");
}

absl::Status LmHeadCrossEntropyForward(
    const CrossEntropyDims& dims, const uint16_t* hidden,
    const uint16_t* weight, const int32_t* targets,
    CrossEntropyDeviceResult* result, void* workspace, size_t workspace_bytes,
    const CudaCrossEntropyOptions& options, cublasHandle_t handle,
    cudaStream_t stream) {
  return Run<uint16_t>(dims, hidden, weight, targets, false, 0.0f, nullptr,
                       nullptr, false, result, workspace, workspace_bytes,
                       options, handle, stream,
                       "cuda LmHeadCrossEntropyForward");
}

absl::Status LmHeadCrossEntropyBackward(
    const CrossEntropyDims& dims, const float* hidden, const float* weight,
    const int32_t* targets, float loss_scale, float* dhidden, float* dweight,
    bool accumulate_dhidden, CrossEntropyDeviceResult* result, void* workspace,
    size_t workspace_bytes, const CudaCrossEntropyOptions& options,
    cublasHandle_t handle, cudaStream_t stream) {
  return Run<float>(dims, hidden, weight, targets, true, loss_scale, dhidden,
                    dweight, accumulate_dhidden, result, workspace,
                    workspace_bytes, options, handle, stream,
                    "cuda LmHeadCrossEntropyBackward");
}

absl::Status LmHeadCrossEntropyBackward(
    const CrossEntropyDims& dims, const uint16_t* hidden,
    const uint16_t* weight, const int32_t* targets, float loss_scale,
    uint16_t* dhidden, float* dweight, bool accumulate_dhidden,
    CrossEntropyDeviceResult* result, void* workspace, size_t workspace_bytes,
    const CudaCrossEntropyOptions& options, cublasHandle_t handle,
    cudaStream_t stream) {
  return Run<uint16_t>(dims, hidden, weight, targets, true, loss_scale, dhidden,
                       dweight, accumulate_dhidden, result, workspace,
                       workspace_bytes, options, handle, stream,
                       "cuda LmHeadCrossEntropyBackward");
}

size_t LmHeadSoftmaxWorkspaceBytes(const CrossEntropyDims& dims,
                                   DType /*dtype*/,
                                   const CudaCrossEntropyOptions& options) {
  if (!Validate(dims, options, "").ok()) return 0;
  return LayOutSoftmax(nullptr, dims, options).bytes;
}

absl::Status LmHeadSoftmax(const CrossEntropyDims& dims, const float* hidden,
                           const float* weight, float* probs, void* workspace,
                           size_t workspace_bytes,
                           const CudaCrossEntropyOptions& options,
                           cublasHandle_t cublas, cudaStream_t stream) {
  return RunSoftmax<float>(dims, hidden, weight, probs, workspace,
                           workspace_bytes, options, cublas, stream);
}

absl::Status LmHeadSoftmax(const CrossEntropyDims& dims, const uint16_t* hidden,
                           const uint16_t* weight, uint16_t* probs,
                           void* workspace, size_t workspace_bytes,
                           const CudaCrossEntropyOptions& options,
                           cublasHandle_t cublas, cudaStream_t stream) {
  return RunSoftmax<uint16_t>(dims, hidden, weight, probs, workspace,
                              workspace_bytes, options, cublas, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
