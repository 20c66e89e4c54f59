// Every training feature on every device (issue 29): one table of
// features, each run as a 3-step job on one rank of each device, so that a
// feature cannot land on one device only. Built twice: as
// device_parity_cpu_test (every CI run) and, under --config=cuda with
// SHARDD_PARITY_CUDA, as device_parity_cuda_test (tagged gpu; skips
// without one).
//
// What a case checks:
//   cpu:  the job runs, repeats its bits when run again, and when the
//         feature must not change the math (recompute, keeping the compute
//         shard) equals the plain job bit for bit; an evaluation scores the
//         loss the training step reports at the same parameters and
//         changes nothing; the measured activation peak is the plan's.
//   cuda: the same job on the GPU (NCCL world of one) against the CPU's
//         within the bounds cuda_backend_test derives (fp32: 1e-4 relative;
//         bf16 storage: 3e-2), and an evaluation changes nothing there too.
// A feature the GPU backend refuses fails its cuda case (by design). Muon
// runs on both through the same optimizer code (optimizer_shards.h). The
// cuda cases also compare the GPU's measured activation peak with the
// plan's, which models the CPU's fp32 state until the plan models the
// device's (issue 41, item 4), so they fail there for now. Recovery in
// place (LoadPlan with keep_state, HealReplicas) and checkpoints run at the
// worker runtime over ShardState (shard_state.h): worker_runtime_test and
// the shards' tests cover the CPU, cuda_backend_test's keep-state case the
// GPU. None of the cuda cases has run on a GPU since the GPU moved onto the
// step driver (2026-12-07).

#include <cmath>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/lora.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "testing/model_builder.h"
#include "testing/step_batches.h"
#include "testing/tiny_models.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/optimizer_options.h"
#include "worker/exec/step_executor.h"
#include "worker/memory/memory_tracker.h"
#ifdef SHARDD_PARITY_CUDA
#include "testing/gpu.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/exec/cuda_backend.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#endif

