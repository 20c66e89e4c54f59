#include "checkpoint/hf_interop.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_util.h"
#include "checkpoint/hf_diffusion_gemma.h"
#include "checkpoint/hf_files.h"
#include "checkpoint/json_text.h"
#include "checkpoint/safetensors.h"
#include "common/status_macros.h"
#include "model/model_util.h"
#include "nlohmann/json.hpp"

namespace shardd {
namespace checkpoint {
namespace {

using nlohmann::json;

constexpr char kLayersPrefix[] = "model.layers.";
// DiffusionGemma's shared stack (checkpoint/hf_diffusion_gemma.h).
constexpr char kDiffusionGemmaPrefix[] = "model.decoder.";

// ---- Names
// -------------------------------------------------------------------

enum Proj { kGate = 0, kUp = 1, kDown = 2 };

// Per-naming module and projection names, indexed by Proj.
struct HfStyle {
  HfMoeNaming naming;
  const char* module;  // Under model.layers.L.
  const char* proj[3];
};
constexpr HfStyle kQwen3 = {
    HfMoeNaming::kQwen3Moe, "mlp", {"gate_proj", "up_proj", "down_proj"}};
constexpr HfStyle kMixtral = {
    HfMoeNaming::kMixtral, "block_sparse_moe", {"w1", "w3", "w2"}};

// GPT-OSS's fused expert tensors under mlp.experts. and shardd's under
// moe.experts., indexed by Fused.
enum Fused { kFusedGateUp = 0, kFusedGateUpBias, kFusedDown, kFusedDownBias };
struct FusedName {
  const char* hf;
  const char* shardd;
};
constexpr FusedName kGptOssFused[] = {
    {"gate_up_proj", "gate_and_up_projs"},
    {"gate_up_proj_bias", "gate_up_proj_bias"},
    {"down_proj", "down_projs"},
    {"down_proj_bias", "down_proj_bias"},
};

const HfStyle* StyleOf(HfMoeNaming naming) {
  switch (naming) {
    case HfMoeNaming::kQwen3Moe:
      return &kQwen3;
    case HfMoeNaming::kMixtral:
      return &kMixtral;
    default:
      return nullptr;
  }
}

const char* NamingName(HfMoeNaming naming) {
  switch (naming) {
    case HfMoeNaming::kQwen3Moe:
      return "Qwen3-MoE";
    case HfMoeNaming::kMixtral:
      return "Mixtral";
    case HfMoeNaming::kGptOss:
      return "GPT-OSS";
    case HfMoeNaming::kDiffusionGemma:
      return "DiffusionGemma";
    default:
      return "none";
  }
}

// A canonical decimal index (no sign, no leading zeros), so names map back
// to exactly themselves.
bool ParseIndexNumber(absl::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 9 || (text.size() > 1 && text[0] == '0')) {
    return false;
  }
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(text, out);
}

// Splits "model.layers.L.<rest>"; false when the name is not a layer's.
bool SplitLayer(absl::string_view name, int64_t* layer,
                absl::string_view* rest) {
  if (!absl::ConsumePrefix(&name, kLayersPrefix)) return false;
  const size_t dot = name.find('.');
  if (dot == absl::string_view::npos) return false;
  if (!ParseIndexNumber(name.substr(0, dot), layer)) return false;
  *rest = name.substr(dot + 1);
  return true;
}

// kExpert: one projection of one expert (Qwen3-MoE, Mixtral); kFused: a
// GPT-OSS tensor of all a layer's experts.
enum class HfKind { kOther, kExpert, kFused, kRouter, kBadExpert };

struct HfName {
  HfKind kind = HfKind::kOther;
  HfMoeNaming naming = HfMoeNaming::kNone;  // Unless kOther.
  const HfStyle* style = nullptr;           // Per-expert namings.
  int64_t layer = 0;
  int64_t expert = 0;
  Proj proj = kGate;
  Fused fused = kFusedGateUp;
  std::string router;  // kRouter: the name after the router's "gate.".
};

HfName ClassifyHf(const std::string& name) {
  HfName out;
  absl::string_view rest;
  if (!SplitLayer(name, &out.layer, &rest)) return out;
  // GPT-OSS: mlp.router.* and mlp.experts.<tensor> (no expert number).
  absl::string_view r = rest;
  if (absl::ConsumePrefix(&r, "mlp.router.")) {
    out.kind = HfKind::kRouter;
    out.naming = HfMoeNaming::kGptOss;
    out.router = std::string(r);
    return out;
  }
  if (absl::ConsumePrefix(&r, "mlp.experts.") &&
      (r.empty() || !absl::ascii_isdigit(r[0]))) {
    out.kind = HfKind::kBadExpert;
    out.naming = HfMoeNaming::kGptOss;
    for (int f = 0; f < 4; ++f) {
      if (r == kGptOssFused[f].hf) {
        out.kind = HfKind::kFused;
        out.fused = static_cast<Fused>(f);
      }
    }
    return out;
  }
  for (const HfStyle* style : {&kQwen3, &kMixtral}) {
    absl::string_view r = rest;
    if (!absl::ConsumePrefix(&r, style->module) ||
        !absl::ConsumePrefix(&r, ".")) {
      continue;
    }
    out.style = style;
    out.naming = style->naming;
    if (r == "gate.weight") {
      out.kind = HfKind::kRouter;
      out.router = "weight";
      return out;
    }
    if (!absl::ConsumePrefix(&r, "experts.")) return out;  // kOther.
    out.kind = HfKind::kBadExpert;
    const size_t dot = r.find('.');
    if (dot == absl::string_view::npos ||
        !ParseIndexNumber(r.substr(0, dot), &out.expert)) {
      return out;
    }
    r.remove_prefix(dot + 1);
    for (int p = 0; p < 3; ++p) {
      if (r == absl::StrCat(style->proj[p], ".weight")) {
        out.kind = HfKind::kExpert;
        out.proj = static_cast<Proj>(p);
        return out;
      }
    }
    return out;
  }
  return out;
}

std::string HfExpertName(const HfStyle& style, int64_t layer, int64_t expert,
                         Proj proj) {
  return absl::StrCat(kLayersPrefix, layer, ".", style.module, ".experts.",
                      expert, ".", style.proj[proj], ".weight");
}
std::string GateUpName(int64_t layer) {
  return absl::StrCat(kLayersPrefix, layer, ".moe.experts.gate_and_up_projs");
}
std::string DownName(int64_t layer) {
  return absl::StrCat(kLayersPrefix, layer, ".moe.experts.down_projs");
}
// shardd's name of a router tensor: moe.gate.<rest>.
std::string RouterName(int64_t layer, absl::string_view rest) {
  return absl::StrCat(kLayersPrefix, layer, ".moe.gate.", rest);
}

// ---- Transposes
// --------------------------------------------------------------

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols,
// in cache-sized tiles.
template <typename T>
void TransposeTyped(const T* src, int64_t rows, int64_t cols,
                    int64_t src_stride, T* dst, int64_t dst_stride) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          dst[c * dst_stride + r] = src[r * src_stride + c];
        }
      }
    }
  }
}

