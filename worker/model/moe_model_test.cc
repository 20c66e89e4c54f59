#include "worker/model/moe_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "testing/map_param_source.h"
#include "testing/random_params.h"
#include "testing/model_builder.h"
#include "testing/model_commands.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

// Parameters and gradients in plain maps: the unsharded view.
using MapSource = ::shardd::testing_util::MapParamSource;

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;

constexpr int64_t kVocab = 13, kDim = 6, kExperts = 4, kInter = 3, kMlp = 5;

// The shared tiny MoE (testing/model_builder.h). Layer 0: MoE + dense MLP;
// layer 1: MoE only; layer 2: dense only.
v1::ModelSpec TinyModel(bool tied) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.layers = 3;
  shape.moe_layers = {true, true, false};
  shape.mlp_layers = {true, false, true};
  shape.tied = tied;
  return testing_util::TinyMoeSpec(shape);
}

struct Data {
  std::vector<std::vector<int32_t>> inputs, targets;
};

Data MakeData(int microbatches, int64_t batch, int64_t seq) {
  Data d;
  std::mt19937 gen(11);
  for (int m = 0; m < microbatches; ++m) {
    std::vector<int32_t> in(batch * seq), tg(batch * seq);
    for (auto& x : in) x = static_cast<int32_t>(gen() % kVocab);
    for (auto& x : tg) x = static_cast<int32_t>(gen() % kVocab);
    d.inputs.push_back(in);
    d.targets.push_back(tg);
  }
  return d;
}

// One step of `model`, whose layer l has experts when moe_layers[l].
double RunStep(MoeModel* model, const std::vector<bool>& moe_layers,
               MapSource* source, const Data& data, int passes, int no_grad,
               int64_t batch, int64_t seq) {
  model->ResetStep();
  const int mbs = static_cast<int>(data.inputs.size());
  for (int m = 0; m < mbs; ++m) {
    EXPECT_THAT(model->SetBatch(m, data.inputs[m].data(),
                                data.targets[m].data(), batch, seq),
                IsOk());
  }
  for (const v1::Command& c :
       testing_util::ModelStepCommands(moe_layers, passes, no_grad, mbs)) {
    absl::Status s = model->Run(c, source);
    EXPECT_TRUE(s.ok()) << s << " at " << c.ShortDebugString();
    if (!s.ok()) return NAN;
  }
  return model->step_loss();
}

// Every third element of every parameter: the analytic gradient of one
// step (2 micro-batches of [batch, seq]) against central differences of
// the fp32 model's loss.
void ExpectGradientsMatchFiniteDifferences(const v1::ModelSpec& spec,
                                           int64_t batch, int64_t seq,
                                           double max_loss) {
  MoeModelOptions options;
  options.microbatches = 2;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model, MoeModel::Create(spec, options));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe_layers = arch.LayersWithExperts();
  MapSource source;
  source.values = testing_util::RandomParamValues(spec);
  const Data data = MakeData(2, batch, seq);
  const double loss =
      RunStep(model.get(), moe_layers, &source, data, 1, 0, batch, seq);
  ASSERT_TRUE(std::isfinite(loss));
  // Near log(13) for random weights.
  EXPECT_GT(loss, 1.5);
  EXPECT_LT(loss, max_loss);
  const MapSource analytic = source;
  int checked = 0;
  int kinks = 0;
  for (auto& [name, values] : source.values) {
    const std::vector<float>& g = analytic.grads.at(name);
    for (size_t i = 0; i < values.size(); i += 3) {
      const float saved = values[i];
      const float h = 2e-3f;
      values[i] = saved + h;
      MapSource plus_src = source;
      const double plus =
          RunStep(model.get(), moe_layers, &plus_src, data, 1, 0, batch, seq);
      values[i] = saved - h;
      MapSource minus_src = source;
      const double minus =
          RunStep(model.get(), moe_layers, &minus_src, data, 1, 0, batch, seq);
      values[i] = saved;
      // Top-k routing is piecewise smooth: where a perturbation flips an
      // expert choice the loss jumps. The two one-sided quotients then
      // disagree; such points are kinks, not gradient errors, and are
      // skipped (and counted: they must stay rare).
      const double forward = (plus - loss) / h;
      const double backward = (loss - minus) / h;
      if (std::fabs(forward - backward) >
          0.05 * std::max(std::fabs(forward), std::fabs(backward)) + 5e-3) {
        ++kinks;
        continue;
      }
      const double numeric = (plus - minus) / (2 * h);
      EXPECT_NEAR(g[i], numeric, 1e-3 + 1e-2 * std::fabs(numeric))
          << name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_LT(kinks, checked / 10) << kinks << " kinks";
  EXPECT_GT(checked, 100);
}

TEST(MoeModelTest, GradientsMatchFiniteDifferences) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied head" : "own head");
    ExpectGradientsMatchFiniteDifferences(TinyModel(tied), 2, 5, 4.0);
  }
}

