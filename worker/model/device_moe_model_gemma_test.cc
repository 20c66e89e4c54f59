// DeviceMoeModel against the CPU MoeModel on DiffusionGemma
// (tests/data/tiny_diffusion_gemma.json: sliding and full layers with their
// own head geometry, values from keys, q/k/v norms, proportional partial
// RoPE, sandwich norms, the dense MLP beside the MoE, the scaled router,
// layer_scalar, soft-capped logits, tied embeddings): the causal pass, and
// the block-diffusion step (encode, self-conditioning decode, decode over
// [encoder K/V ; canvas K/V] in one or several blocks) with two
// micro-batches, the same parameter values and canvases on both sides.
// Skips without a GPU.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "program/pass_layout.h"
#include "testing/device_map_param_source.h"
#include "testing/gpu.h"
#include "testing/map_param_source.h"
#include "testing/model_commands.h"
#include "testing/random_params.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/device_moe_model.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using ::shardd::testing_util::TestDeviceSource;

constexpr int kMicrobatches = 2;
constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 14;  // The canvas (8 or 10 rows) plus a prompt.

// global_head_dim > 0 widens the full-attention layers' heads (the tiny
// config's are 32; the released 26B model's are 512, the widest the GPU
// attention takes).
v1::ModelSpec Spec(bool all_experts, int64_t global_head_dim = 0) {
  std::ifstream in("tests/data/tiny_diffusion_gemma.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string json = ss.str();
  EXPECT_FALSE(json.empty());
  if (all_experts) {
    json = absl::StrReplaceAll(
        json, {{"\"top_k_experts\": 2", "\"top_k_experts\": 8"}});
  }
  if (global_head_dim > 0) {
    const std::string wider = absl::StrReplaceAll(
        json, {{"\"global_head_dim\": 32",
                absl::StrCat("\"global_head_dim\": ", global_head_dim)}});
    EXPECT_NE(wider, json);
    json = wider;
  }
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(json);
  EXPECT_THAT(spec.status(), IsOk());
  return spec.ok() ? *spec : v1::ModelSpec();
}

struct Step {
  std::vector<std::vector<int32_t>> inputs, targets;
  std::vector<std::vector<int64_t>> indices;
  int64_t step = 0;
};

// Next-token targets (every 5th ignored); the keys of the first step whose
// canvases have the self-conditioning coin both up and down.
Step MakeStep(int64_t vocab, int64_t canvas) {
  Step s;
  testing_util::TokenBatches batches = testing_util::RandomTokenBatches(
      kMicrobatches, kBatch * kSeq, vocab, /*seed=*/7);
  s.inputs = std::move(batches.inputs);
  s.targets = std::move(batches.targets);
  for (int m = 0; m < kMicrobatches; ++m) {
    s.indices.push_back({40 + 2 * m, 41 + 2 * m});
  }
  for (s.step = 1;; ++s.step) {
    int coins = 0;
    for (int m = 0; m < kMicrobatches; ++m) {
      DiffusionCanvas c;
      EXPECT_TRUE(BuildDiffusionCanvas(s.inputs[m].data(), kBatch, kSeq, canvas,
                                       vocab, s.step, s.indices[m].data(),
                                       DiffusionTrainingOptions(), &c)
                      .ok());
      coins += c.self_cond[0] + c.self_cond[1];
    }
    if (coins == kMicrobatches) break;
  }
  return s;
}

struct Result {
  double loss = 0.0;
  int64_t tokens = 0;
  std::map<std::string, std::vector<float>> grads;
  bool ok = false;
};

// Runs one step of `shape` on either model (SetBatch, SetSequenceKeys, the
// commands of its pass layout).
template <typename Model>
bool Drive(
    Model* model, const MoeModelOptions& shape,
    const std::vector<bool>& moe_layers, const Step& s,
    typename std::conditional<std::is_same<Model, MoeModel>::value, ParamSource,
                              DeviceParamSource>::type* source,
    bool exchanged = false) {
  model->ResetStep();
  for (int m = 0; m < shape.microbatches; ++m) {
    const absl::Status set = model->SetBatch(m, s.inputs[m].data(),
                                             s.targets[m].data(), kBatch, kSeq);
    EXPECT_THAT(set, IsOk());
    if (!set.ok()) return false;
    EXPECT_THAT(model->SetSequenceKeys(m, s.step, s.indices[m].data()), IsOk());
  }
  const PassLayout layout = PassLayout::For(kBlockDiffusionArchitecture,
                                            shape.passes, shape.no_grad_passes);
  for (const v1::Command& c : testing_util::ModelStepCommands(
           moe_layers, layout, shape.microbatches, exchanged)) {
    const absl::Status st = model->Run(c, source);
    EXPECT_THAT(st, IsOk()) << c.ShortDebugString();
    if (!st.ok()) return false;
  }
  return true;
}

struct Case {
  int passes = 1;  // 1: the causal pass; 3: the block-diffusion step.
  int64_t response = 0;
  DeviceDType activations = DeviceDType::kFloat32;
  int64_t global_head_dim = 0;  // 0: the config's.
  // Expert parallelism over a group of one GPU: DISPATCH, EXPERTS (top-1
  // over the received rows) and COMBINE through NCCL's all-to-all.
  bool ep = false;
};

// ||got - want||_2 / ||want||_2.
double Relative(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0.0, ref = 0.0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    err += d * d;
    ref += static_cast<double>(want[i]) * want[i];
  }
  return ref > 0.0 ? std::sqrt(err / ref) : (err > 0.0 ? INFINITY : 0.0);
}

