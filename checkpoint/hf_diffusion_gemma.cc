#include "checkpoint/hf_diffusion_gemma.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/safetensors.h"
#include "common/status_macros.h"

namespace shardd {
namespace checkpoint {
namespace {

constexpr char kLayers[] = "model.layers.";
constexpr char kDecoder[] = "model.decoder.";

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// "model.layers.L.<rest>" -> "L." and rest.
bool SplitLayer(absl::string_view name, std::string* layer, std::string* rest) {
  if (!absl::ConsumePrefix(&name, kLayers)) return false;
  const size_t dot = name.find('.');
  if (dot == absl::string_view::npos || dot == 0) return false;
  *layer = std::string(name.substr(0, dot + 1));
  *rest = std::string(name.substr(dot + 1));
  return true;
}

// Swaps the last two dims of a [E, R, C] tensor, bytes moved as they are.
absl::Status TransposeExperts(HostTensor* t) {
  const int64_t esize = SafetensorsDTypeBytes(t->dtype);
  if (t->shape.size() != 3 || esize == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", t->name, "\": ", t->dtype, " ",
                     ShapeString(t->shape), " must be a 3-D [E, R, C]"));
  }
  const int64_t experts = t->shape[0], rows = t->shape[1], cols = t->shape[2];
  std::vector<uint8_t> out(t->bytes.size());
  for (int64_t e = 0; e < experts; ++e) {
    const uint8_t* src = t->bytes.data() + e * rows * cols * esize;
    uint8_t* dst = out.data() + e * rows * cols * esize;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(dst + (c * rows + r) * esize, src + (r * cols + c) * esize,
                    static_cast<size_t>(esize));
      }
    }
  }
  t->bytes = std::move(out);
  t->shape = {experts, cols, rows};
  return absl::OkStatus();
}

// [n] ones in `dtype`.
absl::StatusOr<HostTensor> Ones(const std::string& name,
                                const std::string& dtype, int64_t n) {
  HostTensor t{name, dtype, {n}, {}};
  std::vector<uint8_t> one;
  if (dtype == "F32") {
    const float f = 1.0f;
    one.resize(4);
    std::memcpy(one.data(), &f, 4);
  } else if (dtype == "BF16" || dtype == "F16") {
    const uint16_t h = dtype == "BF16" ? 0x3F80 : 0x3C00;
    one.resize(2);
    std::memcpy(one.data(), &h, 2);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\": cannot write 1.0 as ", dtype,
                     " (F32, BF16 or F16)"));
  }
  for (int64_t i = 0; i < n; ++i) {
    t.bytes.insert(t.bytes.end(), one.begin(), one.end());
  }
  return t;
}

// Folds router.per_expert_scale `scale` ([E]) into `down` ([E, D, I]):
// expert e's elements times scale[e] in fp32, as HfWeights reads them.
absl::Status FoldScale(const HostTensor& scale, HostTensor* down) {
  if (!SafetensorsFloatDType(scale.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", scale.name, "\": dtype ", scale.dtype,
                     "; per_expert_scale must be F32, BF16 or F16"));
  }
  const int64_t experts = down->shape[0];
  std::vector<float> factor(static_cast<size_t>(experts));
  SafetensorsToFloat(scale.dtype, scale.bytes.data(), experts, factor.data());
  if (std::all_of(factor.begin(), factor.end(),
                  [](float f) { return f == 1.0f; })) {
    return absl::OkStatus();  // x * 1.0f is x: the bytes stay as they are.
  }
  if (!SafetensorsFloatDType(down->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", down->name, "\": dtype ", down->dtype, "; folding \"",
        scale.name, "\" (not all 1) into it needs F32, BF16 or F16"));
  }
  const int64_t numel = static_cast<int64_t>(down->bytes.size()) /
                        SafetensorsDTypeBytes(down->dtype);
  const int64_t block = numel / experts;
  std::vector<float> values(static_cast<size_t>(numel));
  SafetensorsToFloat(down->dtype, down->bytes.data(), numel, values.data());
  for (int64_t i = 0; i < numel; ++i) values[i] *= factor[i / block];
  down->dtype = "F32";
  down->bytes.resize(static_cast<size_t>(numel) * 4);
  std::memcpy(down->bytes.data(), values.data(), down->bytes.size());
  return absl::OkStatus();
}

