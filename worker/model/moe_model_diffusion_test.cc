// DiffusionGemma's block-diffusion step (encode, self-conditioning decode,
// decode) on the tiny config: the analytic gradients of the whole step
// against central differences of its loss.

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "program/pass_layout.h"
#include "testing/map_param_source.h"
#include "testing/model_commands.h"
#include "testing/random_params.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using MapSource = ::shardd::testing_util::MapParamSource;
using ::testing::HasSubstr;

constexpr int64_t kBatch = 2, kSeq = 12;  // canvas_length 8: prefix 4.
constexpr int kMicrobatches = 2;

v1::ModelSpec TinySpec() {
  std::ifstream in("tests/data/tiny_diffusion_gemma.json");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(text.str());
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

MoeModelOptions DiffusionOptions() {
  MoeModelOptions o;
  o.passes = 3;
  o.no_grad_passes = 1;
  o.microbatches = kMicrobatches;
  return o;
}

struct Step {
  std::vector<std::vector<int32_t>> inputs, targets;
  std::vector<std::vector<int64_t>> indices;
  int64_t step = 0;
};

// Tokens with targets = inputs shifted, and a step whose 4 coins are mixed
// (both decode inputs are exercised).
Step MakeStep(int64_t vocab) {
  Step s;
  std::mt19937 gen(5);
  for (int m = 0; m < kMicrobatches; ++m) {
    std::vector<int32_t> in(kBatch * kSeq), tg(kBatch * kSeq);
    for (int32_t& x : in) x = static_cast<int32_t>(gen() % vocab);
    for (int64_t r = 0; r < kBatch; ++r) {
      for (int64_t i = 0; i < kSeq; ++i) {
        tg[r * kSeq + i] = i + 1 < kSeq ? in[r * kSeq + i + 1]
                                        : static_cast<int32_t>(gen() % vocab);
      }
    }
    s.inputs.push_back(in);
    s.targets.push_back(tg);
    s.indices.push_back({100 + 2 * m, 101 + 2 * m});
  }
  for (s.step = 0;; ++s.step) {
    int coins = 0;
    for (int m = 0; m < kMicrobatches; ++m) {
      DiffusionCanvas c;
      EXPECT_TRUE(BuildDiffusionCanvas(s.inputs[m].data(), kBatch, kSeq, 8,
                                       vocab, s.step, s.indices[m].data(),
                                       DiffusionTrainingOptions(), &c)
                      .ok());
      coins += c.self_cond[0] + c.self_cond[1];
    }
    if (coins == 2) break;
  }
  return s;
}

double RunStep(MoeModel* model, const std::vector<bool>& moe_layers,
               MapSource* source, const Step& s) {
  model->ResetStep();
  for (int m = 0; m < kMicrobatches; ++m) {
    EXPECT_THAT(model->SetBatch(m, s.inputs[m].data(), s.targets[m].data(),
                                kBatch, kSeq),
                IsOk());
    EXPECT_THAT(model->SetSequenceKeys(m, s.step, s.indices[m].data()),
                IsOk());
  }
  const PassLayout layout = PassLayout::For(kBlockDiffusionArchitecture, 3, 1);
  for (const v1::Command& c :
       testing_util::ModelStepCommands(moe_layers, layout, kMicrobatches)) {
    const absl::Status st = model->Run(c, source);
    EXPECT_TRUE(st.ok()) << st << " at " << c.ShortDebugString();
    if (!st.ok()) return NAN;
  }
  return model->step_loss();
}

// `response`: TrainConfig.diffusion.response_length (0: one block).
void CheckWholeStepGradients(int64_t response) {
  const v1::ModelSpec spec = TinySpec();
  MoeModelOptions options = DiffusionOptions();
  options.diffusion.response_length = response;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model, MoeModel::Create(spec, options));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe_layers = arch.LayersWithExperts();
  MapSource source;
  testing_util::RandomParamOptions random;
  random.range = 0.3f;
  random.norm_spread = 0.3f;
  source.values = testing_util::RandomParamValues(spec, random);
  const Step step = MakeStep(arch.vocab);
  // The decode's gradient treats pass 1's distribution as a constant: hold
  // it at the unperturbed step's.
  const double loss = RunStep(model.get(), moe_layers, &source, step);
  model->HoldSelfConditioningForTest(true);
  ASSERT_TRUE(std::isfinite(loss));
  // Two cross-entropies near log(97) = 4.57 each (soft-capped logits at
  // 1.5 keep both within [4.57 - 1.5, 4.57 + 1.5]).
  EXPECT_GT(loss, 2 * (std::log(97.0) - 1.5));
  EXPECT_LT(loss, 2 * (std::log(97.0) + 1.5));
  const MapSource analytic = source;
  // Every parameter the step trains has a gradient, self_conditioning's
  // included (pass 2 reads it).
  for (const char* name :
       {"model.self_conditioning.pre_norm.weight",
        "model.self_conditioning.gate_proj.weight",
        "model.self_conditioning.down_proj.weight"}) {
    ASSERT_TRUE(analytic.grads.count(name)) << name;
    double norm = 0;
    for (float g : analytic.grads.at(name)) norm += std::fabs(g);
    EXPECT_GT(norm, 0) << name;
  }
  // Central differences with h = 3e-3 on fp32 losses near 9: the loss's
  // rounding (a few ulp of 9, ~ 4e-6, amplified by 1 / (2h) -> 7e-4) plus
  // the truncation h^2 L''' / 6 (L''' of O(10) on these soft-capped logits
  // -> ~1.5e-5, a relative 1e-3 for gradients near 1e-2): bound 1e-3
  // absolute + 2% relative. Routing kinks
  // (a perturbation flipping a top-k choice) are detected by one-sided
  // quotients that disagree, skipped and counted.
  const double h = 3e-3;
  int checked = 0, kinks = 0, failed = 0;
  for (auto& [name, values] : source.values) {
    if (!analytic.grads.count(name)) continue;  // Frozen.
    const std::vector<float>& g = analytic.grads.at(name);
    const size_t stride = std::max<size_t>(1, values.size() / 6);
    for (size_t i = 0; i < values.size(); i += stride) {
      const float saved = values[i];
      values[i] = saved + static_cast<float>(h);
      MapSource plus_src = source;
      const double plus = RunStep(model.get(), moe_layers, &plus_src, step);
      values[i] = saved - static_cast<float>(h);
      MapSource minus_src = source;
      const double minus = RunStep(model.get(), moe_layers, &minus_src, step);
      values[i] = saved;
      const double forward = (plus - loss) / h, backward = (loss - minus) / h;
      if (std::fabs(forward - backward) >
          0.2 * std::max(std::fabs(forward), std::fabs(backward)) + 2e-2) {
        ++kinks;
        continue;
      }
      const double numeric = (plus - minus) / (2 * h);
      const bool ok = std::fabs(g[i] - numeric) <= 1e-3 + 2e-2 * std::fabs(numeric);
      failed += !ok;
      EXPECT_TRUE(ok) << name << "[" << i << "]: analytic " << g[i]
                      << " numeric " << numeric;
      ++checked;
    }
  }
  EXPECT_LT(kinks, checked / 10) << kinks << " kinks";
  EXPECT_GT(checked, 150);
  std::printf("response %lld: checked %d, kinks %d, failed %d, loss %.6f\n",
              static_cast<long long>(response), checked, kinks, failed, loss);
}

