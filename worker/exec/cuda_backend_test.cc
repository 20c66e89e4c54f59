#include "worker/exec/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/plan_index.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "testing/gpu.h"
#include "testing/model_builder.h"
#include "testing/step_batches.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_executor.h"
#include "worker/memory/cuda_memory_backend.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_checkpoint.h"
#include "worker/shards/shard_state_transfer.h"

namespace shardd {
namespace {

// vocab 30 pads dim 0 over 4 ranks (8 rows each, 2 of padding on rank 3).
constexpr int64_t kVocab = 30, kDim = 16, kExperts = 4, kInter = 8, kMlp = 12,
                  kSeq = 8;
constexpr uint64_t kSeed = 7;
constexpr char kFrozen[] = "model.layers.0.moe.gate.weight";

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;

// The shared tiny MoE (testing/model_builder.h) with these constants.
// `freeze` freezes layer 0's router (kFrozen).
v1::ModelSpec TinyMoe(bool freeze, bool attention = false) {
  testing_util::TinyMoeShape shape;
  if (attention) testing_util::AddQwen3Attention(&shape);
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.freeze_router0 = freeze;
  return testing_util::TinyMoeSpec(shape);
}

v1::ShardingPlan PlanFor(const v1::ModelSpec& model, bool mixed,
                         int microbatches, bool keep_compute_shard) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy("default");
  options.mutable_mesh()->set_dp_shard(1);
  options.mutable_mesh()->set_dp_replicate(1);
  options.set_mixed_precision(mixed);
  options.set_keep_compute_shard(keep_compute_shard);
  options.set_microbatches(microbatches);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

StepExecutorOptions Options() {
  StepExecutorOptions options;
  options.seed = kSeed;
  options.collective_timeout = absl::Seconds(30);
  options.adamw.lr = 1e-2;
  options.adamw.weight_decay = 0.1;
  options.max_grad_norm = 0.5;  // Clips in the first steps.
  return options;
}

std::vector<std::vector<data::MicroBatch>> Batches(const v1::ShardingPlan& plan,
                                                   int steps) {
  return testing_util::StepBatches(plan, kVocab, kSeed, kSeq, /*rows=*/4,
                                   steps);
}

struct Case {
  bool mixed;
  int microbatches;
  bool keep_compute_shard;
  bool attention = false;
};

class CudaBackendTest : public ::testing::TestWithParam<Case> {};

// One rank, NCCL world of one on GPU 0, against StepExecutor on the CPU
// (Gloo world of one), same seed and batches. Tolerances: fp32 storage
// differs from the CPU only in summation order (1e-4 relative on losses and
// norms, 1e-4 absolute + relative on parameters after 3 AdamW steps at
// lr 1e-2); bf16 storage rounds activations and gathered weights to bf16 on
// both sides but in different places (3e-2 relative on losses and norms;
// parameters within what AdamW's bounded steps allow, derived below).
TEST_P(CudaBackendTest, MatchesTheCpuExecutor) {
  SHARDD_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true, c.attention);
  const v1::ShardingPlan plan =
      PlanFor(model, c.mixed, c.microbatches, c.keep_compute_shard);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  constexpr int kSteps = 3;
  const auto batches = Batches(plan, kSteps);

