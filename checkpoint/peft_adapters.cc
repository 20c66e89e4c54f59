#include "checkpoint/peft_adapters.h"

#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/file_util.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/json_text.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

constexpr char kPeftPrefix[] = "base_model.model.";
constexpr char kLayers[] = "model.layers.";
// Elements converted per pread (bounds the staging buffers: 16 MiB of F32).
constexpr int64_t kChunkElements = int64_t{1} << 22;
constexpr int64_t kMaxConfigBytes = int64_t{1} << 24;

// One adapter tensor in both namings.
struct PeftTensor {
  std::string shardd;
  std::string peft;
  std::vector<int64_t> shardd_shape;
  std::vector<int64_t> peft_shape;
  // An expert lora_B: shardd [E, out, R] <-> PEFT [out, R*E].
  bool experts_b = false;
  int64_t experts = 0;
  int64_t out = 0;
  int64_t rank = 0;
  // DiffusionGemma: the encoder's copies of the same adapter (transformers
  // runs the one stack as two module trees with tied weights).
  std::vector<std::string> copies;
  // The lora_B of a down_projs into which the base folded per-expert
  // scales (DiffusionGemma's router.per_expert_scale): shardd's B[e] is
  // PEFT's times scale[e]. The base parameter whose scales they are.
  std::string scaled_by;
};

struct PeftPlan {
  std::vector<PeftTensor> tensors;  // Sorted by PEFT name.
  std::set<std::string> target_modules;
  std::set<std::string> target_parameters;
  // DiffusionGemma: target_modules as one regular expression over the
  // module paths (a name would also match the vision tower's).
  std::string target_regex;
  // PEFT's task_type: CAUSAL_LM's wrapper needs generation methods that
  // DiffusionGemma's model lacks, so none there (PEFT's plain PeftModel).
  bool causal_lm = true;
};

constexpr char kDiffusionGemma[] = "DiffusionGemmaForBlockDiffusion";
constexpr char kDgDecoder[] = "model.decoder.";
constexpr char kDgEncoderLayers[] = "model.encoder.language_model.layers.";

// transformers' DiffusionGemma paths of a shardd module or parameter path:
// the decoder's, then for a layer's the encoder's copy (moe.experts ->
// experts, moe.gate -> router).
std::vector<std::string> DgPaths(const std::string& fqn) {
  absl::string_view rest = fqn;
  if (!absl::ConsumePrefix(&rest, "model.")) return {fqn};
  std::string tail(rest);
  if (!absl::StartsWith(tail, "layers.")) {
    return {absl::StrCat(kDgDecoder, tail)};
  }
  absl::string_view in_layers = absl::string_view(tail).substr(7);
  const size_t dot = in_layers.find('.');
  std::string layer(in_layers.substr(0, dot));
  std::string inner(dot == absl::string_view::npos ? ""
                                                   : in_layers.substr(dot + 1));
  if (absl::StartsWith(inner, "moe.experts")) {
    inner = absl::StrCat("experts", inner.substr(11));
  } else if (absl::StartsWith(inner, "moe.gate")) {
    inner = absl::StrCat("router", inner.substr(8));
  }
  return {absl::StrCat(kDgDecoder, "layers.", layer, ".", inner),
          absl::StrCat(kDgEncoderLayers, layer, ".", inner)};
}

// A DiffusionGemma path within its layer ("self_attn.q_proj"), or empty
// outside the layers.
std::string DgInLayer(const std::string& hf) {
  absl::string_view rest = hf;
  if (!absl::ConsumePrefix(&rest, "model.decoder.layers.")) return "";
  const size_t dot = rest.find('.');
  return dot == absl::string_view::npos ? "" : std::string(rest.substr(dot + 1));
}

std::string RegexEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '.') out += '\\';
    out += c;
  }
  return out;
}

// PEFT's target_modules regex (re.fullmatch over module paths) for
// DiffusionGemma: the adapted linears in both stacks' layers, and the
// decoder's own ones (self_conditioning).
std::string DgTargetRegex(const std::set<std::string>& in_layer,
                          const std::set<std::string>& outside) {
  std::vector<std::string> parts;
  if (!in_layer.empty()) {
    std::vector<std::string> names;
    for (const std::string& n : in_layer) names.push_back(RegexEscape(n));
    parts.push_back(absl::StrCat(
        "model\\.(decoder|encoder\\.language_model)\\.layers\\.\\d+\\.(",
        absl::StrJoin(names, "|"), ")"));
  }
  for (const std::string& n : outside) parts.push_back(RegexEscape(n));
  return absl::StrJoin(parts, "|");
}

