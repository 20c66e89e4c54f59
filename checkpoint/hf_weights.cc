#include "checkpoint/hf_weights.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/hf_diffusion_gemma.h"
#include "common/status_macros.h"
#include "model/model_util.h"

namespace shardd {
namespace checkpoint {
namespace {

constexpr char kLayers[] = "model.layers.";
// Elements converted per pread of a contiguous range (bounds the staging
// buffer: 16 MiB of F32).
constexpr int64_t kChunkElements = int64_t{1} << 22;

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Reads elements [begin, begin + n) of `source` as fp32.
absl::Status ReadFloats(const HfWeights::Source& source, int64_t begin,
                        int64_t n, float* out, std::vector<uint8_t>* staging) {
  const int64_t esize = SafetensorsDTypeBytes(source.entry->dtype);
  for (int64_t done = 0; done < n;) {
    const int64_t count = std::min(n - done, kChunkElements);
    staging->resize(static_cast<size_t>(count * esize));
    SHARDD_RETURN_IF_ERROR(source.file->ReadBytes(
        *source.entry, (begin + done) * esize, count * esize, staging->data()));
    SafetensorsToFloat(source.entry->dtype, staging->data(), count, out + done);
    done += count;
  }
  return absl::OkStatus();
}

// "model.layers.L.moe.<rest>" -> L and rest.
bool SplitMoe(const std::string& name, std::string* layer_prefix,
              std::string* rest) {
  absl::string_view n = name;
  if (!absl::ConsumePrefix(&n, kLayers)) return false;
  const size_t dot = n.find('.');
  if (dot == absl::string_view::npos) return false;
  absl::string_view tail = n.substr(dot + 1);
  if (!absl::ConsumePrefix(&tail, "moe.")) return false;
  *layer_prefix = absl::StrCat(kLayers, n.substr(0, dot), ".");
  *rest = std::string(tail);
  return true;
}

constexpr char kDecoder[] = "model.decoder.";
constexpr char kDecoderEmbed[] = "model.decoder.embed_tokens.weight";

// The tensor `hf` of `param` has shape `want` (HF's layout; `note` says how
// it maps to the parameter's).
absl::Status CheckShape(const std::string& param, const std::string& hf,
                        const HfWeights::Source& s,
                        const std::vector<int64_t>& want,
                        const std::string& note = "") {
  if (s.entry->shape == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor \"", hf, "\" in ", s.file->path(), ": shape ",
      Shape(s.entry->shape), " but parameter \"", param, "\" needs ",
      Shape(want), note));
}

}  // namespace


absl::StatusOr<std::unique_ptr<HfWeights>> HfWeights::Open(
    const std::string& path, const v1::ModelSpec& model) {
  auto weights = absl::WrapUnique(new HfWeights());
  SHARDD_ASSIGN_OR_RETURN(weights->checkpoint_, OpenHfCheckpoint(path));
  weights->diffusion_gemma_ =
      weights->checkpoint_.tensors.count(kDecoderEmbed) != 0;
  for (const ParamRef& ref : ListParams(model)) {
    if (!ref.tensor->tied_to().empty()) continue;
    SHARDD_RETURN_IF_ERROR(weights->Bind(ref.fqn, *ref.tensor));
  }
  return weights;
}

absl::StatusOr<HfWeights::Source> HfWeights::Find(
    const std::string& tensor) const {
  auto it = checkpoint_.tensors.find(tensor);
  if (it == checkpoint_.tensors.end()) {
    return absl::NotFoundError(
        absl::StrCat("no tensor \"", tensor, "\" in ", checkpoint_.path));
  }
  const Source& s = it->second;
  if (!SafetensorsFloatDType(s.entry->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", tensor, "\" in ", s.file->path(), ": dtype ",
        s.entry->dtype, "; --init-from reads F32, BF16 or F16"));
  }
  return s;
}

