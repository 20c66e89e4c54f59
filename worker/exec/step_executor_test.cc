#include "worker/exec/step_executor.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"
#include "layout/param_init.h"
#include "layout/shard_ranges.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "testing/map_param_source.h"
#include "testing/model_builder.h"
#include "testing/tiny_models.h"
#include "testing/numerics.h"
#include "testing/sft_dataset_writer.h"
#include "testing/shard_state.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/data/batch_sampler.h"
#include "worker/memory/memory_tracker.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

// vocab 30 pads dim 0 over 4 ranks (8 rows each, 2 of padding on rank 3).
constexpr int64_t kVocab = 30, kDim = 16, kExperts = 4, kInter = 8, kMlp = 12,
                  kSeq = 8;
constexpr uint64_t kSeed = 7;
constexpr char kFrozen[] = "model.layers.0.moe.gate.weight";

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;
using ::shardd::testing_util::CollectOwnedState;
using ::shardd::testing_util::ExpectRelativelyNear;
using ::shardd::testing_util::ExpectStepWithinRounding;

// The shared tiny MoE (testing/model_builder.h) with these constants.
// `freeze` freezes layer 0's router (kFrozen).
v1::ModelSpec TinyMoe(bool freeze) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.freeze_router0 = freeze;
  return testing_util::TinyMoeSpec(shape);
}

struct Shape {
  std::string strategy = "default";
  int dp_shard = 1;
  int dp_replicate = 1;
  bool mixed = false;
  int microbatches = 1;
  int passes = 1;
  int no_grad_passes = 0;
  bool defer = false;
  // > 0: reshard_after_forward to groups of this many ranks.
  int reshard_group = 0;
  bool keep_compute_shard = false;
  std::string placement;  // PlanOptions.shard_placement ("": auto).
  // > 0: the activation model of this many sequences of kSeq tokens per
  // micro-batch, with `checkpointing`.
  int micro_batch_size = 0;
  std::string checkpointing;
  int ep = 0;  // Expert parallelism (mesh.ep).
};

v1::ShardingPlan MakePlan(const v1::ModelSpec& model, const Shape& s) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy(s.strategy);
  options.mutable_mesh()->set_dp_shard(s.dp_shard);
  options.mutable_mesh()->set_dp_replicate(s.dp_replicate);
  options.mutable_mesh()->set_ep(s.ep);
  options.set_mixed_precision(s.mixed);
  options.set_microbatches(s.microbatches);
  options.set_passes(s.passes);
  options.set_no_grad_passes(s.no_grad_passes);
  options.set_defer_grad_sync(s.defer);
  if (s.reshard_group > 0) {
    options.mutable_reshard_after_forward()->set_group_size(s.reshard_group);
  }
  options.set_keep_compute_shard(s.keep_compute_shard);
  options.set_shard_placement(s.placement);
  if (s.micro_batch_size > 0) {
    options.set_micro_batch_size(s.micro_batch_size);
    options.set_seq_len(kSeq);
    options.set_activation_checkpointing(s.checkpointing);
  }
  // Several buckets per rank and parameters straddling ranks.
  options.set_bucket_elements(700);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

StepExecutorOptions BaseOptions() {
  StepExecutorOptions options;
  options.seed = kSeed;
  options.collective_timeout = absl::Seconds(20);
  options.adamw.lr = 1e-2;
  options.adamw.weight_decay = 0.1;
  return options;
}

struct RankCtx {
  int shard_rank = 0;
  int replica_rank = 0;
  int data_rank = 0;  // Position among all data-parallel ranks.
  Communicator* shard = nullptr;
  Communicator* replicas = nullptr;
  SliceGroups slices;
  ExpertGroups experts;
  MemoryTracker* tracker = nullptr;
};

// Runs body(ctx) on one thread per rank of the plan's mesh, each with its
// own Gloo shard group (and replicate group under HSDP) over loopback.
template <typename Fn>
void RunWorld(const v1::ShardingPlan& plan, Fn body) {
  const int dp = plan.mesh().dp_shard();
  const int rep = std::max(1, plan.mesh().dp_replicate());
  static std::atomic<int> generation{0};
  const std::string prefix =
      absl::StrCat("step-executor-test/", generation.fetch_add(1));
  InMemoryKeyValueClient kv;
  std::vector<std::thread> threads;
  for (int g = 0; g < dp * rep; ++g) {
    threads.emplace_back([&, g] {
      const int s = g % dp;
      const int r = g / dp;
      KvGlooStore store(&kv, absl::Seconds(20));
      auto shard =
          GlooCommunicator::Create(&store, absl::StrCat(prefix, "/shard", r), s,
                                   dp, "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(shard.ok()) << shard.status();
      std::unique_ptr<GlooCommunicator> replicas;
      if (rep > 1) {
        auto created = GlooCommunicator::Create(
            &store, absl::StrCat(prefix, "/replica", s), r, rep, "127.0.0.1",
            absl::Seconds(20));
        ASSERT_TRUE(created.ok()) << created.status();
        replicas = std::move(*created);
      }
      // Slice groups for units resharded to fewer ranks after forward.
      std::vector<std::unique_ptr<GlooCommunicator>> slice_comms;
      SliceGroups slices;
      for (const v1::FsdpUnit& unit : plan.units()) {
        const int size = unit.reshard_after_forward().group_size();
        if (size <= 1 || size >= dp || slices.count(size) != 0) continue;
        auto created = GlooCommunicator::Create(
            &store,
            absl::StrCat(prefix, "/slice", r, "/g", size, "/q", s / size),
            s % size, size, "127.0.0.1", absl::Seconds(20));
        ASSERT_TRUE(created.ok()) << created.status();
        slices[size] = created->get();
        slice_comms.push_back(std::move(*created));
      }
      // Expert parallelism: the block's ranks, and the ranks at the same
      // place of every block.
      std::unique_ptr<GlooCommunicator> ep_shard, ep;
      ExpertGroups experts;
      if (plan.mesh().ep() > 1) {
        const int n = plan.mesh().ep();
        const int g = dp / n;
        auto block = GlooCommunicator::Create(
            &store, absl::StrCat(prefix, "/epshard", r, "/b", s / g), s % g, g,
            "127.0.0.1", absl::Seconds(20));
        ASSERT_TRUE(block.ok()) << block.status();
        ep_shard = std::move(*block);
        auto across = GlooCommunicator::Create(
            &store, absl::StrCat(prefix, "/ep", r, "/p", s % g), s / g, n,
            "127.0.0.1", absl::Seconds(20));
        ASSERT_TRUE(across.ok()) << across.status();
        ep = std::move(*across);
        experts = {ep_shard.get(), ep.get()};
      }
      MemoryTracker tracker;
      RankCtx ctx;
      ctx.slices = slices;
      ctx.experts = experts;
      ctx.shard_rank = s;
      ctx.replica_rank = r;
      ctx.data_rank = g;
      ctx.shard = shard->get();
      ctx.replicas = replicas.get();
      ctx.tracker = &tracker;
      body(ctx);
    });
  }
  for (std::thread& t : threads) t.join();
}

data::BatchSampler MakeSampler(const v1::ShardingPlan& plan,
                               int64_t global_batch, int64_t seq = kSeq,
                               const std::string& data_path = "",
                               bool packing = true) {
  data::DataSourceOptions source_options;
  source_options.path = data_path;
  source_options.packing = packing;
  source_options.model_vocab_size = kVocab;
  source_options.seed = kSeed;
  auto source = data::CreateDataSource(source_options);
  EXPECT_TRUE(source.ok()) << source.status();
  data::BatchSamplerOptions options;
  options.global_batch = global_batch;
  options.seq_len = seq;
  options.microbatches = plan.step().microbatches();
  options.ranks =
      plan.mesh().dp_shard() * std::max(1, plan.mesh().dp_replicate());
  options.model_vocab_size = kVocab;
  auto sampler = data::BatchSampler::Create(*source, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  return *std::move(sampler);
}

// As the worker fetches them (WorkerRuntime::FetchBatchesLocked): a masked
// source's batches carry the step's counted targets, unless `drop_counted`
// (the loss then falls back to the mean of the micro-batches' means).
std::vector<data::MicroBatch> BatchesFor(const data::BatchSampler& sampler,
                                         int64_t step, int data_rank,
                                         bool drop_counted = false) {
  std::vector<data::MicroBatch> batches;
  int64_t counted = 0;
  if (sampler.source().masked() && !drop_counted) {
    auto total = sampler.CountedTargets(step);
    EXPECT_TRUE(total.ok()) << total.status();
    counted = total.value_or(0);
  }
  for (int m = 0; m < sampler.options().microbatches; ++m) {
    auto batch = sampler.Get(step, data_rank, m);
    EXPECT_TRUE(batch.ok()) << batch.status();
    batches.push_back(*std::move(batch));
    batches.back().step_counted = counted;
  }
  return batches;
}

// The fine-grained mode: one call per command. With `probe`, first sends
// commands that must be rejected without effect.
absl::StatusOr<StepResult> RunFineGrained(
    StepExecutor* executor, const v1::StepProgram& program,
    const std::vector<data::MicroBatch>& batches, bool probe) {
  v1::StepProgram header = program;
  header.clear_commands();
  if (probe) {
    v1::Command step;
    step.set_op(v1::Command::OPTIMIZER_STEP);
    EXPECT_THAT(executor->ExecuteCommand(step),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("BeginStep")));
  }
  SHARDD_RETURN_IF_ERROR(executor->BeginStep(header, batches));
  if (probe) {
    v1::Command step;
    step.set_op(v1::Command::OPTIMIZER_STEP);
    EXPECT_THAT(executor->ExecuteCommand(step),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("computations have not all run")));
    v1::Command wait;
    wait.set_op(v1::Command::WAIT_UNSHARD);
    wait.set_unit(0);
    EXPECT_THAT(executor->ExecuteCommand(wait),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("no pending prefetched UNSHARD")));
    v1::Command unshard;
    unshard.set_op(v1::Command::UNSHARD);
    unshard.set_unit(999);
    EXPECT_THAT(executor->ExecuteCommand(unshard),
                StatusIs(absl::StatusCode::kNotFound));
    v1::Command forward;
    forward.set_op(v1::Command::OP_UNSPECIFIED);
    EXPECT_THAT(executor->ExecuteCommand(forward),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
  for (const v1::Command& command : program.commands()) {
    SHARDD_RETURN_IF_ERROR(executor->ExecuteCommand(command));
  }
  return executor->EndStep();
}

using ::shardd::testing_util::BoundUse;
using ::shardd::testing_util::MoeStepTolerances;
using ::shardd::testing_util::ParamMap;
using ::shardd::testing_util::StepTolerances;
using ::shardd::testing_util::TrainingState;
using ::shardd::testing_util::TrainingStateMaps;
using ::shardd::testing_util::WriteOwnedState;

// The plan's parameters as this rank holds them (other ranks' rows zero).
void CollectParams(const v1::ShardingPlan& plan, const ShardStore& shards,
                   ParamMap* out) {
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      std::vector<float>& values = (*out)[param.name()];
      values.resize(param.numel(), 0.0f);
      EXPECT_THAT(shards.CopyOwnedParamSlice(param.name(), values.data()),
                  IsOk());
    }
  }
}