// The linears whose names PEFT's transformers-5 conversion of a v4 config
// turns into expert target_parameters (peft/utils/
// transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING), by
// architecture. UNIMPLEMENTED for architectures without a PEFT export.
absl::StatusOr<std::set<std::string>> RemappedLinearNames(
    const std::string& architecture) {
  absl::StatusOr<HfMoeNaming> naming = HfNamingOf(architecture);
  if (naming.ok()) {
    switch (*naming) {
      case HfMoeNaming::kNone:
        return std::set<std::string>{};
      case HfMoeNaming::kQwen3Moe:
        return std::set<std::string>{"gate_proj", "up_proj", "down_proj",
                                     "gate"};
      case HfMoeNaming::kMixtral:
        return std::set<std::string>{"w1", "w2", "w3", "gate"};
      default:
        break;
    }
  }
  return absl::UnimplementedError(absl::StrCat(
      "architecture \"", architecture,
      "\": no PEFT adapter export; supported: LlamaForCausalLM, "
      "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, MixtralForCausalLM, "
      "DiffusionGemmaForBlockDiffusion"));
}

// transformers-5's name of a shardd module or parameter path: a layer's
// moe.* is its mlp.*.
std::string HfPath(const std::string& fqn) {
  absl::string_view rest = fqn;
  if (!absl::ConsumePrefix(&rest, kLayers)) return fqn;
  const size_t dot = rest.find('.');
  if (dot == absl::string_view::npos) return fqn;
  absl::string_view tail = rest.substr(dot + 1);
  if (!absl::ConsumePrefix(&tail, "moe.")) return fqn;
  return absl::StrCat(kLayers, rest.substr(0, dot), ".mlp.", tail);
}

// A path within its layer ("mlp.gate_proj.weight"), as PEFT matches
// target_parameters by suffix; the whole path outside the layers.
std::string InLayer(const std::string& hf) {
  absl::string_view rest = hf;
  if (!absl::ConsumePrefix(&rest, kLayers)) return hf;
  const size_t dot = rest.find('.');
  if (dot == absl::string_view::npos) return hf;
  return std::string(rest.substr(dot + 1));
}

std::string ModuleOf(const std::string& fqn) {
  const size_t dot = fqn.rfind('.');
  return dot == std::string::npos ? "" : fqn.substr(0, dot);
}
std::string LeafOf(const std::string& fqn) {
  const size_t dot = fqn.rfind('.');
  return dot == std::string::npos ? fqn : fqn.substr(dot + 1);
}

// transformers' name of an adapted stacked-expert tensor; UNIMPLEMENTED
// for one the export does not know.
absl::StatusOr<std::string> HfExpertTensor(const LoraTarget& t) {
  const std::string tensor = LeafOf(t.base);
  if (tensor == "gate_and_up_projs") return std::string("gate_up_proj");
  if (tensor == "down_projs") return std::string("down_proj");
  return absl::UnimplementedError(absl::StrCat(
      "adapter of \"", t.base,
      "\": PEFT export knows gate_and_up_projs and down_projs"));
}

// The shapes of an expert target's A and B in both layouts.
void SetExpertShapes(const LoraTarget& t, PeftTensor* a, PeftTensor* b) {
  a->shardd_shape = {t.experts, t.rank, t.in};
  a->peft_shape = {t.experts * t.rank, t.in};
  b->shardd_shape = {t.experts, t.out, t.rank};
  b->peft_shape = {t.out, t.rank * t.experts};
  b->experts_b = true;
  b->experts = t.experts;
  b->out = t.out;
  b->rank = t.rank;
}

