#ifndef SHARDD_COMMON_DTYPE_H_
#define SHARDD_COMMON_DTYPE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/model.pb.h"

namespace shardd {

// Bytes per element; 0 for DTYPE_UNSPECIFIED.
int64_t DTypeBytes(v1::DType dtype);

// Short lower-case name: "float32", "bfloat16", "float16", "float8_e4m3",
// "int32", "int64".
std::string DTypeName(v1::DType dtype);

// Accepts the short names above and the usual aliases ("fp32", "f32",
// "bf16", "fp16", "half", "float", "torch.bfloat16", ...), case-insensitive.
// Errors: INVALID_ARGUMENT naming the allowed values.
absl::StatusOr<v1::DType> ParseDType(absl::string_view name);

}  // namespace shardd

#endif  // SHARDD_COMMON_DTYPE_H_
