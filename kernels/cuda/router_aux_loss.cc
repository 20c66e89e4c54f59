#include "kernels/cuda/router_aux_loss.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/bias_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/op_checks.h"
#include "kernels/cuda/router_aux_loss_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

}  // namespace

absl::Status RouterAuxLossAccumulate(const float* probs,
                                     const int32_t* indices, int64_t rows,
                                     int64_t experts, int64_t top_k,
                                     int64_t* counts, double* prob_sums,
                                     int64_t* invalid_indices,
                                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterAuxLossAccumulate";
  SHARDD_RETURN_IF_ERROR(CheckInRange(rows, 0, kMaxInt64, "rows", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(experts, 1, kMaxInt, "experts", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(top_k, 1, experts, "top_k", kOp));
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(probs, "probs", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(indices, "indices", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(counts, "counts", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(prob_sums, "prob_sums", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterAuxCount(indices, rows * top_k, experts, counts,
                           invalid_indices, stream),
      absl::StrCat(kOp, " counts"));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchColumnSumsDouble(probs, rows, experts, prob_sums, stream),
      absl::StrCat(kOp, " prob_sums"));
  return absl::OkStatus();
}

absl::Status RouterAuxLossValue(const int64_t* counts, const double* prob_sums,
                                const int64_t* total_rows, int64_t experts,
                                double* value, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterAuxLossValue";
  SHARDD_RETURN_IF_ERROR(CheckInRange(experts, 1, kMaxInt, "experts", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(counts, "counts", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(prob_sums, "prob_sums", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(total_rows, "total_rows", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(value, "value", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterAuxValue(counts, prob_sums, total_rows, experts, value,
                           stream),
      kOp);
  return absl::OkStatus();
}

absl::Status RouterAuxLossBackward(const float* probs, int64_t rows,
                                   int64_t experts, const int64_t* counts,
                                   const int64_t* total_rows, double scale,
                                   float* d_logits, cudaStream_t stream) {
  constexpr const char* kOp = "cuda RouterAuxLossBackward";
  SHARDD_RETURN_IF_ERROR(CheckInRange(rows, 0, kMaxInt64, "rows", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(experts, 1, kMaxInt, "experts", kOp));
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(probs, "probs", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(counts, "counts", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(total_rows, "total_rows", kOp));
  SHARDD_RETURN_IF_ERROR(CheckNotNull(d_logits, "d_logits", kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchRouterAuxBackward(probs, rows, experts, counts, total_rows, scale,
                              d_logits, stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
