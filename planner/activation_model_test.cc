#include "planner/activation_model.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "common/device_saved_bytes.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/native_spec.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

v1::ModelSpec Config(const std::string& name) {
  std::ifstream in("tests/data/" + name + ".json");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromJson(text.str());
  EXPECT_TRUE(spec.ok()) << name << ": " << spec.status();
  return spec.ok() ? *spec : v1::ModelSpec();
}

v1::PlanOptions Options(int batch, int64_t seq, const std::string& policy) {
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(2);
  options.set_micro_batch_size(batch);
  options.set_seq_len(seq);
  options.set_activation_checkpointing(policy);
  return options;
}

TEST(CheckpointPolicyTest, ParsesEveryFormAndNamesTheFieldOtherwise) {
  for (const char* text :
       {"", "none", "all", "experts", "every:1", "every:3"}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(CheckpointPolicy policy,
                                ParseCheckpointPolicy(text));
    EXPECT_EQ(policy.Text(), std::string(text).empty() ? "none" : text);
  }
  for (const char* text : {"every:0", "every:", "every:x", "layers", "ALL"}) {
    absl::StatusOr<CheckpointPolicy> policy = ParseCheckpointPolicy(text);
    ASSERT_FALSE(policy.ok()) << text;
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(policy.status().message(),
                HasSubstr("activation_checkpointing"));
  }
}

// A Llama layer keeps, per token (T = 2 x 8): the input, inverse RMS and
// normed input; the attention's normed input, q [Hq hd], k and v [Hkv hd],
// o [Hq hd] and lse [Hq]; the residual after it and its inverse RMS; the
// MLP's input copy and gate, up and hidden [I]. Its backward adds the MLP's
// two [I] gradients and the normed input's gradient [D].
TEST(ActivationModelTest, LlamaLayerKeepsWhatItsBackwardReads) {
  const v1::ModelSpec model = Config("tiny_llama3");
  constexpr int64_t t = 16, d = 64, hq = 4, hkv = 1, hd = 16, inter = 96;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel acts,
                              ModelActivations(model, Options(2, 8, "none")));
  ASSERT_EQ(acts.layers_size(), 2);
  const int64_t per_token = (d + 1 + d) + d + hq * hd + 2 * hkv * hd + hq * hd +
                            hq + (d + 1) + (d + 3 * inter);
  for (const v1::LayerActivations& layer : acts.layers()) {
    EXPECT_EQ(layer.saved_bytes(), 4 * t * per_token);
    EXPECT_EQ(layer.checkpoint_bytes(), 4 * t * d);
    EXPECT_EQ(layer.backward_bytes(), 4 * t * (2 * inter + d));
    EXPECT_EQ(layer.experts_saved_bytes(), 0);
    EXPECT_FALSE(layer.recompute());
  }
  EXPECT_EQ(acts.stream_bytes(), 4 * t * d);
  EXPECT_EQ(acts.head_bytes(), 4 * t * (2 * d + 1));
}

v1::PlanOptions GpuOptions(int batch, int64_t seq, const std::string& policy) {
  v1::PlanOptions options = Options(batch, seq, policy);
  options.set_worker_device(v1::WORKER_DEVICE_CUDA);
  return options;
}