// Padding of this rank's shards (from the plan's layout) holds exact zeros
// in the master shard and the AdamW moments.
void ExpectPaddingZero(const v1::ShardingPlan& plan, const ShardStore& shards,
                       int shard_rank) {
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const ShardStore::UnitShard shard = shards.shard(u);
    auto expect_zero = [&](int64_t i) {
      EXPECT_EQ(shard.params[i], 0.0f) << unit.name() << " element " << i;
      EXPECT_EQ(shard.exp_avg[i], 0.0f) << unit.name() << " element " << i;
      EXPECT_EQ(shard.exp_avg_sq[i], 0.0f) << unit.name() << " element " << i;
    };
    if (plan.flat_buckets()) {
      for (int64_t i = 0; i < shard.numel; ++i) {
        if (shard_rank * shard.numel + i >= unit.numel()) expect_zero(i);
      }
      continue;
    }
    for (const v1::ParamLayout& param : unit.params()) {
      const int64_t row_numel = RowNumel(param);
      // An expert-parallel block lists its ep_shard ranks.
      const int64_t valid =
          param.valid_rows(shard_rank % param.valid_rows_size());
      for (int64_t i = param.shard_offset() + valid * row_numel;
           i < param.shard_offset() + param.local_numel(); ++i) {
        expect_zero(i);
      }
    }
  }
}

struct WorldRun {
  // [data rank][step]
  std::vector<std::vector<StepResult>> results;
  // [replica] parameters reassembled from that replica's shard ranks.
  std::vector<ParamMap> initial;
  std::vector<ParamMap> final;
  // [replica][step]: parameters and AdamW moments after each step.
  std::vector<std::vector<TrainingStateMaps>> states;
  // [data rank][step]: with TrainOptions::evaluate, the eval program's
  // result on the step's own batches just before the step.
  std::vector<std::vector<StepResult>> evals;
};

struct TrainOptions {
  // One ExecuteCommand call per command instead of Execute.
  bool fine_grained = false;
  // When set (a one-replica run of the same model and steps): every step
  // s > 0 starts from restart's parameters and AdamW moments after step
  // s - 1 instead of this run's own, so each step is compared from the same
  // state (see the equivalence tests).
  const WorldRun* restart = nullptr;
  // When set: every rank trains on this sampler's data-rank-0 micro-batches
  // instead of its own share of the global batch.
  const data::BatchSampler* shared_data = nullptr;
  int64_t seq = kSeq;  // Tokens per sequence.
  // Before every step: the eval program on that step's batches.
  bool evaluate = false;
  // A data path (an SFT dataset) instead of the Markov source; with
  // `drop_counted` its batches do not carry the step's counted targets.
  std::string data_path;
  bool drop_counted = false;
  bool packing = true;  // An SFT dataset's rows packed (else padded).
};

TrainOptions FineGrained() {
  TrainOptions options;
  options.fine_grained = true;
  return options;
}

// Trains `steps` steps of `plan` on every rank and gathers the results.
WorldRun Train(const v1::ModelSpec& model, const v1::ShardingPlan& plan,
               const StepExecutorOptions& base, int steps, int64_t global_batch,
               const TrainOptions& train = {}) {
  const int dp = plan.mesh().dp_shard();
  const int rep = std::max(1, plan.mesh().dp_replicate());
  absl::StatusOr<v1::StepProgram> compiled = CompileStepProgram(plan);
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  const v1::StepProgram program = compiled.ok() ? *compiled : v1::StepProgram();
  absl::StatusOr<v1::StepProgram> eval_program = CompileEvalProgram(plan);
  EXPECT_TRUE(eval_program.ok()) << eval_program.status();
  const data::BatchSampler sampler =
      MakeSampler(plan, global_batch, train.seq, train.data_path,
                  train.packing);
  WorldRun run;
  run.results.resize(dp * rep);
  run.evals.resize(dp * rep);
  run.initial.resize(rep);
  run.final.resize(rep);
  run.states.assign(rep, std::vector<TrainingStateMaps>(steps));
  absl::Mutex mu;
  RunWorld(plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = base;
    options.shard_rank = ctx.shard_rank;
    options.replica_rank = ctx.replica_rank;
    auto executor =
        StepExecutor::Create(plan, model, options, ctx.shard, ctx.replicas,
                             ctx.tracker, ctx.slices, ctx.experts);
    ASSERT_TRUE(executor.ok()) << executor.status();
    {
      absl::MutexLock lock(&mu);
      CollectParams(plan, (*executor)->shards(),
                    &run.initial[ctx.replica_rank]);
    }
    for (int s = 0; s < steps; ++s) {
      if (train.restart != nullptr && s > 0) {
        WriteOwnedState(plan, train.restart->states[0][s - 1],
                        (*executor)->mutable_shards());
      }
      v1::StepProgram step_program = program;
      step_program.set_step(s);
      const std::vector<data::MicroBatch> batches =
          train.shared_data != nullptr ? BatchesFor(*train.shared_data, s, 0)
                                       : BatchesFor(sampler, s, ctx.data_rank,
                                                    train.drop_counted);
      if (train.evaluate && eval_program.ok()) {
        v1::StepProgram eval = *eval_program;
        eval.set_step(s);
        absl::StatusOr<StepResult> scored = (*executor)->Execute(eval, batches);
        ASSERT_TRUE(scored.ok()) << scored.status();
        run.evals[ctx.data_rank].push_back(*scored);
      }
      absl::StatusOr<StepResult> result =
          train.fine_grained
              ? RunFineGrained(executor->get(), step_program, batches,
                               /*probe=*/s == 0)
              : (*executor)->Execute(step_program, batches);
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->step, s);
      EXPECT_EQ(result->optimizer_steps, s + 1);
      run.results[ctx.data_rank].push_back(*result);
      absl::MutexLock lock(&mu);
      CollectOwnedState(plan, (*executor)->shards(),
                        &run.states[ctx.replica_rank][s]);
    }
    ExpectPaddingZero(plan, (*executor)->shards(), ctx.shard_rank);
    absl::MutexLock lock(&mu);
    CollectParams(plan, (*executor)->shards(), &run.final[ctx.replica_rank]);
  });
  return run;
}

// ---- (1) Measured peak unsharded memory = the plan's prediction -----------

// DiffusionGemma's 3-pass block-diffusion step (tests/data/
// tiny_diffusion_gemma.json with vocab 30 for the sampler and canvas_length
// 4; 10-token sequences: prefix 6, the sliding window of 4 cutting the
// encoder keys): the canvas noise is keyed by the global sequence index,
// so 2 and 4 ranks, under default and diffusion_gemma, must equal one rank
// within rounding.
constexpr int64_t kDiffusionSeq = 10;

v1::ModelSpec TinyDiffusionGemma() {
  return testing_util::TinyDiffusionGemmaSpec();
}

struct MemoryCase {
  std::string strategy;
  int world;
  int microbatches;
  int passes;
  int no_grad_passes;
  bool defer;
  int reshard_group = 0;
  // Tiny DiffusionGemma's 3-pass block-diffusion step instead of TinyMoe.
  bool diffusion = false;
};

class StepExecutorMemoryTest : public ::testing::TestWithParam<MemoryCase> {};

TEST_P(StepExecutorMemoryTest, MeasuredPeakAndCollectivesMatchThePlan) {
  const MemoryCase c = GetParam();
  const v1::ModelSpec model =
      c.diffusion ? TinyDiffusionGemma() : TinyMoe(/*freeze=*/false);
  Shape shape;
  shape.strategy = c.strategy;
  shape.dp_shard = c.world;
  shape.mixed = true;  // bf16 gathers: the bytes differ from fp32's.
  shape.microbatches = c.microbatches;
  shape.passes = c.passes;
  shape.no_grad_passes = c.no_grad_passes;
  shape.defer = c.defer;
  shape.reshard_group = c.reshard_group;
  const v1::ShardingPlan plan = MakePlan(model, shape);
  ASSERT_GT(plan.memory().peak_unsharded_bytes(), 0);
  TrainOptions train;
  if (c.diffusion) train.seq = kDiffusionSeq;
  const WorldRun run = Train(model, plan, BaseOptions(), /*steps=*/2,
                             /*global_batch=*/2 * c.world * c.microbatches,
                             train);
  for (int r = 0; r < c.world; ++r) {
    ASSERT_EQ(run.results[r].size(), 2u);
    for (const StepResult& result : run.results[r]) {
      EXPECT_EQ(result.peak_unsharded_bytes,
                plan.memory().peak_unsharded_bytes())
          << "rank " << r << " step " << result.step;
      const StepCollectives& got = result.collectives;
      EXPECT_EQ(got.all_gathers, plan.comm().all_gathers());
      // Re-gathers from slices really run over the slice groups.
      if (c.reshard_group > 0) {
        EXPECT_GT(got.slice_all_gathers, 0);
      } else {
        EXPECT_EQ(got.slice_all_gathers, 0);
      }
      EXPECT_EQ(got.all_gather_bytes, plan.comm().all_gather_bytes());
      EXPECT_EQ(got.reduce_scatters, plan.comm().reduce_scatters());
      EXPECT_EQ(got.reduce_scatter_bytes, plan.comm().reduce_scatter_bytes());
      EXPECT_EQ(got.replica_all_reduces, 0);
      EXPECT_EQ(got.norm_all_reduces, 1);
      EXPECT_EQ(got.norm_all_reduce_bytes, 4);
      EXPECT_GT(result.peak_activation_bytes, 0);
      EXPECT_GT(result.tokens, 0);
      EXPECT_TRUE(std::isfinite(result.loss));
    }
  }
  const StepResult& r0 = run.results[0][0];
  std::printf(
      "[memory] %-15s ranks=%d M=%d P=%d no_grad=%d defer=%d: peak unsharded "
      "%lld B (plan %lld; params %lld, grads %lld), all-gathers %lld (%lld "
      "B), reduce-scatters %lld (%lld B), activations %lld B, %.1f ms\n",
      c.strategy.c_str(), c.world, c.microbatches, c.passes, c.no_grad_passes,
      c.defer, static_cast<long long>(r0.peak_unsharded_bytes),
      static_cast<long long>(plan.memory().peak_unsharded_bytes()),
      static_cast<long long>(r0.peak_gathered_param_bytes),
      static_cast<long long>(r0.peak_unsharded_grad_bytes),
      static_cast<long long>(r0.collectives.all_gathers),
      static_cast<long long>(r0.collectives.all_gather_bytes),
      static_cast<long long>(r0.collectives.reduce_scatters),
      static_cast<long long>(r0.collectives.reduce_scatter_bytes),
      static_cast<long long>(r0.peak_activation_bytes), r0.seconds * 1e3);
}