void CheckAgainstCpu(const Case& test) {
  const bool bf16 = test.activations == DeviceDType::kBFloat16;
  const v1::ModelSpec spec = Spec(/*all_experts=*/bf16, test.global_head_dim);
  testing_util::RandomParamOptions random;
  random.round_to_bf16 = bf16;
  random.range = static_cast<float>(std::sqrt(3.0 / spec.dims().hidden_size()));
  const auto values = testing_util::RandomParamValues(spec, random);
  MoeModelOptions shape;
  shape.passes = test.passes;
  shape.no_grad_passes = test.passes == 3 ? 1 : 0;
  shape.microbatches = kMicrobatches;
  shape.diffusion.response_length = test.response;
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe_layers = arch.LayersWithExperts();
  const Step s = MakeStep(arch.vocab, test.response > 0 ? test.response : 8);

  SHARDD_ASSERT_OK_AND_ASSIGN(auto cpu_model, MoeModel::Create(spec, shape));
  testing_util::MapParamSource cpu_source;
  cpu_source.values = values;
  ASSERT_TRUE(Drive(cpu_model.get(), shape, moe_layers, s, &cpu_source));
  Result cpu{cpu_model->step_loss(), cpu_model->step_tokens(), cpu_source.grads,
             true};

  TestDeviceSource source;
  source.AddAll(spec, values,
                bf16 ? DeviceDType::kBFloat16 : DeviceDType::kFloat32);
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, nullptr);
  DeviceMoeModelOptions options;
  options.model = shape;
  options.activations = test.activations;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto model, DeviceMoeModel::Create(spec, options, &allocator));
  InMemoryKeyValueClient kv;
  std::unique_ptr<NcclCommunicator> nccl;
  std::unique_ptr<ExpertExchange> exchange;
  if (test.ep) {
    constexpr absl::Duration kTimeout = absl::Seconds(30);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        nccl, NcclCommunicator::Create(&kv, "gemma-ep", 0, 1,
                                       NcclCommunicatorOptions()));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        ExpertExchange made,
        ExpertExchange::Create(nccl.get(), spec.dims().num_experts(),
                               kTimeout));
    exchange = std::make_unique<ExpertExchange>(std::move(made));
    SHARDD_ASSERT_OK(
        model->SetExpertExchange(exchange.get(), 0.0, nccl.get(), kTimeout));
  }
  auto run_gpu = [&]() {
    Result r;
    source.ZeroGrads();
    if (!Drive(model.get(), shape, moe_layers, s, &source, test.ep)) return r;
    auto loss = model->ReadStepLoss();
    EXPECT_THAT(loss.status(), IsOk());
    if (!loss.ok()) return r;
    r.loss = loss->loss;
    r.tokens = loss->tokens;
    r.grads = source.Grads();
    r.ok = true;
    return r;
  };
  const Result gpu = run_gpu();
  ASSERT_TRUE(gpu.ok);
  EXPECT_EQ(model->activation_bytes(), 0);
  EXPECT_EQ(gpu.tokens, cpu.tokens);
  // fp32: every op agrees with the CPU's to ~1e-6 relative (the other
  // architectures' margin, device_moe_model_hf_test.cc), but the step's
  // gradients are ill-conditioned: against float64 the CPU's own gradients
  // sit within 2.3e-3 (the bound moe_model_diffusion_test.cc derives from
  // the soft-cap and self-conditioning softmax), so two fp32 models differ
  // by at most twice that. The causal pass is as well conditioned as the
  // other architectures: 1e-4. bf16 (causal pass only; every expert chosen,
  // so no routing flips): about 28 stored roundings per layer forward and
  // 30 backward, 3 layers, plus 10 around the embedding and the head: 184 *
  // 2^-8 normwise; the loss, a mean of cross-entropies of logits whose
  // error is the forward's share, 1e-2 as the other bf16 tests.
  const double grad_tol = bf16               ? 184 * std::ldexp(1.0, -8)
                          : test.passes == 3 ? 2 * 2.3e-3
                                             : 1e-4;
  const double loss_tol = bf16 ? 1e-2 : 1e-4;
  EXPECT_NEAR(gpu.loss, cpu.loss, loss_tol * std::fabs(cpu.loss));
  double worst = 0.0;
  std::string worst_name;
  for (const auto& [name, want] : cpu.grads) {
    auto it = gpu.grads.find(name);
    ASSERT_TRUE(it != gpu.grads.end()) << name << " has no GPU gradient";
    ASSERT_EQ(it->second.size(), want.size()) << name;
    const double rel = Relative(it->second, want);
    EXPECT_LE(rel, grad_tol) << name;
    if (rel > worst) worst = rel, worst_name = name;
  }
  // What the CPU leaves without a gradient (the causal pass does not use
  // model.self_conditioning) stays zero on the GPU.
  for (const auto& [name, got] : gpu.grads) {
    if (cpu.grads.count(name) > 0) continue;
    EXPECT_EQ(test.passes, 1) << name << " has no CPU gradient";
    EXPECT_EQ(Relative(got, std::vector<float>(got.size(), 0.0f)), 0.0) << name;
  }
  std::printf(
      "DiffusionGemma %s passes %d response %lld: loss %.9g vs %.9g (rel "
      "%.3g, tol %.3g); worst gradient %s rel %.3g (tol %.3g)\n",
      bf16 ? "bf16" : "fp32", test.passes,
      static_cast<long long>(test.response), gpu.loss, cpu.loss,
      std::fabs(gpu.loss - cpu.loss) / std::fabs(cpu.loss), loss_tol,
      worst_name.c_str(), worst, grad_tol);
  // A second step is bit-identical (deterministic kernels; the canvas is
  // keyed by the same step and indices).
  const Result again = run_gpu();
  ASSERT_TRUE(again.ok);
  EXPECT_EQ(again.loss, gpu.loss);
  for (const auto& [name, g] : gpu.grads) {
    EXPECT_EQ(again.grads.at(name), g) << name;
  }
  // Every MoE layer's rows went out and back once forward and once
  // backward per pass with gradients (and forward per pass without).
  if (test.ep) {
    EXPECT_GT(nccl->stats().all_to_all.calls, 0);
  }
}