// The same on raw bytes of `esize`-byte elements (1, 2, 4 or 8).
void Transpose(const uint8_t* src, int64_t rows, int64_t cols,
               int64_t src_stride, uint8_t* dst, int64_t dst_stride,
               int64_t esize) {
  switch (esize) {
    case 1:
      return TransposeTyped(src, rows, cols, src_stride, dst, dst_stride);
    case 2:
      return TransposeTyped(reinterpret_cast<const uint16_t*>(src), rows, cols,
                            src_stride, reinterpret_cast<uint16_t*>(dst),
                            dst_stride);
    case 4:
      return TransposeTyped(reinterpret_cast<const uint32_t*>(src), rows, cols,
                            src_stride, reinterpret_cast<uint32_t*>(dst),
                            dst_stride);
    default:
      return TransposeTyped(reinterpret_cast<const uint64_t*>(src), rows, cols,
                            src_stride, reinterpret_cast<uint64_t*>(dst),
                            dst_stride);
  }
}

// GPT-OSS's layout of a [..., 2I] tensor whose last dim holds shardd's
// gate half then up half: column 2j is gate j, column 2j + 1 is up j. With
// `interleave` false, the inverse (GPT-OSS's layout -> shardd's).
absl::Status Interleave(HostTensor* t, bool interleave = true) {
  const int64_t esize = SafetensorsDTypeBytes(t->dtype);
  const int64_t len = t->shape.empty() ? 0 : t->shape.back();
  if (len % 2 != 0 || esize == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", t->name, "\": ", t->dtype, " ", ShapeText(t->shape),
        " must have an even last dim (gate and up halves)"));
  }
  if (len == 0) return absl::OkStatus();
  const int64_t half = len / 2;
  std::vector<uint8_t> out(t->bytes.size());
  const int64_t rows = static_cast<int64_t>(t->bytes.size()) / (len * esize);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = t->bytes.data() + r * len * esize;
    uint8_t* dst = out.data() + r * len * esize;
    for (int64_t j = 0; j < half; ++j) {
      const int64_t gate = 2 * j, up = 2 * j + 1;  // GPT-OSS's columns.
      if (interleave) {
        std::memcpy(dst + gate * esize, src + j * esize, esize);
        std::memcpy(dst + up * esize, src + (half + j) * esize, esize);
      } else {
        std::memcpy(dst + j * esize, src + gate * esize, esize);
        std::memcpy(dst + (half + j) * esize, src + up * esize, esize);
      }
    }
  }
  t->bytes = std::move(out);
  return absl::OkStatus();
}