namespace shardd {
namespace {

constexpr int64_t kVocab = 30, kSeq = 8, kDiffusionSeq = 10;
constexpr uint64_t kSeed = 11;
constexpr int kSteps = 3;

struct Feature {
  std::string name;
  enum class Model { kMoe, kAux, kDiffusion } model = Model::kMoe;
  bool mixed = false;
  int microbatches = 1;
  bool keep_compute_shard = false;
  std::string checkpointing;  // "", "all", "experts", "every:2"
  bool eval = false;
  bool muon = false;
  // SFT rows: two examples packed per row, prompts and example ends out of
  // the loss (docs/sft_data.md).
  bool packed_sft = false;
  // LoRA adapters on the attention's q/v projections and the experts
  // (docs/lora.md): only they train.
  bool lora = false;
  // On the CPU the feature must not change the math: equals the plain job.
  bool same_as_plain = false;
};

void PrintTo(const Feature& f, std::ostream* os) { *os << f.name; }

// The table. Add a row for a new training feature: it then runs on both
// devices.
std::vector<Feature> Features() {
  std::vector<Feature> f;
  f.push_back({"plain"});
  for (const char* policy : {"all", "experts", "every:2"}) {
    Feature c{absl::StrCat("recompute_", policy)};
    c.checkpointing = policy;
    c.same_as_plain = true;
    f.push_back(c);
  }
  Feature eval{"evaluation"};
  eval.eval = true;
  f.push_back(eval);
  Feature muon{"muon"};
  muon.muon = true;
  f.push_back(muon);
  Feature aux{"load_balancing_loss"};
  aux.model = Feature::Model::kAux;
  f.push_back(aux);
  Feature mb{"micro_batches"};
  mb.microbatches = 2;
  f.push_back(mb);
  Feature mixed{"bf16_mixed_precision"};
  mixed.mixed = true;
  f.push_back(mixed);
  Feature keep{"keep_compute_shard"};
  keep.mixed = true;
  keep.keep_compute_shard = true;
  f.push_back(keep);
  Feature sft{"packed_sft_rows"};
  sft.packed_sft = true;
  f.push_back(sft);
  Feature lora{"lora"};
  lora.lora = true;
  f.push_back(lora);
  Feature diffusion{"block_diffusion"};
  diffusion.model = Feature::Model::kDiffusion;
  f.push_back(diffusion);
  Feature diffusion_recompute{"block_diffusion_recompute_all"};
  diffusion_recompute.model = Feature::Model::kDiffusion;
  diffusion_recompute.checkpointing = "all";
  diffusion_recompute.same_as_plain = true;
  f.push_back(diffusion_recompute);
  return f;
}

v1::ModelSpec ModelOf(const Feature& f) {
  if (f.model == Feature::Model::kDiffusion) {
    return testing_util::TinyDiffusionGemmaSpec();
  }
  // Qwen3-style attention (GQA, q/k norms, a sliding layer) over MoE layers
  // with a dense branch, layer 0's router frozen.
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = 16;
  shape.experts = 4;
  shape.inter = 8;
  shape.mlp = 12;
  testing_util::AddQwen3Attention(&shape);
  shape.freeze_router0 = true;
  v1::ModelSpec spec = testing_util::TinyMoeSpec(shape);
  if (f.model == Feature::Model::kAux) {
    spec.mutable_dims()->set_router_aux_loss_coef(0.02);
  }
  if (f.lora) {
    v1::LoraConfig lora;
    lora.set_rank(2);
    lora.set_alpha(4);
    for (const char* target : {"q_proj", "v_proj", "experts"}) {
      lora.add_targets(target);
    }
    EXPECT_THAT(ApplyLora(lora, &spec), IsOk());
  }
  return spec;
}

int64_t SeqOf(const Feature& f) {
  return f.model == Feature::Model::kDiffusion ? kDiffusionSeq : kSeq;
}

// `device`: whose activations the plan counts (the measured peak equals
// it on either device).
v1::ShardingPlan PlanOf(const v1::ModelSpec& model, const Feature& f,
                        bool with_checkpointing, v1::WorkerDevice device) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy("default");
  options.mutable_mesh()->set_dp_shard(1);
  options.mutable_mesh()->set_dp_replicate(1);
  options.set_mixed_precision(f.mixed);
  options.set_worker_device(device);
  options.set_keep_compute_shard(f.keep_compute_shard);
  options.set_microbatches(f.microbatches);
  if (f.model == Feature::Model::kDiffusion) {
    options.set_passes(3);
    options.set_no_grad_passes(1);
  }
  // The activation model, so that the measured peak has a plan to equal.
  options.set_micro_batch_size(2);
  options.set_seq_len(SeqOf(f));
  if (with_checkpointing) {
    options.set_activation_checkpointing(f.checkpointing);
  }
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

StepExecutorOptions OptionsOf(const Feature& f) {
  StepExecutorOptions options;
  options.seed = kSeed;
  options.collective_timeout = absl::Seconds(30);
  options.adamw.lr = 1e-2;
  options.adamw.weight_decay = 0.1;
  options.max_grad_norm = 0.5;
  if (f.muon) {
    options.optimizer.name = kMuonOptimizer;
    options.optimizer.muon.lr = 0.02;
  }
  return options;
}

std::vector<std::vector<data::MicroBatch>> BatchesOf(
    const v1::ShardingPlan& plan, const Feature& f) {
  std::vector<std::vector<data::MicroBatch>> steps = testing_util::StepBatches(
      plan, kVocab, kSeed, SeqOf(f), /*rows=*/2, kSteps);
  if (!f.packed_sft) return steps;
  // Each row holds an example of 3 tokens, then one of the rest; the first
  // token of each (its prompt) and the last of the first (whose next token
  // is another example's) are not scored.
  constexpr int64_t kFirst = 3;
  for (std::vector<data::MicroBatch>& step : steps) {
    int64_t counted = 0;
    for (data::MicroBatch& b : step) {
      b.segment_starts.assign(b.rows * b.seq_len, 0);
      for (int64_t r = 0; r < b.rows; ++r) {
        for (int64_t j = 0; j < b.seq_len; ++j) {
          const int64_t i = r * b.seq_len + j;
          b.segment_starts[i] = j < kFirst ? 0 : kFirst;
          if (j == 0 || j == kFirst - 1 || j == kFirst) b.targets[i] = -1;
          counted += b.targets[i] >= 0;
        }
      }
    }
    for (data::MicroBatch& b : step) b.step_counted = counted;
  }
  return steps;
}

// What a job produced.
struct Trace {
  std::vector<StepResult> results;         // Training steps.
  std::vector<StepResult> evals;           // Before each training step (eval).
  std::vector<std::vector<float>> params;  // Final owned slices.
  bool ok = false;
};

using ExecutorFactory =
    std::function<absl::StatusOr<std::unique_ptr<StepExecutor>>(
        const v1::ShardingPlan&, const v1::ModelSpec&,
        const StepExecutorOptions&)>;

Trace RunJob(const Feature& f, bool with_checkpointing, v1::WorkerDevice device,
             const ExecutorFactory& make) {
  Trace trace;
  const v1::ModelSpec model = ModelOf(f);
  const v1::ShardingPlan plan = PlanOf(model, f, with_checkpointing, device);
  absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  EXPECT_TRUE(program.ok()) << program.status();
  absl::StatusOr<v1::StepProgram> eval = CompileEvalProgram(plan);
  EXPECT_TRUE(eval.ok()) << eval.status();
  if (!program.ok() || !eval.ok()) return trace;
  absl::StatusOr<std::unique_ptr<StepExecutor>> executor =
      make(plan, model, OptionsOf(f));
  EXPECT_TRUE(executor.ok()) << f.name << ": " << executor.status();
  if (!executor.ok()) return trace;
  const auto batches = BatchesOf(plan, f);
  for (int s = 0; s < kSteps; ++s) {
    if (f.eval) {
      eval->set_step(s);
      absl::StatusOr<StepResult> r = (*executor)->Execute(*eval, batches[s]);
      EXPECT_TRUE(r.ok()) << f.name << " eval " << s << ": " << r.status();
      if (!r.ok()) return trace;
      trace.evals.push_back(*r);
    }
    program->set_step(s);
    absl::StatusOr<StepResult> r = (*executor)->Execute(*program, batches[s]);
    EXPECT_TRUE(r.ok()) << f.name << " step " << s << ": " << r.status();
    if (!r.ok()) return trace;
    trace.results.push_back(*r);
    // The measured activation peak is the plan's.
    EXPECT_EQ(r->peak_activation_bytes, plan.memory().peak_activation_bytes())
        << f.name << " step " << s;
  }
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      std::vector<float> values(param.numel());
      EXPECT_THAT((*executor)->CopyOwnedParamSlice(param.name(), values.data()),
                  IsOk());
      trace.params.push_back(std::move(values));
    }
  }
  trace.ok = true;
  return trace;
}