  // CPU reference.
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(20));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<GlooCommunicator> gloo,
      GlooCommunicator::Create(&store, "device-test/gloo", 0, 1, "127.0.0.1",
                               absl::Seconds(20)));
  MemoryTracker cpu_tracker;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StepExecutor> cpu,
      StepExecutor::Create(plan, model, Options(), gloo.get(), nullptr,
                           &cpu_tracker));
  std::vector<StepResult> cpu_results;
  for (int s = 0; s < kSteps; ++s) {
    program.set_step(s);
    SHARDD_ASSERT_OK_AND_ASSIGN(StepResult r,
                                cpu->Execute(program, batches[s]));
    cpu_results.push_back(r);
  }

  // GPU.
  static int generation = 0;
  NcclCommunicatorOptions nccl_options;
  nccl_options.device = 0;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(&kv,
                               absl::StrCat("device-test/nccl", ++generation),
                               0, 1, nccl_options));
  MemoryTracker tracker;
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, &tracker);
  CudaBackendOptions options;
  options.step = Options();
  options.device = 0;
  CudaBackend* device = nullptr;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StepExecutor> gpu,
      CreateCudaStepExecutor(plan, model, options, nccl.get(), nullptr,
                             &allocator, &tracker, {}, &device));
  const double rel = c.mixed ? 3e-2 : 1e-4;
  for (int s = 0; s < kSteps; ++s) {
    program.set_step(s);
    SHARDD_ASSERT_OK_AND_ASSIGN(StepResult r,
                                gpu->Execute(program, batches[s]));
    const StepResult& want = cpu_results[s];
    EXPECT_EQ(r.step, s);
    EXPECT_EQ(r.optimizer_steps, s + 1);
    EXPECT_EQ(r.tokens, want.tokens);
    EXPECT_NEAR(r.loss, want.loss, rel * std::abs(want.loss)) << s;
    EXPECT_NEAR(r.grad_norm, want.grad_norm, rel * want.grad_norm) << s;
    EXPECT_NEAR(r.clip_coefficient, want.clip_coefficient,
                rel * want.clip_coefficient)
        << s;
    // Memory: the plan's peak, as on the CPU.
    EXPECT_EQ(r.peak_unsharded_bytes, plan.memory().peak_unsharded_bytes())
        << s;
    EXPECT_EQ(r.peak_unsharded_bytes, want.peak_unsharded_bytes) << s;
    // One host synchronization (EndStep) plus the grouped experts' one per
    // MoE forward; the collectives never block the host.
    EXPECT_EQ(r.device.host_synchronizations,
              1 + r.device.model_host_synchronizations)
        << s;
    EXPECT_GT(r.device.model_host_synchronizations, 0);
    EXPECT_LE(r.device.model_host_synchronizations,
              2 * plan.step().microbatches() * plan.step().passes());
    // The caching allocator serves every later step.
    if (s > 0) {
      EXPECT_EQ(r.device.backend_mallocs, 0) << s;
      EXPECT_EQ(r.device.backend_frees, 0) << s;
    }
    EXPECT_EQ(r.collectives.all_gathers, plan.comm().all_gathers());
    EXPECT_EQ(r.collectives.reduce_scatters, plan.comm().reduce_scatters());
    EXPECT_EQ(r.collectives.norm_all_reduces, 1);
  }

  // Parameters after kSteps updates. fp32: 1e-4 absolute + relative (see
  // above). bf16: an element whose gradient is within bf16 rounding of zero
  // may take its Adam step in the other direction on one side, so the
  // sides can differ by whole steps; the bound is what AdamW allows at all:
  // by Cauchy-Schwarz, |m_hat / sqrt(v_hat)| at step t is at most
  //   B_t = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2))
  //         * sqrt(sum_{k<t} (b1^2 / b2)^k)
  // (1.000, 1.002, 1.003 for t = 1..3 at the defaults), whatever the
  // gradients; each step moves a parameter by at most lr * (B_t + wd |p|),
  // and the two sides' steps add. That catches garbage (NaN, unwritten or
  // unstepped shards, a scale error beyond lr); the per-step loss and
  // gradient-norm checks above, and the fp32 cases, check the gradients.
  const StepExecutorOptions adam = Options();
  double max_travel = 0.0;  // sum_t lr * B_t
  for (int t = 1; t <= kSteps; ++t) {
    const double b1 = adam.adamw.beta1, b2 = adam.adamw.beta2;
    double ratio_sum = 0.0;
    for (int k = 0; k < t; ++k) ratio_sum += std::pow(b1 * b1 / b2, k);
    max_travel += adam.adamw.lr * (1 - b1) / (1 - std::pow(b1, t)) *
                  std::sqrt((1 - std::pow(b2, t)) / (1 - b2)) *
                  std::sqrt(ratio_sum);
  }
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      std::vector<float> want(param.numel()), got(param.numel());
      SHARDD_ASSERT_OK(
          cpu->shards().CopyOwnedParamSlice(param.name(), want.data()));
      SHARDD_ASSERT_OK(
          device->shards().CopyOwnedParamSlice(param.name(), got.data()));
      for (int64_t i = 0; i < param.numel(); ++i) {
        const double magnitude = std::abs(want[i]) + max_travel;
        const double tol =
            c.mixed
                ? 2.0 * (max_travel + kSteps * adam.adamw.lr *
                                          adam.adamw.weight_decay * magnitude) +
                      1e-6 * (1.0 + std::abs(want[i]))
                : 1e-4 * (1.0 + std::abs(want[i]));
        ASSERT_NEAR(got[i], want[i], tol) << param.name() << "[" << i << "]";
        ASSERT_TRUE(std::isfinite(got[i])) << param.name() << "[" << i << "]";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, CudaBackendTest,
    ::testing::Values(Case{false, 1, false}, Case{false, 2, false},
                      Case{true, 1, false}, Case{true, 2, true},
                      Case{false, 2, false, /*attention=*/true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.mixed ? "bf16" : "fp32", "_m",
                          info.param.microbatches,
                          info.param.keep_compute_shard ? "_keep" : "",
                          info.param.attention ? "_attention" : "");
    });