std::vector<MemoryCase> MemoryCases() {
  std::vector<MemoryCase> cases;
  for (const char* strategy : {"default", "diffusion_gemma"}) {
    for (int world : {1, 2}) {
      cases.push_back({strategy, world, 1, 1, 0, false});
      cases.push_back({strategy, world, 2, 1, 0, false});
      cases.push_back({strategy, world, 2, 1, 0, true});
      cases.push_back({strategy, world, 1, 2, 1, false});
    }
    // 3 ranks: the 4 experts split by elements (the default placement).
    cases.push_back({strategy, 3, 1, 1, 0, false});
    // Reshard after forward to pairs of ranks: slices kept, re-gathered
    // over the pair; with 2 passes they are gathered again in each pass.
    cases.push_back({strategy, 4, 1, 1, 0, false, 2});
    cases.push_back({strategy, 4, 2, 2, 1, true, 2});
    // DiffusionGemma's step: F0 F1 F2 B2 B0 per micro-batch.
    for (int world : {1, 2, 4}) {
      cases.push_back({strategy, world, 1, 3, 1, false, 0, true});
    }
    cases.push_back({strategy, 2, 2, 3, 1, true, 0, true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, StepExecutorMemoryTest,
                         ::testing::ValuesIn(MemoryCases()),
                         [](const ::testing::TestParamInfo<MemoryCase>& info) {
                           const MemoryCase& c = info.param;
                           std::string name = c.strategy == "default"
                                                  ? "Default"
                                                  : "Diffusion";
                           if (c.diffusion) name += "Gemma";
                           absl::StrAppend(&name, "_W", c.world, "_M",
                                           c.microbatches, "_P", c.passes,
                                           c.defer ? "_Defer" : "");
                           if (c.reshard_group > 0) {
                             absl::StrAppend(&name, "_Slice", c.reshard_group);
                           }
                           return name;
                         });

// ---- (2) Equivalence across world sizes ------------------------------------

constexpr int kSteps = 3;
constexpr int64_t kGlobalBatch = 8;

StepExecutorOptions EquivalenceOptions() {
  StepExecutorOptions options = BaseOptions();
  options.max_grad_norm = 0.05;  // Small enough to clip every step.
  return options;
}

// 1 rank, 1 micro-batch, the default strategy: the unsharded reference.
const WorldRun& Reference() {
  static const WorldRun* run = [] {
    const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
    return new WorldRun(Train(model, MakePlan(model, Shape()),
                              EquivalenceOptions(), kSteps, kGlobalBatch));
  }();
  return *run;
}

using MapSource = ::shardd::testing_util::MapParamSource;

// The same training written without any sharding: whole tensors in maps,
// MoeModel on them, the global norm, clipping and AdamW on every trainable
// tensor. Returns the final parameters and the losses.
// With `restart` (a one-replica run), every step s > 0 starts from
// restart's state after step s - 1, as TrainOptions::restart does.
WorldRun UnshardedTraining(const v1::ModelSpec& spec,
                           const StepExecutorOptions& options, int steps,
                           int64_t global_batch,
                           const WorldRun* restart = nullptr) {
  WorldRun run;
  run.results.resize(1);
  run.states.resize(1);
  MapSource source;
  std::map<std::string, bool> frozen;
  ParamMap exp_avg, exp_avg_sq;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    std::vector<float>& values = source.values[ref.fqn];
    values.resize(Numel(*ref.tensor));
    InitParamRange(kSeed, ref.fqn,
                   InitRuleFor(*ref.tensor, ref.path.back()->kind(), ref.fqn),
                   0, static_cast<int64_t>(values.size()), values.data());
    frozen[ref.fqn] = ref.tensor->frozen();
    exp_avg[ref.fqn].assign(values.size(), 0.0f);
    exp_avg_sq[ref.fqn].assign(values.size(), 0.0f);
  }
  run.initial.push_back(source.values);
  const v1::ShardingPlan plan = MakePlan(spec, Shape());
  absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  EXPECT_TRUE(program.ok()) << program.status();
  const data::BatchSampler sampler = MakeSampler(plan, global_batch);
  absl::StatusOr<std::unique_ptr<MoeModel>> model =
      MoeModel::Create(spec, MoeModelOptions());
  EXPECT_TRUE(model.ok()) << model.status();
  if (!program.ok() || !model.ok()) return run;
  for (int s = 0; s < steps; ++s) {
    if (restart != nullptr && s > 0) {
      const TrainingStateMaps& from = restart->states[0][s - 1];
      source.values = from.params;
      exp_avg = from.exp_avg;
      exp_avg_sq = from.exp_avg_sq;
    }
    (*model)->ResetStep();
    absl::StatusOr<data::MicroBatch> batch = sampler.Get(s, 0, 0);
    EXPECT_TRUE(batch.ok()) << batch.status();
    if (!batch.ok()) return run;
    SHARDD_EXPECT_OK((*model)->SetBatch(0, batch->inputs.data(),
                                        batch->targets.data(), batch->rows,
                                        batch->seq_len));
    source.grads.clear();
    for (const v1::Command& c : program->commands()) {
      if (c.op() == v1::Command::FORWARD || c.op() == v1::Command::BACKWARD) {
        SHARDD_EXPECT_OK((*model)->Run(c, &source));
      }
    }
    StepResult result;
    result.loss = (*model)->step_loss();
    double sum = 0.0;
    for (const auto& [name, g] : source.grads) {
      for (float x : g) sum += static_cast<double>(x) * x;
    }
    result.grad_norm = std::sqrt(sum);
    run.results[0].push_back(result);
    const double clip =
        std::min(1.0, options.max_grad_norm / (result.grad_norm + 1e-6));
    for (auto& [name, values] : source.values) {
      if (frozen.at(name)) continue;
      std::vector<float>& g = source.grads[name];
      g.resize(values.size(), 0.0f);
      for (float& x : g) x *= static_cast<float>(clip);
      SHARDD_EXPECT_OK(kernels::AdamWStep(
          values.data(), g.data(), exp_avg[name].data(),
          exp_avg_sq[name].data(), static_cast<int64_t>(values.size()), s + 1,
          options.adamw));
    }
    run.states[0].push_back({source.values, exp_avg, exp_avg_sq});
  }
  run.final.push_back(source.values);
  return run;
}

// How close a sharded step must come to the one-rank step: the two compute
// the same sums in other orders (each rank's GEMMs over its own tokens, the
// reduce-scatter over the ranks' partial sums, OpenBLAS' blocking from the
// shapes and the CPU's kernel), so they agree within fp32 rounding, whose
// bounds testing/numerics.h derives. Free-running runs cannot be compared
// that way: AdamW divides by sqrt(v) + eps and so amplifies the last-bit
// difference of a gradient near zero into a visible parameter difference,
// which the next steps carry on (measured in docs/testing.md). Each step
// therefore starts from the reference's state (TrainOptions::restart).

StepTolerances Tolerances(int world) {
  return MoeStepTolerances(TinyMoe(/*freeze=*/true).dims(), kGlobalBatch * kSeq,
                           world);
}

TrainingState StateAfter(const WorldRun& run, size_t replica, int step) {
  return run.states[replica][step].view();
}

// The global loss of a step: every rank holds the same number of tokens, so
// it is the mean of the ranks' losses.
// The step's loss as the coordinator reports it: the ranks' losses
// weighted by their counted tokens.
double MeanLoss(const WorldRun& run, int step) {
  double loss = 0.0, weighted = 0.0;
  int64_t tokens = 0;
  for (const auto& rank : run.results) {
    loss += rank[step].loss;
    weighted += rank[step].loss * static_cast<double>(rank[step].tokens);
    tokens += rank[step].tokens;
  }
  return tokens > 0 ? weighted / static_cast<double>(tokens)
                    : loss / run.results.size();
}

// A run from the same state as `ref` at every step (TrainOptions::restart)
// ends every step within rounding of it (ExpectStepWithinRounding), with
// its loss and gradient norm within `tol`.
void ExpectSameStepsAs(const v1::ModelSpec& model, const WorldRun& ref,
                       const WorldRun& run, const StepExecutorOptions& options,
                       const StepTolerances& tol) {
  ASSERT_EQ(ref.states[0].size(), run.states[0].size());
  const int steps = static_cast<int>(ref.states[0].size());
  std::set<std::string> frozen;
  for (const ParamRef& param : ListParams(model)) {
    if (param.tensor->frozen()) frozen.insert(param.fqn);
  }
  ParamMap zeros;
  for (const auto& [name, values] : ref.initial[0]) {
    zeros[name].assign(values.size(), 0.0f);
  }
  BoundUse use;
  for (int s = 0; s < steps; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s));
    use.loss = std::max(
        use.loss, ExpectRelativelyNear(MeanLoss(run, s), ref.results[0][s].loss,
                                       tol.loss));
    for (const auto& rank : run.results) {
      ASSERT_EQ(rank.size(), static_cast<size_t>(steps));
      use.grad_norm =
          std::max(use.grad_norm,
                   ExpectRelativelyNear(rank[s].grad_norm,
                                        ref.results[0][s].grad_norm, tol.grad));
    }
    const TrainingState before =
        s == 0 ? TrainingState{&ref.initial[0], &zeros, &zeros}
               : StateAfter(ref, 0, s - 1);
    for (size_t replica = 0; replica < run.states.size(); ++replica) {
      SCOPED_TRACE(absl::StrCat("replica ", replica));
      if (s == 0) {
        EXPECT_EQ(run.initial[replica], ref.initial[0]);
      }
      ExpectStepWithinRounding(frozen, options.adamw, s, tol, before,
                               StateAfter(ref, 0, s),
                               StateAfter(run, replica, s), &use);
    }
  }
  std::printf("[equivalence] share of each bound used: %s\n",
              use.ToString().c_str());
}

TEST(StepExecutorReferenceTest, ClipsAndFreezes) {
  const WorldRun& ref = Reference();
  ASSERT_EQ(ref.results.size(), 1u);
  ASSERT_EQ(ref.results[0].size(), static_cast<size_t>(kSteps));
  for (const StepResult& r : ref.results[0]) {
    // Clipping engaged: the reported factor is max_norm / (norm + 1e-6).
    EXPECT_GT(r.grad_norm, 0.05);
    EXPECT_NEAR(r.clip_coefficient, 0.05 / (r.grad_norm + 1e-6), 1e-12);
    EXPECT_EQ(r.tokens, kGlobalBatch * kSeq);
  }
  for (const StepResult& r : ref.results[0]) {
    EXPECT_TRUE(std::isfinite(r.loss) && r.loss > 0) << r.loss;
  }
  // Against the same training without sharding or an executor, from the
  // same state at every step. Both run the same kernels on the same shapes
  // and give the same gradients, but the executor rounds the squared norm to
  // fp32 for its all-reduce where this sums in double: the clip coefficient
  // can differ in its last bit (it does on some steps under OpenBLAS'
  // SkylakeX kernels), so the comparison is within rounding, not bitwise.
  const WorldRun unsharded =
      UnshardedTraining(TinyMoe(/*freeze=*/true), EquivalenceOptions(), kSteps,
                        kGlobalBatch, &ref);
  ExpectSameStepsAs(TinyMoe(/*freeze=*/true), ref, unsharded,
                    EquivalenceOptions(), Tolerances(1));
  // The frozen router never moves (no update, no weight decay); the others do.
  EXPECT_EQ(ref.final[0].at(kFrozen), ref.initial[0].at(kFrozen));
  for (const auto& [name, values] : ref.final[0]) {
    if (name == kFrozen) continue;
    EXPECT_NE(values, ref.initial[0].at(name)) << name;
  }
}