// A GPU worker keeps the same tensors of a Llama layer, the stream-shaped
// ones in the storage dtype (bf16: 2 bytes) and the inverse RMS and lse in
// fp32, but of the MLP only the kernel's gate and up (each region rounded
// to 256 bytes) and nothing of its backward's scratch.
TEST(ActivationModelTest, GpuLlamaLayerCountsTheStorageDtype) {
  const v1::ModelSpec model = Config("tiny_llama3");
  constexpr int64_t t = 16, d = 64, hq = 4, hkv = 1, hd = 16, inter = 96;
  for (const int64_t s : {2, 4}) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        v1::ActivationModel acts,
        ModelActivations(model, GpuOptions(2, 8, "none"), s == 2));
    EXPECT_EQ(acts.worker_device(), v1::WORKER_DEVICE_CUDA);
    EXPECT_EQ(acts.storage_bytes(), s);
    ASSERT_EQ(acts.layers_size(), 2);
    // Input and normed input; the attention's copy of it, q, k, v, o; the
    // residual after it. Four fp32 vectors: two inverse RMS, lse [Hq].
    const int64_t stream = s * t * (4 * d + 2 * hq * hd + 2 * hkv * hd);
    const int64_t f32 = 4 * t * (2 + hq);
    const int64_t mlp = 2 * ((t * inter * s + 255) / 256 * 256);
    for (const v1::LayerActivations& layer : acts.layers()) {
      EXPECT_EQ(layer.saved_bytes(), stream + f32 + mlp);
      EXPECT_EQ(layer.checkpoint_bytes(), s * t * d);
      EXPECT_EQ(layer.backward_bytes(), s * t * d);
      EXPECT_EQ(layer.experts_saved_bytes(), 0);
    }
    EXPECT_EQ(acts.stream_bytes(), s * t * d);
    EXPECT_EQ(acts.head_bytes(), 2 * s * t * d + 4 * t);
    EXPECT_EQ(acts.grad_stream_bytes(), s * t * d);
  }
  // A CPU worker's model is unchanged by the storage dtype.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ActivationModel cpu,
      ModelActivations(model, Options(2, 8, "none"), /*bf16_storage=*/true));
  EXPECT_EQ(cpu.storage_bytes(), 4);
  EXPECT_EQ(cpu.stream_bytes(), 4 * t * d);
}

// A GPU MoE layer: the router kernel's saved state and one grouped-experts
// workspace (the forward's and the backward's regions together), so the
// experts' backward adds nothing but the step's gradients.
TEST(ActivationModelTest, GpuExpertsKeepTheKernelsWorkspace) {
  const v1::ModelSpec model = Config("tiny_mixtral");
  constexpr int64_t t = 16, d = 64, e = 8, k = 2, inter = 48;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ActivationModel acts,
      ModelActivations(model, GpuOptions(2, 8, "none"), true));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel cpu,
                              ModelActivations(model, Options(2, 8, "none")));
  ASSERT_EQ(acts.layers_size(), 2);
  for (int l = 0; l < 2; ++l) {
    const v1::LayerActivations& layer = acts.layers(l);
    EXPECT_EQ(layer.experts_saved_bytes(),
              device_bytes::GroupedExpertsWorkspace(t, k, e, d, inter, 2));
    EXPECT_EQ(layer.experts_backward_bytes(), 0);
    EXPECT_EQ(layer.experts_grad_bytes(), 2 * t * d + 4 * t * k);
    EXPECT_EQ(layer.checkpoint_bytes(), 2 * 2 * t * d + 2 * 4 * t * k);
    EXPECT_EQ(layer.routed_rows(), t * k);
    // Without the load-balancing loss the router's backward is scratch.
    EXPECT_EQ(layer.backward_bytes(), 0);
    EXPECT_LT(layer.saved_bytes(), cpu.layers(l).saved_bytes());
  }
}

// DiffusionGemma's block-diffusion step on a GPU: the decode layers and
// the self-conditioning block as the device keeps them (pass 1 keeps
// nothing of its block; the encode's K/V gradients stay fp32).
TEST(ActivationModelTest, GpuBlockDiffusionStep) {
  const v1::ModelSpec gemma = Config("tiny_diffusion_gemma");
  v1::PlanOptions step = GpuOptions(2, 16, "none");
  step.set_passes(3);
  step.set_no_grad_passes(1);
  step.set_response_length(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel gpu,
                              ModelActivations(gemma, step, true));
  v1::PlanOptions on_cpu = step;
  on_cpu.set_worker_device(v1::WORKER_DEVICE_CPU);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel cpu,
                              ModelActivations(gemma, on_cpu, true));
  ASSERT_TRUE(gpu.block_diffusion());
  ASSERT_EQ(gpu.decode_layers_size(), cpu.decode_layers_size());
  EXPECT_EQ(gpu.sc_embed_bytes(), 0);
  EXPECT_GT(gpu.sc_signal_bytes(), 0);
  EXPECT_EQ(gpu.sc_backward_bytes(), 0);
  EXPECT_EQ(gpu.sc_probs_bytes(), cpu.sc_probs_bytes());
  EXPECT_EQ(gpu.decode_stream_bytes() * 2, cpu.decode_stream_bytes());
  for (int l = 0; l < gpu.decode_layers_size(); ++l) {
    EXPECT_EQ(gpu.decode_layers(l).encoder_kv_grad_bytes(),
              cpu.decode_layers(l).encoder_kv_grad_bytes());
    EXPECT_GT(gpu.decode_layers(l).encoder_kv_grad_bytes(), 0);
    EXPECT_LT(gpu.layers(l).saved_bytes(), cpu.layers(l).saved_bytes());
    EXPECT_EQ(gpu.layers(l).backward_bytes(), 0);
  }
}