// DiffusionGemma's plan: both stacks' copies, the regex, the scaled B.
absl::StatusOr<PeftPlan> PlanDgPeft(const std::vector<LoraTarget>& targets) {
  std::map<std::string, int> adapted_in_module;
  for (const LoraTarget& t : targets) {
    if (t.experts > 0) ++adapted_in_module[ModuleOf(t.base)];
  }
  PeftPlan plan;
  std::set<std::string> in_layer, outside;
  for (const LoraTarget& t : targets) {
    PeftTensor a, b;
    a.shardd = t.a;
    b.shardd = t.b;
    std::vector<std::string> modules = DgPaths(ModuleOf(t.base));
    if (t.experts == 0) {
      const std::string where = DgInLayer(modules[0]);
      if (where.empty()) {
        outside.insert(modules[0]);
      } else {
        in_layer.insert(where);
      }
      a.shardd_shape = a.peft_shape = {t.rank, t.in};
      b.shardd_shape = b.peft_shape = {t.out, t.rank};
    } else {
      SHARDD_ASSIGN_OR_RETURN(const std::string hf_tensor, HfExpertTensor(t));
      plan.target_parameters.insert(absl::StrCat("experts.", hf_tensor));
      // gate_up_proj is registered first, so its wrapper is the inner one.
      if (hf_tensor == "gate_up_proj" &&
          adapted_in_module[ModuleOf(t.base)] > 1) {
        for (std::string& m : modules) m += ".base_layer";
      }
      SetExpertShapes(t, &a, &b);
      if (hf_tensor == "down_proj") b.scaled_by = t.base;
    }
    for (size_t i = 0; i < modules.size(); ++i) {
      const std::string ka = absl::StrCat(kPeftPrefix, modules[i],
                                          ".lora_A.weight");
      const std::string kb = absl::StrCat(kPeftPrefix, modules[i],
                                          ".lora_B.weight");
      if (i == 0) {
        a.peft = ka;
        b.peft = kb;
      } else {
        a.copies.push_back(ka);
        b.copies.push_back(kb);
      }
    }
    plan.tensors.push_back(std::move(a));
    plan.tensors.push_back(std::move(b));
  }
  plan.target_regex = DgTargetRegex(in_layer, outside);
  plan.causal_lm = false;
  std::sort(
      plan.tensors.begin(), plan.tensors.end(),
      [](const PeftTensor& x, const PeftTensor& y) { return x.peft < y.peft; });
  return plan;
}

absl::StatusOr<PeftPlan> PlanPeft(const v1::ModelSpec& model) {
  if (model.architecture() == kDiffusionGemma) {
    SHARDD_ASSIGN_OR_RETURN(const std::vector<LoraTarget> targets,
                            LoraTargetsOf(model));
    if (targets.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the model (", model.architecture(), ") has no LoRA adapters"));
    }
    return PlanDgPeft(targets);
  }
  SHARDD_ASSIGN_OR_RETURN(const std::set<std::string> remapped,
                          RemappedLinearNames(model.architecture()));
  SHARDD_ASSIGN_OR_RETURN(const std::vector<LoraTarget> targets,
                          LoraTargetsOf(model));
  if (targets.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model (", model.architecture(), ") has no LoRA adapters"));
  }
  // Expert tensors adapted per experts module: two nest (see the header).
  std::map<std::string, int> adapted_in_module;
  for (const LoraTarget& t : targets) {
    if (t.experts > 0) ++adapted_in_module[ModuleOf(t.base)];
  }
  PeftPlan plan;
  for (const LoraTarget& t : targets) {
    PeftTensor a, b;
    a.shardd = t.a;
    b.shardd = t.b;
    std::string module;  // PEFT's module path of the wrapper.
    if (t.experts == 0) {
      module = HfPath(ModuleOf(t.base));
      const std::string leaf = LeafOf(module);
      if (remapped.count(leaf) != 0) {
        plan.target_parameters.insert(InLayer(HfPath(t.base)));
      } else {
        plan.target_modules.insert(leaf);
      }
      a.shardd_shape = a.peft_shape = {t.rank, t.in};
      b.shardd_shape = b.peft_shape = {t.out, t.rank};
    } else {
      const std::string experts = HfPath(ModuleOf(t.base));
      SHARDD_ASSIGN_OR_RETURN(const std::string hf_tensor, HfExpertTensor(t));
      plan.target_parameters.insert(
          InLayer(absl::StrCat(experts, ".", hf_tensor)));
      // gate_up_proj is registered first, so its wrapper is the inner one.
      const bool inner = hf_tensor == "gate_up_proj" &&
                         adapted_in_module[ModuleOf(t.base)] > 1;
      module = inner ? experts + ".base_layer" : experts;
      SetExpertShapes(t, &a, &b);
    }
    a.peft = absl::StrCat(kPeftPrefix, module, ".lora_A.weight");
    b.peft = absl::StrCat(kPeftPrefix, module, ".lora_B.weight");
    plan.tensors.push_back(std::move(a));
    plan.tensors.push_back(std::move(b));
  }
  std::sort(
      plan.tensors.begin(), plan.tensors.end(),
      [](const PeftTensor& x, const PeftTensor& y) { return x.peft < y.peft; });
  return plan;
}