struct EquivalenceCase {
  std::string name;
  Shape shape;
};

class StepExecutorEquivalenceTest
    : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(StepExecutorEquivalenceTest, SameStepsAsOneRankWithinRounding) {
  const EquivalenceCase& c = GetParam();
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan plan = MakePlan(model, c.shape);
  // The element placement is really exercised where the name says so.
  const int element_rows = ElementSplitParams(plan);
  if (c.shape.placement == "auto") {
    EXPECT_GT(element_rows, 0);
  } else if (c.shape.placement == "dim0") {
    EXPECT_EQ(element_rows, 0);
  }
  TrainOptions train;
  train.restart = &Reference();
  const WorldRun run =
      Train(model, plan, EquivalenceOptions(), kSteps, kGlobalBatch, train);
  const int world = c.shape.dp_shard * c.shape.dp_replicate;
  ExpectSameStepsAs(model, Reference(), run, EquivalenceOptions(),
                    Tolerances(world));
  // Expert parallelism really exchanged the tokens: per micro-batch and MoE
  // layer a dispatch and a combine forward, their transposes backward.
  int moe_layers = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    moe_layers += unit.kind() == v1::UNIT_EXPERTS ? 1 : 0;
  }
  // Recomputed experts dispatch and combine once more in BACKWARD COMBINE.
  const bool recompute =
      c.shape.checkpointing == "experts" || c.shape.checkpointing == "all";
  for (const auto& rank : run.results) {
    for (const StepResult& r : rank) {
      EXPECT_EQ(r.collectives.all_to_alls,
                c.shape.ep > 1 ? (recompute ? 6 : 4) * moe_layers *
                                     std::max(1, c.shape.microbatches)
                               : 0);
      // The plan counts them when it models the activations (the rows).
      if (plan.has_activations()) {
        EXPECT_EQ(r.collectives.all_to_alls, plan.comm().all_to_alls());
      }
      EXPECT_EQ(r.collectives.all_gathers, plan.comm().all_gathers());
      EXPECT_EQ(r.collectives.reduce_scatters, plan.comm().reduce_scatters());
      EXPECT_EQ(r.collectives.all_gather_bytes,
                plan.comm().all_gather_bytes());
    }
  }
}

std::vector<EquivalenceCase> EquivalenceCases() {
  std::vector<EquivalenceCase> cases;
  for (const char* strategy :
       {"default", "diffusion_gemma", "deepseek_v4", "megatron_fsdp"}) {
    for (int world : {1, 2, 4}) {
      if (world == 1 && std::string(strategy) == "default") continue;
      Shape s;
      s.strategy = strategy;
      s.dp_shard = world;
      cases.push_back({absl::StrCat(strategy, "_W", world), s});
    }
    // HSDP: 2 shard ranks x 2 replicas.
    Shape hsdp;
    hsdp.strategy = strategy;
    hsdp.dp_shard = 2;
    hsdp.dp_replicate = 2;
    cases.push_back({absl::StrCat(strategy, "_hsdp_2x2"), hsdp});
    // FSDP2's reshard_after_forward=2 on 4 ranks: backward re-gathers each
    // layer from the slices over pairs of ranks.
    Shape slices;
    slices.strategy = strategy;
    slices.dp_shard = 4;
    slices.reshard_group = 2;
    cases.push_back({absl::StrCat(strategy, "_W4_slice2"), slices});
  }
  // 8 ranks: the 4 stacked experts do not divide, so the default placement
  // splits them by elements (row_numel 1) and dim0 pads half the ranks.
  for (const char* placement : {"auto", "dim0"}) {
    Shape s;
    s.dp_shard = 8;
    s.placement = placement;
    cases.push_back({absl::StrCat("default_W8_", placement), s});
    Shape own = s;
    own.strategy = "diffusion_gemma";  // The experts are their own unit.
    cases.push_back({absl::StrCat("diffusion_gemma_W8_", placement), own});
  }
  // Expert parallelism: the experts in blocks over 1 or 2 ranks, the
  // routed tokens exchanged; with HSDP, micro-batches and deferred sync.
  for (const char* strategy : {"default", "diffusion_gemma"}) {
    for (const auto& [world, ep] :
         std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {4, 4}}) {
      Shape s;
      s.strategy = strategy;
      s.dp_shard = world;
      s.ep = ep;
      cases.push_back({absl::StrCat(strategy, "_W", world, "_ep", ep), s});
    }
  }
  {
    Shape hsdp;
    hsdp.dp_shard = 2;
    hsdp.dp_replicate = 2;
    hsdp.ep = 2;
    cases.push_back({"default_hsdp_2x2_ep2", hsdp});
    Shape deferred;
    deferred.dp_shard = 4;
    deferred.ep = 2;
    deferred.microbatches = 2;
    deferred.defer = true;
    cases.push_back({"accumulate_deferred_W4_ep2", deferred});
    // Recomputed experts and layers: BACKWARD COMBINE runs the exchanged
    // forward again.
    for (const char* policy : {"experts", "all"}) {
      Shape recompute;
      recompute.dp_shard = 4;
      recompute.ep = 2;
      recompute.micro_batch_size = kGlobalBatch / 4;
      recompute.checkpointing = policy;
      cases.push_back({absl::StrCat("recompute_", policy, "_W4_ep2"),
                       recompute});
    }
  }
  // Gradient accumulation: 2 micro-batches of B/2 equal one batch of B,
  // with and without deferred gradient sync.
  for (bool defer : {false, true}) {
    Shape s;
    s.dp_shard = 2;
    s.microbatches = 2;
    s.defer = defer;
    cases.push_back({defer ? "accumulate_deferred_W2" : "accumulate_W2", s});
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<EquivalenceCase>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Worlds, StepExecutorEquivalenceTest,
                         ::testing::ValuesIn(EquivalenceCases()), CaseName);

// With the same micro-batches on every rank nothing is left to round
// differently: each rank computes the one-rank gradient bit for bit, the
// average of two equal fp32 values is exact ((g + g) / 2 = g), and AdamW is
// elementwise. So 2 shard ranks, and 2 x 2 HSDP, must reproduce a one-rank
// run bit for bit over several free-running steps: this pins the optimizer,
// its moments and the shard bookkeeping exactly, where the test above can
// only bound them. (4 ranks would sum g + g + g + g, and 3g rounds.)
// Clipping is off: the global norm is summed per shard, which rounds.
class StepExecutorIdenticalDataTest
    : public ::testing::TestWithParam<EquivalenceCase> {};

// Two shards of identical data against one rank, bit for bit (see above).
void ExpectBitwiseEqualToOneRank(const v1::ModelSpec& model, const Shape& shape,
                                 StepExecutorOptions options = BaseOptions()) {
  options.max_grad_norm = 0.0;
  Shape one = shape;
  one.dp_shard = 1;
  one.dp_replicate = 1;
  const v1::ShardingPlan one_plan = MakePlan(model, one);
  const data::BatchSampler data = MakeSampler(one_plan, kGlobalBatch / 2);
  TrainOptions train;
  train.shared_data = &data;
  const WorldRun ref =
      Train(model, one_plan, options, kSteps, kGlobalBatch, train);
  const WorldRun run = Train(model, MakePlan(model, shape), options, kSteps,
                             kGlobalBatch, train);
  for (size_t r = 0; r < run.results.size(); ++r) {
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(run.results[r][s].loss, ref.results[0][s].loss)
          << "rank " << r << " step " << s;
    }
  }
  for (size_t replica = 0; replica < run.states.size(); ++replica) {
    for (int s = 0; s < kSteps; ++s) {
      SCOPED_TRACE(absl::StrCat("replica ", replica, " step ", s));
      const TrainingStateMaps& got = run.states[replica][s];
      const TrainingStateMaps& want = ref.states[0][s];
      EXPECT_EQ(got.params, want.params);
      EXPECT_EQ(got.exp_avg, want.exp_avg);
      EXPECT_EQ(got.exp_avg_sq, want.exp_avg_sq);
    }
  }
}

TEST_P(StepExecutorIdenticalDataTest, BitwiseEqualToOneRank) {
  ExpectBitwiseEqualToOneRank(TinyMoe(/*freeze=*/true), GetParam().shape);
}

// The same with attention layers (Qwen3 style: GQA, q/k norms, RoPE, one
// sliding-window layer) in every decoder unit.
TEST(StepExecutorAttentionTest, ShardedBitwiseEqualToOneRank) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.freeze_router0 = true;
  shape.attention = true;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 4;
  shape.qk_norm = true;
  shape.sliding_layers = {false, true};
  shape.window = 3;
  Shape sharded;
  sharded.dp_shard = 2;
  ExpectBitwiseEqualToOneRank(testing_util::TinyMoeSpec(shape), sharded);
  sharded.strategy = "megatron_fsdp";
  ExpectBitwiseEqualToOneRank(testing_util::TinyMoeSpec(shape), sharded);
}

// Muon through the whole step (gradients, the optimizer's all-gather on
// the communication queue, Newton-Schulz per matrix and per expert): 2 shard
// ranks and 2 x 2 HSDP on identical data equal one rank bit for bit, as
// AdamW does above. (3 ranks with uneven rows: muon_optimizer_test, where
// the gradients are the same bits at every world size.)
TEST(StepExecutorMuonTest, ShardedBitwiseEqualToOneRank) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = kExperts;
  shape.inter = kInter;
  shape.mlp = kMlp;
  shape.freeze_router0 = true;
  shape.attention = true;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 4;
  StepExecutorOptions options = BaseOptions();
  options.optimizer.name = kMuonOptimizer;
  options.optimizer.muon.lr = 0.02;
  Shape sharded;
  sharded.dp_shard = 2;
  ExpectBitwiseEqualToOneRank(testing_util::TinyMoeSpec(shape), sharded,
                              options);
  sharded.dp_replicate = 2;
  ExpectBitwiseEqualToOneRank(testing_util::TinyMoeSpec(shape), sharded,
                              options);
}