TEST(ActivationModelTest, TokenBuffersScaleWithTheMicroBatch) {
  const v1::ModelSpec model = Config("tiny_mixtral");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel one,
                              ModelActivations(model, Options(1, 16, "none")));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel two,
                              ModelActivations(model, Options(2, 16, "none")));
  for (int l = 0; l < one.layers_size(); ++l) {
    EXPECT_EQ(two.layers(l).saved_bytes(), 2 * one.layers(l).saved_bytes());
    EXPECT_EQ(two.layers(l).experts_backward_bytes(),
              2 * one.layers(l).experts_backward_bytes());
    // The experts' sort keeps 2E + 1 int64 whatever the tokens.
    constexpr int64_t kSort = (2 * 8 + 1) * 8;
    EXPECT_EQ(two.layers(l).experts_saved_bytes() - kSort,
              2 * (one.layers(l).experts_saved_bytes() - kSort));
    EXPECT_GT(one.layers(l).experts_saved_bytes(), kSort);
  }
}

TEST(ActivationModelTest, PoliciesChooseTheLayersThatRecompute) {
  const v1::ModelSpec model = Config("tiny_deepseek_v3");  // 3 layers, 1 dense
  auto flags = [&](const std::string& policy) {
    absl::StatusOr<v1::ActivationModel> acts =
        ModelActivations(model, Options(1, 8, policy));
    EXPECT_TRUE(acts.ok()) << acts.status();
    std::string out;
    for (const v1::LayerActivations& l : acts->layers()) {
      out += l.recompute() ? 'L' : l.recompute_experts() ? 'E' : '-';
    }
    return out;
  };
  EXPECT_EQ(flags("none"), "---");
  EXPECT_EQ(flags("all"), "LLL");
  EXPECT_EQ(flags("every:2"), "L-L");
  // The dense first layer has no experts to recompute.
  EXPECT_EQ(flags("experts"), "-EE");
}

TEST(ActivationModelTest, RefusesWhatItCannotModel) {
  const v1::ModelSpec mixtral = Config("tiny_mixtral");
  absl::StatusOr<v1::ActivationModel> zero =
      ModelActivations(mixtral, Options(0, 8, ""));
  ASSERT_FALSE(zero.ok());
  EXPECT_THAT(zero.status().message(), HasSubstr("micro_batch_size"));
  absl::StatusOr<v1::ActivationModel> bad =
      ModelActivations(mixtral, Options(1, 8, "sometimes"));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("activation_checkpointing"));
  const v1::ModelSpec gemma = Config("tiny_diffusion_gemma");
  v1::PlanOptions step = Options(1, 8, "");
  step.set_passes(3);
  step.set_no_grad_passes(1);
  absl::StatusOr<v1::ActivationModel> no_room = ModelActivations(gemma, step);
  ASSERT_FALSE(no_room.ok());
  EXPECT_THAT(no_room.status().message(), HasSubstr("response_length"));
  step.set_seq_len(12);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel diffusion,
                              ModelActivations(gemma, step));
  EXPECT_TRUE(diffusion.block_diffusion());
  EXPECT_EQ(diffusion.response_length(), 8);  // canvas_length
  EXPECT_EQ(diffusion.decode_layers_size(), diffusion.layers_size());
  // A recomputed encode layer keeps its K/V for the decodes; a decode
  // layer does not.
  step.set_activation_checkpointing("all");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ActivationModel recomputed,
                              ModelActivations(gemma, step));
  for (int l = 0; l < recomputed.layers_size(); ++l) {
    EXPECT_TRUE(recomputed.layers(l).recompute());
    EXPECT_TRUE(recomputed.decode_layers(l).recompute());
    EXPECT_TRUE(recomputed.layers(l).checkpoint_after_experts());
    // Per row, the encode keeps more: its K/V besides the same buffers.
    EXPECT_GT(recomputed.layers(l).checkpoint_bytes() / 12.0,
              recomputed.decode_layers(l).checkpoint_bytes() /
                  static_cast<double>(recomputed.response_length()));
  }
}

