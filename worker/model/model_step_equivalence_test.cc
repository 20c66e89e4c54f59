// The step driver (model_step.h over cpu_block_ops.h) against MoeModel's
// own step (MoeModelOptions::legacy_step_for_test): the same losses, token
// counts, load-balancing statistics, parameter gradients and activation
// bytes (each command's peak and what it leaves), bit for bit, for every
// architecture and step feature the CPU computes outside DiffusionGemma.
// Both run the same kernels in the same order, so any difference is a
// change of what the step computes, keeps or frees.

#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "program/pass_layout.h"
#include "testing/map_param_source.h"
#include "testing/model_builder.h"
#include "testing/model_commands.h"
#include "testing/random_params.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using MapSource = ::shardd::testing_util::MapParamSource;

enum class Recompute { kNone, kAll, kExperts, kEveryOther };

struct Case {
  std::string config;  // tests/data file, or "" for the builder's model
  int passes = 1;
  int no_grad = 0;
  int microbatches = 2;
  Recompute recompute = Recompute::kNone;
  bool eval = false;
  bool freeze = false;  // Freeze layer 0 and the head.
  // DiffusionGemma's block-diffusion step (3 passes, 1 without gradients):
  // tokens per sequence and train.diffusion.response_length.
  int64_t seq = 8;
  int64_t response = 0;
  bool hold = false;  // HoldSelfConditioningForTest after the first step.
};

bool Diffusion(const Case& c) { return c.passes == 3 && c.no_grad == 1 && c.config == "tiny_diffusion_gemma.json"; }

std::string Name(const Case& c) {
  return absl::StrCat(c.config.empty() ? "builder" : c.config, " passes=",
                      c.passes, "/", c.no_grad, " mb=", c.microbatches,
                      " recompute=", static_cast<int>(c.recompute),
                      c.eval ? " eval" : "", c.freeze ? " frozen" : "",
                      " seq=", c.seq, " response=", c.response,
                      c.hold ? " hold" : "");
}

v1::ModelSpec SpecOf(const Case& c) {
  v1::ModelSpec spec;
  if (c.config.empty()) {
    testing_util::TinyMoeShape shape;
    shape.vocab = 13;
    shape.dim = 6;
    shape.experts = 4;
    shape.inter = 3;
    shape.mlp = 5;
    shape.layers = 3;
    shape.moe_layers = {true, true, false};
    shape.mlp_layers = {true, false, true};
    shape.tied = true;
    spec = testing_util::TinyMoeSpec(shape);
  } else {
    std::ifstream in("tests/data/" + c.config);
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<v1::ModelSpec> parsed = ModelSpecFromHfConfig(text.str());
    EXPECT_TRUE(parsed.ok()) << c.config << ": " << parsed.status();
    if (parsed.ok()) spec = *parsed;
  }
  if (c.freeze) {
    for (const ParamRef& ref : ListParams(spec)) {
      if (absl::StartsWith(ref.fqn, "model.layers.0.") ||
          ref.fqn == "lm_head.weight") {
        const_cast<v1::TensorSpec*>(ref.tensor)->set_frozen(true);
      }
    }
  }
  return spec;
}

// Everything one model produced over two steps.
struct Trace {
  std::vector<int64_t> peaks, lives;
  std::vector<double> losses;
  std::vector<int64_t> tokens;
  std::vector<std::vector<int64_t>> aux_counts;
  std::vector<std::vector<float>> aux_sums;
  std::map<std::string, std::vector<float>> grads;
};