// Sorts `tensors` by name. Errors: INVALID_ARGUMENT for two tensors with
// one name.
absl::StatusOr<std::vector<HostTensor>> SortedByName(
    std::vector<HostTensor> tensors) {
  std::sort(
      tensors.begin(), tensors.end(),
      [](const HostTensor& a, const HostTensor& b) { return a.name < b.name; });
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (tensors[i].name == tensors[i - 1].name) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", tensors[i].name,
                       "\": two tensors have this name after conversion"));
    }
  }
  return tensors;
}

}  // namespace

bool DiffusionGemmaIgnoredTensor(absl::string_view name) {
  if (absl::StartsWith(name, "model.encoder.vision_tower.") ||
      absl::StartsWith(name, "model.encoder.embed_vision.")) {
    return true;
  }
  if (!absl::ConsumePrefix(&name, "model.encoder.language_model.layers.") ||
      !absl::ConsumeSuffix(&name, ".layer_scalar")) {
    return false;
  }
  return !name.empty() &&
         name.find_first_not_of("0123456789") == absl::string_view::npos;
}

absl::StatusOr<std::vector<HostTensor>> DiffusionGemmaShardToHf(
    std::vector<HostTensor> tensors) {
  std::vector<HostTensor> out;
  for (HostTensor& t : tensors) {
    if (t.name == "lm_head.weight") continue;  // Tied: HF does not save it.
    std::string layer, rest;
    const bool in_layer = SplitLayer(t.name, &layer, &rest);
    const std::string hf_layer = absl::StrCat(kDecoder, "layers.", layer);
    if (in_layer && absl::StartsWith(rest, "moe.")) {
      const std::string moe = rest.substr(4);
      if (moe == "gate.scale" || moe == "gate.proj.weight") {
        t.name = absl::StrCat(hf_layer, "router.", moe.substr(5));
      } else if (moe == "experts.gate_and_up_projs" ||
                 moe == "experts.down_projs") {
        const bool down = moe == "experts.down_projs";
        SHARDD_RETURN_IF_ERROR(TransposeExperts(&t));
        t.name = absl::StrCat(
            hf_layer, down ? "experts.down_proj" : "experts.gate_up_proj");
        if (down) {
          SHARDD_ASSIGN_OR_RETURN(
              HostTensor ones,
              Ones(absl::StrCat(hf_layer, "router.per_expert_scale"), t.dtype,
                   t.shape[0]));
          out.push_back(std::move(ones));
        }
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t.name,
            "\": has no counterpart in DiffusionGemma's Hugging Face "
            "naming (router.{scale,proj.weight}, "
            "experts.{gate_up_proj,down_proj})"));
      }
      out.push_back(std::move(t));
      continue;
    }
    if (in_layer && rest == "layer_scalar") {
      HostTensor copy = t;
      copy.name = absl::StrCat("model.encoder.language_model.layers.", layer,
                               "layer_scalar");
      out.push_back(std::move(copy));
    }
    absl::string_view tail = t.name;
    if (absl::ConsumePrefix(&tail, "model.")) {
      t.name = absl::StrCat(kDecoder, tail);
    }
    out.push_back(std::move(t));
  }
  return SortedByName(std::move(out));
}

