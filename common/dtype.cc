#include "common/dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardd {

int64_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
    case v1::INT32:
      return 4;
    case v1::BFLOAT16:
    case v1::FLOAT16:
      return 2;
    case v1::FLOAT8_E4M3:
      return 1;
    case v1::INT64:
      return 8;
    default:
      return 0;
  }
}

std::string DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return "float32";
    case v1::BFLOAT16:
      return "bfloat16";
    case v1::FLOAT16:
      return "float16";
    case v1::FLOAT8_E4M3:
      return "float8_e4m3";
    case v1::INT32:
      return "int32";
    case v1::INT64:
      return "int64";
    default:
      return "unspecified";
  }
}

absl::StatusOr<v1::DType> ParseDType(absl::string_view name) {
  std::string s = absl::AsciiStrToLower(name);
  // PyTorch spells dtypes "torch.bfloat16" in some configs.
  if (absl::StartsWith(s, "torch.")) s = s.substr(6);
  if (s == "float32" || s == "fp32" || s == "f32" || s == "float") {
    return v1::FLOAT32;
  }
  if (s == "bfloat16" || s == "bf16") return v1::BFLOAT16;
  if (s == "float16" || s == "fp16" || s == "f16" || s == "half") {
    return v1::FLOAT16;
  }
  if (s == "float8_e4m3" || s == "float8_e4m3fn" || s == "fp8_e4m3" ||
      s == "e4m3" || s == "fp8") {
    return v1::FLOAT8_E4M3;
  }
  if (s == "int32" || s == "i32" || s == "int") return v1::INT32;
  if (s == "int64" || s == "i64" || s == "long") return v1::INT64;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype \"", name,
      "\"; allowed: float32, bfloat16, float16, float8_e4m3, int32, int64 "
      "(aliases: fp32, f32, float, bf16, fp16, half, fp8, torch.<name>)"));
}

}  // namespace shardd
