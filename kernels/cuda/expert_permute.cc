#include "kernels/cuda/expert_permute.h"

#include <initializer_list>
#include <limits>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/expert_permute_kernels.h"
#include "kernels/cuda/op_checks.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxInt = std::numeric_limits<int>::max();

absl::Status CheckRows(int64_t rows, const char* rows_name, int64_t d,
                       const char* op) {
  SHARDD_RETURN_IF_ERROR(CheckInRange(rows, 0, kMaxInt64, rows_name, op));
  return CheckInRange(d, 1, kMaxInt, "d", op);
}

absl::Status CheckPointers(
    std::initializer_list<std::pair<const void*, const char*>> pointers,
    const char* op) {
  for (const auto& [p, name] : pointers) {
    SHARDD_RETURN_IF_ERROR(CheckNotNull(p, name, op));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status PackDispatch(const T* x, const float* weights,
                          const int32_t* indices, const int64_t* order,
                          int64_t rows, int k, int64_t d, int64_t local,
                          float* send, cudaStream_t stream) {
  constexpr const char* kOp = "cuda PackDispatchRows";
  SHARDD_RETURN_IF_ERROR(CheckRows(rows, "rows", d, kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(k, 1, kMaxInt, "k", kOp));
  SHARDD_RETURN_IF_ERROR(
      CheckInRange(local, 1, kMaxInt, "local_experts", kOp));
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckPointers({{x, "x"},
                                        {weights, "weights"},
                                        {indices, "indices"},
                                        {order, "order"},
                                        {send, "send"}},
                                       kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchPackRows(x, weights, indices, order, rows,
                                             k, d, local, send, stream),
                              kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Unpack(const float* recv, int64_t received, int64_t d, T* x_r,
                    int32_t* ids_r, float* w_r, cudaStream_t stream) {
  constexpr const char* kOp = "cuda UnpackDispatchRows";
  SHARDD_RETURN_IF_ERROR(CheckRows(received, "received", d, kOp));
  if (received == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckPointers(
      {{recv, "recv"}, {x_r, "x_r"}, {ids_r, "ids_r"}, {w_r, "w_r"}}, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchUnpackDispatchRows(recv, received, d, x_r, ids_r, w_r, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status PackGrad(const T* dy, const int64_t* order, int64_t rows, int k,
                      int64_t d, float* send, cudaStream_t stream) {
  constexpr const char* kOp = "cuda PackGradRows";
  SHARDD_RETURN_IF_ERROR(CheckRows(rows, "rows", d, kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(k, 1, kMaxInt, "k", kOp));
  if (rows == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(
      CheckPointers({{dy, "dy"}, {order, "order"}, {send, "send"}}, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchPackRows<T>(dy, /*weights=*/nullptr, /*indices=*/nullptr, order,
                        rows, k, d, /*local_experts=*/1, send, stream),
      kOp);
  return absl::OkStatus();
}

template <typename T>
absl::Status Combine(const float* back, const int64_t* position, int64_t t,
                     int k, int64_t width, int64_t d, T* y, float* d_weights,
                     cudaStream_t stream) {
  constexpr const char* kOp = "cuda CombineRows";
  SHARDD_RETURN_IF_ERROR(CheckRows(t, "t", d, kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(k, 1, kMaxInt, "k", kOp));
  SHARDD_RETURN_IF_ERROR(CheckInRange(width, d, kMaxInt64, "width", kOp));
  if (d_weights != nullptr && width == d) {
    return absl::InvalidArgumentError(
        "cuda CombineRows: d_weights needs rows wider than d (width > d)");
  }
  if (t == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(CheckPointers(
      {{back, "back"}, {position, "position"}, {y, "y"}}, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchCombineRows(back, position, t, k, width, d, y, d_weights, stream),
      kOp);
  return absl::OkStatus();
}

}  // namespace

absl::Status PackDispatchRows(const float* x, const float* weights,
                              const int32_t* indices, const int64_t* order,
                              int64_t rows, int k, int64_t d,
                              int64_t local_experts, float* send,
                              cudaStream_t stream) {
  return PackDispatch(x, weights, indices, order, rows, k, d, local_experts,
                      send, stream);
}
absl::Status PackDispatchRows(const uint16_t* x, const float* weights,
                              const int32_t* indices, const int64_t* order,
                              int64_t rows, int k, int64_t d,
                              int64_t local_experts, float* send,
                              cudaStream_t stream) {
  return PackDispatch(x, weights, indices, order, rows, k, d, local_experts,
                      send, stream);
}

absl::Status UnpackDispatchRows(const float* recv, int64_t received,
                                int64_t d, float* x_r, int32_t* ids_r,
                                float* w_r, cudaStream_t stream) {
  return Unpack(recv, received, d, x_r, ids_r, w_r, stream);
}
absl::Status UnpackDispatchRows(const float* recv, int64_t received,
                                int64_t d, uint16_t* x_r, int32_t* ids_r,
                                float* w_r, cudaStream_t stream) {
  return Unpack(recv, received, d, x_r, ids_r, w_r, stream);
}

absl::Status PackGradRows(const float* dy, const int64_t* order, int64_t rows,
                          int k, int64_t d, float* send, cudaStream_t stream) {
  return PackGrad(dy, order, rows, k, d, send, stream);
}
absl::Status PackGradRows(const uint16_t* dy, const int64_t* order,
                          int64_t rows, int k, int64_t d, float* send,
                          cudaStream_t stream) {
  return PackGrad(dy, order, rows, k, d, send, stream);
}

absl::Status PackCombineGradRows(const float* dx_r, const float* dw_r,
                                 int64_t received, int64_t d, float* send,
                                 cudaStream_t stream) {
  constexpr const char* kOp = "cuda PackCombineGradRows";
  SHARDD_RETURN_IF_ERROR(CheckRows(received, "received", d, kOp));
  if (received == 0) return absl::OkStatus();
  SHARDD_RETURN_IF_ERROR(
      CheckPointers({{dx_r, "dx_r"}, {dw_r, "dw_r"}, {send, "send"}}, kOp));
  SHARDD_CUDA_RETURN_IF_ERROR(
      LaunchPackCombineGradRows(dx_r, dw_r, received, d, send, stream), kOp);
  return absl::OkStatus();
}

absl::Status CombineRows(const float* back, const int64_t* position, int64_t t,
                         int k, int64_t width, int64_t d, float* y,
                         float* d_weights, cudaStream_t stream) {
  return Combine(back, position, t, k, width, d, y, d_weights, stream);
}
absl::Status CombineRows(const float* back, const int64_t* position, int64_t t,
                         int k, int64_t width, int64_t d, uint16_t* y,
                         float* d_weights, cudaStream_t stream) {
  return Combine(back, position, t, k, width, d, y, d_weights, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