// shardd's expert lora_B [E, out, R] as PEFT's [out, R*E]:
// PEFT's B[o, r*E + e] = shardd's B[e][o, r].
std::vector<float> ExpertsBToPeft(const PeftTensor& t,
                                  const std::vector<float>& in) {
  const int64_t E = t.experts, O = t.out, R = t.rank;
  std::vector<float> out(in.size());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t r = 0; r < R; ++r) {
        out[o * R * E + r * E + e] = in[(e * O + o) * R + r];
      }
    }
  }
  return out;
}

// shardd's expert lora_B [E, out, R] over a base with `scale` folded in,
// as the B of the unfolded base: B[e] / scale[e]. INVALID_ARGUMENT for a
// scale count other than E or a zero scale under a non-zero B[e].
absl::Status UnscaleExpertsB(const PeftTensor& t,
                             const std::vector<float>& scale,
                             std::vector<float>* b) {
  const int64_t block = t.out * t.rank;
  if (static_cast<int64_t>(scale.size()) != t.experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", t.scaled_by, "\": the base has ", scale.size(),
        " per-expert scales, the adapters ", t.experts, " experts"));
  }
  for (int64_t e = 0; e < t.experts; ++e) {
    for (int64_t i = e * block; i < (e + 1) * block; ++i) {
      if (scale[e] == 0.0f) {
        if ((*b)[i] != 0.0f) {
          return absl::InvalidArgumentError(absl::StrCat(
              "\"", t.scaled_by, "\": expert ", e,
              "'s per_expert_scale is 0 in the base, so its trained adapter "
              "has no Hugging Face equivalent"));
        }
        continue;
      }
      (*b)[i] /= scale[e];
    }
  }
  return absl::OkStatus();
}

// The model recorded in a checkpoint's index; `recorded` false when there
// is none.
absl::Status RecordedModel(const CheckpointReader& reader, v1::ModelSpec* model,
                           bool* recorded) {
  const std::string& text = reader.index().model_spec_json;
  *recorded = !text.empty();
  if (!*recorded) return absl::OkStatus();
  const auto parsed = google::protobuf::util::JsonStringToMessage(text, model);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat(
        reader.dir(), ": index.json.model: ", std::string(parsed.message())));
  }
  return absl::OkStatus();
}

// A config value for messages: a number as written ("8"), else described.
std::string ValueText(const json* v) {
  if (v == nullptr) return "missing";
  return v->is_number() || v->is_boolean() ? v->dump() : DescribeJsonValue(*v);
}

std::string ListText(const std::set<std::string>& names) {
  return absl::StrCat("[", absl::StrJoin(names, ", "), "]");
}

json ConfigJson(const v1::LoraConfig& lora, const PeftPlan& plan) {
  json config = json::object();
  config["peft_type"] = "LORA";
  if (plan.causal_lm) {
    config["task_type"] = "CAUSAL_LM";
  } else {
    config["task_type"] = nullptr;
  }
  config["base_model_name_or_path"] = nullptr;
  config["revision"] = nullptr;
  config["r"] = lora.rank();
  // PEFT writes an int for an int alpha.
  const double alpha = lora.alpha();
  if (alpha == std::floor(alpha) && std::fabs(alpha) < 1e15) {
    config["lora_alpha"] = static_cast<int64_t>(alpha);
  } else {
    config["lora_alpha"] = alpha;
  }
  config["lora_dropout"] = 0.0;
  config["bias"] = "none";
  config["lora_bias"] = false;
  config["fan_in_fan_out"] = false;
  config["use_rslora"] = false;
  config["use_dora"] = false;
  config["init_lora_weights"] = true;
  config["inference_mode"] = true;
  config["modules_to_save"] = nullptr;
  config["layers_to_transform"] = nullptr;
  config["layers_pattern"] = nullptr;
  config["exclude_modules"] = nullptr;
  config["rank_pattern"] = json::object();
  config["alpha_pattern"] = json::object();
  if (!plan.target_regex.empty()) {
    config["target_modules"] = plan.target_regex;
  } else {
    config["target_modules"] = json::array();
    for (const std::string& m : plan.target_modules) {
      config["target_modules"].push_back(m);
    }
  }
  config["target_parameters"] = json::array();
  for (const std::string& p : plan.target_parameters) {
    config["target_parameters"].push_back(p);
  }
  return config;
}

