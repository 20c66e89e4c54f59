#ifndef SHARDD_MODEL_NATIVE_SPEC_H_
#define SHARDD_MODEL_NATIVE_SPEC_H_

// shardd's native JSON model spec: the module tree written by hand (see
// docs/model-spec.md). Used for custom models and by the training path.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/model.pb.h"

namespace shardd {

// Parses and validates (ValidateModelSpec) a native spec.
// Errors: INVALID_ARGUMENT naming the JSON path of the bad field
// ("root.children[1].params[0].shape[2]") and what is allowed.
absl::StatusOr<v1::ModelSpec> ModelSpecFromNativeJson(absl::string_view json);

// Writes a spec in the native format; ModelSpecFromNativeJson reads it back
// to an equal message, hf_config_json aside (the native format describes
// the model, not the file it came from).
std::string ModelSpecToNativeJson(const v1::ModelSpec& model);

// Parses either format: a document with a top-level "root" member is a native
// spec, anything else is treated as an HF config.json, whose text the spec
// keeps in hf_config_json. Errors: as the two parsers.
absl::StatusOr<v1::ModelSpec> ModelSpecFromJson(absl::string_view json);

}  // namespace shardd

#endif  // SHARDD_MODEL_NATIVE_SPEC_H_