TEST(DeviceMoeModelGemmaTest, Fp32CausalPassMatchesCpuModel) {
  SHARDD_SKIP_WITHOUT_GPU();
  CheckAgainstCpu({1, 0, DeviceDType::kFloat32});
}

TEST(DeviceMoeModelGemmaTest, Bf16CausalPassMatchesCpuModelWithinTolerance) {
  SHARDD_SKIP_WITHOUT_GPU();
  CheckAgainstCpu({1, 0, DeviceDType::kBFloat16});
}

TEST(DeviceMoeModelGemmaTest, Fp32BlockDiffusionStepMatchesCpuModel) {
  SHARDD_SKIP_WITHOUT_GPU();
  CheckAgainstCpu({3, 0, DeviceDType::kFloat32});
}

TEST(DeviceMoeModelGemmaTest, Fp32BlockDiffusionInBlocksMatchesCpuModel) {
  SHARDD_SKIP_WITHOUT_GPU();
  // A response of 10 rows: blocks of 8 and 2 after a prompt of 4, so the
  // sliding layers' decode keys start past the first encoder row.
  CheckAgainstCpu({3, 10, DeviceDType::kFloat32});
}

TEST(DeviceMoeModelGemmaTest, Fp32WideFullAttentionHeadsMatchCpuModel) {
  SHARDD_SKIP_WITHOUT_GPU();
  // The released model's 512-wide full-attention heads, both step shapes.
  CheckAgainstCpu({1, 0, DeviceDType::kFloat32, 512});
  CheckAgainstCpu({3, 10, DeviceDType::kFloat32, 512});
}