// Elements [begin, begin + n) of `entry` as fp32.
absl::Status ReadFloats(const SafetensorsReader& file,
                        const SafetensorsEntry& entry, int64_t begin, int64_t n,
                        float* out) {
  const int64_t esize = SafetensorsDTypeBytes(entry.dtype);
  std::vector<uint8_t> staging;
  for (int64_t done = 0; done < n;) {
    const int64_t count = std::min(n - done, kChunkElements);
    staging.resize(static_cast<size_t>(count * esize));
    SHARDD_RETURN_IF_ERROR(file.ReadBytes(entry, (begin + done) * esize,
                                          count * esize, staging.data()));
    SafetensorsToFloat(entry.dtype, staging.data(), count, out + done);
    done += count;
  }
  return absl::OkStatus();
}

// Writes the adapter files into `tmp`.
absl::Status WriteAdapterFiles(const std::string& tmp,
                               const std::vector<PeftTensor>& tensors,
                               const std::vector<std::vector<float>>& values,
                               const json& config) {
  std::vector<TensorView> views;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const absl::Span<const uint8_t> bytes(
        reinterpret_cast<const uint8_t*>(values[i].data()),
        values[i].size() * sizeof(float));
    views.push_back({tensors[i].peft, "F32", tensors[i].peft_shape, bytes});
    for (const std::string& copy : tensors[i].copies) {
      views.push_back({copy, "F32", tensors[i].peft_shape, bytes});
    }
  }
  std::sort(views.begin(), views.end(),
            [](const TensorView& x, const TensorView& y) {
              return x.name < y.name;
            });
  SHARDD_RETURN_IF_ERROR(
      WriteSafetensors(absl::StrCat(tmp, "/", kPeftWeightsFileName), views,
                       {{"format", "pt"}})
          .status());
  SHARDD_ASSIGN_OR_RETURN(std::string text, DumpJson(config, 2));
  text.push_back('\n');
  SHARDD_RETURN_IF_ERROR(
      WriteStringToFile(absl::StrCat(tmp, "/", kPeftConfigFileName), text));
  return SyncDir(tmp);
}

// Renames `tmp` to `out_dir`, which may exist only as an empty directory.
absl::Status Publish(const std::string& tmp, const std::string& out_dir,
                     const std::string& parent) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(out_dir, ec))) {
    const bool empty_dir = std::filesystem::is_directory(out_dir, ec) &&
                           std::filesystem::is_empty(out_dir, ec) && !ec;
    if (!empty_dir) {
      return absl::AlreadyExistsError(absl::StrCat(
          out_dir, " already exists and is not an empty directory"));
    }
  }
  if (::rename(tmp.c_str(), out_dir.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot rename ", tmp, " to"),
                       out_dir);
  }
  return SyncDir(parent);
}

}  // namespace

absl::StatusOr<bool> CheckpointHasLora(const std::string& checkpoint_dir) {
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(checkpoint_dir));
  v1::ModelSpec model;
  bool recorded = false;
  SHARDD_RETURN_IF_ERROR(RecordedModel(*reader, &model, &recorded));
  return recorded && model.lora().rank() > 0;
}