// A Gloo world of one over an in-memory store: the CPU executor.
Trace RunCpu(const Feature& f, bool with_checkpointing) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(20));
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> gloo =
      GlooCommunicator::Create(&store, "parity/gloo", 0, 1, "127.0.0.1",
                               absl::Seconds(20));
  EXPECT_TRUE(gloo.ok()) << gloo.status();
  if (!gloo.ok()) return Trace();
  MemoryTracker tracker;
  return RunJob(f, with_checkpointing, v1::WORKER_DEVICE_CPU,
                [&](const v1::ShardingPlan& plan, const v1::ModelSpec& model,
                    const StepExecutorOptions& options) {
                  return StepExecutor::Create(plan, model, options, gloo->get(),
                                              nullptr, &tracker);
                });
}

class DeviceParityTest : public ::testing::TestWithParam<Feature> {};

#ifndef SHARDD_PARITY_CUDA

TEST_P(DeviceParityTest, Cpu) {
  const Feature& f = GetParam();
  const Trace run = RunCpu(f, /*with_checkpointing=*/true);
  ASSERT_TRUE(run.ok);
  const Trace again = RunCpu(f, /*with_checkpointing=*/true);
  ASSERT_TRUE(again.ok);
  // Deterministic: the same bits again.
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(run.results[s].loss, again.results[s].loss) << s;
    EXPECT_EQ(run.results[s].grad_norm, again.results[s].grad_norm) << s;
    EXPECT_TRUE(std::isfinite(run.results[s].loss)) << s;
    EXPECT_GT(run.results[s].tokens, 0) << s;
  }
  EXPECT_EQ(run.params, again.params);
  if (f.same_as_plain) {
    const Trace plain = RunCpu(f, /*with_checkpointing=*/false);
    ASSERT_TRUE(plain.ok);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(run.results[s].loss, plain.results[s].loss) << s;
      EXPECT_EQ(run.results[s].grad_norm, plain.results[s].grad_norm) << s;
    }
    EXPECT_EQ(run.params, plain.params);
  }
  if (f.eval) {
    // The evaluation before step s scores the loss step s reports (same
    // parameters, same batches), and the training it interleaves with is
    // the plain job's.
    Feature train_only = f;
    train_only.eval = false;
    const Trace plain = RunCpu(train_only, true);
    ASSERT_TRUE(plain.ok);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_TRUE(run.evals[s].eval);
      EXPECT_EQ(run.evals[s].loss, plain.results[s].loss) << s;
      EXPECT_EQ(run.evals[s].optimizer_steps, s) << s;
      EXPECT_EQ(run.results[s].loss, plain.results[s].loss) << s;
    }
    EXPECT_EQ(run.params, plain.params);
  }
}