TEST(StepExecutorMuonTest, MuonDiffersFromAdamWAndFlatRangesAreRefused) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  StepExecutorOptions muon = BaseOptions();
  muon.optimizer.name = kMuonOptimizer;
  const v1::ShardingPlan plan = MakePlan(model, Shape());
  const WorldRun adamw_run = Train(model, plan, BaseOptions(), 1, kGlobalBatch);
  const WorldRun muon_run = Train(model, plan, muon, 1, kGlobalBatch);
  // The expert matrices take Muon's step; the embedding AdamW's either way.
  const std::string experts = "model.layers.1.moe.experts.down_projs";
  EXPECT_NE(muon_run.final[0].at(experts), adamw_run.final[0].at(experts));
  EXPECT_EQ(muon_run.final[0].at("model.embed_tokens.weight"),
            adamw_run.final[0].at("model.embed_tokens.weight"));

  Shape flat;
  flat.strategy = "megatron_fsdp";
  flat.dp_shard = 2;
  const v1::ShardingPlan flat_plan = MakePlan(model, flat);
  RunWorld(flat_plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = muon;
    options.shard_rank = ctx.shard_rank;
    EXPECT_THAT(StepExecutor::Create(flat_plan, model, options, ctx.shard,
                                     ctx.replicas, ctx.tracker, ctx.slices)
                    .status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("optimizer muon: unit ")));
  });
}