// Qwen3-style attention layers: GQA (2 query heads on 1 kv head), per-head
// q/k norms, RoPE, a causal layer and a sliding-window one.
TEST(MoeModelTest, AttentionGradientsMatchFiniteDifferences) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = 8;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.layers = 2;
  shape.tied = false;
  shape.attention = true;
  shape.heads = 2;
  shape.kv_heads = 1;
  shape.head_dim = 4;
  shape.qk_norm = true;
  shape.sliding_layers = {false, true};
  shape.window = 3;
  ExpectGradientsMatchFiniteDifferences(testing_util::TinyMoeSpec(shape), 2, 6,
                                        4.0);
}

// GPT-OSS layers from a Hugging Face config: q/k/v/o biases, sinks, yarn
// RoPE (untruncated), a sliding and a full layer, the top-k-then-softmax
// router with its bias, clamped swiglu experts with biases. swiglu_limit
// 1.5 is about two standard deviations of the pre-activations (~0.8 here):
// the clamps cut a few values, and few sit close enough to a clamp's kink
// for the central differences to straddle it (at 0.5 too many do; the
// kernel test and the PyTorch reference check the clamp itself).
TEST(MoeModelTest, GptOssGradientsMatchFiniteDifferences) {
  const char* config = R"({
    "architectures": ["GptOssForCausalLM"], "vocab_size": 13,
    "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 3,
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 3, "swiglu_limit": 1.5, "torch_dtype": "float32",
    "max_position_embeddings": 64, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "original_max_position_embeddings": 16,
                     "truncate": false}})";
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::ModelSpec spec,
                              ModelSpecFromHfConfig(config));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  EXPECT_EQ(arch.activation, kernels::GatedActivation::kClampedSwiGLU);
  EXPECT_EQ(arch.swiglu_limit, 1.5f);
  EXPECT_EQ(arch.router_scoring, kernels::RouterScoring::kTopKThenSoftmax);
  for (const MoeLayerSpec& layer : arch.layers) {
    EXPECT_TRUE(layer.attention_bias && layer.has_sinks && layer.router_bias &&
                layer.expert_bias);
  }
  EXPECT_TRUE(arch.layers[0].sliding);
  EXPECT_FALSE(arch.layers[1].sliding);
  ExpectGradientsMatchFiniteDifferences(spec, 2, 6, 4.0);
}

// The load-balancing loss (dims.router_aux_loss_coef): its gradient flows
// through the softmax into the routers and on into the model. The
// coefficient is large (1.0, aux is about top_k = 2) so that its share of
// the router gradients is far above the check's tolerance; each of the 2
// micro-batches has its own statistics. Layer 2 is dense and adds no rows.
TEST(MoeModelTest, RouterAuxLossGradientsMatchFiniteDifferences) {
  v1::ModelSpec spec = TinyModel(false);
  spec.mutable_dims()->set_router_aux_loss_coef(1.0);
  ExpectGradientsMatchFiniteDifferences(spec, 2, 5, 7.0);
}