absl::Status CheckUniqueNames(const std::vector<HostTensor>& tensors) {
  std::set<std::string> seen;
  for (const HostTensor& t : tensors) {
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name,
                       "\": two tensors have this name after "
                       "conversion"));
    }
  }
  return absl::OkStatus();
}

void SortByName(std::vector<HostTensor>* tensors) {
  std::sort(
      tensors->begin(), tensors->end(),
      [](const HostTensor& a, const HostTensor& b) { return a.name < b.name; });
}

// GPT-OSS's name of a layer's fused expert tensor.
std::string GptOssName(int64_t layer, Fused f) {
  return absl::StrCat(kLayersPrefix, layer, ".mlp.experts.",
                      kGptOssFused[f].hf);
}

// A layer's GPT-OSS expert tensors (by Fused; biases optional) ->
// shardd's, appended to `out`: the same shapes and bytes but gate/up
// columns de-interleaved.
absl::Status GptOssToShardd(int64_t layer,
                            const std::array<HostTensor*, 4>& fused,
                            std::vector<HostTensor>* out) {
  for (Fused f : {kFusedGateUp, kFusedDown}) {
    if (fused[f] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, ": \"", GptOssName(layer, f),
          "\" is missing (GPT-OSS experts need gate_up_proj and down_proj)"));
    }
  }
  const HostTensor& gate_up = *fused[kFusedGateUp];
  if (gate_up.shape.size() != 3 || gate_up.shape[2] % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", gate_up.name, "\": ", gate_up.dtype, " ",
        ShapeText(gate_up.shape),
        " must be [E, D, 2I] with an even last dim (gate and up columns)"));
  }
  const int64_t experts = gate_up.shape[0], hidden = gate_up.shape[1],
                inter = gate_up.shape[2] / 2;
  const std::vector<int64_t> want[4] = {gate_up.shape,
                                        {experts, 2 * inter},
                                        {experts, inter, hidden},
                                        {experts, hidden}};
  for (int f = 0; f < 4; ++f) {
    const HostTensor* t = fused[f];
    if (t == nullptr) continue;
    // The biases may be of another dtype than the weights.
    const std::string& dtype = f == kFusedDown ? gate_up.dtype : t->dtype;
    if (t->shape != want[f] || t->dtype != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t->name, "\": ", t->dtype, " ", ShapeText(t->shape),
          ", expected ", dtype, " ", ShapeText(want[f]), " like \"",
          gate_up.name, "\" ", ShapeText(gate_up.shape),
          " (gate_up_proj [E, D, 2I], gate_up_proj_bias [E, 2I], down_proj "
          "[E, I, D], down_proj_bias [E, D])"));
    }
  }
  for (int f = 0; f < 4; ++f) {
    if (fused[f] == nullptr) continue;
    HostTensor t = std::move(*fused[f]);
    if (f == kFusedGateUp || f == kFusedGateUpBias) {
      SHARDD_RETURN_IF_ERROR(Interleave(&t, /*interleave=*/false));
    }
    t.name = absl::StrCat(kLayersPrefix, layer, ".moe.experts.",
                          kGptOssFused[f].shardd);
    out->push_back(std::move(t));
  }
  return absl::OkStatus();
}

