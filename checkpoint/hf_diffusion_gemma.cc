#include "checkpoint/hf_diffusion_gemma.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
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
bool SplitLayer(absl::string_view name, std::string* layer,
                std::string* rest) {
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

}  // namespace

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
        t.name = absl::StrCat(hf_layer, down ? "experts.down_proj"
                                             : "experts.gate_up_proj");
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
  std::sort(out.begin(), out.end(),
            [](const HostTensor& a, const HostTensor& b) {
              return a.name < b.name;
            });
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].name == out[i - 1].name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", out[i].name,
          "\": two tensors have this name after conversion"));
    }
  }
  return out;
}

}  // namespace checkpoint
}  // namespace shardd
