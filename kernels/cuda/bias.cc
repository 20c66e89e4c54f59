#include "kernels/cuda/bias.h"

#include <limits>

#include "common/status_macros.h"
#include "kernels/cuda/bias_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/op_checks.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

absl::Status Check(int64_t tokens, int64_t out, const void* a, const char* a_name,
                   const void* b, const char* b_name, const char* op) {
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(tokens, 0, std::numeric_limits<int64_t>::max(), "tokens",
                   op));
  SHARDD_RETURN_IF_ERROR(CheckInRange(out, 1, kMaxInt, "out", op));
  if (tokens == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckNotNull(a, a_name, op));
  return CheckNotNull(b, b_name, op);
}

template <typename T>
absl::Status Add(const T* b, int64_t tokens, int64_t out, T* y,
                 cudaStream_t stream) {
  constexpr const char* kOp = "cuda AddBias";
  SHARDD_RETURN_IF_ERROR(Check(tokens, out, b, "b", y, "y", kOp));
  if (tokens == 0) return absl::OkStatus();
  constexpr DType kType = DTypeOf<T>::value;
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchAddRowBias(kType, b, kType, y, tokens, out, /*offsets=*/nullptr,
                       /*segments=*/1, /*row_scale=*/nullptr, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Backward(const T* dy, int64_t tokens, int64_t out, float* db,
                      cudaStream_t stream) {
  constexpr const char* kOp = "cuda BiasBackward";
  SHARDD_RETURN_IF_ERROR(Check(tokens, out, dy, "dy", db, "db", kOp));
  if (tokens == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchColumnSums(DTypeOf<T>::value, dy, tokens, out, /*offsets=*/nullptr,
                       /*segments=*/1, /*row_scale=*/nullptr, db, stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace

absl::Status AddBias(const float* b, int64_t tokens, int64_t out, float* y,
                     cudaStream_t stream) {
  return Add(b, tokens, out, y, stream);
}
absl::Status AddBias(const uint16_t* b, int64_t tokens, int64_t out,
                     uint16_t* y, cudaStream_t stream) {
  return Add(b, tokens, out, y, stream);
}
absl::Status BiasBackward(const float* dy, int64_t tokens, int64_t out,
                          float* db, cudaStream_t stream) {
  return Backward(dy, tokens, out, db, stream);
}
absl::Status BiasBackward(const uint16_t* dy, int64_t tokens, int64_t out,
                          float* db, cudaStream_t stream) {
  return Backward(dy, tokens, out, db, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