absl::Status ExportPeftAdapters(const std::string& checkpoint_dir,
                                const std::string& out_dir,
                                const std::string& base_dir) {
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(checkpoint_dir));
  v1::ModelSpec model;
  bool recorded = false;
  SHARDD_RETURN_IF_ERROR(RecordedModel(*reader, &model, &recorded));
  if (!recorded || model.lora().rank() <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(checkpoint_dir,
                     recorded ? ": the model has no LoRA adapters"
                              : ": the checkpoint records no model",
                     "; export it as a whole model (ExportHfModel) instead"));
  }
  SHARDD_ASSIGN_OR_RETURN(const PeftPlan plan, PlanPeft(model));
  // Per-expert scales the base folded into adapted weights: PEFT's B is
  // shardd's divided by them.
  std::unique_ptr<HfWeights> base;
  for (const PeftTensor& t : plan.tensors) {
    if (t.scaled_by.empty() || base != nullptr) continue;
    if (base_dir.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--base: ", model.architecture(), "'s adapters of \"", t.scaled_by,
          "\" are exported for the Hugging Face base the job started from "
          "(its router.per_expert_scale, which shardd folds into the "
          "experts); name that directory"));
    }
    SHARDD_ASSIGN_OR_RETURN(base,
                            HfWeights::Open(base_dir, WithoutLoraAdapters(model)));
  }

  // Verify only the files holding adapters: the frozen base's may be large.
  std::set<std::string> files;
  for (const PeftTensor& t : plan.tensors) {
    const TensorRecord* record = reader->FindTensor(t.shardd);
    if (record == nullptr) {
      return absl::DataLossError(
          absl::StrCat(checkpoint_dir, ": adapter \"", t.shardd,
                       "\" of the recorded model is not in the checkpoint"));
    }
    if (record->shape != t.shardd_shape ||
        !SafetensorsFloatDType(record->dtype)) {
      return absl::DataLossError(absl::StrCat(
          checkpoint_dir, ": adapter \"", t.shardd, "\" is ", record->dtype,
          " ", ShapeText(record->shape), ", the recorded model's is ",
          ShapeText(t.shardd_shape), " (F32, BF16 or F16)"));
    }
    for (const ChunkRecord& c : record->chunks) files.insert(c.file);
  }
  for (const std::string& f : files) {
    SHARDD_RETURN_IF_ERROR(reader->VerifyFile(f));
  }
  std::vector<std::vector<float>> values;
  for (const PeftTensor& t : plan.tensors) {
    const TensorRecord& record = *reader->FindTensor(t.shardd);
    SHARDD_ASSIGN_OR_RETURN(const int64_t numel, ShapeNumel(record.shape));
    std::vector<uint8_t> bytes(
        static_cast<size_t>(numel * SafetensorsDTypeBytes(record.dtype)));
    SHARDD_RETURN_IF_ERROR(
        reader->ReadElements(t.shardd, 0, numel, bytes.data()));
    std::vector<float> v(static_cast<size_t>(numel));
    SafetensorsToFloat(record.dtype, bytes.data(), numel, v.data());
    if (!t.scaled_by.empty()) {
      SHARDD_ASSIGN_OR_RETURN(const std::vector<float> scale,
                              base->ExpertScales(t.scaled_by));
      SHARDD_RETURN_IF_ERROR(UnscaleExpertsB(t, scale, &v));
    }
    if (t.experts_b) v = ExpertsBToPeft(t, v);
    values.push_back(std::move(v));
  }

  const std::filesystem::path out_path =
      std::filesystem::path(out_dir).lexically_normal();
  std::string target = out_path.string();
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  std::string parent = std::filesystem::path(target).parent_path().string();
  if (parent.empty()) parent = ".";
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot create directory", parent);
  std::string tmp = absl::StrCat(
      parent, "/.tmp-", std::filesystem::path(target).filename().string(),
      "-XXXXXX");
  if (::mkdtemp(tmp.data()) == nullptr) {
    return ErrnoStatus(errno, "cannot create directory", tmp);
  }
  absl::Status status = WriteAdapterFiles(tmp, plan.tensors, values,
                                          ConfigJson(model.lora(), plan));
  if (status.ok()) status = Publish(tmp, target, parent);
  if (!status.ok()) std::filesystem::remove_all(tmp, ec);
  return status;
}