std::vector<EquivalenceCase> IdenticalDataCases() {
  std::vector<EquivalenceCase> cases;
  for (const EquivalenceCase& c : EquivalenceCases()) {
    // Expert parallelism sums both ranks' rows in one GEMM, which rounds
    // unlike g + g.
    if (c.shape.dp_shard == 2 && c.shape.ep <= 1) cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Worlds, StepExecutorIdenticalDataTest,
                         ::testing::ValuesIn(IdenticalDataCases()), CaseName);

// ---- Activations: measured = planned, recompute changes no bit -------------

// The shipped tiny configs of every architecture the CPU path trains, plus
// the attention-free tiny MoE. Their vocabularies hold the sampler's.
v1::ModelSpec TinyHf(const std::string& name) {
  std::ifstream in(absl::StrCat("tests/data/", name, ".json"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(text.str());
  EXPECT_TRUE(spec.ok()) << name << ": " << spec.status();
  return spec.ok() ? *spec : v1::ModelSpec();
}

struct ActivationCase {
  std::string model;  // tests/data/<model>.json, or "tiny_moe_native".
  std::string strategy = "default";
  int world = 1;
  int microbatches = 1;
  int passes = 1;
  int no_grad_passes = 0;
};

class StepExecutorActivationTest
    : public ::testing::TestWithParam<ActivationCase> {};

// Every rank's measured peak of gathered parameters, unsharded gradients
// and activations (the CPU model's buffers, MemoryKind::kActivations) is
// the plan's peak_step_bytes, and its activations' own peak the plan's,
// for each checkpointing policy; and recomputing changes no loss,
// parameter or moment bit (the recomputed forward is the same arithmetic
// on the same inputs). An evaluation before every step holds what the
// eval program's ledger says and leaves nothing behind. Mutation checks:
// dropping the router's row scratch from the planner's count fails both
// DeepSeek-V3 cases; dropping the self-conditioning probabilities fails
// both block-diffusion cases.
TEST_P(StepExecutorActivationTest, MeasuredEqualsPlannedAndRecomputeIsExact) {
  const ActivationCase c = GetParam();
  const v1::ModelSpec model =
      c.model == "tiny_moe_native"        ? TinyMoe(/*freeze=*/true)
             : c.model == "tiny_diffusion_gemma" ? TinyDiffusionGemma()
                                          : TinyHf(c.model);
  const bool gemma = c.model == "tiny_diffusion_gemma";
  constexpr int kBatchPerRank = 2;
  const int64_t global_batch =
      int64_t{kBatchPerRank} * c.world * c.microbatches;
  StepExecutorOptions options = BaseOptions();
  std::map<std::string, WorldRun> runs;
  std::map<std::string, int64_t> planned_peaks;
  for (const char* policy : {"none", "all", "experts", "every:2"}) {
    SCOPED_TRACE(policy);
    Shape shape;
    shape.strategy = c.strategy;
    shape.dp_shard = c.world;
    shape.microbatches = c.microbatches;
    shape.passes = c.passes;
    shape.no_grad_passes = c.no_grad_passes;
    shape.micro_batch_size = kBatchPerRank;
    shape.checkpointing = policy;
    const v1::ShardingPlan plan = MakePlan(model, shape);
    ASSERT_TRUE(plan.has_activations());
    const v1::MemoryReport& memory = plan.memory();
    ASSERT_GT(memory.peak_activation_bytes(), 0);
    ASSERT_GT(memory.peak_step_bytes(), memory.peak_unsharded_bytes());
    EXPECT_EQ(memory.peak_total_bytes(),
              memory.persistent_bytes() + memory.peak_step_bytes());
    planned_peaks[policy] = memory.peak_activation_bytes();
    absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
    ASSERT_TRUE(program.ok()) << program.status();
    absl::StatusOr<std::vector<ActivationPoint>> planned =
        ReplayActivations(plan, *program);
    ASSERT_TRUE(planned.ok()) << planned.status();
    EXPECT_EQ(plan.activations().block_diffusion(), gemma && c.passes == 3);
    absl::StatusOr<v1::StepProgram> eval_program = CompileEvalProgram(plan);
    ASSERT_TRUE(eval_program.ok()) << eval_program.status();
    absl::StatusOr<std::vector<ActivationPoint>> planned_eval =
        ReplayActivations(plan, *eval_program);
    ASSERT_TRUE(planned_eval.ok()) << planned_eval.status();
    // An evaluation before each step: it holds what the plan says, and
    // leaves nothing behind (the step's trace starts from zero again).
    TrainOptions train;
    train.evaluate = true;
    const WorldRun run =
        Train(model, plan, options, /*steps=*/2, global_batch, train);
    for (size_t r = 0; r < run.evals.size(); ++r) {
      for (const StepResult& eval : run.evals[r]) {
        ASSERT_EQ(eval.activation_trace.size(), planned_eval->size());
        for (size_t i = 0; i < planned_eval->size(); ++i) {
          EXPECT_EQ(eval.activation_trace[i], (*planned_eval)[i])
              << "eval computation " << i << " rank " << r;
        }
        EXPECT_EQ(eval.activation_trace.back().after, 0);
      }
    }
    for (size_t r = 0; r < run.results.size(); ++r) {
      ASSERT_EQ(run.results[r].size(), 2u);
      for (const StepResult& result : run.results[r]) {
        SCOPED_TRACE(absl::StrCat("rank ", r, " step ", result.step));
        // Command by command, during and after.
        ASSERT_EQ(result.activation_trace.size(), planned->size());
        for (size_t i = 0; i < planned->size(); ++i) {
          EXPECT_EQ(result.activation_trace[i].during, (*planned)[i].during)
              << "computation " << i;
          EXPECT_EQ(result.activation_trace[i].after, (*planned)[i].after)
              << "computation " << i;
        }
        EXPECT_EQ(result.peak_activation_bytes, memory.peak_activation_bytes());
        EXPECT_EQ(result.peak_unsharded_bytes, memory.peak_unsharded_bytes());
        // Parameters, gradients and activations together.
        EXPECT_EQ(result.peak_step_bytes, memory.peak_step_bytes())
            << "plan's peak " << memory.peak_step_where();
        EXPECT_LE(memory.peak_step_bytes(), memory.peak_unsharded_bytes() +
                                                memory.peak_activation_bytes());
      }
    }
    runs.emplace(policy, run);
  }
  // Recomputing layers holds fewer activations than keeping them.
  EXPECT_LT(planned_peaks["all"], planned_peaks["none"]);
  EXPECT_LE(planned_peaks["every:2"], planned_peaks["none"]);
  const WorldRun& base = runs.at("none");
  for (const auto& [policy, run] : runs) {
    SCOPED_TRACE(policy);
    for (size_t r = 0; r < run.results.size(); ++r) {
      for (int s = 0; s < 2; ++s) {
        EXPECT_EQ(run.results[r][s].loss, base.results[r][s].loss);
        EXPECT_EQ(run.results[r][s].grad_norm, base.results[r][s].grad_norm);
      }
    }
    for (size_t replica = 0; replica < run.states.size(); ++replica) {
      EXPECT_EQ(run.states[replica][1].params, base.states[replica][1].params);
      EXPECT_EQ(run.states[replica][1].exp_avg,
                base.states[replica][1].exp_avg);
    }
  }
}

std::vector<ActivationCase> ActivationCases() {
  std::vector<ActivationCase> cases;
  for (const char* model :
       {"tiny_moe_native", "tiny_llama3", "tiny_mixtral", "tiny_qwen3_moe",
        "tiny_qwen3_moe_aux", "tiny_deepseek_v3", "tiny_gpt_oss",
        "tiny_gpt_oss_aux"}) {
    cases.push_back({model});
  }
  // Sharded, micro-batches, a pass without gradients, other strategies.
  cases.push_back({"tiny_qwen3_moe_aux", "default", 2, 2});
  cases.push_back({"tiny_deepseek_v3", "default", 2, 1, 2, 1});
  cases.push_back({"tiny_gpt_oss", "megatron_fsdp", 2});
  cases.push_back({"tiny_mixtral", "diffusion_gemma", 3, 2});
  // DiffusionGemma: the causal pass, and the block-diffusion step (encode,
  // self-conditioning decode, decode; the encode's K/V live until its
  // backward) under both strategies, with micro-batches.
  cases.push_back({"tiny_diffusion_gemma"});
  cases.push_back({"tiny_diffusion_gemma", "default", 1, 1, 3, 1});
  cases.push_back({"tiny_diffusion_gemma", "diffusion_gemma", 2, 2, 3, 1});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Models, StepExecutorActivationTest, ::testing::ValuesIn(ActivationCases()),
    [](const ::testing::TestParamInfo<ActivationCase>& info) {
      const ActivationCase& c = info.param;
      std::string name = absl::StrCat(c.model, "_", c.strategy, "_w", c.world,
                                      "_m", c.microbatches, "_p", c.passes);
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

// ---- The load-balancing loss across world sizes -----------------------------

// Hugging Face's loss is that of one process on the whole micro-batch:
// CE + c * aux, where aux's expert counts and probability sums run over
// every token of every MoE layer. aux is not a mean over tokens, so the
// ranks' own values do not average to it; CpuBackend sums the statistics
// over the shard group and the replicas after FORWARD(HEAD), and every
// rank's loss and gradient must then equal the one-rank run's within
// rounding. c = 0.5 makes the aux term (about c * top_k = 1) a third of
// the loss and a large share of the routers' gradients.
constexpr double kAuxCoef = 0.5;

v1::ModelSpec TinyMoeAux() {
  v1::ModelSpec spec = TinyMoe(/*freeze=*/false);
  spec.mutable_dims()->set_router_aux_loss_coef(kAuxCoef);
  return spec;
}

// The one-rank run with `microbatches` micro-batches (each with its own
// statistics, as Hugging Face computes the loss per forward).
const WorldRun& AuxReference(int microbatches) {
  static auto* runs = new std::map<int, WorldRun>();
  auto it = runs->find(microbatches);
  if (it == runs->end()) {
    Shape one;
    one.microbatches = microbatches;
    const v1::ModelSpec model = TinyMoeAux();
    it = runs->emplace(microbatches,
                       Train(model, MakePlan(model, one), EquivalenceOptions(),
                             kSteps, kGlobalBatch))
             .first;
  }
  return it->second;
}

TEST(StepExecutorAuxLossTest, OneRankIsTheUnshardedModelAndTheTermCounts) {
  const WorldRun& ref = AuxReference(1);
  const WorldRun unsharded = UnshardedTraining(
      TinyMoeAux(), EquivalenceOptions(), kSteps, kGlobalBatch, &ref);
  ExpectSameStepsAs(TinyMoeAux(), ref, unsharded, EquivalenceOptions(),
                    MoeStepTolerances(TinyMoeAux().dims(), kGlobalBatch * kSeq,
                                      1));
  // The same steps without the term: the first step's loss is lower by
  // c * aux, aux = E sum_e F_e P_e, which is top_k = 2 when the choices
  // are balanced (F_e = top_k / E, sum_e P_e = 1) and near it at random
  // initial weights.
  const v1::ModelSpec plain = TinyMoe(/*freeze=*/false);
  const WorldRun without =
      Train(plain, MakePlan(plain, Shape()), EquivalenceOptions(), 1,
            kGlobalBatch);
  const double aux =
      (ref.results[0][0].loss - without.results[0][0].loss) / kAuxCoef;
  EXPECT_GT(aux, 1.5);
  EXPECT_LT(aux, 2.5);
  std::printf("[aux] step-0 loss %.6f = CE %.6f + %.2f * aux %.6f\n",
              ref.results[0][0].loss, without.results[0][0].loss, kAuxCoef,
              aux);
}

class StepExecutorAuxLossTest
    : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(StepExecutorAuxLossTest, SameStepsAsOneProcessWithinRounding) {
  const EquivalenceCase& c = GetParam();
  const v1::ModelSpec model = TinyMoeAux();
  TrainOptions train;
  train.restart = &AuxReference(c.shape.microbatches);
  const WorldRun run = Train(model, MakePlan(model, c.shape),
                             EquivalenceOptions(), kSteps, kGlobalBatch, train);
  const int world = c.shape.dp_shard * c.shape.dp_replicate;
  ExpectSameStepsAs(model, AuxReference(c.shape.microbatches), run,
                    EquivalenceOptions(),
                    MoeStepTolerances(model.dims(), kGlobalBatch * kSeq, world));
}

std::vector<EquivalenceCase> AuxLossCases() {
  std::vector<EquivalenceCase> cases;
  for (int world : {2, 4}) {
    Shape s;
    s.dp_shard = world;
    cases.push_back({absl::StrCat("default_W", world), s});
  }
  Shape megatron;
  megatron.strategy = "megatron_fsdp";
  megatron.dp_shard = 4;
  cases.push_back({"megatron_fsdp_W4", megatron});
  Shape hsdp;
  hsdp.dp_shard = 2;
  hsdp.dp_replicate = 2;
  cases.push_back({"hsdp_2x2", hsdp});
  // Two micro-batches, each with its own statistics, against one rank
  // running the same two.
  Shape accumulate;
  accumulate.dp_shard = 2;
  accumulate.microbatches = 2;
  cases.push_back({"accumulate_W2", accumulate});
  // Expert parallelism: the statistics are the router's, over every rank's
  // tokens (the all-reduce of the shard group), wherever the experts run.
  for (const auto& [world, ep] :
       std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {4, 4}}) {
    Shape s;
    s.dp_shard = world;
    s.ep = ep;
    cases.push_back({absl::StrCat("default_W", world, "_ep", ep), s});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Worlds, StepExecutorAuxLossTest,
                         ::testing::ValuesIn(AuxLossCases()), CaseName);

// The 1, 2 and 4 rank runs of tiny DiffusionGemma's 3-pass step (above)
// must equal one rank within rounding.
Shape DiffusionShape(const std::string& strategy, int world) {
  Shape s;
  s.strategy = strategy;
  s.dp_shard = world;
  s.passes = 3;
  s.no_grad_passes = 1;
  return s;
}

TrainOptions DiffusionTrain() {
  TrainOptions train;
  train.seq = kDiffusionSeq;
  return train;
}

const WorldRun& DiffusionReference() {
  static const WorldRun* run = [] {
    const v1::ModelSpec model = TinyDiffusionGemma();
    return new WorldRun(Train(model, MakePlan(model, DiffusionShape("default", 1)),
                              EquivalenceOptions(), kSteps, kGlobalBatch,
                              DiffusionTrain()));
  }();
  return *run;
}

class StepExecutorDiffusionTest
    : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(StepExecutorDiffusionTest, SameStepsAsOneRankWithinRounding) {
  const EquivalenceCase& c = GetParam();
  const v1::ModelSpec model = TinyDiffusionGemma();
  TrainOptions train = DiffusionTrain();
  train.restart = &DiffusionReference();
  const WorldRun run = Train(model, MakePlan(model, c.shape),
                             EquivalenceOptions(), kSteps, kGlobalBatch, train);
  // Tokens through the step: the encode's sequence and the decode's canvas.
  const int64_t tokens = kGlobalBatch * (kDiffusionSeq + 4);
  ExpectSameStepsAs(model, DiffusionReference(), run, EquivalenceOptions(),
                    MoeStepTolerances(model.dims(), tokens, c.shape.dp_shard));
  // Under expert parallelism every pass exchanged each MoE layer's rows:
  // dispatch and combine forward, their transposes in the passes with
  // gradients.
  const v1::ShardingPlan plan = MakePlan(model, c.shape);
  int moe_layers = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    moe_layers += unit.kind() == v1::UNIT_EXPERTS ? 1 : 0;
  }
  const int passes = c.shape.passes, grad_passes = passes - c.shape.no_grad_passes;
  for (const auto& rank : run.results) {
    for (const StepResult& r : rank) {
      EXPECT_EQ(r.collectives.all_to_alls,
                c.shape.ep > 1 ? moe_layers * (2 * passes + 2 * grad_passes)
                               : 0);
      // The plan counts them when it models the activations (the rows).
      if (plan.has_activations()) {
        EXPECT_EQ(r.collectives.all_to_alls, plan.comm().all_to_alls());
      }
    }
  }
}

std::vector<EquivalenceCase> DiffusionCases() {
  std::vector<EquivalenceCase> cases;
  for (const char* strategy : {"default", "diffusion_gemma"}) {
    for (int world : {1, 2, 4}) {
      if (world == 1 && std::string(strategy) == "default") continue;
      cases.push_back({absl::StrCat(strategy, "_W", world),
                       DiffusionShape(strategy, world)});
    }
  }
  // Expert parallelism inside the Gemma layers' EXPERTS.
  for (const char* strategy : {"default", "diffusion_gemma"}) {
    for (const auto& [world, ep] :
         std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {4, 4}}) {
      Shape s = DiffusionShape(strategy, world);
      s.ep = ep;
      cases.push_back({absl::StrCat(strategy, "_W", world, "_ep", ep), s});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Worlds, StepExecutorDiffusionTest,
                         ::testing::ValuesIn(DiffusionCases()), CaseName);

// ---- SFT data: a loss mask and the global batch's token mean ---------------

// 40 examples of 3 to 9 tokens (kSeq 8 holds 9) with random masks, so the
// ranks and micro-batches of a step count different numbers of targets
// (from none to all). The loss is the mean over the global batch's
// counted tokens: 2 and 4 ranks, with and without micro-batches and
// deferred sync, packed (the default) and padded, must equal one rank
// within rounding. The mean of per-micro-batch means (drop_counted) does
// not, which the last case checks on padded rows (where the counts differ
// most) so the test can fail.
std::string SftDataDir() {
  static const std::string* dir = [] {
    auto* d = new std::string(::testing::TempDir() + "/executor_sft");
    const std::string mk = "rm -rf '" + *d + "' && mkdir -p '" + *d + "'";
    EXPECT_EQ(std::system(mk.c_str()), 0);
    std::mt19937 gen(11);
    std::vector<testing_util::SftExample> examples;
    for (int e = 0; e < 40; ++e) {
      testing_util::SftExample x;
      const int n = 3 + static_cast<int>(gen() % 7);
      for (int j = 0; j < n; ++j) {
        x.tokens.push_back(static_cast<int32_t>(1 + gen() % (kVocab - 1)));
        // A prompt of a few tokens, then a response counted in the loss.
        x.mask.push_back(j >= n / 2 || (e % 5 == 0));
      }
      x.line = e + 1;
      examples.push_back(std::move(x));
    }
    testing_util::WriteSftDataset(*d, examples, kVocab);
    return d;
  }();
  return *dir;
}

TrainOptions SftTrain() {
  TrainOptions train;
  train.data_path = SftDataDir();
  return train;
}

const WorldRun& SftReference() {
  static const WorldRun* run = [] {
    const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
    return new WorldRun(Train(model, MakePlan(model, Shape()),
                              EquivalenceOptions(), kSteps, kGlobalBatch,
                              SftTrain()));
  }();
  return *run;
}

TEST(StepExecutorSftTest, GlobalTokenMeanAtEveryWorldAndMicroBatching) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const WorldRun& ref = SftReference();
  // The mask really varies the counts: every step counts fewer targets
  // than it has rows x seq.
  for (const StepResult& r : ref.results[0]) {
    EXPECT_LT(r.tokens, kGlobalBatch * kSeq);
    EXPECT_GT(r.tokens, 0);
  }
  struct Case {
    int world;
    int microbatches;
    bool defer;
  };
  for (const Case& c : std::vector<Case>{
           {2, 1, false}, {4, 1, false}, {2, 2, false}, {2, 2, true}}) {
    SCOPED_TRACE(absl::StrCat("world ", c.world, " micro-batches ",
                              c.microbatches, c.defer ? " deferred" : ""));
    Shape shape;
    shape.dp_shard = c.world;
    shape.microbatches = c.microbatches;
    shape.defer = c.defer;
    TrainOptions train = SftTrain();
    train.restart = &ref;
    const WorldRun run = Train(model, MakePlan(model, shape),
                               EquivalenceOptions(), kSteps, kGlobalBatch,
                               train);
    ExpectSameStepsAs(model, ref, run, EquivalenceOptions(),
                      MoeStepTolerances(model.dims(), kGlobalBatch * kSeq,
                                        c.world));
  }
  // Padded rows: 4 ranks equal one; without the global count each rank
  // averages its own tokens and the gradient differs from the global
  // mean's far beyond rounding.
  TrainOptions padded = SftTrain();
  padded.packing = false;
  const WorldRun one = Train(model, MakePlan(model, Shape()),
                             EquivalenceOptions(), 1, kGlobalBatch, padded);
  Shape four;
  four.dp_shard = 4;
  const StepTolerances tol =
      MoeStepTolerances(model.dims(), kGlobalBatch * kSeq, 4);
  const WorldRun right = Train(model, MakePlan(model, four),
                               EquivalenceOptions(), 1, kGlobalBatch, padded);
  padded.drop_counted = true;
  const WorldRun wrong = Train(model, MakePlan(model, four),
                               EquivalenceOptions(), 1, kGlobalBatch, padded);
  const double want = one.results[0][0].grad_norm;
  const double norm = wrong.results[0][0].grad_norm;
  EXPECT_LE(std::abs(right.results[0][0].grad_norm - want) / want, tol.grad);
  EXPECT_GT(std::abs(norm - want) / want, 10 * tol.grad)
      << norm << " vs " << want;
}

// ---- Evaluation: forward-only programs -------------------------------------

// An eval program run before each step, on that step's batches, scores
// exactly the loss the step then reports (the same forward on the same
// parameters, the cross-entropy of the same code: bit for bit), and leaves
// no trace: the training run with evaluations equals the one without bit for
// bit (a gradient, moment or parameter it touched would show), and its
// measured peak is the eval program's replayed one.
struct EvalCase {
  std::string name;
  Shape shape;
  bool diffusion = false;
  bool sft = false;  // The SFT dataset: masked, packed rows.
};

class StepExecutorEvalTest : public ::testing::TestWithParam<EvalCase> {};

TEST_P(StepExecutorEvalTest, ScoresTheStepLossAndChangesNothing) {
  const EvalCase& c = GetParam();
  const v1::ModelSpec model =
      c.diffusion ? TinyDiffusionGemma() : TinyMoe(/*freeze=*/true);
  const v1::ShardingPlan plan = MakePlan(model, c.shape);
  TrainOptions train;
  if (c.diffusion) train.seq = kDiffusionSeq;
  if (c.sft) train.data_path = SftDataDir();
  const WorldRun plain =
      Train(model, plan, EquivalenceOptions(), kSteps, kGlobalBatch, train);
  train.evaluate = true;
  const WorldRun evaluated =
      Train(model, plan, EquivalenceOptions(), kSteps, kGlobalBatch, train);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram eval,
                              CompileEvalProgram(plan));
  v1::MemoryReport eval_memory;
  v1::CommReport eval_comm;
  SHARDD_ASSERT_OK(
      ReplayStepProgram(plan, eval, false, &eval_memory, &eval_comm));
  ASSERT_GT(eval_memory.peak_unsharded_bytes(), 0);
  EXPECT_LE(eval_memory.peak_unsharded_bytes(),
            plan.memory().peak_unsharded_bytes());
  const int world = c.shape.dp_shard * c.shape.dp_replicate;
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(plain.results[r].size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(evaluated.results[r].size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(evaluated.evals[r].size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      SCOPED_TRACE(absl::StrCat("rank ", r, " step ", s));
      const StepResult& want = plain.results[r][s];
      const StepResult& trained = evaluated.results[r][s];
      const StepResult& scored = evaluated.evals[r][s];
      EXPECT_EQ(trained.loss, want.loss);
      EXPECT_EQ(trained.grad_norm, want.grad_norm);
      EXPECT_FALSE(trained.eval);
      EXPECT_TRUE(scored.eval);
      EXPECT_EQ(scored.loss, want.loss);
      EXPECT_EQ(scored.tokens, want.tokens);
      EXPECT_EQ(scored.optimizer_steps, s);
      EXPECT_EQ(scored.grad_norm, 0.0);
      EXPECT_EQ(scored.peak_unsharded_bytes,
                eval_memory.peak_unsharded_bytes());
      EXPECT_EQ(scored.peak_unsharded_grad_bytes, 0);
      EXPECT_EQ(scored.collectives.all_gathers, eval_comm.all_gathers());
      EXPECT_EQ(scored.collectives.reduce_scatters, 0);
      EXPECT_EQ(scored.collectives.norm_all_reduces, 0);
    }
  }
  for (int rep = 0; rep < c.shape.dp_replicate; ++rep) {
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(evaluated.states[rep][s].params, plain.states[rep][s].params);
      EXPECT_EQ(evaluated.states[rep][s].exp_avg, plain.states[rep][s].exp_avg);
      EXPECT_EQ(evaluated.states[rep][s].exp_avg_sq,
                plain.states[rep][s].exp_avg_sq);
    }
  }
}

std::vector<EvalCase> EvalCases() {
  std::vector<EvalCase> cases;
  auto add = [&](const std::string& name, Shape s, bool diffusion = false,
                 bool sft = false) {
    cases.push_back({name, s, diffusion, sft});
  };
  Shape s;
  add("default_W1", s);
  for (const char* strategy : {"default", "megatron_fsdp", "diffusion_gemma"}) {
    s = Shape();
    s.strategy = strategy;
    s.dp_shard = 2;
    add(absl::StrCat(strategy, "_W2"), s);
  }
  s = Shape();
  s.dp_shard = 2;
  s.dp_replicate = 2;
  add("hsdp_2x2", s);
  s = Shape();
  s.dp_shard = 4;
  s.reshard_group = 2;  // Slices kept after forward in training only.
  add("W4_slice2", s);
  s = Shape();
  s.dp_shard = 2;
  s.mixed = true;
  s.microbatches = 2;
  s.defer = true;
  add("mixed_accumulate_W2", s);
  // Masked rows: each rank scores its own token mean over its micro-batches,
  // as the training step reports it.
  s = Shape();
  s.dp_shard = 2;
  s.microbatches = 2;
  add("sft_accumulate_W2", s, false, /*sft=*/true);
  s = Shape();
  s.passes = 2;
  s.no_grad_passes = 1;
  add("two_passes_W1", s);
  add("gemma_default_W1", DiffusionShape("default", 1), true);
  add("gemma_diffusion_gemma_W2", DiffusionShape("diffusion_gemma", 2), true);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, StepExecutorEvalTest,
                         ::testing::ValuesIn(EvalCases()),
                         [](const ::testing::TestParamInfo<EvalCase>& info) {
                           return info.param.name;
                         });

// ---- (3) Fine-grained mode = whole programs --------------------------------

TEST(StepExecutorFineGrainedTest, OneCallPerCommandGivesIdenticalResults) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  Shape shape;
  shape.strategy = "diffusion_gemma";
  shape.dp_shard = 2;
  shape.microbatches = 2;
  shape.passes = 2;
  shape.no_grad_passes = 1;
  shape.defer = true;
  const v1::ShardingPlan plan = MakePlan(model, shape);
  const StepExecutorOptions options = EquivalenceOptions();
  const WorldRun whole = Train(model, plan, options, 2, kGlobalBatch);
  const WorldRun fine =
      Train(model, plan, options, 2, kGlobalBatch, FineGrained());
  ASSERT_EQ(whole.results.size(), fine.results.size());
  for (size_t r = 0; r < whole.results.size(); ++r) {
    ASSERT_EQ(whole.results[r].size(), fine.results[r].size());
    for (size_t s = 0; s < whole.results[r].size(); ++s) {
      const StepResult& a = whole.results[r][s];
      const StepResult& b = fine.results[r][s];
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_EQ(a.grad_norm, b.grad_norm);
      EXPECT_EQ(a.tokens, b.tokens);
      EXPECT_EQ(a.commands, b.commands);
      EXPECT_EQ(a.peak_unsharded_bytes, b.peak_unsharded_bytes);
      EXPECT_EQ(a.peak_unsharded_bytes, plan.memory().peak_unsharded_bytes());
      EXPECT_EQ(a.collectives.all_gathers, b.collectives.all_gathers);
      EXPECT_EQ(a.collectives.reduce_scatters, b.collectives.reduce_scatters);
    }
  }
  EXPECT_EQ(whole.final, fine.final);  // Bitwise.
}

// ---- (4) Stale plans and malformed programs --------------------------------

TEST(StepExecutorValidationTest, RefusesStalePlansAndBadProgramsWithoutEffect) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = MakePlan(model, Shape());
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  const data::BatchSampler sampler = MakeSampler(plan, 2);
  RunWorld(plan, [&](const RankCtx& ctx) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> executor,
        StepExecutor::Create(plan, model, BaseOptions(), ctx.shard, nullptr,
                             ctx.tracker));
    const std::vector<data::MicroBatch> batches = BatchesFor(sampler, 0, 0);

    v1::StepProgram stale = program;
    stale.set_plan_fingerprint(plan.fingerprint() + 1);
    EXPECT_THAT(executor->Execute(stale, batches),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("stale plan")));
    EXPECT_THAT(executor->BeginStep(stale, batches),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("stale plan")));

    v1::StepProgram truncated = program;
    truncated.mutable_commands()->RemoveLast();  // No OPTIMIZER_STEP.
    EXPECT_THAT(executor->Execute(truncated, batches),
                StatusIs(absl::StatusCode::kInvalidArgument));

    EXPECT_THAT(
        executor->Execute(program, {}),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batches")));
    std::vector<data::MicroBatch> bad = batches;
    bad[0].inputs[3] = static_cast<int32_t>(kVocab);
    EXPECT_THAT(
        executor->Execute(program, bad),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batches[0]")));
    bad = batches;
    bad[0].targets.pop_back();
    EXPECT_THAT(
        executor->Execute(program, bad),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batches[0]")));

    // A step that ends early is aborted; one that never started anything
    // leaves the executor usable.
    EXPECT_THAT(executor->EndStep(),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    SHARDD_EXPECT_OK(executor->BeginStep(program, batches));
    EXPECT_THAT(executor->Execute(program, batches),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("in progress")));
    EXPECT_THAT(executor->EndStep(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("before OPTIMIZER_STEP")));

    // Nothing above changed the shards or the step count.
    EXPECT_EQ(executor->optimizer_steps(), 0);
    SHARDD_EXPECT_OK(executor->health());
    SHARDD_ASSERT_OK_AND_ASSIGN(const StepResult result,
                                executor->Execute(program, batches));
    EXPECT_EQ(result.optimizer_steps, 1);
    EXPECT_EQ(result.commands, program.commands_size());
  });
}