// The same through GPT-OSS's top-k-then-softmax router with its bias: the
// loss reads the softmax over all experts that the router keeps for it.
TEST(MoeModelTest, GptOssRouterAuxLossGradientsMatchFiniteDifferences) {
  const char* config = R"({
    "architectures": ["GptOssForCausalLM"], "vocab_size": 13,
    "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 3,
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "output_router_logits": true,
    "sliding_window": 3, "swiglu_limit": 1.5, "torch_dtype": "float32"})";
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::ModelSpec spec,
                              ModelSpecFromHfConfig(config));
  ASSERT_EQ(spec.dims().router_aux_loss_coef(), 0.9);  // GptOssConfig's.
  ExpectGradientsMatchFiniteDifferences(spec, 2, 6, 7.0);
}

TEST(MoeModelTest, RouterAuxStatsCountEveryMoeLayersRows) {
  v1::ModelSpec spec = TinyModel(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto off, MoeModel::Create(spec, {}));
  EXPECT_FALSE(off->router_aux_loss());
  EXPECT_EQ(off->router_aux_stats(0), nullptr);
  const double coef = 0.25;
  spec.mutable_dims()->set_router_aux_loss_coef(coef);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto on, MoeModel::Create(spec, {}));
  ASSERT_TRUE(on->router_aux_loss());
  EXPECT_EQ(on->router_aux_stats(1), nullptr);
  MapSource source;
  source.values = testing_util::RandomParamValues(spec);
  const Data data = MakeData(1, 2, 5);
  const std::vector<bool> moe_layers = {true, true, false};
  MapSource off_source = source;
  const double loss_off =
      RunStep(off.get(), moe_layers, &off_source, data, 1, 0, 2, 5);
  const double loss_on = RunStep(on.get(), moe_layers, &source, data, 1, 0, 2, 5);
  const MoeModel::RouterAuxStats& stats = *on->router_aux_stats(0);
  // 10 tokens through 2 MoE layers, 2 choices each, on one rank.
  ASSERT_EQ(stats.counts.size(), kExperts + 2u);
  int64_t choices = 0;
  for (int e = 0; e < kExperts; ++e) choices += stats.counts[e];
  EXPECT_EQ(choices, 20 * 2);
  EXPECT_EQ(stats.counts[kExperts], 20);
  EXPECT_EQ(stats.counts[kExperts + 1], 1);
  double prob_total = 0.0;
  for (float p : stats.prob_sums) prob_total += p;
  // 20 softmax rows, each summing to 1 within E u; E + 1 roundings more.
  EXPECT_NEAR(prob_total, 20.0, 20.0 * 2 * kExperts * 6e-8);
  // The loss grows by coef * aux, aux = E sum_e (c_e / R)(s_e / R),
  // recomputed here from the statistics (the CE part is the same
  // computation in both models, bit for bit; the difference of two losses
  // near 3 rounds by a few ulps, 4e-7 of the loss).
  double aux = 0.0;
  for (int e = 0; e < kExperts; ++e) {
    aux += (stats.counts[e] / 20.0) * (stats.prob_sums[e] / 20.0);
  }
  aux *= kExperts;
  EXPECT_GT(aux, 1.0);  // At least top_k * min-share; 2 when balanced.
  EXPECT_NEAR(loss_on - loss_off, coef * aux, 1e-12 + 4e-7 * loss_on);
  // Only the routers (and what feeds them) see the extra gradient: the
  // final norm's does not change.
  EXPECT_EQ(source.grads.at("model.norm.weight"),
            off_source.grads.at("model.norm.weight"));
  EXPECT_NE(source.grads.at("model.layers.0.moe.gate.weight"),
            off_source.grads.at("model.layers.0.moe.gate.weight"));
}