absl::StatusOr<std::unique_ptr<PeftAdapters>> PeftAdapters::Open(
    const std::string& dir, const v1::ModelSpec& model,
    const ExpertScaleFn& scales) {
  if (model.lora().rank() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model (", model.architecture(),
                     ") has no LoRA adapters to read from ", dir));
  }
  SHARDD_ASSIGN_OR_RETURN(const PeftPlan plan, PlanPeft(model));
  const v1::LoraConfig& lora = model.lora();

  const std::string config_path = absl::StrCat(dir, "/", kPeftConfigFileName);
  SHARDD_ASSIGN_OR_RETURN(const std::string text,
                          ReadFileToString(config_path, kMaxConfigBytes));
  SHARDD_ASSIGN_OR_RETURN(
      const json config,
      ParseJsonStrict(text, config_path, absl::StatusCode::kDataLoss));
  if (!config.is_object()) {
    return absl::DataLossError(
        absl::StrCat(config_path, ": must be a JSON object"));
  }
  auto field = [&](const char* name) -> const json* {
    auto it = config.find(name);
    return it == config.end() || it->is_null() ? nullptr : &*it;
  };
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat(kPeftConfigFileName, ": ", what, " (", dir, ")"));
  };
  if (const json* v = field("peft_type");
      v != nullptr && !(v->is_string() && v->get<std::string>() == "LORA")) {
    return bad(absl::StrCat("peft_type is ", DescribeJsonValue(*v),
                            ", shardd reads \"LORA\""));
  }
  {
    const json* v = field("r");
    int64_t r = 0;
    if (v == nullptr || !GetNonNegativeInt(*v, &r) || r != lora.rank()) {
      return bad(absl::StrCat("r is ", ValueText(v),
                              ", the job's --lora-rank is ", lora.rank()));
    }
  }
  {
    const json* v = field("lora_alpha");
    if (v == nullptr || !v->is_number() || v->get<double>() != lora.alpha()) {
      return bad(absl::StrCat("lora_alpha is ", ValueText(v),
                              ", the job's --lora-alpha is ", lora.alpha()));
    }
  }
  for (const char* flag :
       {"use_rslora", "use_dora", "lora_bias", "fan_in_fan_out"}) {
    const json* v = field(flag);
    if (v != nullptr && !(v->is_boolean() && !v->get<bool>())) {
      return bad(absl::StrCat(flag, " is ", ValueText(v),
                              "; shardd implements only false"));
    }
  }
  for (const char* pattern : {"rank_pattern", "alpha_pattern"}) {
    const json* v = field(pattern);
    if (v != nullptr && !(v->is_object() && v->empty())) {
      return bad(absl::StrCat(pattern, " is ", v->dump(),
                              "; shardd gives every adapter one r and "
                              "lora_alpha"));
    }
  }
  auto names = [&](const char* key,
                   const std::set<std::string>& want) -> absl::Status {
    const json* v = field(key);
    std::set<std::string> got;
    if (v != nullptr) {
      if (!v->is_array()) {
        return bad(absl::StrCat(key, " is ", DescribeJsonValue(*v),
                                "; shardd reads a list of names"));
      }
      for (const json& n : *v) {
        if (!n.is_string()) {
          return bad(absl::StrCat(key, " holds ", DescribeJsonValue(n),
                                  "; shardd reads a list of names"));
        }
        got.insert(n.get<std::string>());
      }
    }
    if (got != want) {
      return bad(absl::StrCat(key, " is ", ListText(got),
                              ", the job's --lora-targets give ",
                              ListText(want)));
    }
    return absl::OkStatus();
  };
  if (!plan.target_regex.empty()) {
    const json* v = field("target_modules");
    if (v == nullptr || !v->is_string() ||
        v->get<std::string>() != plan.target_regex) {
      return bad(absl::StrCat("target_modules is ", ValueText(v),
                              ", the job's --lora-targets give \"",
                              plan.target_regex, "\""));
    }
  } else {
    SHARDD_RETURN_IF_ERROR(names("target_modules", plan.target_modules));
  }
  SHARDD_RETURN_IF_ERROR(names("target_parameters", plan.target_parameters));

  auto adapters = absl::WrapUnique(new PeftAdapters());
  adapters->dir_ = dir;
  SHARDD_ASSIGN_OR_RETURN(
      adapters->file_,
      SafetensorsReader::Open(absl::StrCat(dir, "/", kPeftWeightsFileName)));
  const SafetensorsReader& file = *adapters->file_;
  std::set<std::string> expected;
  for (const PeftTensor& t : plan.tensors) {
    expected.insert(t.peft);
    const SafetensorsEntry* e = file.Find(t.peft);
    if (e == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": no tensor \"", t.peft, "\" (adapter \"",
                       t.shardd, "\" of the job's model)"));
    }
    if (e->shape != t.peft_shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": tensor \"", t.peft, "\" has shape ",
          ShapeText(e->shape), ", adapter \"", t.shardd, "\" ",
          ShapeText(t.shardd_shape), " needs ", ShapeText(t.peft_shape)));
    }
    if (!SafetensorsFloatDType(e->dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor \"", t.peft, "\" is ", e->dtype,
                       "; adapters are read from F32, BF16 or F16"));
    }
    Binding b;
    b.entry = e;
    b.numel = e->numel;
    b.experts_b = t.experts_b;
    b.experts = t.experts;
    b.out = t.out;
    b.rank = t.rank;
    if (!t.scaled_by.empty()) {
      if (!scales) {
        return absl::FailedPreconditionError(absl::StrCat(
            "adapter \"", t.shardd, "\" needs the base's per-expert scales "
            "(its router.per_expert_scale): start from a Hugging Face base "
            "(--init-from)"));
      }
      SHARDD_ASSIGN_OR_RETURN(b.scale, scales(t.scaled_by));
      if (static_cast<int64_t>(b.scale.size()) != t.experts) {
        return absl::InvalidArgumentError(absl::StrCat(
            "adapter \"", t.shardd, "\": the base has ", b.scale.size(),
            " per-expert scales for ", t.experts, " experts"));
      }
    }
    // One stack, two module trees: the copies must hold the same values.
    for (const std::string& copy : t.copies) {
      expected.insert(copy);
      const SafetensorsEntry* c = file.Find(copy);
      if (c == nullptr || c->shape != e->shape ||
          !SafetensorsFloatDType(c->dtype)) {
        return absl::InvalidArgumentError(absl::StrCat(
            file.path(), ": no tensor \"", copy, "\" of shape ",
            ShapeText(e->shape), " (the encoder's copy of \"", t.peft,
            "\": transformers runs the one stack as two module trees)"));
      }
      std::vector<float> x(static_cast<size_t>(e->numel)),
          y(static_cast<size_t>(e->numel));
      SHARDD_RETURN_IF_ERROR(ReadFloats(file, *e, 0, e->numel, x.data()));
      SHARDD_RETURN_IF_ERROR(ReadFloats(file, *c, 0, e->numel, y.data()));
      if (x != y) {
        return absl::InvalidArgumentError(absl::StrCat(
            file.path(), ": \"", copy, "\" differs from \"", t.peft,
            "\"; shardd trains one adapter for both (the encode and the "
            "decodes run the same stack)"));
      }
    }
    adapters->bindings_[t.shardd] = std::move(b);
  }
  for (const SafetensorsEntry& e : file.tensors()) {
    if (expected.count(e.name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor \"", e.name,
                       "\" is no adapter of the job's model (its LoRA targets ",
                       absl::StrJoin(lora.targets(), ", "), ")"));
    }
  }
  return adapters;
}