absl::Status HfWeights::Bind(const std::string& name,
                             const v1::TensorSpec& tensor) {
  const std::vector<int64_t> shape(tensor.shape().begin(),
                                   tensor.shape().end());
  auto check_shape = [&](const std::string& hf, const Source& s,
                         const std::vector<int64_t>& want) {
    return CheckShape(name, hf, s, want);
  };
  auto direct = [&](const std::string& hf) -> absl::Status {
    SHARDD_ASSIGN_OR_RETURN(Source s, Find(hf));
    SHARDD_RETURN_IF_ERROR(check_shape(hf, s, shape));
    Binding b;
    b.source = s;
    bindings_[name] = b;
    return absl::OkStatus();
  };
  if (checkpoint_.tensors.count(name) == 0 && diffusion_gemma_) {
    return BindDiffusionGemma(name, shape);
  }
  std::string layer, rest;
  if (!SplitMoe(name, &layer, &rest)) return direct(name);
  if (checkpoint_.tensors.count(name) != 0) return direct(name);  // Native names.

  const std::string fused = absl::StrCat(layer, "mlp.experts.");
  const bool gate_up = rest == "experts.gate_and_up_projs";
  const bool down = rest == "experts.down_projs";
  if ((rest == "experts.gate_up_proj_bias" || gate_up) &&
      checkpoint_.tensors.count(fused + (gate_up ? "gate_up_proj" : "gate_up_proj_bias"))) {
    // GPT-OSS: interleaved gate/up columns, same shape.
    const std::string hf =
        fused + (gate_up ? "gate_up_proj" : "gate_up_proj_bias");
    SHARDD_ASSIGN_OR_RETURN(Source s, Find(hf));
    SHARDD_RETURN_IF_ERROR(check_shape(hf, s, shape));
    if (shape.back() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter \"", name, "\": last dim ", shape.back(),
          " must be even (gate and up halves)"));
    }
    Binding b;
    b.layout = Layout::kInterleaved;
    b.source = s;
    b.row_length = shape.back();
    bindings_[name] = b;
    return absl::OkStatus();
  }
  if (down && checkpoint_.tensors.count(fused + "down_proj")) return direct(fused + "down_proj");
  if (gate_up || down) {
    if (shape.size() != 3 || (gate_up && shape[2] % 2 != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter \"", name, "\": shape ", Shape(shape), " must be ",
          gate_up ? "[E, D, 2I]" : "[E, I, D]"));
    }
    const int64_t experts = shape[0];
    // Per-expert Linear weights ([out, in]) in Qwen3-MoE / DeepSeek-V3 or
    // Mixtral naming.
    struct Style {
      const char* module;
      const char* gate;
      const char* up;
      const char* down;
    };
    static constexpr Style kStyles[] = {
        {"mlp", "gate_proj", "up_proj", "down_proj"},
        {"block_sparse_moe", "w1", "w3", "w2"}};
    auto expert_name = [&](const Style& st, int64_t e, const char* proj) {
      return absl::StrCat(layer, st.module, ".experts.", e, ".", proj,
                          ".weight");
    };
    const Style* style = nullptr;
    for (const Style& st : kStyles) {
      if (checkpoint_.tensors.count(expert_name(st, 0, gate_up ? st.gate : st.down))) {
        style = &st;
      }
    }
    if (style == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "parameter \"", name, "\": no tensor \"", name, "\", \"", fused,
          gate_up ? "gate_up_proj" : "down_proj", "\", \"",
          expert_name(kStyles[0], 0, gate_up ? "gate_proj" : "down_proj"),
          "\" or \"",
          expert_name(kStyles[1], 0, gate_up ? "w1" : "w2"), "\" in ", checkpoint_.path));
    }
    for (const Style& st : kStyles) {
      if (&st != style && checkpoint_.tensors.count(expert_name(st, 0, st.down))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, "*: experts in both \"", style->module,
            ".experts\" and \"", st.module, ".experts\" naming in ", checkpoint_.path));
      }
    }
    const char* extra = gate_up ? style->gate : style->down;
    if (checkpoint_.tensors.count(expert_name(*style, experts, extra))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", expert_name(*style, experts, extra), "\" in ",
          checkpoint_.tensors.at(expert_name(*style, experts, extra)).file->path(),
          ": the checkpoint has more experts than parameter \"", name,
          "\"'s ", experts));
    }
    Binding b;
    b.layout = Layout::kTransposedExperts;
    b.rows = shape[1];
    b.row_length = shape[2];
    const int64_t inter = gate_up ? shape[2] / 2 : shape[1];
    const int64_t hidden = shape[1 + (gate_up ? 0 : 1)];
    for (int64_t e = 0; e < experts; ++e) {
      std::vector<ColumnSource>& columns = b.experts.emplace_back();
      std::vector<std::pair<const char*, int64_t>> projs;
      if (gate_up) {
        projs = {{style->gate, 0}, {style->up, inter}};
      } else {
        projs = {{style->down, 0}};
      }
      for (const auto& [proj, col] : projs) {
        const std::string hf = expert_name(*style, e, proj);
        absl::StatusOr<Source> s = Find(hf);
        if (!s.ok()) {
          return absl::Status(s.status().code(),
                              absl::StrCat("parameter \"", name, "\" (expert ",
                                           e, " of ", experts, "): ",
                                           s.status().message()));
        }
        // HF Linear weights are [out, in]: gate/up [I, D], down [D, I].
        const std::vector<int64_t> want =
            gate_up ? std::vector<int64_t>{inter, hidden}
                    : std::vector<int64_t>{hidden, inter};
        SHARDD_RETURN_IF_ERROR(check_shape(hf, *s, want));
        columns.push_back(
            {col, col + (gate_up ? inter : hidden), *s});
      }
    }
    bindings_[name] = std::move(b);
    return absl::OkStatus();
  }
  // Other MoE tensors: the router and shared experts under the HF module
  // names.
  std::vector<std::string> tried = {name};
  for (const char* module : {"mlp.", "block_sparse_moe."}) {
    tried.push_back(absl::StrCat(layer, module, rest));
  }
  if (absl::StartsWith(rest, "gate.")) {
    tried.push_back(absl::StrCat(layer, "mlp.router.",
                                 absl::StripPrefix(rest, "gate.")));
  }
  for (const std::string& hf : tried) {
    if (checkpoint_.tensors.count(hf)) return direct(hf);
  }
  return absl::NotFoundError(absl::StrCat("parameter \"", name,
                                          "\": no tensor \"",
                                          absl::StrJoin(tried, "\", \""),
                                          "\" in ", checkpoint_.path));
}

