#include "kernels/cuda/embedding.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/embedding_kernels.h"
#include "kernels/cuda/op_checks.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

// Scratch of the backward: bucket offsets [vocab_size + 1], sorted tokens
// [num_tokens].
struct BackwardLayout {
  int32_t* buckets = nullptr;
  int32_t* sorted_tokens = nullptr;
  size_t bytes = 0;
};

BackwardLayout LayOutBackward(void* base, int64_t vocab_size,
                              int64_t num_tokens) {
  WorkspaceCarver carver(base);
  BackwardLayout layout;
  layout.buckets = carver.Take<int32_t>(static_cast<size_t>(vocab_size) + 1);
  layout.sorted_tokens = carver.Take<int32_t>(static_cast<size_t>(num_tokens));
  layout.bytes = carver.used();
  return layout;
}

absl::Status ValidateSizes(int64_t vocab_size, int64_t dim, int64_t num_tokens,
                           const char* op) {
  // vocab_size + 1 buckets must fit int32 as well.
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(vocab_size, 0, kMaxInt32 - 1, "vocab_size", op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(
      dim, 0, std::numeric_limits<int64_t>::max() / 16, "dim", op));
  return CheckInRange(num_tokens, 0, kMaxInt32, "num_tokens", op);
}

template <typename T>
absl::Status Forward(const T* table, int64_t vocab_size, int64_t dim,
                     const int32_t* ids, int64_t num_tokens, T* out,
                     int32_t* bad_id_count, cudaStream_t stream) {
  constexpr const char* kOp = "cuda EmbeddingForward";
  SHARDD_RETURN_IF_ERROR(ValidateSizes(vocab_size, dim, num_tokens, kOp));
  if (num_tokens == 0 || dim == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(ids, "ids", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(out, "out", kOp));
  if (vocab_size > 0) SHARDD_RETURN_IF_ERROR(CheckNotNull(table, "table", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchEmbeddingForward(table, vocab_size,
                             dim * static_cast<int64_t>(sizeof(T)), ids,
                             num_tokens, out, bad_id_count, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const T* dout, const int32_t* ids, int64_t num_tokens,
                      int64_t vocab_size, int64_t dim, float* dtable,
                      void* workspace, size_t workspace_bytes,
                      int32_t* bad_id_count, int64_t padding_id,
                      cudaStream_t stream) {
  constexpr const char* kOp = "cuda EmbeddingBackward";
  SHARDD_RETURN_IF_ERROR(ValidateSizes(vocab_size, dim, num_tokens, kOp));
  if (num_tokens == 0 || dim == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(dout, "dout", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(ids, "ids", kOp));
  if (vocab_size > 0) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(dtable, "dtable", kOp));
  }
  const BackwardLayout layout =
      LayOutBackward(workspace, vocab_size, num_tokens);
  SHARDD_RETURN_IF_ERROR(
      CheckWorkspace(workspace, workspace_bytes, layout.bytes, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchEmbeddingBackward(dout, ids, num_tokens, vocab_size, dim, dtable,
                              layout.buckets, layout.sorted_tokens,
                              bad_id_count, padding_id, stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace

absl::Status EmbeddingForward(const float* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, float* out,
                              int32_t* bad_id_count, cudaStream_t stream) {
  return Forward(table, vocab_size, dim, ids, num_tokens, out, bad_id_count,
                 stream);
}

absl::Status EmbeddingForward(const uint16_t* table, int64_t vocab_size,
                              int64_t dim, const int32_t* ids,
                              int64_t num_tokens, uint16_t* out,
                              int32_t* bad_id_count, cudaStream_t stream) {
  return Forward(table, vocab_size, dim, ids, num_tokens, out, bad_id_count,
                 stream);
}

size_t EmbeddingBackwardWorkspaceBytes(int64_t vocab_size, int64_t num_tokens) {
  if (vocab_size < 0 || num_tokens < 0) return 0;
  return LayOutBackward(nullptr, vocab_size, num_tokens).bytes;
}

absl::Status EmbeddingBackward(const float* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable, void* workspace,
                               size_t workspace_bytes, int32_t* bad_id_count,
                               cudaStream_t stream, int64_t padding_id) {
  return Backward(dout, ids, num_tokens, vocab_size, dim, dtable, workspace,
                  workspace_bytes, bad_id_count, padding_id, stream);
}

absl::Status EmbeddingBackward(const uint16_t* dout, const int32_t* ids,
                               int64_t num_tokens, int64_t vocab_size,
                               int64_t dim, float* dtable, void* workspace,
                               size_t workspace_bytes, int32_t* bad_id_count,
                               cudaStream_t stream, int64_t padding_id) {
  return Backward(dout, ids, num_tokens, vocab_size, dim, dtable, workspace,
                  workspace_bytes, bad_id_count, padding_id, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
