#ifndef SHARDD_MODEL_HF_CONFIG_H_
#define SHARDD_MODEL_HF_CONFIG_H_

// Hugging Face config.json -> module tree with exact parameter names, shapes
// and dtypes. Grouped experts are always stored stacked as
// `...moe.experts.gate_and_up_projs` [E, D, 2I] and `...moe.experts.down_projs`
// [E, I, D], whatever the checkpoint's own naming.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/model.pb.h"

namespace shardd {

// Architecture class names ModelSpecFromHfConfig understands, sorted.
std::vector<std::string> SupportedArchitectures();

// Parses a config.json. The architecture comes from `architectures[0]`.
// Errors: INVALID_ARGUMENT for malformed JSON, a missing, non-integer, zero or
// negative size (the message names the JSON field and the allowed range), or
// an unknown architecture (the message lists the supported ones).
absl::StatusOr<v1::ModelSpec> ModelSpecFromHfConfig(absl::string_view json);

}  // namespace shardd

#endif  // SHARDD_MODEL_HF_CONFIG_H_
