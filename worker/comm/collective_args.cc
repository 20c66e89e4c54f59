#include "worker/comm/collective_args.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace shardd {

bool IsReducibleDType(v1::DType dtype) {
  return dtype == v1::FLOAT32 || dtype == v1::BFLOAT16 || dtype == v1::INT32 ||
         dtype == v1::INT64;
}

absl::StatusOr<int64_t> CollectiveElementBytes(v1::DType dtype,
                                               bool needs_reduction,
                                               ReduceOp op) {
  const int64_t bytes = DTypeBytes(dtype);
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", v1::DType_Name(dtype),
                     " is not supported; allowed: FLOAT32, BFLOAT16, FLOAT16, "
                     "FLOAT8_E4M3, INT32, INT64"));
  }
  if (needs_reduction) {
    if (!IsReducibleDType(dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype ", v1::DType_Name(dtype),
          " cannot be reduced; allowed: FLOAT32, BFLOAT16, INT32, INT64"));
    }
    if (op == ReduceOp::kAvg && (dtype == v1::INT32 || dtype == v1::INT64)) {
      return absl::InvalidArgumentError(
          absl::StrCat("op kAvg needs a float dtype, got ",
                       v1::DType_Name(dtype), "; use kSum"));
    }
  }
  return bytes;
}

absl::StatusOr<int64_t> CollectiveBufferBytes(int64_t count, int64_t ranks,
                                              int64_t element_bytes,
                                              absl::string_view count_name) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(count_name, " must be >= 0, got ", count));
  }
  const int64_t per_element = ranks * element_bytes;
  if (count > std::numeric_limits<int64_t>::max() / per_element) {
    return absl::InvalidArgumentError(
        absl::StrCat(count_name, " ", count, " overflows the buffer size"));
  }
  return count * per_element;
}

absl::Status CheckCollectiveBuffer(const void* ptr, int64_t bytes,
                                   absl::string_view name) {
  if (ptr == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must not be null when the count is positive"));
  }
  return absl::OkStatus();
}

absl::Status CheckPositiveFinite(absl::Duration duration,
                                 absl::string_view name) {
  if (duration <= absl::ZeroDuration() ||
      duration == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be positive and finite, got ",
                     absl::FormatDuration(duration)));
  }
  return absl::OkStatus();
}

}  // namespace shardd