// Fine-grained mode gives the same result as Execute, and misuse is
// rejected without effect.
TEST(CudaBackendFineGrainedTest, OneCallPerCommandMatchesExecute) {
  SHARDD_SKIP_WITHOUT_GPU();
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = PlanFor(model, false, 1, false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  const auto batches = Batches(plan, 1);
  InMemoryKeyValueClient kv;
  MemoryTracker tracker;
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, &tracker);
  CudaBackendOptions options;
  options.step = Options();
  std::vector<double> losses;
  for (int mode = 0; mode < 2; ++mode) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<NcclCommunicator> nccl,
        NcclCommunicator::Create(&kv, absl::StrCat("device-fine/", mode), 0, 1,
                                 NcclCommunicatorOptions()));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> gpu,
        CreateCudaStepExecutor(plan, model, options, nccl.get(), nullptr,
                               &allocator, &tracker));
    program.set_step(0);
    if (mode == 0) {
      SHARDD_ASSERT_OK_AND_ASSIGN(StepResult r,
                                  gpu->Execute(program, batches[0]));
      losses.push_back(r.loss);
      continue;
    }
    v1::StepProgram header = program;
    header.clear_commands();
    SHARDD_ASSERT_OK(gpu->BeginStep(header, batches[0]));
    v1::Command step;
    step.set_op(v1::Command::OPTIMIZER_STEP);
    EXPECT_THAT(gpu->ExecuteCommand(step),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    v1::Command wait;
    wait.set_op(v1::Command::WAIT_UNSHARD);
    wait.set_unit(0);
    EXPECT_THAT(gpu->ExecuteCommand(wait),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    for (const v1::Command& command : program.commands()) {
      SHARDD_ASSERT_OK(gpu->ExecuteCommand(command));
    }
    SHARDD_ASSERT_OK_AND_ASSIGN(StepResult r, gpu->EndStep());
    losses.push_back(r.loss);
    EXPECT_EQ(r.device.host_synchronizations,
              1 + r.device.model_host_synchronizations);
  }
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(losses[0], losses[1]);
}

