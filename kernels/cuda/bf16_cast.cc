#include "kernels/cuda/bf16_cast.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/bf16_cast_kernels.h"
#include "kernels/cuda/cuda_status.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

absl::Status Validate(const void* in, size_t in_size, const void* out,
                      size_t out_size, int64_t n, const char* op) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": n must be >= 0, got ", n));
  }
  if (n == 0) return absl::OkStatus();
  if (in == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": in is null"));
  }
  if (out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": out is null"));
  }
  const uintptr_t in_begin = reinterpret_cast<uintptr_t>(in);
  const uintptr_t out_begin = reinterpret_cast<uintptr_t>(out);
  const uintptr_t in_end = in_begin + static_cast<uintptr_t>(n) * in_size;
  const uintptr_t out_end = out_begin + static_cast<uintptr_t>(n) * out_size;
  if (in_begin < out_end && out_begin < in_end) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": in and out must not overlap"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CastFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                            cudaStream_t stream) {
  constexpr const char* kOp = "cuda CastFp32ToBf16";
  SHARDD_RETURN_IF_ERROR(
      Validate(in, sizeof(float), out, sizeof(uint16_t), n, kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchFp32ToBf16(in, out, n, stream), kOp);
  return absl::OkStatus();
}

absl::Status CastBf16ToFp32(const uint16_t* in, float* out, int64_t n,
                            cudaStream_t stream) {
  constexpr const char* kOp = "cuda CastBf16ToFp32";
  SHARDD_RETURN_IF_ERROR(
      Validate(in, sizeof(uint16_t), out, sizeof(float), n, kOp));
  if (n == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(LaunchBf16ToFp32(in, out, n, stream), kOp);
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