#else  // SHARDD_PARITY_CUDA

TEST_P(DeviceParityTest, Cuda) {
  SHARDD_SKIP_WITHOUT_GPU();
  const Feature& f = GetParam();
  const Trace cpu = RunCpu(f, /*with_checkpointing=*/true);
  ASSERT_TRUE(cpu.ok);
  InMemoryKeyValueClient kv;
  static int generation = 0;
  NcclCommunicatorOptions nccl_options;
  nccl_options.device = 0;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(&kv, absl::StrCat("parity/nccl", ++generation),
                               0, 1, nccl_options));
  MemoryTracker tracker;
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, &tracker);
  const Trace gpu = RunJob(
      f, true, v1::WORKER_DEVICE_CUDA,
      [&](const v1::ShardingPlan& plan, const v1::ModelSpec& model,
          const StepExecutorOptions& step) {
        CudaBackendOptions options;
        options.step = step;
        options.device = 0;
        return CreateCudaStepExecutor(plan, model, options, nccl.get(), nullptr,
                                      &allocator, &tracker, {}, nullptr);
      });
  ASSERT_TRUE(gpu.ok) << f.name << " does not run on the GPU";
  const double rel = f.mixed ? 3e-2 : 1e-4;
  for (int s = 0; s < kSteps; ++s) {
    const StepResult& want = cpu.results[s];
    const StepResult& got = gpu.results[s];
    EXPECT_EQ(got.tokens, want.tokens) << s;
    EXPECT_NEAR(got.loss, want.loss, rel * std::abs(want.loss)) << s;
    EXPECT_NEAR(got.grad_norm, want.grad_norm, rel * want.grad_norm) << s;
    if (f.eval) {
      EXPECT_NEAR(gpu.evals[s].loss, cpu.evals[s].loss,
                  rel * std::abs(cpu.evals[s].loss))
          << s;
    }
  }
}

#endif  // SHARDD_PARITY_CUDA

INSTANTIATE_TEST_SUITE_P(Features, DeviceParityTest,
                         ::testing::ValuesIn(Features()),
                         [](const ::testing::TestParamInfo<Feature>& info) {
                           std::string name = info.param.name;
                           for (char& c : name) {
                             if (c == ':') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace shardd
