#ifndef SHARDD_CHECKPOINT_JSON_TEXT_H_
#define SHARDD_CHECKPOINT_JSON_TEXT_H_

// Exception-free JSON text in and out for the checkpoint files (safetensors
// headers, index.json, Hugging Face index files), on nlohmann-json.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace checkpoint {

// Parses `text` as exactly one JSON value (surrounding whitespace allowed).
// Stricter than nlohmann's default: an object with a repeated key is an
// error instead of keeping the last value. Errors: `code` (DATA_LOSS for
// file contents) with "<what>: <syntax error at byte N ...>" or
// "<what>: key \"k\" appears twice".
absl::StatusOr<nlohmann::json> ParseJsonStrict(absl::string_view text,
                                               absl::string_view what,
                                               absl::StatusCode code);

// Serializes `value` compactly (indent < 0) or pretty-printed. Errors:
// INVALID_ARGUMENT naming the first string or key that is not valid UTF-8
// (JSON text must be).
absl::StatusOr<std::string> DumpJson(const nlohmann::json& value,
                                     int indent = -1);

// True when `text` is well-formed UTF-8 (no overlong forms or surrogates).
bool IsValidUtf8(absl::string_view text);

// Reads a non-negative integer that fits int64 (not a float, not a bool).
bool GetNonNegativeInt(const nlohmann::json& value, int64_t* out);

// Short description of a JSON value for error messages: its type and, for
// scalars, the value, cut to 40 characters.
std::string DescribeJsonValue(const nlohmann::json& value);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_JSON_TEXT_H_
