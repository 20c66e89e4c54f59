#ifndef SHARDD_MODEL_MODEL_UTIL_H_
#define SHARDD_MODEL_MODEL_UTIL_H_

// Walking and checking model module trees.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "proto/model.pb.h"

namespace shardd {

// Product of the dimensions (1 for a scalar).
int64_t Numel(const v1::TensorSpec& tensor);

// A shape as error messages write it: "[8, 16, 32]".
std::string ShapeText(absl::Span<const int64_t> shape);

// One parameter as the walk sees it.
struct ParamRef {
  std::string fqn;  // "model.layers.3.moe.experts.down_projs"
  const v1::TensorSpec* tensor = nullptr;  // Points into the ModelSpec.
  // Modules from the root down to the owner (root first, owner last).
  std::vector<const v1::ModuleSpec*> path;
  // Fully qualified module names matching `path` ("" for the root).
  std::vector<std::string> path_names;
};

// Calls `fn` for every parameter in depth-first, declaration order: a
// module's own params, then its children. Tied parameters are visited too
// (check tensor->tied_to()).
void ForEachParam(const v1::ModelSpec& model,
                  const std::function<void(const ParamRef&)>& fn);

// All parameters in walk order.
std::vector<ParamRef> ListParams(const v1::ModelSpec& model);

// Totals; tied parameters count once, frozen ones are not trainable.
v1::ModelSummary Summarize(const v1::ModelSpec& model);

// A standard attention's head geometry from the spec's dims:
// num_attention_heads, num_key_value_heads (0: the attention heads) and
// head_dim (0: hidden / heads). Unchecked: callers refuse values < 1.
struct AttentionHeads {
  int64_t q = 0;
  int64_t kv = 0;
  int64_t dim = 0;
};
AttentionHeads AttentionHeadsOf(const v1::ModelDims& dims, int64_t hidden);

// Structural checks every spec must pass before planning:
// non-empty architecture; a root with an empty name; at most 64 module
// levels; every shape has >= 1 dimension, each >= 1 and the total below 2^53
// (and the model's untied total below 2^53); dtype set; names non-empty, free
// of '.', unique among siblings (params and child modules together); tied_to
// names an existing, untied parameter of the same shape; grouped experts
// (MODULE_GROUPED_EXPERTS) hold gate_and_up_projs [E, D, 2I] and down_projs
// [E, I, D] with matching E, D and I (and, when present, gate_up_proj_bias
// [E, 2I] and down_proj_bias [E, D]).
// Errors: INVALID_ARGUMENT naming the offending parameter or module path and
// what is allowed.
absl::Status ValidateModelSpec(const v1::ModelSpec& model);

}  // namespace shardd

#endif  // SHARDD_MODEL_MODEL_UTIL_H_
