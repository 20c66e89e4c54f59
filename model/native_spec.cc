#include "model/native_spec.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "model/hf_config.h"
#include "model/json_describe.h"
#include "model/model_util.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace {

// A protobuf util::Status as an absl::Status (protobuf 3.21 has its own).
template <typename S>
absl::Status ToAbsl(const S& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(std::string(status.message()));
}

using nlohmann::json;

// Same bound as ValidateModelSpec; checked while parsing so the error names
// the JSON path and the recursion below stays shallow.
constexpr int kMaxDepth = 64;
constexpr int64_t kMaxDim = int64_t{1} << 53;

struct KindName {
  v1::ModuleKind kind;
  const char* name;
};

constexpr KindName kKinds[] = {
    {v1::MODULE_GENERIC, "generic"},
    {v1::MODULE_MODEL, "model"},
    {v1::MODULE_LAYER_LIST, "layer_list"},
    {v1::MODULE_DECODER_LAYER, "decoder_layer"},
    {v1::MODULE_ATTENTION, "attention"},
    {v1::MODULE_MLP, "mlp"},
    {v1::MODULE_MOE, "moe"},
    {v1::MODULE_ROUTER, "router"},
    {v1::MODULE_GROUPED_EXPERTS, "grouped_experts"},
    {v1::MODULE_EMBEDDING, "embedding"},
    {v1::MODULE_NORM, "norm"},
    {v1::MODULE_LM_HEAD, "lm_head"},
    {v1::MODULE_KIND_UNSPECIFIED, "unspecified"},
};

std::string KindToName(v1::ModuleKind kind) {
  for (const KindName& k : kKinds) {
    if (k.kind == kind) return k.name;
  }
  return "unspecified";
}

std::string AllowedKinds() {
  std::vector<std::string> names;
  for (const KindName& k : kKinds) names.push_back(k.name);
  return absl::StrJoin(names, ", ");
}

std::string ActivationToName(v1::Activation a) {
  switch (a) {
    case v1::SWIGLU:
      return "swiglu";
    case v1::GEGLU:
      return "geglu";
    case v1::SWIGLU_OAI:
      return "swiglu_oai";
    default:
      return "unspecified";
  }
}

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// Rejects members other than `allowed` (typos in hand-written specs would
// otherwise be silently ignored). Members starting with '_' are comments.
absl::Status CheckMembers(const json& obj, const std::string& path,
                          std::initializer_list<const char*> allowed) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (!key.empty() && key[0] == '_') continue;
    bool ok = false;
    for (const char* a : allowed) ok |= key == a;
    if (!ok) {
      std::vector<std::string> names(allowed.begin(), allowed.end());
      return Bad(path.empty() ? key : absl::StrCat(path, ".", key),
                 absl::StrCat("unknown member; allowed: ",
                              absl::StrJoin(names, ", ")));
    }
  }
  return absl::OkStatus();
}

std::string Sub(const std::string& path, const char* key) {
  return path.empty() ? key : absl::StrCat(path, ".", key);
}

absl::StatusOr<int64_t> ReadInt(const json& v, const std::string& path,
                                int64_t lo, int64_t hi) {
  const std::string allowed =
      absl::StrCat("must be an integer in [", lo, ", ", hi, "], got ");
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) {
      return Bad(path, absl::StrCat(allowed, u));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) return Bad(path, absl::StrCat(allowed, i));
    return i;
  }
  return Bad(path, absl::StrCat(allowed, DescribeJson(v)));
}

absl::StatusOr<std::string> ReadString(const json& v, const std::string& path) {
  if (!v.is_string()) {
    return Bad(path, absl::StrCat("must be a string, got ", DescribeJson(v)));
  }
  return v.get<std::string>();
}

absl::StatusOr<v1::DType> ReadDType(const json& v, const std::string& path) {
  SHARDD_ASSIGN_OR_RETURN(std::string name, ReadString(v, path));
  auto dtype = ParseDType(name);
  if (!dtype.ok()) return Bad(path, dtype.status().message());
  return *dtype;
}