TEST(MoeModelTest, RouterAuxLossNeedsASoftmaxRouter) {
  v1::ModelSpec spec = TinyModel(true);
  spec.mutable_dims()->set_router_aux_loss_coef(-1.0);
  EXPECT_THAT(MoeModel::Create(spec, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims.router_aux_loss_coef")));
  spec.mutable_dims()->set_router_aux_loss_coef(0.1);
  spec.mutable_dims()->set_router_scoring(v1::ROUTER_SIGMOID_GROUP_LIMITED);
  spec.mutable_dims()->set_n_group(2);
  spec.mutable_dims()->set_topk_group(1);
  spec.mutable_dims()->set_routed_scaling_factor(1.0);
  EXPECT_THAT(MoeModel::Create(spec, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims.router_aux_loss_coef: the "
                                 "load-balancing loss needs a softmax")));
}

TEST(MoeModelTest, GptOssSpecsMissingABiasOrSinkAreRefusedByName) {
  const char* config = R"({
    "architectures": ["GptOssForCausalLM"], "vocab_size": 13,
    "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 3,
    "num_local_experts": 4, "num_experts_per_tok": 2,
    "torch_dtype": "float32"})";
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec spec,
                              ModelSpecFromHfConfig(config));
  // Drop self_attn.sinks: dims.attention.sinks still asks for it.
  v1::ModuleSpec* attn = spec.mutable_root()
                             ->mutable_children(0)
                             ->mutable_children(1)
                             ->mutable_children(0)
                             ->mutable_children(0);
  ASSERT_EQ(attn->name(), "self_attn");
  ASSERT_EQ(attn->params(attn->params_size() - 1).name(), "sinks");
  attn->mutable_params()->RemoveLast();
  EXPECT_THAT(ReadMoeArchitecture(spec).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.layers.0.self_attn.sinks")));
  spec.mutable_dims()->set_swiglu_limit(0.0);
  EXPECT_THAT(
      ReadMoeArchitecture(spec).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("swiglu_limit")));
}

TEST(MoeModelTest, MultiPassAndOrderErrors) {
  const v1::ModelSpec spec = TinyModel(true);
  MoeModelOptions options;
  options.passes = 3;
  options.no_grad_passes = 1;
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model, MoeModel::Create(spec, options));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe_layers = arch.LayersWithExperts();
  MapSource source;
  source.values = testing_util::RandomParamValues(spec);
  const Data data = MakeData(1, 2, 4);
  const double loss =
      RunStep(model.get(), moe_layers, &source, data, 3, 1, 2, 4);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_EQ(model->step_tokens(), 2 * 2 * 4);  // Two grad passes.

  // Out-of-order commands are refused, not computed.
  model->ResetStep();
  v1::Command c;
  c.set_op(v1::Command::FORWARD);
  c.set_part(v1::Command::EXPERTS);
  c.set_layer(0);
  EXPECT_THAT(model->Run(c, &source),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  c.set_op(v1::Command::BACKWARD);
  c.set_part(v1::Command::HEAD);
  EXPECT_THAT(model->Run(c, &source),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no gradients")));
  c.set_layer(7);
  c.set_part(v1::Command::LAYER);
  c.set_pass(1);
  EXPECT_THAT(
      model->Run(c, &source),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 7")));
  const int32_t bad[2] = {0, 99};
  EXPECT_THAT(model->SetBatch(0, bad, bad, 1, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("99")));
}

TEST(MoeModelTest, RefusesWhatTheCpuPathCannotCompute) {
  v1::ModelSpec spec = TinyModel(true);
  v1::ModuleSpec* layer0 = spec.mutable_root()
                               ->mutable_children(0)
                               ->mutable_children(1)
                               ->mutable_children(0);
  // An attention module the model does not know (a bare q_proj tensor):
  // refused, naming it.
  v1::ModuleSpec* attn = AddChild(layer0, "self_attn", v1::MODULE_ATTENTION);
  AddParam(attn, "q_proj", {kDim, kDim});
  EXPECT_THAT(MoeModel::Create(spec, MoeModelOptions()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'model.layers.0.self_attn.q_proj' is not "
                                 "part of the CPU training model")));
  MoeModelOptions bad;
  bad.passes = 2;
  bad.no_grad_passes = 2;
  EXPECT_THAT(MoeModel::Create(TinyModel(true), bad).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no_grad_passes")));
}

}  // namespace
}  // namespace shardd