// ---- Reading
// -----------------------------------------------------------------

}  // namespace

absl::StatusOr<std::vector<HostTensor>> ReadHfTensors(const std::string& path) {
  SHARDD_ASSIGN_OR_RETURN(const HfCheckpointFiles checkpoint,
                          OpenHfCheckpoint(path));
  std::vector<HostTensor> out;
  for (const auto& [name, ref] : checkpoint.tensors) {  // Sorted by name.
    HostTensor& t = out.emplace_back();
    t.name = name;
    t.dtype = ref.entry->dtype;
    t.shape = ref.entry->shape;
    SHARDD_ASSIGN_OR_RETURN(t.bytes, ref.file->ReadTensor(*ref.entry));
  }
  return out;
}

absl::Status WriteHfTensors(const std::string& dir,
                            const std::vector<HostTensor>& tensors,
                            int64_t max_shard_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot create directory", dir);
  // Greedy packing in the given order.
  std::vector<std::vector<const HostTensor*>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const HostTensor& t : tensors) {
    const int64_t size = static_cast<int64_t>(t.bytes.size());
    if (max_shard_bytes > 0 && !shards.back().empty() &&
        in_shard + size > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&t);
    in_shard += size;
    total += size;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  auto write = [&](const std::string& name,
                   const std::vector<const HostTensor*>& shard) {
    std::vector<TensorView> views;
    for (const HostTensor* t : shard) {
      views.push_back({t->name, t->dtype, t->shape, t->bytes});
    }
    return WriteSafetensors(absl::StrCat(dir, "/", name), views, metadata)
        .status();
  };
  if (shards.size() == 1) return write(kHfSingleFileName, shards[0]);
  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, shards.size());
    SHARDD_RETURN_IF_ERROR(write(name, shards[k]));
    for (const HostTensor* t : shards[k]) weight_map[t->name] = name;
  }
  json index = {{"metadata", {{"total_size", total}}},
                {"weight_map", weight_map}};
  SHARDD_ASSIGN_OR_RETURN(std::string text, DumpJson(index, 2));
  text.push_back('\n');
  SHARDD_RETURN_IF_ERROR(
      WriteStringToFile(absl::StrCat(dir, "/", kHfIndexFileName), text));
  return SyncDir(dir);
}

