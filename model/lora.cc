#include "model/lora.h"

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/model_util.h"

namespace shardd {
namespace {

constexpr char kExperts[] = "experts";
// The stacked expert tensors: name, and which of its dims are in and out
// (shardd's [E, in, out]).
constexpr const char* kExpertTensors[] = {"gate_and_up_projs", "down_projs"};

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// A module that computes x W^T with its 2-D "weight": not a norm, an
// embedding (looked up, not multiplied) or an adapter itself.
const v1::TensorSpec* LinearWeight(const v1::ModuleSpec& m) {
  if (m.kind() == v1::MODULE_NORM || m.kind() == v1::MODULE_EMBEDDING ||
      m.name() == "lora_A" || m.name() == "lora_B") {
    return nullptr;
  }
  for (const v1::TensorSpec& t : m.params()) {
    if (t.name() == "weight" && t.shape_size() == 2 && t.tied_to().empty()) {
      return &t;
    }
  }
  return nullptr;
}

v1::TensorSpec* AddParam(v1::ModuleSpec* m, const std::string& name,
                         std::vector<int64_t> shape, v1::DType dtype) {
  v1::TensorSpec* t = m->add_params();
  t->set_name(name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(dtype);
  return t;
}

// Calls fn(module, fqn) for every module, depth first.
void ForEachModule(
    v1::ModuleSpec* m, const std::string& fqn,
    const std::function<void(v1::ModuleSpec*, const std::string&)>& fn) {
  fn(m, fqn);
  for (v1::ModuleSpec& child : *m->mutable_children()) {
    ForEachModule(&child, Join(fqn, child.name()), fn);
  }
}

}  // namespace

LoraAdapter LoraAdapterOf(absl::string_view fqn) {
  if (absl::EndsWith(fqn, ".lora_A.weight") || absl::EndsWith(fqn, "_lora_A")) {
    return LoraAdapter::kA;
  }
  if (absl::EndsWith(fqn, ".lora_B.weight") || absl::EndsWith(fqn, "_lora_B")) {
    return LoraAdapter::kB;
  }
  return LoraAdapter::kNone;
}

absl::Status ApplyLora(const v1::LoraConfig& config, v1::ModelSpec* model) {
  if (config.rank() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lora.rank: must be >= 1, got ", config.rank()));
  }
  if (!std::isfinite(config.alpha()) || !(config.alpha() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lora.alpha: must be a finite number > 0, got ", config.alpha()));
  }
  if (config.targets().empty()) {
    return absl::InvalidArgumentError(
        "lora.targets: name at least one module (q_proj, v_proj, ..., or "
        "experts)");
  }
  if (model->lora().rank() != 0) {
    return absl::InvalidArgumentError(
        "lora: the model already has LoRA adapters");
  }
  std::set<std::string> wanted;
  for (const std::string& t : config.targets()) {
    if (!wanted.insert(t).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("lora.targets: '", t, "' is named twice"));
    }
  }
  const int64_t r = config.rank();
  std::set<std::string> matched;
  std::set<std::string> available;  // For the error message.
  ForEachModule(
      model->mutable_root(), "",
      [&](v1::ModuleSpec* m, const std::string& fqn) {
        if (m->kind() == v1::MODULE_GROUPED_EXPERTS) {
          available.insert(kExperts);
          if (!wanted.count(kExperts)) return;
          matched.insert(kExperts);
          std::vector<v1::TensorSpec> base;
          for (const v1::TensorSpec& t : m->params()) base.push_back(t);
          for (const char* name : kExpertTensors) {
            for (const v1::TensorSpec& t : base) {
              if (t.name() != name || t.shape_size() != 3) continue;
              // shardd's [E, in, out] against HF's [E, out, in].
              const int64_t e = t.shape(0), in = t.shape(1), out = t.shape(2);
              AddParam(m, absl::StrCat(name, "_lora_A"), {e, r, in}, t.dtype());
              AddParam(m, absl::StrCat(name, "_lora_B"), {e, out, r},
                       t.dtype());
            }
          }
          return;
        }
        const v1::TensorSpec* w = LinearWeight(*m);
        if (w == nullptr || fqn.empty()) return;
        available.insert(m->name());
        if (!wanted.count(m->name())) return;
        matched.insert(m->name());
        const int64_t out = w->shape(0), in = w->shape(1);
        const v1::DType dtype = w->dtype();
        v1::ModuleSpec* a = m->add_children();
        a->set_name("lora_A");
        a->set_kind(v1::MODULE_GENERIC);
        AddParam(a, "weight", {r, in}, dtype);
        v1::ModuleSpec* b = m->add_children();
        b->set_name("lora_B");
        b->set_kind(v1::MODULE_GENERIC);
        AddParam(b, "weight", {out, r}, dtype);
      });
  for (const std::string& t : wanted) {
    if (!matched.count(t)) {
      std::vector<std::string> names(available.begin(), available.end());
      return absl::InvalidArgumentError(absl::StrCat(
          "lora.targets: '", t, "' matches no linear module of ",
          model->architecture(), "; its targets are ",
          absl::StrJoin(names, ", ")));
    }
  }
  // Everything but the adapters is frozen: no gradient, no optimizer state,
  // no gradient reduce-scatter.
  ForEachModule(model->mutable_root(), "",
                [&](v1::ModuleSpec* m, const std::string& fqn) {
                  for (v1::TensorSpec& t : *m->mutable_params()) {
                    if (!IsLoraAdapter(Join(fqn, t.name()))) t.set_frozen(true);
                  }
                });
  *model->mutable_lora() = config;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<LoraTarget>> LoraTargetsOf(
    const v1::ModelSpec& model) {
  std::vector<LoraTarget> out;
  if (model.lora().rank() == 0) return out;
  const int64_t r = model.lora().rank();
  const double scale = model.lora().alpha() / static_cast<double>(r);
  std::map<std::string, const v1::TensorSpec*> params;
  std::vector<std::string> order;
  for (const ParamRef& ref : ListParams(model)) {
    params[ref.fqn] = ref.tensor;
    order.push_back(ref.fqn);
  }
  auto shape_of = [&](const std::string& name,
                      std::vector<int64_t> want) -> absl::Status {
    auto it = params.find(name);
    std::vector<int64_t> got;
    if (it != params.end()) {
      got.assign(it->second->shape().begin(), it->second->shape().end());
    }
    if (got != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lora: adapter '", name, "' must have shape ", ShapeText(want),
          it == params.end() ? " and is missing" : ", got " + ShapeText(got)));
    }
    return absl::OkStatus();
  };
  for (const std::string& fqn : order) {
    if (IsLoraAdapter(fqn)) continue;
    const v1::TensorSpec& t = *params[fqn];
    LoraTarget target;
    target.base = fqn;
    target.rank = r;
    target.scale = scale;
    if (absl::EndsWith(fqn, ".weight") && t.shape_size() == 2) {
      const std::string module = fqn.substr(0, fqn.size() - 7);
      target.a = module + ".lora_A.weight";
      target.b = module + ".lora_B.weight";
      if (!params.count(target.a)) continue;
      target.out = t.shape(0);
      target.in = t.shape(1);
      if (absl::Status s = shape_of(target.a, {r, target.in}); !s.ok()) {
        return s;
      }
      if (absl::Status s = shape_of(target.b, {target.out, r}); !s.ok()) {
        return s;
      }
    } else if (t.shape_size() == 3 && params.count(fqn + "_lora_A")) {
      target.a = fqn + "_lora_A";
      target.b = fqn + "_lora_B";
      target.experts = t.shape(0);
      target.in = t.shape(1);
      target.out = t.shape(2);
      if (absl::Status s = shape_of(target.a, {target.experts, r, target.in});
          !s.ok()) {
        return s;
      }
      if (absl::Status s =
              shape_of(target.b, {target.experts, target.out, r});
          !s.ok()) {
        return s;
      }
    } else {
      continue;
    }
    out.push_back(std::move(target));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        "lora: the model records LoRA but holds no adapters");
  }
  return out;
}

v1::ModelSpec WithoutLoraAdapters(const v1::ModelSpec& model) {
  v1::ModelSpec out = model;
  out.clear_lora();
  ForEachModule(
      out.mutable_root(), "", [](v1::ModuleSpec* m, const std::string& fqn) {
        auto* params = m->mutable_params();
        for (int i = params->size() - 1; i >= 0; --i) {
          if (IsLoraAdapter(Join(fqn, params->Get(i).name()))) {
            params->DeleteSubrange(i, 1);
          }
        }
        auto* children = m->mutable_children();
        for (int i = children->size() - 1; i >= 0; --i) {
          const std::string& name = children->Get(i).name();
          if (name == "lora_A" || name == "lora_B") {
            children->DeleteSubrange(i, 1);
          }
        }
      });
  return out;
}

}  // namespace shardd
