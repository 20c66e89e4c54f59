#ifndef SHARDD_TESTING_STRATEGY_TEST_UTIL_H_
#define SHARDD_TESTING_STRATEGY_TEST_UTIL_H_

// Small hand-built module trees and checks for the strategy and layout
// tests. The shapes are tiny so expectations can be derived by hand.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/model.pb.h"
#include "model/model_util.h"
#include "planner/sharding_strategy.h"

namespace shardd {
namespace testing_util {

inline v1::TensorSpec Tensor(const std::string& name,
                             std::initializer_list<int64_t> shape,
                             v1::DType dtype = v1::BFLOAT16) {
  v1::TensorSpec tensor;
  tensor.set_name(name);
  for (int64_t dim : shape) tensor.add_shape(dim);
  tensor.set_dtype(dtype);
  return tensor;
}

inline v1::ModuleSpec Module(const std::string& name, v1::ModuleKind kind,
                             std::vector<v1::TensorSpec> params = {},
                             std::vector<v1::ModuleSpec> children = {}) {
  v1::ModuleSpec module;
  module.set_name(name);
  module.set_kind(kind);
  for (v1::TensorSpec& param : params) *module.add_params() = param;
  for (v1::ModuleSpec& child : children) *module.add_children() = child;
  return module;
}

// Sizes of the toy MoE model below.
struct ToyDims {
  int64_t vocab = 32;
  int64_t hidden = 8;
  int64_t dense_inter = 6;  // Dense MLP branch; 0 for none.
  int64_t moe_inter = 4;
  int64_t experts = 3;  // 0: no MoE branch.
  int layers = 3;
  int first_dense = 0;  // Leading layers without experts.
  bool tie_embeddings = true;
};

// Params per layer, walk order:
//   input_layernorm.weight [D]
//   self_attn.qkv [3D, D], self_attn.o [D, D]
//   mlp.gate_up [2Id, D], mlp.down [D, Id]          (when dense_inter > 0)
//   moe.router.weight [E, D]
//   moe.experts.gate_and_up_projs [E, D, 2I], moe.experts.down_projs [E, I, D]
// and outside the layers: model.embed_tokens.weight [V, D], model.norm.weight
// [D], lm_head.weight [V, D] (tied to the embedding when tie_embeddings).
inline v1::ModuleSpec ToyLayer(const ToyDims& d, int index) {
  std::vector<v1::ModuleSpec> children;
  children.push_back(Module("input_layernorm", v1::MODULE_NORM,
                            {Tensor("weight", {d.hidden})}));
  children.push_back(Module("self_attn", v1::MODULE_ATTENTION,
                            {Tensor("qkv", {3 * d.hidden, d.hidden}),
                             Tensor("o", {d.hidden, d.hidden})}));
  if (d.dense_inter > 0) {
    children.push_back(Module("mlp", v1::MODULE_MLP,
                              {Tensor("gate_up", {2 * d.dense_inter, d.hidden}),
                               Tensor("down", {d.hidden, d.dense_inter})}));
  }
  if (d.experts > 0 && index >= d.first_dense) {
    children.push_back(Module(
        "moe", v1::MODULE_MOE, {},
        {Module("router", v1::MODULE_ROUTER,
                {Tensor("weight", {d.experts, d.hidden})}),
         Module("experts", v1::MODULE_GROUPED_EXPERTS,
                {Tensor("gate_and_up_projs",
                        {d.experts, d.hidden, 2 * d.moe_inter}),
                 Tensor("down_projs", {d.experts, d.moe_inter, d.hidden})})}));
  }
  return Module(absl::StrCat(index), v1::MODULE_DECODER_LAYER, {}, children);
}

inline v1::ModelSpec ToyModel(const ToyDims& d = ToyDims()) {
  std::vector<v1::ModuleSpec> layers;
  for (int i = 0; i < d.layers; ++i) layers.push_back(ToyLayer(d, i));
  v1::TensorSpec head = Tensor("weight", {d.vocab, d.hidden});
  if (d.tie_embeddings) head.set_tied_to("model.embed_tokens.weight");
  v1::ModelSpec model;
  model.set_architecture("ToyMoeForCausalLM");
  model.set_dtype(v1::BFLOAT16);
  *model.mutable_root() = Module(
      "", v1::MODULE_MODEL, {},
      {Module(
           "model", v1::MODULE_GENERIC, {},
           {Module("embed_tokens", v1::MODULE_EMBEDDING,
                   {Tensor("weight", {d.vocab, d.hidden})}),
            Module("layers", v1::MODULE_LAYER_LIST, {}, layers),
            Module("norm", v1::MODULE_NORM, {Tensor("weight", {d.hidden})})}),
       Module("lm_head", v1::MODULE_LM_HEAD, {head})});
  return model;
}

inline std::vector<std::string> ParamNames(const UnitDraft& unit) {
  std::vector<std::string> names;
  for (const ParamRef& param : unit.params) names.push_back(param.fqn);
  return names;
}

inline std::vector<std::string> UnitNames(const UnitGrouping& grouping) {
  std::vector<std::string> names;
  for (const UnitDraft& unit : grouping.units) names.push_back(unit.name);
  return names;
}

// Every untied parameter of `model` sits in exactly one unit, tied ones in
// none, and parameters keep walk order inside each unit.
inline ::testing::AssertionResult EveryParamOnce(const v1::ModelSpec& model,
                                                 const UnitGrouping& grouping) {
  std::map<std::string, int> walk_pos;
  std::map<std::string, int> seen;
  int pos = 0;
  for (const ParamRef& param : ListParams(model)) {
    walk_pos[param.fqn] = pos++;
    if (param.tensor->tied_to().empty()) seen[param.fqn] = 0;
  }
  for (const UnitDraft& unit : grouping.units) {
    int last = -1;
    for (const ParamRef& param : unit.params) {
      auto it = seen.find(param.fqn);
      if (it == seen.end()) {
        return ::testing::AssertionFailure()
               << "unit " << unit.name << " holds tied or unknown "
               << param.fqn;
      }
      ++it->second;
      if (walk_pos[param.fqn] <= last) {
        return ::testing::AssertionFailure()
               << "unit " << unit.name << " breaks walk order at " << param.fqn;
      }
      last = walk_pos[param.fqn];
    }
  }
  for (const auto& [name, count] : seen) {
    if (count != 1) {
      return ::testing::AssertionFailure()
             << name << " appears in " << count << " units";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_STRATEGY_TEST_UTIL_H_
