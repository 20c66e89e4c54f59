// Runs one training step of the CPU model (worker/model/moe_model.h) on
// random fp32 weights and tokens, and writes everything a reference needs
// to recompute it as JSON: the spec's dims, every parameter (shardd layout
// and names), the tokens, the loss and every parameter's gradient.
//
//   model_dump --model CONFIG.json --batch B --seq S --seed N --out FILE
//
// CONFIG.json is a Hugging Face config or a native spec. With
// --diffusion_step (DiffusionGemma only) the step is the 3-pass
// block-diffusion step (moe_model.h) at optimizer step --step, row r's
// global sequence index 1000 + r and targets = the inputs shifted (the
// last drawn); the dump adds the canvas the model drew. Test-only.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "google/protobuf/util/json_util.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "model/native_spec.h"
#include "nlohmann/json.hpp"
#include "program/pass_layout.h"
#include "testing/map_param_source.h"
#include "testing/model_commands.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

ABSL_FLAG(std::string, model, "", "HF config.json or native spec");
ABSL_FLAG(int64_t, batch, 2, "sequences");
ABSL_FLAG(int64_t, seq, 16, "tokens per sequence");
ABSL_FLAG(uint32_t, seed, 1, "random seed");
ABSL_FLAG(double, scale, 0.2, "weights uniform in [-scale, scale]");
ABSL_FLAG(double, gate_up_scale, 1.0,
          "multiplies the range of every moe.experts.gate_and_up_projs (large "
          "enough, GPT-OSS's clamped activation cuts some values)");
ABSL_FLAG(std::string, out, "", "output JSON");
ABSL_FLAG(bool, diffusion_step, false,
          "DiffusionGemma: run the 3-pass block-diffusion step");
ABSL_FLAG(int64_t, step, 5, "the optimizer step keying the canvas noise");
ABSL_FLAG(int64_t, response_length, 0,
          "--diffusion_step: the canvas rows per sequence, in blocks of "
          "canvas_length (0: one block)");

namespace shardd {
namespace {

int Run() {
  std::ifstream in(absl::GetFlag(FLAGS_model));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec =
      text.str().find("\"architectures\"") != std::string::npos
          ? ModelSpecFromHfConfig(text.str())
          : ModelSpecFromJson(text.str());
  if (!spec.ok()) {
    std::fprintf(stderr, "model_dump: %s\n", spec.status().ToString().c_str());
    return 1;
  }
  // fp32 throughout: the reference recomputes in float64.
  absl::StatusOr<MoeArchitecture> arch = ReadMoeArchitecture(*spec);
  const bool diffusion = absl::GetFlag(FLAGS_diffusion_step);
  MoeModelOptions model_options;
  if (diffusion) {
    model_options.passes = 3;
    model_options.no_grad_passes = 1;
    model_options.diffusion.response_length =
        absl::GetFlag(FLAGS_response_length);
  }
  absl::StatusOr<std::unique_ptr<MoeModel>> model =
      MoeModel::Create(*spec, model_options);
  if (!arch.ok() || !model.ok()) {
    std::fprintf(
        stderr, "model_dump: %s\n",
        (arch.ok() ? model.status() : arch.status()).ToString().c_str());
    return 1;
  }
  std::mt19937 gen(absl::GetFlag(FLAGS_seed));
  const float scale = static_cast<float>(absl::GetFlag(FLAGS_scale));
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  testing_util::MapParamSource source;
  nlohmann::json params = nlohmann::json::object();
  for (const ParamRef& ref : ListParams(*spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    std::vector<float>& v = source.values[ref.fqn];
    v.resize(Numel(*ref.tensor));
    // Norm weights near 1; everything else, biases and sinks included,
    // random and nonzero so that every term is exercised.
    const bool norm = absl::StrContains(ref.fqn, "norm");
    const float range =
        absl::EndsWith(ref.fqn, "gate_and_up_projs")
            ? scale * static_cast<float>(absl::GetFlag(FLAGS_gate_up_scale))
            : scale;
    for (float& x : v) x = norm ? 1.0f + 0.1f * uni(gen) : range * uni(gen);
    params[ref.fqn] = {
        {"shape", std::vector<int64_t>(ref.tensor->shape().begin(),
                                       ref.tensor->shape().end())},
        {"values", v}};
  }
  const int64_t batch = absl::GetFlag(FLAGS_batch),
                seq = absl::GetFlag(FLAGS_seq);
  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (int32_t& x : inputs) x = static_cast<int32_t>(gen() % arch->vocab);
  for (int32_t& x : targets) x = static_cast<int32_t>(gen() % arch->vocab);
  std::vector<int64_t> indices(batch);
  const int64_t step = absl::GetFlag(FLAGS_step);
  if (diffusion) {
    for (int64_t i = 0; i + 1 < batch * seq; ++i) {
      if ((i + 1) % seq != 0) targets[i] = inputs[i + 1];
    }
    for (int64_t r = 0; r < batch; ++r) indices[r] = 1000 + r;
  }
  absl::Status status =
      (*model)->SetBatch(0, inputs.data(), targets.data(), batch, seq);
  if (status.ok() && diffusion) {
    status = (*model)->SetSequenceKeys(0, step, indices.data());
  }
  const std::vector<v1::Command> commands =
      diffusion ? testing_util::ModelStepCommands(
                      arch->LayersWithExperts(),
                      PassLayout::For(kBlockDiffusionArchitecture, 3, 1), 1)
                : testing_util::ModelStepCommands(arch->LayersWithExperts(),
                                                  1, 0, 1);
  for (const v1::Command& c : commands) {
    if (!status.ok()) break;
    status = (*model)->Run(c, &source);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "model_dump: %s\n", status.ToString().c_str());
    return 1;
  }
  std::string dims;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(spec->dims(), &dims,
                                                    options);
  nlohmann::json out = {{"architecture", spec->architecture()},
                        {"dims", nlohmann::json::parse(dims)},
                        {"batch", batch},
                        {"seq", seq},
                        {"inputs", inputs},
                        {"targets", targets},
                        {"params", params},
                        {"loss", (*model)->step_loss()},
                        {"grads", source.grads}};
  if (diffusion) {
    DiffusionCanvas canvas;
    const int64_t response = model_options.diffusion.response_length > 0
                                 ? model_options.diffusion.response_length
                                 : spec->dims().canvas_length();
    status = BuildDiffusionCanvas(inputs.data(), batch, seq, response,
                                  arch->vocab, step, indices.data(),
                                  model_options.diffusion, &canvas);
    if (!status.ok()) {
      std::fprintf(stderr, "model_dump: %s\n", status.ToString().c_str());
      return 1;
    }
    out["diffusion"] = {{"step", step},
                        {"sequence_indices", indices},
                        {"canvas_length", spec->dims().canvas_length()},
                        {"response_length", response},
                        {"noised", canvas.noised},
                        {"self_conditioning", canvas.self_cond}};
  }
  std::ofstream file(absl::GetFlag(FLAGS_out));
  file << out.dump();
  return file.good() ? 0 : 1;
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardd::Run();
}