// LoadPlan keep_state on a GPU: a host snapshot of the device shards,
// restored, brings back the same masters and moments, so the step after
// it repeats bit for bit (the kernels are run-to-run deterministic); then
// healing (BroadcastShardState over NCCL) and a checkpoint round trip.
TEST(CudaBackendKeepStateTest, SnapshotRestoresTheShards) {
  SHARDD_SKIP_WITHOUT_GPU();
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = PlanFor(model, false, 1, false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  const auto batches = Batches(plan, 2);
  InMemoryKeyValueClient kv;
  MemoryTracker tracker;
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, &tracker);
  CudaBackendOptions options;
  options.step = Options();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Create(&kv, "device-keep", 0, 1,
                               NcclCommunicatorOptions()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<StepExecutor> gpu,
      CreateCudaStepExecutor(plan, model, options, nccl.get(), nullptr,
                             &allocator, &tracker));
  program.set_step(0);
  SHARDD_ASSERT_OK(gpu->Execute(program, batches[0]).status());
  SHARDD_ASSERT_OK_AND_ASSIGN(const ShardStateSnapshot kept,
                              CaptureShardState(*gpu->shard_state()));
  const int64_t kept_steps = gpu->optimizer_steps();
  program.set_step(1);
  SHARDD_ASSERT_OK_AND_ASSIGN(const StepResult first,
                              gpu->Execute(program, batches[1]));
  SHARDD_ASSERT_OK_AND_ASSIGN(const ShardStateSnapshot after,
                              CaptureShardState(*gpu->shard_state()));
  ASSERT_EQ(after.units.size(), kept.units.size());
  EXPECT_NE(after.units[0].params, kept.units[0].params);  // It trained.
  SHARDD_ASSERT_OK(RestoreShardState(kept, gpu->shard_state()));
  SHARDD_ASSERT_OK(gpu->RestoreOptimizerSteps(kept_steps));
  SHARDD_ASSERT_OK_AND_ASSIGN(const StepResult again,
                              gpu->Execute(program, batches[1]));
  EXPECT_EQ(again.loss, first.loss);
  EXPECT_EQ(again.grad_norm, first.grad_norm);
  SHARDD_ASSERT_OK_AND_ASSIGN(const ShardStateSnapshot repeated,
                              CaptureShardState(*gpu->shard_state()));
  for (size_t u = 0; u < after.units.size(); ++u) {
    EXPECT_EQ(repeated.units[u].params, after.units[u].params) << u;
    EXPECT_EQ(repeated.units[u].exp_avg, after.units[u].exp_avg) << u;
  }
  // A snapshot of another layout is refused by unit, changing nothing.
  ShardStateSnapshot wrong = kept;
  wrong.units[0].params.push_back(0.0f);
  EXPECT_THAT(RestoreShardState(wrong, gpu->shard_state()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr("unit 0")));

  // Healing from a replica: the broadcast runs in place on the device
  // buffers over NCCL, its header staged from host memory (a group of one
  // here: the root receives nothing, and nothing changes).
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<NcclCommunicator> heal,
      NcclCommunicator::Create(&kv, "device-heal", 0, 1,
                               NcclCommunicatorOptions()));
  int64_t steps = gpu->optimizer_steps();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const int64_t received,
      BroadcastShardState(gpu->shard_state(), &steps, heal.get(), 0,
                          absl::Seconds(60)));
  EXPECT_EQ(received, 0);
  EXPECT_EQ(steps, gpu->optimizer_steps());

  // A checkpoint of the device shards (written from one host copy) loads
  // back into them.
  const char* tmp_root = getenv("TEST_TMPDIR");
  const std::string root =
      absl::StrCat(tmp_root != nullptr ? tmp_root : "/tmp", "/device-ckpt");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp,
                              checkpoint::BeginCheckpoint(root, steps));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      checkpoint::RankFile file,
      SaveRankShards(plan, *gpu->shard_state(), tmp, 0));
  SHARDD_ASSERT_OK_AND_ASSIGN(const checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(plan, steps, {file}));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string dir,
                              checkpoint::CommitCheckpoint(root, tmp, index));
  SHARDD_ASSERT_OK_AND_ASSIGN(const ShardStateSnapshot saved,
                              CaptureShardState(*gpu->shard_state()));
  SHARDD_ASSERT_OK(RestoreShardState(kept, gpu->shard_state()));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<checkpoint::CheckpointReader> reader,
      checkpoint::CheckpointReader::Open(dir));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const int64_t loaded_step,
      LoadRankShards(plan, gpu->shard_state(), reader.get(), 0));
  EXPECT_EQ(loaded_step, steps);
  SHARDD_ASSERT_OK_AND_ASSIGN(const ShardStateSnapshot loaded,
                              CaptureShardState(*gpu->shard_state()));
  for (size_t u = 0; u < saved.units.size(); ++u) {
    EXPECT_EQ(loaded.units[u].params, saved.units[u].params) << u;
    EXPECT_EQ(loaded.units[u].exp_avg, saved.units[u].exp_avg) << u;
    EXPECT_EQ(loaded.units[u].exp_avg_sq, saved.units[u].exp_avg_sq) << u;
  }
}

}  // namespace
}  // namespace shardd