absl::Status HfWeights::BindDiffusionGemma(const std::string& name,
                                           const std::vector<int64_t>& shape) {
  absl::string_view tail = name;
  if (!absl::ConsumePrefix(&tail, "model.")) {
    return absl::NotFoundError(absl::StrCat("parameter \"", name,
                                            "\": no tensor \"", name, "\" in ",
                                            checkpoint_.path));
  }
  std::string layer, rest;
  if (!SplitMoe(name, &layer, &rest)) {
    // Attention, dense MLP, norms, layer_scalar, embedding, self_conditioning.
    const std::string hf = absl::StrCat(kDecoder, tail);
    absl::StatusOr<Source> s = Find(hf);
    if (!s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat("parameter \"", name, "\": ",
                                       s.status().message()));
    }
    SHARDD_RETURN_IF_ERROR(CheckShape(name, hf, *s, shape));
    Binding b;
    b.source = *s;
    bindings_[name] = b;
    return absl::OkStatus();
  }
  // "model.layers.L." -> "model.decoder.layers.L.".
  const std::string hf_layer =
      absl::StrCat(kDecoder, absl::StripPrefix(layer, "model."));
  auto find = [&](const std::string& hf) -> absl::StatusOr<Source> {
    absl::StatusOr<Source> s = Find(hf);
    if (s.ok()) return s;
    return absl::Status(s.status().code(),
                        absl::StrCat("parameter \"", name, "\": ",
                                     s.status().message()));
  };
  if (rest == "gate.scale" || rest == "gate.proj.weight") {
    const std::string hf =
        absl::StrCat(hf_layer, "router.", absl::StripPrefix(rest, "gate."));
    SHARDD_ASSIGN_OR_RETURN(Source s, find(hf));
    SHARDD_RETURN_IF_ERROR(CheckShape(name, hf, s, shape));
    Binding b;
    b.source = s;
    bindings_[name] = b;
    return absl::OkStatus();
  }
  const bool gate_up = rest == "experts.gate_and_up_projs";
  if (!gate_up && rest != "experts.down_projs") {
    return absl::NotFoundError(absl::StrCat(
        "parameter \"", name,
        "\": no DiffusionGemma tensor maps to it (the released checkpoint's "
        "MoE holds router.{scale,proj.weight,per_expert_scale} and "
        "experts.{gate_up_proj,down_proj}) in ",
        checkpoint_.path));
  }
  if (shape.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter \"", name, "\": shape ", Shape(shape),
                     " must be ", gate_up ? "[E, D, 2I]" : "[E, I, D]"));
  }
  // HF stores each expert as a Linear weight [out, in]: the transpose of
  // shardd's [in, out].
  const int64_t experts = shape[0], rows = shape[1], cols = shape[2];
  const std::string hf =
      absl::StrCat(hf_layer, gate_up ? "experts.gate_up_proj"
                                     : "experts.down_proj");
  SHARDD_ASSIGN_OR_RETURN(Source s, find(hf));
  SHARDD_RETURN_IF_ERROR(CheckShape(
      name, hf, s, {experts, cols, rows},
      absl::StrCat(" (its ", Shape(shape), " with each expert transposed)")));
  Binding b;
  b.layout = Layout::kTransposedExperts;
  b.rows = rows;
  b.row_length = cols;
  for (int64_t e = 0; e < experts; ++e) {
    b.experts.push_back({{0, cols, s, e * rows * cols}});
  }
  if (!gate_up) {
    // router.per_expert_scale multiplies expert e's output; folded into its
    // down projection as NeMo's adapter does.
    const std::string scale = absl::StrCat(hf_layer, "router.per_expert_scale");
    SHARDD_ASSIGN_OR_RETURN(b.scale, find(scale));
    SHARDD_RETURN_IF_ERROR(CheckShape(
        name, scale, b.scale, {experts},
        " (one scale per expert, folded into its down projection)"));
    b.scaled = true;
    b.scale_block = rows * cols;
  }
  bindings_[name] = std::move(b);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> HfWeights::ExpertScales(
    const std::string& name) const {
  auto it = bindings_.find(name);
  if (it == bindings_.end()) {
    return absl::NotFoundError(
        absl::StrCat("parameter \"", name, "\" is not bound to ", path()));
  }
  const Binding& b = it->second;
  if (!b.scaled) {
    return std::vector<float>(b.experts.size(), 1.0f);
  }
  const int64_t n = b.scale.entry->numel;
  std::vector<float> scale(static_cast<size_t>(n));
  std::vector<uint8_t> staging;
  SHARDD_RETURN_IF_ERROR(ReadFloats(b.scale, 0, n, scale.data(), &staging));
  return scale;
}