absl::StatusOr<std::vector<HostTensor>> HfToShardd(
    std::vector<HostTensor> tensors, HfMoeNaming* naming) {
  for (const HostTensor& t : tensors) {
    if (absl::StartsWith(t.name, kDiffusionGemmaPrefix)) {
      SHARDD_ASSIGN_OR_RETURN(std::vector<HostTensor> out,
                              DiffusionGemmaHfToShardd(std::move(tensors)));
      if (naming != nullptr) *naming = HfMoeNaming::kDiffusionGemma;
      return out;
    }
  }
  // Per layer, per expert: gate, up, down.
  std::map<int64_t, std::map<int64_t, std::array<HostTensor*, 3>>> layers;
  // GPT-OSS: per layer, by Fused.
  std::map<int64_t, std::array<HostTensor*, 4>> fused_layers;
  HfMoeNaming found = HfMoeNaming::kNone;
  std::string found_from;  // A tensor that set `found`, for errors.
  std::vector<HostTensor> out;
  for (HostTensor& t : tensors) {
    const HfName n = ClassifyHf(t.name);
    if (n.kind == HfKind::kBadExpert) {
      if (n.naming == HfMoeNaming::kGptOss) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t.name,
            "\": unsupported per-expert tensor; GPT-OSS experts hold only "
            "gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias "
            "(MXFP4 *_blocks / *_scales need dequantizing first)"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\": unsupported per-expert tensor; ",
          NamingName(n.naming), " experts hold only ",
          absl::StrJoin(n.style->proj, ", "), " weights"));
    }
    if (n.kind == HfKind::kOther) {
      out.push_back(std::move(t));
      continue;
    }
    if (found != HfMoeNaming::kNone && found != n.naming) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\" uses ", NamingName(n.naming),
          " naming but \"", found_from, "\" uses ", NamingName(found)));
    }
    found = n.naming;
    found_from = t.name;
    if (n.kind == HfKind::kRouter) {
      HostTensor router = std::move(t);
      router.name = RouterName(n.layer, n.router);
      out.push_back(std::move(router));
    } else if (n.kind == HfKind::kFused) {
      fused_layers[n.layer][n.fused] = &t;
    } else {
      layers[n.layer][n.expert][n.proj] = &t;
    }
  }
  if (naming != nullptr) *naming = found;
  const HfStyle* style = StyleOf(found);
  for (auto& [layer, fused] : fused_layers) {
    SHARDD_RETURN_IF_ERROR(GptOssToShardd(layer, fused, &out));
  }
  for (auto& [layer, experts] : layers) {
    const int64_t num_experts = static_cast<int64_t>(experts.size());
    // Experts must be 0..E-1 with all three projections.
    for (int64_t e = 0; e < num_experts; ++e) {
      auto it = experts.find(e);
      for (int p = 0; p < 3; ++p) {
        if (it == experts.end() || it->second[p] == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer ", layer, ": ", num_experts, " experts found but \"",
              HfExpertName(*style, layer, e, static_cast<Proj>(p)),
              "\" is missing (experts must be numbered 0..E-1, each with ",
              absl::StrJoin(style->proj, ", "), ")"));
        }
      }
    }
    const HostTensor& gate0 = *experts[0][kGate];
    if (gate0.shape.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", gate0.name, "\": shape ",
                       ShapeText(gate0.shape), " must be [I, D]"));
    }
    const int64_t inter = gate0.shape[0], hidden = gate0.shape[1];
    const std::string dtype = gate0.dtype;
    const int64_t esize = SafetensorsDTypeBytes(dtype);
    for (const auto& [e, projs] : experts) {
      for (int p = 0; p < 3; ++p) {
        const HostTensor& t = *projs[p];
        const std::vector<int64_t> want =
            p == kDown ? std::vector<int64_t>{hidden, inter}
                       : std::vector<int64_t>{inter, hidden};
        if (t.shape != want || t.dtype != dtype) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor \"", t.name, "\": ", t.dtype, " ", ShapeText(t.shape),
              ", expected ", dtype, " ", ShapeText(want), " like \"",
              gate0.name, "\" (gate/up [I, D], down [D, I])"));
        }
      }
    }
    HostTensor gate_up{
        GateUpName(layer), dtype, {num_experts, hidden, 2 * inter}, {}};
    HostTensor down{DownName(layer), dtype, {num_experts, inter, hidden}, {}};
    const int64_t per_expert = hidden * inter * esize;
    gate_up.bytes.resize(2 * num_experts * per_expert);
    down.bytes.resize(num_experts * per_expert);
    for (int64_t e = 0; e < num_experts; ++e) {
      uint8_t* gu = gate_up.bytes.data() + e * 2 * per_expert;
      // [I, D] -> columns [0, I) and [I, 2I) of [D, 2I].
      Transpose(experts[e][kGate]->bytes.data(), inter, hidden, hidden, gu,
                2 * inter, esize);
      Transpose(experts[e][kUp]->bytes.data(), inter, hidden, hidden,
                gu + inter * esize, 2 * inter, esize);
      // [D, I] -> [I, D].
      Transpose(experts[e][kDown]->bytes.data(), hidden, inter, inter,
                down.bytes.data() + e * per_expert, hidden, esize);
    }
    out.push_back(std::move(gate_up));
    out.push_back(std::move(down));
  }
  SortByName(&out);
  SHARDD_RETURN_IF_ERROR(CheckUniqueNames(out));
  return out;
}