// Expert parallelism of DiffusionGemma's experts on the GPU (a group of
// one): the exchanged phases give the CPU model's step within the same
// bounds (only the experts' summation order changes: top-1 rows combined
// back in slot order, ~1e-7 relative in fp32).
TEST(DeviceMoeModelGemmaTest, Fp32ExpertParallelMatchesCpuModel) {
  SHARDD_SKIP_WITHOUT_GPU();
  Case causal{1, 0, DeviceDType::kFloat32};
  causal.ep = true;
  CheckAgainstCpu(causal);
  Case diffusion{3, 10, DeviceDType::kFloat32};
  diffusion.ep = true;
  CheckAgainstCpu(diffusion);
}

TEST(DeviceMoeModelGemmaTest, Bf16BlockDiffusionStepRunsAndRepeats) {
  SHARDD_SKIP_WITHOUT_GPU();
  // bf16's rounding through three passes exceeds any useful derived bound
  // (docs/testing.md), so this checks what holds exactly: the step runs,
  // frees every activation, its loss is finite, and it repeats bit for bit.
  const v1::ModelSpec spec = Spec(/*all_experts=*/true);
  testing_util::RandomParamOptions random;
  random.round_to_bf16 = true;
  random.range = static_cast<float>(std::sqrt(3.0 / spec.dims().hidden_size()));
  MoeModelOptions shape;
  shape.passes = 3;
  shape.no_grad_passes = 1;
  shape.microbatches = kMicrobatches;
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const Step s = MakeStep(arch.vocab, 8);
  TestDeviceSource source;
  source.AddAll(spec, testing_util::RandomParamValues(spec, random),
                DeviceDType::kBFloat16);
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, nullptr);
  DeviceMoeModelOptions options;
  options.model = shape;
  options.activations = DeviceDType::kBFloat16;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto model, DeviceMoeModel::Create(spec, options, &allocator));
  double losses[2];
  for (double& loss : losses) {
    source.ZeroGrads();
    ASSERT_TRUE(
        Drive(model.get(), shape, arch.LayersWithExperts(), s, &source));
    SHARDD_ASSERT_OK_AND_ASSIGN(const DeviceMoeModel::StepLoss l,
                                model->ReadStepLoss());
    loss = l.loss;
    EXPECT_EQ(model->activation_bytes(), 0);
  }
  EXPECT_TRUE(std::isfinite(losses[0]));
  // Two cross-entropies of a near-uniform model over 97 tokens.
  EXPECT_GT(losses[0], 1.0);
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
}  // namespace shardd