absl::StatusOr<std::vector<HostTensor>> DiffusionGemmaHfToShardd(
    std::vector<HostTensor> tensors) {
  // A layer's expert tensors, by "L.".
  struct Experts {
    HostTensor* gate_up = nullptr;  // experts.gate_up_proj [E, 2I, D]
    HostTensor* down = nullptr;     // experts.down_proj [E, D, I]
    HostTensor* scale = nullptr;    // router.per_expert_scale [E]
  };
  std::map<std::string, Experts> layers;
  std::vector<HostTensor> out;
  for (HostTensor& t : tensors) {
    if (DiffusionGemmaIgnoredTensor(t.name)) continue;
    absl::string_view tail = t.name;
    if (!absl::ConsumePrefix(&tail, kDecoder)) {
      if (absl::StartsWith(t.name, "model.")) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t.name, "\": not under ", kDecoder,
            " in a DiffusionGemma checkpoint (its model.encoder. holds only "
            "the vision tower, embed_vision and layer_scalar copies)"));
      }
      out.push_back(std::move(t));  // E.g. an lm_head.weight.
      continue;
    }
    const std::string name = absl::StrCat("model.", tail);
    std::string layer, rest;
    if (!SplitLayer(name, &layer, &rest) ||
        !(absl::StartsWith(rest, "router.") ||
          absl::StartsWith(rest, "experts."))) {
      t.name = name;
      out.push_back(std::move(t));
      continue;
    }
    Experts& experts = layers[layer];
    if (rest == "router.scale" || rest == "router.proj.weight") {
      t.name = absl::StrCat(kLayers, layer, "moe.gate.",
                            absl::StripPrefix(rest, "router."));
      out.push_back(std::move(t));
    } else if (rest == "router.per_expert_scale") {
      experts.scale = &t;
    } else if (rest == "experts.gate_up_proj") {
      experts.gate_up = &t;
    } else if (rest == "experts.down_proj") {
      experts.down = &t;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name,
                       "\": has no counterpart in shardd's DiffusionGemma tree "
                       "(router.{scale,proj.weight,per_expert_scale}, "
                       "experts.{gate_up_proj,down_proj})"));
    }
  }
  for (auto& [layer, experts] : layers) {
    const std::string hf_layer = absl::StrCat(kDecoder, "layers.", layer);
    for (const HostTensor* t : {experts.gate_up, experts.down}) {
      if (t != nullptr && t->shape.size() != 3) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", t->name, "\": ", t->dtype, " ", ShapeString(t->shape),
            " must be 3-D (gate_up_proj [E, 2I, D], down_proj [E, D, I])"));
      }
    }
    if (experts.scale != nullptr && experts.down == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", experts.scale->name, "\": no \"", hf_layer,
                       "experts.down_proj\" to fold it into"));
    }
    if (experts.down != nullptr && experts.scale == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", experts.down->name, "\": \"", hf_layer,
          "router.per_expert_scale\" is missing (it is folded into "
          "down_projs)"));
    }
    if (experts.gate_up != nullptr && experts.down != nullptr) {
      const HostTensor& gu = *experts.gate_up;
      const HostTensor& dn = *experts.down;
      if (gu.shape[1] % 2 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", gu.name, "\": ", gu.dtype, " ", ShapeString(gu.shape),
            " must be [E, 2I, D] with an even 2I (gate and up halves)"));
      }
      const std::vector<int64_t> want = {gu.shape[0], gu.shape[2],
                                         gu.shape[1] / 2};
      if (dn.shape != want || dn.dtype != gu.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor \"", dn.name, "\": ", dn.dtype, " ", ShapeString(dn.shape),
            ", expected ", gu.dtype, " ", ShapeString(want), " like \"",
            gu.name, "\" ", ShapeString(gu.shape),
            " (gate_up_proj [E, 2I, D], down_proj [E, D, I])"));
      }
    }
    if (experts.down != nullptr) {
      HostTensor& dn = *experts.down;
      const HostTensor& scale = *experts.scale;
      if (scale.shape != std::vector<int64_t>{dn.shape[0]}) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", scale.name, "\": ", scale.dtype, " ",
                         ShapeString(scale.shape), ", expected [", dn.shape[0],
                         "] (one scale per expert of \"", dn.name, "\" ",
                         dn.dtype, " ", ShapeString(dn.shape), ")"));
      }
      SHARDD_RETURN_IF_ERROR(FoldScale(scale, &dn));
      SHARDD_RETURN_IF_ERROR(TransposeExperts(&dn));
      dn.name = absl::StrCat(kLayers, layer, "moe.experts.down_projs");
      out.push_back(std::move(dn));
    }
    if (experts.gate_up != nullptr) {
      HostTensor& gu = *experts.gate_up;
      SHARDD_RETURN_IF_ERROR(TransposeExperts(&gu));
      gu.name = absl::StrCat(kLayers, layer, "moe.experts.gate_and_up_projs");
      out.push_back(std::move(gu));
    }
  }
  return SortedByName(std::move(out));
}

}  // namespace checkpoint
}  // namespace shardd