absl::Status HfWeights::ApplyScale(const Binding& b, int64_t begin,
                                   int64_t end, float* out) const {
  const int64_t first = begin / b.scale_block;
  const int64_t last = (end - 1) / b.scale_block;
  std::vector<float> scale(static_cast<size_t>(last - first + 1));
  std::vector<uint8_t> staging;
  SHARDD_RETURN_IF_ERROR(ReadFloats(b.scale, first, last - first + 1,
                                    scale.data(), &staging));
  for (int64_t i = begin; i < end; ++i) {
    out[i - begin] *= scale[i / b.scale_block - first];
  }
  return absl::OkStatus();
}

absl::Status HfWeights::Read(const std::string& name,
                             const v1::TensorSpec& tensor, int64_t begin,
                             int64_t end, float* out) const {
  auto it = bindings_.find(name);
  if (it == bindings_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "parameter \"", name, "\" is not bound to ", checkpoint_.path,
        " (not a parameter of the model it was opened for)"));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t numel,
      ShapeNumel(std::vector<int64_t>(tensor.shape().begin(),
                                      tensor.shape().end())));
  if (begin < 0 || begin > end || end > numel) {
    return absl::OutOfRangeError(
        absl::StrCat("parameter \"", name, "\": elements [", begin, ", ", end,
                     ") outside its ", numel));
  }
  const Binding& b = it->second;
  absl::Status status;
  std::vector<uint8_t> staging;
  switch (b.layout) {
    case Layout::kDirect:
      status = ReadFloats(b.source, begin, end - begin, out, &staging);
      break;
    case Layout::kInterleaved:
      status = ReadInterleaved(b, begin, end, out);
      break;
    case Layout::kTransposedExperts:
      status = ReadTransposed(b, begin, end, out);
      break;
  }
  if (status.ok() && b.scaled && begin < end) {
    status = ApplyScale(b, begin, end, out);
  }
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("parameter \"", name,
                                                  "\": ", status.message()));
}

absl::Status HfWeights::ReadInterleaved(const Binding& b, int64_t begin,
                                        int64_t end, float* out) const {
  const int64_t len = b.row_length, half = len / 2;
  std::vector<uint8_t> staging;
  std::vector<float> rows;
  // Whole rows at a time, in chunks; a partial first or last row is read
  // whole and only its wanted part kept.
  int64_t row = begin / len;
  while (row * len < end) {
    const int64_t max_rows = std::max<int64_t>(1, kChunkElements / len);
    const int64_t last = std::min((end + len - 1) / len, row + max_rows);
    const int64_t n = (last - row) * len;
    rows.resize(static_cast<size_t>(n));
    SHARDD_RETURN_IF_ERROR(
        ReadFloats(b.source, row * len, n, rows.data(), &staging));
    for (int64_t r = row; r < last; ++r) {
      const float* src = rows.data() + (r - row) * len;
      const int64_t lo = std::max(begin, r * len), hi = std::min(end, (r + 1) * len);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t j = i - r * len;
        out[i - begin] = src[j < half ? 2 * j : 2 * (j - half) + 1];
      }
    }
    row = last;
  }
  return absl::OkStatus();
}