TEST(StepExecutorValidationTest, NonFiniteGradientNormSkipsTheUpdate) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  const v1::ShardingPlan plan = MakePlan(model, Shape());
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  const data::BatchSampler sampler = MakeSampler(plan, 2);
  RunWorld(plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = BaseOptions();
    // Absurd steps blow the parameters up until the loss overflows.
    options.adamw.lr = 1e30;
    options.adamw.weight_decay = 0.0;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> executor,
        StepExecutor::Create(plan, model, options, ctx.shard, nullptr,
                             ctx.tracker));
    absl::Status failure;
    int s = 0;
    for (; s < 10 && failure.ok(); ++s) {
      std::vector<float> before;
      for (int u = 0; u < plan.units_size(); ++u) {
        const ShardStore::UnitShard shard = executor->shards().shard(u);
        before.insert(before.end(), shard.params, shard.params + shard.numel);
      }
      v1::StepProgram step = program;
      step.set_step(s);
      absl::StatusOr<StepResult> result =
          executor->Execute(step, BatchesFor(sampler, s, 0));
      if (result.ok()) continue;
      failure = result.status();
      std::vector<float> after;
      for (int u = 0; u < plan.units_size(); ++u) {
        const ShardStore::UnitShard shard = executor->shards().shard(u);
        after.insert(after.end(), shard.params, shard.params + shard.numel);
      }
      EXPECT_EQ(before, after);
    }
    ASSERT_THAT(failure,
                StatusIs(absl::StatusCode::kInternal, HasSubstr("not finite")));
    EXPECT_EQ(executor->optimizer_steps(), s - 1);
    // All ranks skipped the same step: the executor stays usable.
    SHARDD_EXPECT_OK(executor->health());
  });
}