absl::StatusOr<std::vector<HostTensor>> ShardToHf(
    std::vector<HostTensor> tensors, HfMoeNaming naming) {
  if (naming == HfMoeNaming::kDiffusionGemma) {
    return DiffusionGemmaShardToHf(std::move(tensors));
  }
  const HfStyle* style = StyleOf(naming);
  // Per layer: gate_and_up_projs, down_projs.
  std::map<int64_t, std::pair<HostTensor*, HostTensor*>> layers;
  std::vector<HostTensor> out;
  for (HostTensor& t : tensors) {
    int64_t layer;
    absl::string_view rest;
    const bool moe =
        SplitLayer(t.name, &layer, &rest) && absl::StartsWith(rest, "moe.");
    if (!moe) {
      out.push_back(std::move(t));
      continue;
    }
    if (style == nullptr && naming != HfMoeNaming::kGptOss) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name,
                       "\": MoE tensors need an HF naming "
                       "(Qwen3-MoE, Mixtral or GPT-OSS), got none"));
    }
    const std::string moe_rest(rest.substr(4));  // After "moe.".
    const std::string prefix = absl::StrCat(kLayersPrefix, layer, ".");
    if (naming == HfMoeNaming::kGptOss) {
      // Fused experts with interleaved gate/up columns; the router is
      // mlp.router.
      HostTensor r = std::move(t);
      int fused = -1;
      for (int f = 0; f < 4; ++f) {
        if (moe_rest == absl::StrCat("experts.", kGptOssFused[f].shardd)) {
          fused = f;
        }
      }
      if (fused == kFusedGateUp || fused == kFusedGateUpBias) {
        SHARDD_RETURN_IF_ERROR(Interleave(&r));
      }
      if (fused >= 0) {
        r.name = GptOssName(layer, static_cast<Fused>(fused));
      } else if (absl::StartsWith(moe_rest, "gate.")) {
        r.name = prefix + "mlp.router." + moe_rest.substr(5);
      } else {
        r.name = prefix + "mlp." + moe_rest;
      }
      out.push_back(std::move(r));
      continue;
    }
    if (moe_rest == "experts.gate_and_up_projs") {
      layers[layer].first = &t;
    } else if (moe_rest == "experts.down_projs") {
      layers[layer].second = &t;
    } else if (absl::StartsWith(moe_rest, "experts.")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", t.name, "\": has no Hugging Face counterpart in ",
          NamingName(naming),
          " naming (its experts hold only gate, up and down weights)"));
    } else {
      // The router (moe.gate.weight), shared experts, DeepSeek's
      // e_score_correction_bias: the same names under the HF MoE module.
      HostTensor r = std::move(t);
      r.name = absl::StrCat(prefix, style->module, ".", moe_rest);
      out.push_back(std::move(r));
    }
  }
  for (const auto& [layer, pair] : layers) {
    if (pair.first == nullptr || pair.second == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, ": ",
          pair.first == nullptr ? GateUpName(layer) : DownName(layer),
          " is missing (both grouped-expert tensors are needed)"));
    }
    const HostTensor& gu = *pair.first;
    const HostTensor& dn = *pair.second;
    if (gu.shape.size() != 3 || gu.shape[2] % 2 != 0 || dn.shape.size() != 3 ||
        dn.shape[0] != gu.shape[0] || dn.shape[1] != gu.shape[2] / 2 ||
        dn.shape[2] != gu.shape[1] || dn.dtype != gu.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, ": ", gu.dtype, " ", ShapeText(gu.shape), " and ",
          dn.dtype, " ", ShapeText(dn.shape),
          " must be one dtype, [E, D, 2I] and [E, I, D]"));
    }
    const int64_t num_experts = gu.shape[0], hidden = gu.shape[1],
                  inter = gu.shape[2] / 2;
    const int64_t esize = SafetensorsDTypeBytes(gu.dtype);
    const int64_t per_expert = hidden * inter * esize;
    for (int64_t e = 0; e < num_experts; ++e) {
      const uint8_t* gu_e = gu.bytes.data() + e * 2 * per_expert;
      for (Proj p : {kGate, kUp, kDown}) {
        HostTensor t{HfExpertName(*style, layer, e, p), gu.dtype,
                     p == kDown ? std::vector<int64_t>{hidden, inter}
                                : std::vector<int64_t>{inter, hidden},
                     std::vector<uint8_t>(per_expert)};
        if (p == kDown) {
          Transpose(dn.bytes.data() + e * per_expert, inter, hidden, hidden,
                    t.bytes.data(), inter, esize);
        } else {
          Transpose(gu_e + (p == kUp ? inter * esize : 0), hidden, inter,
                    2 * inter, t.bytes.data(), hidden, esize);
        }
        out.push_back(std::move(t));
      }
    }
  }
  SortByName(&out);
  SHARDD_RETURN_IF_ERROR(CheckUniqueNames(out));
  return out;
}