// Through the planner: the step's peak counts activations, recomputing
// lowers it, and a plan without a micro-batch has none.
TEST(ActivationModelTest, PlansCountActivationsInThePeak) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  const v1::ModelSpec model = Config("tiny_qwen3_moe");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plain,
                              planner.Plan(model, Options(0, 0, "")));
  EXPECT_FALSE(plain.has_activations());
  EXPECT_EQ(plain.memory().peak_step_bytes(),
            plain.memory().peak_unsharded_bytes());
  EXPECT_EQ(plain.memory().peak_total_bytes(),
            plain.memory().persistent_bytes() +
                plain.memory().peak_unsharded_bytes());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan kept,
                              planner.Plan(model, Options(2, 32, "none")));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan recomputed,
                              planner.Plan(model, Options(2, 32, "all")));
  for (const v1::ShardingPlan* plan : {&kept, &recomputed}) {
    const v1::MemoryReport& m = plan->memory();
    EXPECT_GT(m.peak_step_bytes(), m.peak_unsharded_bytes());
    EXPECT_LE(m.peak_step_bytes(),
              m.peak_unsharded_bytes() + m.peak_activation_bytes());
    EXPECT_EQ(m.peak_total_bytes(), m.persistent_bytes() + m.peak_step_bytes());
    // Parameters and gradients do not change.
    EXPECT_EQ(m.peak_unsharded_bytes(), plain.memory().peak_unsharded_bytes());
  }
  EXPECT_LT(recomputed.memory().peak_activation_bytes(),
            kept.memory().peak_activation_bytes());
  EXPECT_LT(recomputed.memory().peak_step_bytes(),
            kept.memory().peak_step_bytes());
  // A GPU worker under mixed precision keeps half the stream's bytes.
  v1::PlanOptions on_gpu = Options(2, 32, "none");
  on_gpu.set_worker_device(v1::WORKER_DEVICE_CUDA);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan gpu,
                              planner.Plan(model, on_gpu));
  EXPECT_EQ(gpu.activations().storage_bytes(), 2);
  EXPECT_LT(gpu.memory().peak_activation_bytes(),
            kept.memory().peak_activation_bytes());
  on_gpu.set_mixed_precision(false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan gpu_fp32,
                              planner.Plan(model, on_gpu));
  EXPECT_EQ(gpu_fp32.activations().storage_bytes(), 4);
  EXPECT_GT(gpu_fp32.memory().peak_activation_bytes(),
            gpu.memory().peak_activation_bytes());
  // What the workers run differs, so the fingerprint does.
  EXPECT_NE(kept.fingerprint(), recomputed.fingerprint());
  EXPECT_NE(kept.fingerprint(), plain.fingerprint());
  // A model's plan without a micro-batch (SubmitModel's) has nothing to
  // count; the policy is still checked.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan alone,
                              planner.Plan(model, Options(0, 0, "all")));
  EXPECT_FALSE(alone.has_activations());
  absl::StatusOr<v1::ShardingPlan> bad =
      planner.Plan(model, Options(0, 0, "every:0"));
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("activation_checkpointing"));
}

}  // namespace
}  // namespace shardd