absl::Status HfWeights::ReadTransposed(const Binding& b, int64_t begin,
                                       int64_t end, float* out) const {
  const int64_t rows = b.rows, cols = b.row_length, per_expert = rows * cols;
  std::vector<uint8_t> staging;
  std::vector<float> block;
  // Out[(r, c)] for r in [r0, r1), c in [c0, c1) of expert e.
  auto piece = [&](int64_t e, int64_t r0, int64_t r1, int64_t c0,
                   int64_t c1) -> absl::Status {
    for (const ColumnSource& cs : b.experts[e]) {
      const int64_t lo = std::max(c0, cs.col_begin);
      const int64_t hi = std::min(c1, cs.col_end);
      if (lo >= hi) continue;
      // The source is [cs.col_end - cs.col_begin, rows]: its row c holds
      // column c of ours.
      const int64_t nr = r1 - r0, nc = hi - lo;
      block.resize(static_cast<size_t>(nr * nc));
      if (nr == rows) {
        SHARDD_RETURN_IF_ERROR(ReadFloats(
            cs.source, cs.offset + (lo - cs.col_begin) * rows, nc * rows,
            block.data(), &staging));
      } else {
        for (int64_t c = lo; c < hi; ++c) {
          SHARDD_RETURN_IF_ERROR(
              ReadFloats(cs.source, cs.offset + (c - cs.col_begin) * rows + r0,
                         nr,
                         block.data() + (c - lo) * nr, &staging));
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        float* dst = out + (e * per_expert + r * cols + lo) - begin;
        const float* src = block.data() + (r - r0);
        for (int64_t c = 0; c < nc; ++c) dst[c] = src[c * nr];
      }
    }
    return absl::OkStatus();
  };
  for (int64_t e = begin / per_expert; e * per_expert < end; ++e) {
    const int64_t lo = std::max(begin, e * per_expert) - e * per_expert;
    const int64_t hi = std::min(end, (e + 1) * per_expert) - e * per_expert;
    int64_t r = lo / cols;
    if (lo % cols != 0) {  // Partial first row.
      const int64_t stop = std::min(hi, (r + 1) * cols);
      SHARDD_RETURN_IF_ERROR(piece(e, r, r + 1, lo % cols, stop - r * cols));
      ++r;
    }
    const int64_t full_end = hi / cols;
    if (r < full_end) {
      SHARDD_RETURN_IF_ERROR(piece(e, r, full_end, 0, cols));
      r = full_end;
    }
    if (r * cols < hi && r * cols >= lo) {  // Partial last row.
      SHARDD_RETURN_IF_ERROR(piece(e, r, r + 1, 0, hi - r * cols));
    }
  }
  return absl::OkStatus();
}

int64_t HfWeights::data_bytes_read() const {
  int64_t total = 0;
  for (const auto& file : checkpoint_.files) total += file->data_bytes_read();
  return total;
}

std::vector<std::string> HfWeights::UnusedTensors() const {
  std::set<std::string> used;
  for (const auto& [name, b] : bindings_) {
    if (b.scaled) used.insert(b.scale.entry->name);
    if (b.layout != Layout::kTransposedExperts) {
      used.insert(b.source.entry->name);
      continue;
    }
    for (const auto& expert : b.experts) {
      for (const ColumnSource& cs : expert) used.insert(cs.source.entry->name);
    }
  }
  std::vector<std::string> unused;
  for (const auto& [name, source] : checkpoint_.tensors) {
    if (used.count(name) != 0) continue;
    if (diffusion_gemma_ && DiffusionGemmaIgnoredTensor(name)) continue;
    unused.push_back(name);
  }
  return unused;
}

std::vector<std::string> HfWeights::IgnoredTensors() const {
  std::vector<std::string> ignored;
  if (!diffusion_gemma_) return ignored;
  for (const auto& [name, source] : checkpoint_.tensors) {
    if (DiffusionGemmaIgnoredTensor(name)) ignored.push_back(name);
  }
  return ignored;
}

}  // namespace checkpoint
}  // namespace shardd