Trace Run(const v1::ModelSpec& spec, const Case& c, bool legacy) {
  Trace trace;
  MoeModelOptions options;
  options.passes = c.passes;
  options.no_grad_passes = c.no_grad;
  options.microbatches = c.microbatches;
  options.legacy_step_for_test = legacy;
  options.diffusion.response_length = c.response;
  absl::StatusOr<std::unique_ptr<MoeModel>> created =
      MoeModel::Create(spec, options);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return trace;
  MoeModel& model = **created;
  absl::StatusOr<MoeArchitecture> arch = ReadMoeArchitecture(spec);
  EXPECT_TRUE(arch.ok()) << arch.status();
  if (!arch.ok()) return trace;
  const int layers = static_cast<int>(arch->layers.size());
  std::vector<bool> whole(layers, false), experts(layers, false);
  for (int l = 0; l < layers; ++l) {
    whole[l] = c.recompute == Recompute::kAll ||
               (c.recompute == Recompute::kEveryOther && l % 2 == 0);
    experts[l] = c.recompute == Recompute::kExperts;
  }
  EXPECT_THAT(model.SetRecompute(whole, experts), IsOk());
  model.SetEvaluation(c.eval);

  MapSource source;
  source.values = testing_util::RandomParamValues(spec);
  std::mt19937 gen(7);
  const int64_t batch = 2, seq = c.seq;
  for (int step = 0; step < 2; ++step) {
    if (step == 1 && c.hold) model.HoldSelfConditioningForTest(true);
    model.ResetStep();
    std::vector<std::vector<int32_t>> inputs(c.microbatches),
        targets(c.microbatches);
    for (int m = 0; m < c.microbatches; ++m) {
      inputs[m].resize(batch * seq);
      targets[m].resize(batch * seq);
      for (int32_t& x : inputs[m]) x = gen() % arch->vocab;
      for (int32_t& x : targets[m]) {
        // Some ignored targets.
        x = gen() % 5 == 0 ? -1 : static_cast<int32_t>(gen() % arch->vocab);
      }
      EXPECT_THAT(model.SetBatch(m, inputs[m].data(), targets[m].data(),
                                 batch, seq),
                  IsOk());
      if (Diffusion(c)) {
        // Keys that change the canvas and the coins from step to step.
        const std::vector<int64_t> keys = {10 * m + 3 * step,
                                           10 * m + 3 * step + 1};
        EXPECT_THAT(model.SetSequenceKeys(m, step + 5, keys.data()), IsOk());
      }
    }
    std::vector<v1::Command> commands =
        Diffusion(c)
            ? testing_util::ModelStepCommands(
                  arch->LayersWithExperts(),
                  PassLayout::For(kBlockDiffusionArchitecture, 3, 1),
                  c.microbatches)
            : testing_util::ModelStepCommands(arch->LayersWithExperts(),
                                              c.passes, c.no_grad,
                                              c.microbatches);
    if (c.eval) {
      // An evaluation runs the forwards only, none with a graph.
      std::vector<v1::Command> forwards;
      for (v1::Command cmd : commands) {
        if (cmd.op() != v1::Command::FORWARD) continue;
        cmd.set_requires_grad(false);
        forwards.push_back(cmd);
      }
      commands = forwards;
    }
    for (const v1::Command& cmd : commands) {
      const absl::Status status = model.Run(cmd, &source);
      EXPECT_TRUE(status.ok()) << status << " at " << cmd.ShortDebugString();
      if (!status.ok()) return trace;
      trace.peaks.push_back(model.command_activation_peak());
      trace.lives.push_back(model.activation_bytes());
      if (cmd.op() == v1::Command::FORWARD &&
          cmd.part() == v1::Command::HEAD && cmd.requires_grad()) {
        MoeModel::RouterAuxStats* aux = model.router_aux_stats(cmd.pass());
        if (aux != nullptr) {
          trace.aux_counts.push_back(aux->counts);
          trace.aux_sums.push_back(aux->prob_sums);
        }
      }
    }
    trace.losses.push_back(model.step_loss());
    trace.tokens.push_back(model.step_tokens());
  }
  trace.grads = source.grads;
  return trace;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

void ExpectSame(const Case& c) {
  SCOPED_TRACE(Name(c));
  const v1::ModelSpec spec = SpecOf(c);
  const Trace legacy = Run(spec, c, /*legacy=*/true);
  const Trace driver = Run(spec, c, /*legacy=*/false);
  ASSERT_FALSE(legacy.losses.empty());
  ASSERT_EQ(legacy.losses.size(), driver.losses.size());
  for (size_t i = 0; i < legacy.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&legacy.losses[i], &driver.losses[i], 8), 0)
        << "step " << i << " loss " << legacy.losses[i] << " vs "
        << driver.losses[i];
    EXPECT_GT(legacy.losses[i], 0.0);
  }
  EXPECT_EQ(legacy.tokens, driver.tokens);
  ASSERT_EQ(legacy.peaks.size(), driver.peaks.size());
  for (size_t i = 0; i < legacy.peaks.size(); ++i) {
    EXPECT_EQ(legacy.peaks[i], driver.peaks[i]) << "command " << i;
    EXPECT_EQ(legacy.lives[i], driver.lives[i]) << "command " << i;
  }
  EXPECT_EQ(legacy.aux_counts, driver.aux_counts);
  ASSERT_EQ(legacy.aux_sums.size(), driver.aux_sums.size());
  for (size_t i = 0; i < legacy.aux_sums.size(); ++i) {
    EXPECT_TRUE(SameBits(legacy.aux_sums[i], driver.aux_sums[i])) << i;
  }
  ASSERT_EQ(legacy.grads.size(), driver.grads.size());
  for (const auto& [name, g] : legacy.grads) {
    auto it = driver.grads.find(name);
    ASSERT_NE(it, driver.grads.end()) << name;
    EXPECT_TRUE(SameBits(g, it->second)) << name;
  }
  if (!c.eval) {
    EXPECT_FALSE(legacy.grads.empty());
  }
}