TEST(StepExecutorValidationTest, CreateChecksItsArguments) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  Shape two;
  two.dp_shard = 2;
  const v1::ShardingPlan plan = MakePlan(model, two);
  RunWorld(MakePlan(model, Shape()), [&](const RankCtx& ctx) {
    // A one-rank group for a two-rank plan.
    EXPECT_THAT(
        StepExecutor::Create(plan, model, BaseOptions(), ctx.shard, nullptr,
                             ctx.tracker),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_group")));
    StepExecutorOptions options = BaseOptions();
    options.adamw.beta1 = 1.5;
    EXPECT_THAT(
        StepExecutor::Create(MakePlan(model, Shape()), model, options,
                             ctx.shard, nullptr, ctx.tracker),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("adamw")));
    options = BaseOptions();
    options.max_grad_norm = -1;
    EXPECT_THAT(StepExecutor::Create(MakePlan(model, Shape()), model, options,
                                     ctx.shard, nullptr, ctx.tracker),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("max_grad_norm")));
  });
}

// ---- (5) A rank that stops taking part -------------------------------------

struct FaultCase {
  v1::Command::Op stop_before;
};

class StepExecutorFaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(StepExecutorFaultTest, PeersFailWithinTheTimeoutAndCommitNothing) {
  const v1::Command::Op stop_before = GetParam().stop_before;
  const v1::ModelSpec model = TinyMoe(/*freeze=*/false);
  Shape shape;
  shape.dp_shard = 2;
  const v1::ShardingPlan plan = MakePlan(model, shape);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  int stop = 0;
  while (program.commands(stop).op() != stop_before) ++stop;
  const data::BatchSampler sampler = MakeSampler(plan, 4);
  const absl::Duration timeout = absl::Seconds(1);
  absl::Notification peer_done;
  RunWorld(plan, [&](const RankCtx& ctx) {
    StepExecutorOptions options = BaseOptions();
    options.shard_rank = ctx.shard_rank;
    options.collective_timeout = timeout;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<StepExecutor> executor,
        StepExecutor::Create(plan, model, options, ctx.shard, nullptr,
                             ctx.tracker));
    // One good step, so the optimizer state is not trivially zero.
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const StepResult first,
        executor->Execute(program, BatchesFor(sampler, 0, ctx.data_rank)));
    EXPECT_EQ(first.optimizer_steps, 1);
    v1::StepProgram second = program;
    second.set_step(1);
    const std::vector<data::MicroBatch> batches =
        BatchesFor(sampler, 1, ctx.data_rank);

    if (ctx.shard_rank == 1) {
      // Runs the commands before `stop`, then goes silent while staying
      // connected: its peer can only notice through the timeout.
      v1::StepProgram header = second;
      header.clear_commands();
      SHARDD_ASSERT_OK(executor->BeginStep(header, batches));
      for (int i = 0; i < stop; ++i) {
        SHARDD_ASSERT_OK(executor->ExecuteCommand(second.commands(i)));
      }
      peer_done.WaitForNotificationWithTimeout(absl::Seconds(30));
      return;
    }

    std::vector<std::vector<float>> before;
    for (int u = 0; u < plan.units_size(); ++u) {
      const ShardStore::UnitShard s = executor->shards().shard(u);
      for (const float* p : {s.params, s.exp_avg, s.exp_avg_sq}) {
        before.emplace_back(p, p + s.numel);
      }
    }
    const absl::Time start = absl::Now();
    const absl::StatusOr<StepResult> result =
        executor->Execute(second, batches);
    const absl::Duration elapsed = absl::Now() - start;
    peer_done.Notify();
    const std::string op = v1::Command::Op_Name(stop_before);
    EXPECT_THAT(result,
                StatusIs(absl::StatusCode::kAborted, HasSubstr("commands[")));
    EXPECT_THAT(result.status().message(), HasSubstr(op));
    EXPECT_THAT(result.status().message(), HasSubstr("DEADLINE_EXCEEDED"));
    EXPECT_LT(elapsed, 2 * timeout);
    std::printf("[fault] stop before %s: peer failed after %.2f s: %s\n",
                op.c_str(), absl::ToDoubleSeconds(elapsed),
                result.status().ToString().c_str());

    // Nothing was committed, and the executor refuses further steps.
    EXPECT_EQ(executor->optimizer_steps(), 1);
    std::vector<std::vector<float>> after;
    for (int u = 0; u < plan.units_size(); ++u) {
      const ShardStore::UnitShard s = executor->shards().shard(u);
      for (const float* p : {s.params, s.exp_avg, s.exp_avg_sq}) {
        after.emplace_back(p, p + s.numel);
      }
    }
    EXPECT_EQ(before, after);
    EXPECT_THAT(executor->health(),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    v1::StepProgram third = program;
    third.set_step(2);
    EXPECT_THAT(
        executor->Execute(third, batches),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unusable")));
  });
}

INSTANTIATE_TEST_SUITE_P(
    StopPoints, StepExecutorFaultTest,
    ::testing::Values(FaultCase{v1::Command::REDUCE_SCATTER},
                      FaultCase{v1::Command::OPTIMIZER_STEP}),
    [](const ::testing::TestParamInfo<FaultCase>& info) {
      return v1::Command::Op_Name(info.param.stop_before);
    });

}  // namespace
}  // namespace shardd

namespace shardd {
namespace {

// ---- Mixed precision ------------------------------------------------------
// bf16 gathers round each master element on its own, so the compute weights
// do not depend on the layout: from the same state, a sharded bf16 step must
// equal a one-rank bf16 step within the fp32 bounds (only the fp32 reduction
// order differs). Against fp32, the loss moves by at most the first-order
// effect of rounding every weight to bf16 (derived in the test).
// keep_compute_shard changes where the bf16 bytes of an unshard come from
// (a copy the optimizer refreshes instead of a cast at every unshard), not
// what they are: losses, gradient norms and parameters are bitwise equal,
// and the copies cost exactly the planned persistent bytes.
TEST(StepExecutorMixedPrecisionTest, KeepingComputeShardsChangesNoBit) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  for (const char* strategy : {"default", "megatron_fsdp"}) {
    SCOPED_TRACE(strategy);
    Shape cast;
    cast.mixed = true;
    cast.dp_shard = 2;
    cast.strategy = strategy;
    Shape keep = cast;
    keep.keep_compute_shard = true;
    const v1::ShardingPlan cast_plan = MakePlan(model, cast);
    const v1::ShardingPlan keep_plan = MakePlan(model, keep);
    EXPECT_EQ(cast_plan.memory().compute_shard_bytes(), 0);
    EXPECT_EQ(keep_plan.memory().compute_shard_bytes(),
              keep_plan.memory().sharded_param_bytes() / 2);
    EXPECT_EQ(keep_plan.memory().persistent_bytes(),
              cast_plan.memory().persistent_bytes() +
                  keep_plan.memory().compute_shard_bytes());
    EXPECT_NE(keep_plan.fingerprint(), cast_plan.fingerprint());
    const WorldRun a =
        Train(model, cast_plan, EquivalenceOptions(), kSteps, kGlobalBatch);
    const WorldRun b =
        Train(model, keep_plan, EquivalenceOptions(), kSteps, kGlobalBatch);
    for (size_t r = 0; r < a.results.size(); ++r) {
      for (int s = 0; s < kSteps; ++s) {
        EXPECT_EQ(a.results[r][s].loss, b.results[r][s].loss) << "step " << s;
        EXPECT_EQ(a.results[r][s].grad_norm, b.results[r][s].grad_norm);
      }
    }
    EXPECT_EQ(a.final[0], b.final[0]);
  }
}

TEST(StepExecutorMixedPrecisionTest, ShardedBf16EqualsOneRankBf16NearFp32) {
  const v1::ModelSpec model = TinyMoe(/*freeze=*/true);
  Shape one;
  one.mixed = true;
  one.dp_shard = 1;
  const WorldRun single = Train(model, MakePlan(model, one),
                                EquivalenceOptions(), kSteps, kGlobalBatch);
  // Against fp32, from the fp32 reference's state at every step. bf16
  // compute rounds each weight once, w -> w (1 + d) with |d| <= 2^-8 (bf16
  // keeps 8 significant bits), so to first order the loss moves by
  // sum_i d_i w_i dL/dw_i: at most 2^-8 sum_i |w_i dL/dw_i|, with dL/dw the
  // unclipped gradient (the reference's first moment / ((1 - beta1) clip)).
  // Second-order terms are 2^-8 times smaller; fp32's own rounding is
  // tol.loss.
  const WorldRun& fp32 = Reference();
  TrainOptions from_fp32;
  from_fp32.restart = &fp32;
  const WorldRun bf16 = Train(model, MakePlan(model, one), EquivalenceOptions(),
                              kSteps, kGlobalBatch, from_fp32);
  const StepTolerances tol = Tolerances(1);
  const kernels::AdamWConfig& adamw = EquivalenceOptions().adamw;
  for (int s = 0; s < kSteps; ++s) {
    const ParamMap& w = s == 0 ? fp32.initial[0] : fp32.states[0][s - 1].params;
    double first_order = 0.0;
    for (const auto& [name, m] : fp32.states[0][s].exp_avg) {
      const std::vector<float>* m_prev =
          s == 0 ? nullptr : &fp32.states[0][s - 1].exp_avg.at(name);
      for (size_t i = 0; i < m.size(); ++i) {
        const double g =
            (m[i] - (m_prev ? adamw.beta1 * (*m_prev)[i] : 0.0)) /
            ((1 - adamw.beta1) * fp32.results[0][s].clip_coefficient);
        first_order += std::fabs(w.at(name)[i] * g);
      }
    }
    const double want = fp32.results[0][s].loss;
    const double allowed = 0x1p-8 * first_order + tol.loss * want;
    EXPECT_NEAR(bf16.results[0][s].loss, want, allowed) << "step " << s;
    std::printf(
        "[bf16] step %d: |loss - fp32 loss| %.3e, %.2e of the bound %.3e\n", s,
        std::fabs(bf16.results[0][s].loss - want),
        std::fabs(bf16.results[0][s].loss - want) / allowed, allowed);
  }
  for (const char* strategy : {"default", "diffusion_gemma"}) {
    SCOPED_TRACE(strategy);
    Shape two;
    two.mixed = true;
    two.dp_shard = 2;
    two.strategy = strategy;
    TrainOptions train;
    train.restart = &single;
    const WorldRun run =
        Train(model, MakePlan(model, two), EquivalenceOptions(), kSteps,
              kGlobalBatch, train);
    ExpectSameStepsAs(model, single, run, EquivalenceOptions(), Tolerances(2));
  }
}

}  // namespace
}  // namespace shardd