bool PeftAdapters::Provides(const std::string& name) const {
  return bindings_.count(name) != 0;
}

absl::Status PeftAdapters::Read(const std::string& name,
                                const v1::TensorSpec& tensor, int64_t begin,
                                int64_t end, float* out) const {
  (void)tensor;  // The binding knows the shape.
  auto it = bindings_.find(name);
  if (it == bindings_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "parameter \"", name, "\" is no LoRA adapter read from ", dir_));
  }
  const Binding& b = it->second;
  if (begin < 0 || begin > end || end > b.numel) {
    return absl::OutOfRangeError(absl::StrCat("parameter \"", name,
                                              "\": elements [", begin, ", ",
                                              end, ") outside its ", b.numel));
  }
  const absl::Status status =
      b.experts_b ? ReadExpertsB(b, begin, end, out)
                  : ReadFloats(*file_, *b.entry, begin, end - begin, out);
  if (status.ok()) {
    // shardd's B[e] over the folded base: PEFT's times scale[e].
    if (!b.scale.empty()) {
      const int64_t block = b.out * b.rank;
      for (int64_t i = begin; i < end; ++i) out[i - begin] *= b.scale[i / block];
    }
    return status;
  }
  return absl::Status(status.code(), absl::StrCat("parameter \"", name,
                                                  "\": ", status.message()));
}

absl::Status PeftAdapters::ReadExpertsB(const Binding& b, int64_t begin,
                                        int64_t end, float* out) const {
  if (begin == end) return absl::OkStatus();
  const int64_t E = b.experts, O = b.out, R = b.rank;
  const int64_t per_expert = O * R, row = R * E;
  const int64_t e_first = begin / per_expert, e_last = (end - 1) / per_expert;
  // PEFT's row o holds every expert's B[e][o, :]: read the rows the range
  // touches (all of them once it spans two experts), in chunks.
  int64_t o_begin = 0, o_end = O;
  if (e_first == e_last) {
    o_begin = (begin % per_expert) / R;
    o_end = ((end - 1) % per_expert) / R + 1;
  }
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunkElements / row);
  std::vector<float> rows;
  for (int64_t c0 = o_begin; c0 < o_end; c0 += rows_per_chunk) {
    const int64_t c1 = std::min(o_end, c0 + rows_per_chunk);
    rows.resize(static_cast<size_t>((c1 - c0) * row));
    SHARDD_RETURN_IF_ERROR(
        ReadFloats(*file_, *b.entry, c0 * row, (c1 - c0) * row, rows.data()));
    for (int64_t e = e_first; e <= e_last; ++e) {
      for (int64_t o = c0; o < c1; ++o) {
        const int64_t first = (e * O + o) * R;
        const int64_t lo = std::max(begin, first);
        const int64_t hi = std::min(end, first + R);
        for (int64_t i = lo; i < hi; ++i) {
          out[i - begin] = rows[(o - c0) * row + (i - first) * E + e];
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace shardd