TEST(MoeModelDiffusionTest, WholeStepGradientsMatchFiniteDifferences) {
  CheckWholeStepGradients(0);
}

// A response of 10 tokens: blocks of 8 and 2 after a 2-token prompt, so the
// second block's queries see the first block's clean tokens, and sliding
// layers (window 4) cut the encoder keys per block.
TEST(MoeModelDiffusionTest, TwoBlockResponseGradientsMatchFiniteDifferences) {
  CheckWholeStepGradients(10);
}

// The two loss weights (TrainConfig.diffusion) scale the encoder's AR loss
// and the canvas loss and their gradients: the step at weights (a, b)
// equals a * (the step at (1, 0)) + b * (the step at (0, 1)). fp32 on both
// sides, the same operations with other scale factors: each gradient
// element's rounding differs by a few ulp of its terms, so 1e-5 relative
// L2 (a dropped or doubled weight is off by O(1)).
TEST(MoeModelDiffusionTest, LossWeightsScaleEachLossAndItsGradients) {
  const v1::ModelSpec spec = TinySpec();
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe_layers = arch.LayersWithExperts();
  testing_util::RandomParamOptions random;
  random.range = 0.3f;
  const auto values = testing_util::RandomParamValues(spec, random);
  const Step step = MakeStep(arch.vocab);
  struct Run {
    double loss = 0;
    std::map<std::string, std::vector<float>> grads;
  };
  auto run = [&](double encoder, double diffusion) {
    MoeModelOptions options = DiffusionOptions();
    options.diffusion.encoder_loss_weight = encoder;
    options.diffusion.diffusion_loss_weight = diffusion;
    Run r;
    auto model = MoeModel::Create(spec, options);
    EXPECT_THAT(model.status(), IsOk());
    if (!model.ok()) return r;
    MapSource source;
    source.values = values;
    r.loss = RunStep(model->get(), moe_layers, &source, step);
    r.grads = source.grads;
    return r;
  };
  const Run ar = run(1, 0), canvas = run(0, 1), both = run(1, 1),
            mixed = run(2, 0.5);
  // Each loss near log(97) (soft-capped logits), so neither is zero.
  EXPECT_GT(ar.loss, 1.0);
  EXPECT_GT(canvas.loss, 1.0);
  EXPECT_NEAR(both.loss, ar.loss + canvas.loss, 1e-9 * both.loss);
  EXPECT_NEAR(mixed.loss, 2 * ar.loss + 0.5 * canvas.loss, 1e-9 * mixed.loss);
  ASSERT_FALSE(mixed.grads.empty());
  for (const auto& [name, g] : mixed.grads) {
    const std::vector<float>& ga = ar.grads.at(name);
    const std::vector<float>& gc = canvas.grads.at(name);
    double err = 0, ref = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const double want = 2.0 * ga[i] + 0.5 * gc[i];
      err += (g[i] - want) * (g[i] - want);
      ref += want * want;
    }
    EXPECT_LE(std::sqrt(err), 1e-5 * std::sqrt(ref) + 1e-30) << name;
  }
}

TEST(MoeModelDiffusionTest, RefusesOtherShapesAndShortSequences) {
  const v1::ModelSpec spec = TinySpec();
  MoeModelOptions two;
  two.passes = 2;
  two.no_grad_passes = 1;
  EXPECT_THAT(MoeModel::Create(spec, two).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("3 passes, 1 without gradients")));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model,
                              MoeModel::Create(spec, DiffusionOptions()));
  std::vector<int32_t> tokens(8, 1);
  EXPECT_THAT(model->SetBatch(0, tokens.data(), tokens.data(), 1, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs more than 8 tokens per sequence")));
}

}  // namespace
}  // namespace shardd