absl::StatusOr<std::string> ImportHfToCheckpoint(const std::string& hf_path,
                                                 const std::string& root,
                                                 int64_t step) {
  SHARDD_ASSIGN_OR_RETURN(std::vector<HostTensor> hf, ReadHfTensors(hf_path));
  SHARDD_ASSIGN_OR_RETURN(std::vector<HostTensor> tensors,
                          HfToShardd(std::move(hf)));
  std::vector<RankTensor> pieces;
  for (const HostTensor& t : tensors) {
    SHARDD_ASSIGN_OR_RETURN(int64_t numel, ShapeNumel(t.shape));
    pieces.push_back({t.name, t.dtype, t.shape, 0, numel, t.bytes});
  }
  SHARDD_ASSIGN_OR_RETURN(std::string tmp, BeginCheckpoint(root, step));
  SHARDD_ASSIGN_OR_RETURN(RankFile file, WriteRankFile(tmp, 0, pieces));
  CheckpointIndex index;
  index.step = step;
  index.saved_by = {"hf_import", 1, {}};
  SHARDD_RETURN_IF_ERROR(AddRankFile(file, &index));
  return CommitCheckpoint(root, tmp, index);
}

absl::Status ExportCheckpointToHf(const std::string& checkpoint_dir,
                                  HfMoeNaming naming, const std::string& dir,
                                  int64_t max_shard_bytes) {
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(checkpoint_dir));
  SHARDD_RETURN_IF_ERROR(reader->VerifyAll());
  std::vector<HostTensor> tensors;
  for (const auto& [name, record] : reader->index().tensors) {
    if (name.find('/') != std::string::npos) continue;  // Optimizer state.
    HostTensor& t = tensors.emplace_back();
    t.name = name;
    t.dtype = record.dtype;
    t.shape = record.shape;
    const int64_t numel = *ShapeNumel(record.shape);  // Validated index.
    t.bytes.resize(numel * SafetensorsDTypeBytes(record.dtype));
    SHARDD_RETURN_IF_ERROR(
        reader->ReadElements(name, 0, numel, t.bytes.data()));
  }
  SHARDD_ASSIGN_OR_RETURN(std::vector<HostTensor> hf,
                          ShardToHf(std::move(tensors), naming));
  return WriteHfTensors(dir, hf, max_shard_bytes);
}

}  // namespace checkpoint
}  // namespace shardd