absl::StatusOr<v1::ModelDims> ReadDims(const json& v, const std::string& path) {
  if (!v.is_object()) {
    return Bad(path, absl::StrCat("must be an object, got ", DescribeJson(v)));
  }
  SHARDD_RETURN_IF_ERROR(CheckMembers(v, path,
                                      {"vocab_size",
                                       "hidden_size",
                                       "num_layers",
                                       "num_experts",
                                       "top_k",
                                       "moe_intermediate_size",
                                       "dense_intermediate_size",
                                       "num_shared_experts",
                                       "first_k_dense_layers",
                                       "activation",
                                       "tie_word_embeddings",
                                       "rms_norm_eps",
                                       "num_attention_heads",
                                       "num_key_value_heads",
                                       "head_dim",
                                       "attention",
                                       "final_logit_softcapping",
                                       "embedding_scale",
                                       "canvas_length",
                                       "norm_topk_prob",
                                       "router_scoring",
                                       "swiglu_limit",
                                       "swiglu_alpha",
                                       "n_group",
                                       "topk_group",
                                       "routed_scaling_factor",
                                       "router_aux_loss_coef",
                                       "pad_token_id"}));
  v1::ModelDims d;
  constexpr int64_t kI32 = 2147483647;
  constexpr int64_t kBig = kMaxDim - 1;
  struct IntField {
    const char* key;
    int64_t hi;
    std::function<void(int64_t)> set;
  };
  const IntField fields[] = {
      {"vocab_size", kBig, [&](int64_t x) { d.set_vocab_size(x); }},
      {"hidden_size", kBig, [&](int64_t x) { d.set_hidden_size(x); }},
      {"num_layers", kI32, [&](int64_t x) { d.set_num_layers(x); }},
      {"num_experts", kI32, [&](int64_t x) { d.set_num_experts(x); }},
      {"top_k", kI32, [&](int64_t x) { d.set_top_k(x); }},
      {"moe_intermediate_size", kBig,
       [&](int64_t x) { d.set_moe_intermediate_size(x); }},
      {"dense_intermediate_size", kBig,
       [&](int64_t x) { d.set_dense_intermediate_size(x); }},
      {"num_shared_experts", kI32,
       [&](int64_t x) { d.set_num_shared_experts(x); }},
      {"first_k_dense_layers", kI32,
       [&](int64_t x) { d.set_first_k_dense_layers(x); }},
      {"num_attention_heads", kI32,
       [&](int64_t x) { d.set_num_attention_heads(x); }},
      {"num_key_value_heads", kI32,
       [&](int64_t x) { d.set_num_key_value_heads(x); }},
      {"head_dim", kBig, [&](int64_t x) { d.set_head_dim(x); }},
      {"n_group", kI32, [&](int64_t x) { d.set_n_group(x); }},
      {"topk_group", kI32, [&](int64_t x) { d.set_topk_group(x); }},
      {"canvas_length", kBig, [&](int64_t x) { d.set_canvas_length(x); }},
      {"pad_token_id", kBig, [&](int64_t x) { d.set_pad_token_id(x); }},
  };
  // Every size is optional and defaults to 0 ("none").
  for (const IntField& f : fields) {
    auto it = v.find(f.key);
    if (it == v.end()) continue;
    SHARDD_ASSIGN_OR_RETURN(int64_t x, ReadInt(*it, Sub(path, f.key), 0, f.hi));
    f.set(x);
  }
  if (d.top_k() > d.num_experts()) {
    return Bad(Sub(path, "top_k"),
               absl::StrCat("must be at most num_experts (", d.num_experts(),
                            "), got ", d.top_k()));
  }
  if (auto it = v.find("activation"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(std::string a,
                            ReadString(*it, Sub(path, "activation")));
    if (a == "swiglu") {
      d.set_activation(v1::SWIGLU);
    } else if (a == "geglu") {
      d.set_activation(v1::GEGLU);
    } else if (a == "swiglu_oai") {
      d.set_activation(v1::SWIGLU_OAI);
    } else if (a != "unspecified") {
      return Bad(Sub(path, "activation"),
                 absl::StrCat("unknown activation \"", a,
                              "\"; allowed: swiglu, geglu, swiglu_oai, "
                              "unspecified"));
    }
  }
  if (auto it = v.find("router_scoring"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(std::string a,
                            ReadString(*it, Sub(path, "router_scoring")));
    if (a == "topk_then_softmax") {
      d.set_router_scoring(v1::ROUTER_TOPK_THEN_SOFTMAX);
    } else if (a == "sigmoid_group_limited") {
      d.set_router_scoring(v1::ROUTER_SIGMOID_GROUP_LIMITED);
    } else if (a != "softmax_then_topk") {
      return Bad(Sub(path, "router_scoring"),
                 absl::StrCat("unknown router scoring \"", a,
                              "\"; allowed: softmax_then_topk, "
                              "topk_then_softmax, sigmoid_group_limited"));
    }
  }
  for (const char* key :
       {"swiglu_limit", "swiglu_alpha", "routed_scaling_factor",
        "router_aux_loss_coef"}) {
    auto it = v.find(key);
    if (it == v.end()) continue;
    if (!it->is_number() || !std::isfinite(it->get<double>()) ||
        it->get<double>() < 0) {
      return Bad(Sub(path, key), absl::StrCat("must be a non-negative number, "
                                              "got ",
                                              DescribeJson(*it)));
    }
    if (std::string(key) == "swiglu_limit") {
      d.set_swiglu_limit(it->get<double>());
    } else if (std::string(key) == "swiglu_alpha") {
      d.set_swiglu_alpha(it->get<double>());
    } else if (std::string(key) == "routed_scaling_factor") {
      d.set_routed_scaling_factor(it->get<double>());
    } else {
      d.set_router_aux_loss_coef(it->get<double>());
    }
  }
  if (auto it = v.find("tie_word_embeddings"); it != v.end()) {
    if (!it->is_boolean()) {
      return Bad(
          Sub(path, "tie_word_embeddings"),
          absl::StrCat("must be true or false, got ", DescribeJson(*it)));
    }
    d.set_tie_word_embeddings(it->get<bool>());
  }
  if (auto it = v.find("rms_norm_eps"); it != v.end()) {
    if (!it->is_number() || !std::isfinite(it->get<double>()) ||
        it->get<double>() < 0) {
      return Bad(Sub(path, "rms_norm_eps"),
                 absl::StrCat("must be a non-negative number, got ",
                              DescribeJson(*it)));
    }
    d.set_rms_norm_eps(it->get<double>());
  }
  if (auto it = v.find("norm_topk_prob"); it != v.end()) {
    if (!it->is_boolean()) {
      return Bad(
          Sub(path, "norm_topk_prob"),
          absl::StrCat("must be true or false, got ", DescribeJson(*it)));
    }
    d.set_norm_topk_prob(it->get<bool>());
  }
  for (const char* key : {"final_logit_softcapping", "embedding_scale"}) {
    auto it = v.find(key);
    if (it == v.end()) continue;
    if (!it->is_number() || !std::isfinite(it->get<double>()) ||
        it->get<double>() < 0) {
      return Bad(Sub(path, key), absl::StrCat("must be a non-negative number, "
                                              "got ",
                                              DescribeJson(*it)));
    }
    if (std::string(key) == "final_logit_softcapping") {
      d.set_final_logit_softcapping(it->get<double>());
    } else {
      d.set_embedding_scale(it->get<double>());
    }
  }
  if (auto it = v.find("attention"); it != v.end()) {
    // The AttentionSpec message in its proto JSON form (field names as in
    // proto/model.proto); values are checked where they are used.
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const absl::Status parsed =
        ToAbsl(google::protobuf::util::JsonStringToMessage(
            it->dump(), d.mutable_attention(), options));
    if (!parsed.ok()) {
      return Bad(Sub(path, "attention"), parsed.message());
    }
  }
  return d;
}

absl::Status ReadParam(const json& v, const std::string& path,
                       v1::DType default_dtype, v1::TensorSpec* t) {
  if (!v.is_object()) {
    return Bad(path, absl::StrCat("must be an object, got ", DescribeJson(v)));
  }
  SHARDD_RETURN_IF_ERROR(
      CheckMembers(v, path, {"name", "shape", "dtype", "frozen", "tied_to"}));
  auto name = v.find("name");
  if (name == v.end()) {
    return Bad(Sub(path, "name"), "missing; must be a non-empty string");
  }
  SHARDD_ASSIGN_OR_RETURN(*t->mutable_name(),
                          ReadString(*name, Sub(path, "name")));
  auto shape = v.find("shape");
  if (shape == v.end()) {
    return Bad(Sub(path, "shape"),
               "missing; must be a non-empty array of integers >= 1");
  }
  if (!shape->is_array() || shape->empty()) {
    return Bad(Sub(path, "shape"),
               absl::StrCat("must be a non-empty array of integers >= 1, got ",
                            DescribeJson(*shape)));
  }
  for (size_t i = 0; i < shape->size(); ++i) {
    SHARDD_ASSIGN_OR_RETURN(
        int64_t d, ReadInt((*shape)[i], absl::StrCat(path, ".shape[", i, "]"),
                           1, kMaxDim - 1));
    t->add_shape(d);
  }
  t->set_dtype(default_dtype);
  if (auto it = v.find("dtype"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(v1::DType dt, ReadDType(*it, Sub(path, "dtype")));
    t->set_dtype(dt);
  }
  if (auto it = v.find("frozen"); it != v.end()) {
    if (!it->is_boolean()) {
      return Bad(
          Sub(path, "frozen"),
          absl::StrCat("must be true or false, got ", DescribeJson(*it)));
    }
    t->set_frozen(it->get<bool>());
  }
  if (auto it = v.find("tied_to"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(*t->mutable_tied_to(),
                            ReadString(*it, Sub(path, "tied_to")));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModuleKind> ReadKind(const json& v,
                                        const std::string& path) {
  SHARDD_ASSIGN_OR_RETURN(std::string s, ReadString(v, path));
  for (const KindName& k : kKinds) {
    if (s == k.name) return k.kind;
  }
  return Bad(path, absl::StrCat("unknown module kind \"", s,
                                "\"; allowed: ", AllowedKinds()));
}

absl::Status ReadModule(const json& v, const std::string& path, bool is_root,
                        int depth, v1::DType default_dtype, v1::ModuleSpec* m) {
  if (depth > kMaxDepth) {
    return Bad(path, absl::StrCat("modules nested deeper than ", kMaxDepth,
                                  " levels"));
  }
  if (!v.is_object()) {
    return Bad(path, absl::StrCat("must be an object, got ", DescribeJson(v)));
  }
  SHARDD_RETURN_IF_ERROR(
      CheckMembers(v, path, {"name", "kind", "params", "children"}));
  if (auto it = v.find("name"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(*m->mutable_name(),
                            ReadString(*it, Sub(path, "name")));
  } else if (!is_root) {
    return Bad(Sub(path, "name"), "missing; must be a non-empty string");
  }
  if (is_root && !m->name().empty()) {
    return Bad(Sub(path, "name"), "the root module's name must be empty");
  }
  m->set_kind(is_root ? v1::MODULE_MODEL : v1::MODULE_GENERIC);
  if (auto it = v.find("kind"); it != v.end()) {
    SHARDD_ASSIGN_OR_RETURN(v1::ModuleKind kind,
                            ReadKind(*it, Sub(path, "kind")));
    m->set_kind(kind);
  }
  if (auto it = v.find("params"); it != v.end()) {
    if (!it->is_array()) {
      return Bad(Sub(path, "params"),
                 absl::StrCat("must be an array, got ", DescribeJson(*it)));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      SHARDD_RETURN_IF_ERROR(ReadParam((*it)[i],
                                       absl::StrCat(path, ".params[", i, "]"),
                                       default_dtype, m->add_params()));
    }
  }
  if (auto it = v.find("children"); it != v.end()) {
    if (!it->is_array()) {
      return Bad(Sub(path, "children"),
                 absl::StrCat("must be an array, got ", DescribeJson(*it)));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      SHARDD_RETURN_IF_ERROR(
          ReadModule((*it)[i], absl::StrCat(path, ".children[", i, "]"), false,
                     depth + 1, default_dtype, m->add_children()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelSpec> FromNativeDoc(const json& doc) {
  if (!doc.is_object()) {
    return Bad("spec",
               absl::StrCat("must be a JSON object, got ", DescribeJson(doc)));
  }
  SHARDD_RETURN_IF_ERROR(CheckMembers(
      doc, "", {"architecture", "model_type", "dtype", "dims", "root"}));
  v1::ModelSpec spec;
  auto arch = doc.find("architecture");
  if (arch == doc.end()) {
    return Bad("architecture", "missing; must be a non-empty string");
  }
  SHARDD_ASSIGN_OR_RETURN(*spec.mutable_architecture(),
                          ReadString(*arch, "architecture"));
  if (spec.architecture().empty()) {
    return Bad("architecture", "must be a non-empty string");
  }
  if (auto it = doc.find("model_type"); it != doc.end()) {
    SHARDD_ASSIGN_OR_RETURN(*spec.mutable_model_type(),
                            ReadString(*it, "model_type"));
  }
  spec.set_dtype(v1::FLOAT32);
  if (auto it = doc.find("dtype"); it != doc.end()) {
    SHARDD_ASSIGN_OR_RETURN(v1::DType dt, ReadDType(*it, "dtype"));
    spec.set_dtype(dt);
  }
  if (auto it = doc.find("dims"); it != doc.end()) {
    SHARDD_ASSIGN_OR_RETURN(*spec.mutable_dims(), ReadDims(*it, "dims"));
  }
  auto root = doc.find("root");
  if (root == doc.end()) return Bad("root", "missing; must be an object");
  SHARDD_RETURN_IF_ERROR(
      ReadModule(*root, "root", true, 0, spec.dtype(), spec.mutable_root()));
  absl::Status valid = ValidateModelSpec(spec);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid model spec: ", valid.message()));
  }
  return spec;
}

json ModuleToJson(const v1::ModuleSpec& m, v1::DType default_dtype,
                  bool is_root) {
  json out = json::object();
  if (!is_root || !m.name().empty()) out["name"] = m.name();
  out["kind"] = KindToName(m.kind());
  if (m.params_size() > 0) {
    json params = json::array();
    for (const v1::TensorSpec& t : m.params()) {
      json p = json::object();
      p["name"] = t.name();
      json shape = json::array();
      for (int64_t d : t.shape()) shape.push_back(d);
      p["shape"] = std::move(shape);
      if (t.dtype() != default_dtype) p["dtype"] = DTypeName(t.dtype());
      if (t.frozen()) p["frozen"] = true;
      if (!t.tied_to().empty()) p["tied_to"] = t.tied_to();
      params.push_back(std::move(p));
    }
    out["params"] = std::move(params);
  }
  if (m.children_size() > 0) {
    json children = json::array();
    for (const v1::ModuleSpec& c : m.children()) {
      children.push_back(ModuleToJson(c, default_dtype, false));
    }
    out["children"] = std::move(children);
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::ModelSpec> ModelSpecFromNativeJson(absl::string_view text) {
  const json doc = json::parse(text.begin(), text.end(), nullptr,
                               /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(
        "spec: malformed JSON; expected one JSON object");
  }
  return FromNativeDoc(doc);
}

std::string ModelSpecToNativeJson(const v1::ModelSpec& model) {
  // nlohmann's default object type sorts keys; that is fine for a format
  // read by key.
  json doc = json::object();
  doc["architecture"] = model.architecture();
  if (!model.model_type().empty()) doc["model_type"] = model.model_type();
  doc["dtype"] = DTypeName(model.dtype());
  const v1::ModelDims& d = model.dims();
  json dims = json::object();
  dims["vocab_size"] = d.vocab_size();
  dims["hidden_size"] = d.hidden_size();
  dims["num_layers"] = d.num_layers();
  dims["num_experts"] = d.num_experts();
  dims["top_k"] = d.top_k();
  dims["moe_intermediate_size"] = d.moe_intermediate_size();
  dims["dense_intermediate_size"] = d.dense_intermediate_size();
  dims["num_shared_experts"] = d.num_shared_experts();
  dims["first_k_dense_layers"] = d.first_k_dense_layers();
  dims["activation"] = ActivationToName(d.activation());
  dims["tie_word_embeddings"] = d.tie_word_embeddings();
  dims["rms_norm_eps"] = d.rms_norm_eps();
  dims["num_attention_heads"] = d.num_attention_heads();
  dims["num_key_value_heads"] = d.num_key_value_heads();
  dims["head_dim"] = d.head_dim();
  if (d.norm_topk_prob()) dims["norm_topk_prob"] = true;
  if (d.router_scoring() == v1::ROUTER_TOPK_THEN_SOFTMAX) {
    dims["router_scoring"] = "topk_then_softmax";
  } else if (d.router_scoring() == v1::ROUTER_SIGMOID_GROUP_LIMITED) {
    dims["router_scoring"] = "sigmoid_group_limited";
  }
  if (d.n_group() != 0) dims["n_group"] = d.n_group();
  if (d.topk_group() != 0) dims["topk_group"] = d.topk_group();
  if (d.routed_scaling_factor() != 0) {
    dims["routed_scaling_factor"] = d.routed_scaling_factor();
  }
  if (d.router_aux_loss_coef() != 0) {
    dims["router_aux_loss_coef"] = d.router_aux_loss_coef();
  }
  if (d.swiglu_limit() != 0) dims["swiglu_limit"] = d.swiglu_limit();
  if (d.swiglu_alpha() != 0) dims["swiglu_alpha"] = d.swiglu_alpha();
  if (d.final_logit_softcapping() != 0) {
    dims["final_logit_softcapping"] = d.final_logit_softcapping();
  }
  if (d.embedding_scale() != 0) dims["embedding_scale"] = d.embedding_scale();
  if (d.canvas_length() != 0) dims["canvas_length"] = d.canvas_length();
  if (d.has_pad_token_id()) dims["pad_token_id"] = d.pad_token_id();
  if (d.has_attention()) {
    std::string text;
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    if (google::protobuf::util::MessageToJsonString(d.attention(), &text,
                                                    options)
            .ok()) {
      dims["attention"] = json::parse(text);
    }
  }
  doc["dims"] = std::move(dims);
  doc["root"] = ModuleToJson(model.root(), model.dtype(), true);
  // Replace invalid UTF-8 instead of throwing (names come from callers).
  return doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

absl::StatusOr<v1::ModelSpec> ModelSpecFromJson(absl::string_view text) {
  const json doc = json::parse(text.begin(), text.end(), nullptr,
                               /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(
        "malformed JSON; expected one JSON object (a native spec or a "
        "config.json)");
  }
  if (doc.is_object() && doc.contains("root")) return FromNativeDoc(doc);
  SHARDD_ASSIGN_OR_RETURN(v1::ModelSpec spec, ModelSpecFromHfConfig(text));
  spec.set_hf_config_json(std::string(text));
  return spec;
}

}  // namespace shardd