const char* const kConfigs[] = {
    "tiny_mixtral_aux.json", "tiny_qwen3_moe.json",
    "tiny_qwen3_moe_aux.json", "tiny_qwen3_moe_unnormalized.json",
    "tiny_gpt_oss.json",     "tiny_gpt_oss_aux.json",
    "tiny_deepseek_v3.json", "tiny_llama3.json",
    "",
};

TEST(ModelStepEquivalenceTest, EveryArchitecture) {
  for (const char* config : kConfigs) ExpectSame(Case{config});
}

TEST(ModelStepEquivalenceTest, Recompute) {
  for (const char* config : kConfigs) {
    for (Recompute r :
         {Recompute::kAll, Recompute::kExperts, Recompute::kEveryOther}) {
      Case c{config};
      c.recompute = r;
      ExpectSame(c);
    }
  }
}

TEST(ModelStepEquivalenceTest, PassesAndMicroBatches) {
  for (const char* config : kConfigs) {
    Case two{config, /*passes=*/2, /*no_grad=*/0, /*microbatches=*/1};
    ExpectSame(two);
    Case three{config, /*passes=*/3, /*no_grad=*/1, /*microbatches=*/3};
    three.recompute = Recompute::kEveryOther;
    ExpectSame(three);
  }
}

TEST(ModelStepEquivalenceTest, Evaluation) {
  for (const char* config : kConfigs) {
    Case c{config};
    c.eval = true;
    ExpectSame(c);
  }
}

TEST(ModelStepEquivalenceTest, FrozenParameters) {
  for (const char* config : kConfigs) {
    Case c{config};
    c.freeze = true;
    c.recompute = Recompute::kAll;
    ExpectSame(c);
  }
}

constexpr char kGemma[] = "tiny_diffusion_gemma.json";

TEST(ModelStepEquivalenceTest, DiffusionGemmaCausalPass) {
  for (Recompute r : {Recompute::kNone, Recompute::kAll, Recompute::kExperts,
                      Recompute::kEveryOther}) {
    Case c{kGemma};
    c.recompute = r;
    ExpectSame(c);
  }
  Case eval{kGemma};
  eval.eval = true;
  ExpectSame(eval);
  Case frozen{kGemma};
  frozen.freeze = true;
  ExpectSame(frozen);
}

TEST(ModelStepEquivalenceTest, DiffusionGemmaBlockDiffusionStep) {
  // canvas_length 8: 12 tokens hold one block after a prefix of 4, 20 two
  // blocks of a 16-token response.
  for (int64_t response : {0, 16}) {
    for (Recompute r : {Recompute::kNone, Recompute::kAll,
                        Recompute::kExperts, Recompute::kEveryOther}) {
      Case c{kGemma, /*passes=*/3, /*no_grad=*/1, /*microbatches=*/2};
      c.seq = response == 0 ? 12 : 20;
      c.response = response;
      c.recompute = r;
      ExpectSame(c);
    }
    Case eval{kGemma, 3, 1, 2};
    eval.seq = response == 0 ? 12 : 20;
    eval.response = response;
    eval.eval = true;
    ExpectSame(eval);
  }
  Case frozen{kGemma, 3, 1, 2};
  frozen.seq = 12;
  frozen.freeze = true;
  ExpectSame(frozen);
  Case hold{kGemma, 3, 1, 1};
  hold.seq = 12;
  hold.hold = true;
  ExpectSame(hold);
}

}  // namespace
}  // namespace shardd
