#include "model/model_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardd {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
// Parameters (and models) must stay exactly representable as doubles, which
// the JSON writers and byte estimates rely on.
constexpr int64_t kMaxElements = int64_t{1} << 53;
// Deeper trees are certainly malformed; bounding the depth keeps every
// recursive walk (ours and protobuf's) far from the stack limit.
constexpr int kMaxModuleDepth = 64;

// a + b, saturating at INT64_MAX (both non-negative).
int64_t SaturatingAdd(int64_t a, int64_t b) {
  return a > kInt64Max - b ? kInt64Max : a + b;
}

std::string JoinName(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

std::string ShapeString(const v1::TensorSpec& t) {
  return ShapeText(t.shape());
}

void Walk(const v1::ModuleSpec& module, const std::string& fqn,
          std::vector<const v1::ModuleSpec*>* path,
          std::vector<std::string>* path_names,
          const std::function<void(const ParamRef&)>& fn) {
  path->push_back(&module);
  path_names->push_back(fqn);
  for (const v1::TensorSpec& t : module.params()) {
    ParamRef ref;
    ref.fqn = JoinName(fqn, t.name());
    ref.tensor = &t;
    ref.path = *path;
    ref.path_names = *path_names;
    fn(ref);
  }
  for (const v1::ModuleSpec& child : module.children()) {
    Walk(child, JoinName(fqn, child.name()), path, path_names, fn);
  }
  path->pop_back();
  path_names->pop_back();
}

// Structural checks of one module and (recursively) its children; collects
// every parameter by name for the tied_to pass.
absl::Status ValidateModule(
    const v1::ModuleSpec& module, const std::string& fqn, int depth,
    std::map<std::string, const v1::TensorSpec*>* params, int64_t* total) {
  const std::string where = fqn.empty() ? "root module" : "module " + fqn;
  if (depth > kMaxModuleDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": module tree deeper than ", kMaxModuleDepth, " levels"));
  }
  std::set<std::string> sibling_names;
  auto check_name = [&](const std::string& name,
                        const char* what) -> absl::Status {
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a ", what, " has an empty name; names must be non-empty"));
    }
    if (name.find('.') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", what, " name \"", name,
                       "\" contains '.'; names are single path components"));
    }
    if (!sibling_names.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": name \"", name,
                       "\" is used twice; parameter and child module names "
                       "must be unique within a module"));
    }
    return absl::OkStatus();
  };

  for (const v1::TensorSpec& t : module.params()) {
    absl::Status s = check_name(t.name(), "parameter");
    if (!s.ok()) return s;
    const std::string name = JoinName(fqn, t.name());
    if (t.shape().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", name, ": shape has no dimensions; need at least 1"));
    }
    int64_t numel = 1;
    for (int i = 0; i < t.shape_size(); ++i) {
      const int64_t d = t.shape(i);
      if (d < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", name, ": shape[", i, "] is ", d,
                         "; every dimension must be >= 1"));
      }
      if (numel > (kMaxElements - 1) / d) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", name, ": shape ", ShapeString(t),
            " has 2^53 or more elements; the limit is below 2^53"));
      }
      numel *= d;
    }
    if (t.dtype() == v1::DTYPE_UNSPECIFIED || !v1::DType_IsValid(t.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", name,
          ": dtype is not set; allowed: float32, bfloat16, float16, "
          "float8_e4m3, int32, int64"));
    }
    if (!t.tied_to().empty()) {
      // Tied parameters share storage; they add nothing to the total.
    } else {
      *total += numel;
      if (*total >= kMaxElements) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter ", name,
            ": the model's total parameter count reaches 2^53; the limit is "
            "below 2^53"));
      }
    }
    (*params)[name] = &t;
  }

  if (module.kind() == v1::MODULE_GROUPED_EXPERTS) {
    const v1::TensorSpec* gate_up = nullptr;
    const v1::TensorSpec* down = nullptr;
    for (const v1::TensorSpec& t : module.params()) {
      if (t.name() == "gate_and_up_projs") gate_up = &t;
      if (t.name() == "down_projs") down = &t;
    }
    if (gate_up == nullptr || down == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": grouped experts must hold gate_and_up_projs [E, D, 2I] and "
          "down_projs [E, I, D]"));
    }
    if (gate_up->shape_size() != 3 || gate_up->shape(2) % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", JoinName(fqn, "gate_and_up_projs"), ": shape ",
          ShapeString(*gate_up), " must be [E, D, 2I] (3-D, last dim even)"));
    }
    const int64_t e = gate_up->shape(0);
    const int64_t d = gate_up->shape(1);
    const int64_t i = gate_up->shape(2) / 2;
    if (down->shape_size() != 3 || down->shape(0) != e || down->shape(1) != i ||
        down->shape(2) != d) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", JoinName(fqn, "down_projs"), ": shape ",
          ShapeString(*down), " must be [E, I, D] = [", e, ", ", i, ", ", d,
          "] to match gate_and_up_projs ", ShapeString(*gate_up)));
    }
    // Optional expert biases (GPT-OSS) must agree too.
    for (const v1::TensorSpec& t : module.params()) {
      int64_t want = -1;
      if (t.name() == "gate_up_proj_bias") want = 2 * i;
      if (t.name() == "down_proj_bias") want = d;
      if (want < 0) continue;
      if (t.shape_size() != 2 || t.shape(0) != e || t.shape(1) != want) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", JoinName(fqn, t.name()), ": shape ",
                         ShapeString(t), " must be [", e, ", ", want, "]"));
      }
    }
  }

  for (const v1::ModuleSpec& child : module.children()) {
    absl::Status s = check_name(child.name(), "child module");
    if (!s.ok()) return s;
    s = ValidateModule(child, JoinName(fqn, child.name()), depth + 1, params,
                       total);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Numel(const v1::TensorSpec& tensor) {
  int64_t n = 1;
  for (int64_t d : tensor.shape()) {
    // Invalid (unvalidated) shapes must not cause overflow: clamp instead.
    if (d <= 0) return 0;
    if (n > kInt64Max / d) return kInt64Max;
    n *= d;
  }
  return n;
}

void ForEachParam(const v1::ModelSpec& model,
                  const std::function<void(const ParamRef&)>& fn) {
  if (!model.has_root()) return;
  std::vector<const v1::ModuleSpec*> path;
  std::vector<std::string> path_names;
  Walk(model.root(), "", &path, &path_names, fn);
}

std::vector<ParamRef> ListParams(const v1::ModelSpec& model) {
  std::vector<ParamRef> out;
  ForEachParam(model, [&out](const ParamRef& ref) { out.push_back(ref); });
  return out;
}

v1::ModelSummary Summarize(const v1::ModelSpec& model) {
  int64_t total = 0;
  int64_t trainable = 0;
  int64_t experts = 0;
  int64_t trainable_experts = 0;  // Excluded from the non-expert share.
  int32_t tensors = 0;
  ForEachParam(model, [&](const ParamRef& ref) {
    ++tensors;
    if (!ref.tensor->tied_to().empty()) return;
    const int64_t n = Numel(*ref.tensor);
    total = SaturatingAdd(total, n);
    const bool is_expert =
        ref.path.back()->kind() == v1::MODULE_GROUPED_EXPERTS;
    if (is_expert) experts = SaturatingAdd(experts, n);
    if (!ref.tensor->frozen()) {
      trainable = SaturatingAdd(trainable, n);
      if (is_expert) trainable_experts = SaturatingAdd(trainable_experts, n);
    }
  });
  v1::ModelSummary summary;
  summary.set_total_params(total);
  summary.set_trainable_params(trainable);
  summary.set_expert_params(experts);
  summary.set_num_param_tensors(tensors);
  // Per token: every trainable non-expert parameter plus the routed share
  // (top_k / E) of the experts. In double: totals can reach 2^53.
  const int32_t e = model.dims().num_experts();
  const int32_t k = model.dims().top_k();
  const double share =
      (e > 0 && k > 0 && k < e) ? static_cast<double>(k) / e : 1.0;
  const double active = static_cast<double>(trainable - trainable_experts) +
                        share * static_cast<double>(experts);
  summary.set_active_params(active >= 9.2e18 ? kInt64Max
                                             : std::llround(active));
  return summary;
}

absl::Status ValidateModelSpec(const v1::ModelSpec& model) {
  if (model.architecture().empty()) {
    return absl::InvalidArgumentError(
        "architecture: must be a non-empty class name");
  }
  if (!model.has_root()) {
    return absl::InvalidArgumentError("root: the model has no root module");
  }
  if (!model.root().name().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("root: the root module's name must be empty, got \"",
                     model.root().name(), "\""));
  }
  std::map<std::string, const v1::TensorSpec*> params;
  int64_t total = 0;
  absl::Status s = ValidateModule(model.root(), "", 0, &params, &total);
  if (!s.ok()) return s;
  for (const auto& [name, tensor] : params) {
    if (tensor->tied_to().empty()) continue;
    auto it = params.find(tensor->tied_to());
    if (it == params.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, ": tied_to \"", tensor->tied_to(),
                       "\" names no parameter of the model"));
    }
    const v1::TensorSpec& target = *it->second;
    if (!target.tied_to().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, ": tied_to \"", tensor->tied_to(),
                       "\" is itself tied; it must name an untied parameter"));
    }
    if (target.shape().size() != tensor->shape().size() ||
        !std::equal(target.shape().begin(), target.shape().end(),
                    tensor->shape().begin())) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, ": shape ", ShapeString(*tensor),
                       " differs from its tied_to target ", tensor->tied_to(),
                       " ", ShapeString(target)));
    }
  }
  return absl::OkStatus();
}

AttentionHeads AttentionHeadsOf(const v1::ModelDims& dims, int64_t hidden) {
  AttentionHeads heads;
  heads.q = dims.num_attention_heads();
  heads.kv = dims.num_key_value_heads() > 0 ? dims.num_key_value_heads()
                                            : dims.num_attention_heads();
  heads.dim = dims.head_dim() > 0 ? dims.head_dim()
                                  : (heads.q > 0 ? hidden / heads.q : 0);
  return heads;
}

}  // namespace shardd
