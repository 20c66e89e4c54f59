#include "worker/worker_runtime.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/plan_index.h"
#include "common/error_info.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "testing/model_builder.h"
#include "testing/numerics.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/shards/shard_checkpoint.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 32, kDim = 16, kExperts = 4, kInter = 8;
constexpr int64_t kSeq = 8;
constexpr int64_t kGlobalBatch = 8;

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;

// Embedding, 2 MoE layers (RMSNorm, router, 4 experts top-2 SwiGLU), final
// norm, head tied to the embedding.
v1::ModelSpec TinyMoe(int64_t vocab = kVocab) {
  v1::ModelSpec spec;
  spec.set_architecture("ShardMoEForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_top_k(2);
  dims->set_activation(v1::SWIGLU);
  dims->set_rms_norm_eps(1e-6);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  AddParam(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
           {vocab, kDim});
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  for (int i = 0; i < 2; ++i) {
    v1::ModuleSpec* layer =
        AddChild(layers, std::to_string(i), v1::MODULE_DECODER_LAYER);
    AddParam(AddChild(layer, "input_layernorm", v1::MODULE_NORM), "weight",
             {kDim});
    v1::ModuleSpec* moe = AddChild(layer, "moe", v1::MODULE_MOE);
    AddParam(AddChild(moe, "gate", v1::MODULE_ROUTER), "weight",
             {kExperts, kDim});
    v1::ModuleSpec* experts =
        AddChild(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
    AddParam(experts, "gate_and_up_projs", {kExperts, kDim, 2 * kInter});
    AddParam(experts, "down_projs", {kExperts, kInter, kDim});
  }
  AddParam(AddChild(model, "norm", v1::MODULE_NORM), "weight", {kDim});
  v1::TensorSpec* head = AddParam(AddChild(root, "lm_head", v1::MODULE_LM_HEAD),
                                  "weight", {vocab, kDim});
  head->set_tied_to("model.embed_tokens.weight");
  return spec;
}

v1::ShardingPlan MakePlan(const v1::ModelSpec& model, int dp_shard,
                          int dp_replicate, int microbatches = 1,
                          bool defer = false) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy("default");
  options.mutable_mesh()->set_dp_shard(dp_shard);
  options.mutable_mesh()->set_dp_replicate(dp_replicate);
  options.set_mixed_precision(false);
  options.set_microbatches(microbatches);
  options.set_defer_grad_sync(defer);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

v1::LoadPlanRequest MakeLoad(const v1::ShardingPlan& plan,
                             const v1::ModelSpec& model, int rank,
                             uint64_t epoch = 1) {
  v1::LoadPlanRequest request;
  *request.mutable_plan() = plan;
  *request.mutable_model() = model;
  request.set_rank(rank);
  request.set_seed(11);
  request.set_job_id("job");
  request.set_membership_epoch(epoch);
  request.set_collective_timeout_ms(20000);
  v1::TrainConfig* train = request.mutable_train();
  train->set_global_batch(kGlobalBatch);
  train->set_seq_len(kSeq);
  train->set_seed(3);
  return request;
}

// Runs fn(rank) on `world` threads and joins them.
void RunRanks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (std::thread& t : threads) t.join();
}

struct RankSteps {
  v1::LoadPlanResponse load;
  std::vector<v1::ExecuteResponse> steps;
};

// Loads `plan` on `world` runtimes sharing one KV store and runs `steps`
// Execute steps on each.
std::vector<RankSteps> Train(const v1::ModelSpec& model,
                             const v1::ShardingPlan& plan, int steps) {
  const int world = plan.world_size();
  const absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  EXPECT_THAT(program.status(), IsOk());
  if (!program.ok()) return {};
  InMemoryKeyValueClient kv;
  std::vector<RankSteps> out(world);
  RunRanks(world, [&](int rank) {
    WorkerRuntime runtime;
    absl::StatusOr<v1::LoadPlanResponse> load =
        runtime.LoadPlan(MakeLoad(plan, model, rank), &kv);
    ASSERT_THAT(load.status(), IsOk());
    out[rank].load = *load;
    for (int s = 0; s < steps; ++s) {
      v1::ExecuteRequest request;
      *request.mutable_program() = *program;
      request.mutable_program()->set_step(s);
      absl::StatusOr<v1::ExecuteResponse> response = runtime.Execute(request);
      ASSERT_THAT(response.status(), IsOk())
          << "rank " << rank << " step " << s;
      out[rank].steps.push_back(*response);
    }
  });
  return out;
}

double MeanLoss(const std::vector<RankSteps>& ranks, int step) {
  double sum = 0;
  for (const RankSteps& r : ranks) sum += r.steps[step].loss();
  return sum / ranks.size();
}

int64_t ShardBytes(const v1::ShardingPlan& plan) {
  int64_t elements = 0;
  for (const v1::FsdpUnit& unit : plan.units()) elements += unit.shard_numel();
  return elements * 4;  // fp32 master shards.
}

TEST(WorkerRuntimeTest, ModelVocabSizeComesFromTheEmbedding) {
  SHARDD_ASSERT_OK_AND_ASSIGN(int64_t vocab, ModelVocabSize(TinyMoe(40)));
  EXPECT_EQ(vocab, 40);
}

TEST(WorkerRuntimeTest, WeightsRootConfinesInitFrom) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string base = absl::StrCat(tmp != nullptr ? tmp : "/tmp",
                                        "/weights_root");
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base + "/root/model");
  std::filesystem::create_directories(base + "/elsewhere");
  std::filesystem::create_directory_symlink(base + "/elsewhere",
                                            base + "/root/link");
  const std::string root = base + "/root";
  SHARDD_EXPECT_OK(CheckUnderRoot(root, root + "/model", "f"));
  SHARDD_EXPECT_OK(CheckUnderRoot(root, root, "f"));
  SHARDD_EXPECT_OK(CheckUnderRoot(root + "/", root + "/model/missing", "f"));
  for (const std::string& outside :
       {base + "/elsewhere", root + "/../elsewhere", root + "/link",
        root + "/link/x", base + "/rootx", std::string("/etc")}) {
    EXPECT_THAT(CheckUnderRoot(root, outside, "train.init_from"),
                StatusIs(absl::StatusCode::kPermissionDenied,
                         HasSubstr("train.init_from")))
        << outside;
  }
}

TEST(WorkerRuntimeTest, OneAndTwoRanksAndHsdpTrainTheSameModel) {
  const v1::ModelSpec model = TinyMoe();
  constexpr int kSteps = 3;
  const v1::ShardingPlan plan1 = MakePlan(model, 1, 1);
  const v1::ShardingPlan plan2 = MakePlan(model, 2, 1);
  const v1::ShardingPlan plan4 = MakePlan(model, 2, 2);  // HSDP 2 x 2.
  const std::vector<RankSteps> one = Train(model, plan1, kSteps);
  const std::vector<RankSteps> two = Train(model, plan2, kSteps);
  const std::vector<RankSteps> four = Train(model, plan4, kSteps);
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(two.size(), 2u);
  ASSERT_EQ(four.size(), 4u);
  for (const auto* ranks : {&one, &two, &four}) {
    for (const RankSteps& r : *ranks) ASSERT_EQ(r.steps.size(), kSteps);
  }

  // The Markov chain's entropy rate is positive and below log V (uniform
  // next-token distribution), the same on every rank.
  const double entropy = one[0].load.data_entropy_rate();
  EXPECT_GT(entropy, 0.0);
  EXPECT_LT(entropy, std::log(static_cast<double>(kVocab)));
  EXPECT_EQ(one[0].load.shard_bytes(), ShardBytes(plan1));
  for (const RankSteps& r : two) {
    EXPECT_EQ(r.load.shard_bytes(), ShardBytes(plan2));
    EXPECT_EQ(r.load.data_entropy_rate(), entropy);
  }
  // 1 rank holds everything; 2 shard ranks about half each (padding aside).
  EXPECT_LT(ShardBytes(plan2), ShardBytes(plan1));

  // The runs are free-running, so the bounds are those of
  // testing/numerics.h for that case: the first step starts from the same
  // parameters (loss and gradient norm within one step's rounding); later
  // losses within the drift that rounding can cause through AdamW
  // (FreeRunningLossTolerance). step_executor_test compares every step from
  // a shared state.
  v1::ModelDims dims;
  dims.set_vocab_size(kVocab);
  dims.set_hidden_size(kDim);
  dims.set_num_layers(2);
  dims.set_num_experts(kExperts);
  dims.set_top_k(2);
  dims.set_moe_intermediate_size(kInter);
  const testing_util::StepTolerances tol =
      testing_util::MoeStepTolerances(dims, kGlobalBatch * kSeq, 4);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::TrainConfig train,
      ResolveTrainConfig(MakeLoad(plan1, model, 0).train(), 1, 1));
  const kernels::AdamWConfig adamw = AdamWConfigOf(train);
  for (int s = 0; s < kSteps; ++s) {
    const double reference = one[0].steps[s].loss();
    ASSERT_TRUE(std::isfinite(reference));
    // The global loss is the mean of the ranks' means: every rank trains on
    // global_batch / world rows of seq_len targets.
    const double allowed = testing_util::FreeRunningLossTolerance(
        s, reference, adamw, train.grad_clip(), tol);
    EXPECT_NEAR(MeanLoss(two, s), reference, allowed) << "step " << s;
    EXPECT_NEAR(MeanLoss(four, s), reference, allowed) << "step " << s;
    const double norm = one[0].steps[s].grad_norm();
    for (const auto* ranks : {&two, &four}) {
      const int world = static_cast<int>(ranks->size());
      for (const RankSteps& r : *ranks) {
        const v1::ExecuteResponse& step = r.steps[s];
        EXPECT_EQ(step.tokens(), kGlobalBatch / world * kSeq);
        EXPECT_EQ(step.step(), s + 1);
        // Every rank of a world reports the one all-reduced norm.
        EXPECT_EQ(step.grad_norm(), ranks->front().steps[s].grad_norm());
        if (s == 0) {
          EXPECT_NEAR(step.grad_norm(), norm, tol.grad * norm);
        }
      }
    }
    EXPECT_EQ(one[0].steps[s].tokens(), kGlobalBatch * kSeq);
  }
  // Two ranks see different sequences, so their own losses differ.
  EXPECT_NE(two[0].steps[0].loss(), two[1].steps[0].loss());

  // Measured peaks and collectives are the plan's predictions.
  for (const auto& [ranks, plan] :
       {std::make_pair(&two, &plan2), std::make_pair(&four, &plan4)}) {
    for (const RankSteps& r : *ranks) {
      for (const v1::ExecuteResponse& step : r.steps) {
        EXPECT_EQ(step.peak_unsharded_bytes(),
                  plan->memory().peak_unsharded_bytes());
        EXPECT_EQ(step.all_gathers(), plan->comm().all_gathers());
        EXPECT_EQ(step.reduce_scatters(), plan->comm().reduce_scatters());
        EXPECT_EQ(step.all_reduces(), plan->comm().all_reduces());
        EXPECT_EQ(step.all_gather_bytes(), plan->comm().all_gather_bytes());
      }
    }
  }
  EXPECT_GT(plan4.comm().all_reduces(), 0);
  EXPECT_EQ(plan2.comm().all_reduces(), 0);
}

TEST(WorkerRuntimeTest, FineGrainedCommandsEqualExecute) {
  const v1::ModelSpec model = TinyMoe();
  // Two micro-batches with deferred sync: the longest command sequence.
  const v1::ShardingPlan plan = MakePlan(model, 2, 1, 2, /*defer=*/true);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  constexpr int kSteps = 2;
  const std::vector<RankSteps> whole = Train(model, plan, kSteps);
  ASSERT_EQ(whole.size(), 2u);

  InMemoryKeyValueClient kv;
  std::vector<std::vector<v1::ExecuteResponse>> fine(2);
  RunRanks(2, [&](int rank) {
    WorkerRuntime runtime;
    ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, rank), &kv).status(),
                IsOk());
    const int n = program.commands_size();
    for (int s = 0; s < kSteps; ++s) {
      v1::RunCommandRequest request;
      request.set_plan_fingerprint(plan.fingerprint());
      request.set_step(s);
      v1::ExecuteResponse last;
      if (rank == 0) {
        // One request per command, begin and end on their own.
        request.set_begin_step(true);
        ASSERT_THAT(runtime.RunCommand(request).status(), IsOk());
        request.set_begin_step(false);
        for (int i = 0; i < n; ++i) {
          *request.mutable_command() = program.commands(i);
          request.set_index(i);
          ASSERT_THAT(runtime.RunCommand(request).status(), IsOk())
              << "command " << i;
        }
        request.clear_command();
        request.set_end_step(true);
        SHARDD_ASSERT_OK_AND_ASSIGN(last, runtime.RunCommand(request));
      } else {
        // begin_step with the first command, end_step with the last.
        for (int i = 0; i < n; ++i) {
          request.set_begin_step(i == 0);
          request.set_end_step(i == n - 1);
          *request.mutable_command() = program.commands(i);
          request.set_index(i);
          SHARDD_ASSERT_OK_AND_ASSIGN(last, runtime.RunCommand(request));
        }
      }
      fine[rank].push_back(last);
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(fine[rank].size(), kSteps);
    for (int s = 0; s < kSteps; ++s) {
      const v1::ExecuteResponse& a = whole[rank].steps[s];
      const v1::ExecuteResponse& b = fine[rank][s];
      // The same code path on the same data: bit-identical.
      EXPECT_EQ(a.loss(), b.loss()) << "rank " << rank << " step " << s;
      EXPECT_EQ(a.grad_norm(), b.grad_norm());
      EXPECT_EQ(a.tokens(), b.tokens());
      EXPECT_EQ(b.step(), s + 1);
      EXPECT_EQ(a.all_gathers(), b.all_gathers());
      EXPECT_EQ(a.reduce_scatters(), b.reduce_scatters());
      EXPECT_EQ(a.peak_unsharded_bytes(), b.peak_unsharded_bytes());
    }
  }
}

TEST(WorkerRuntimeTest, RefusesStepsWithoutAPlanOrOnAStalePlan) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  WorkerRuntime runtime;
  v1::ExecuteRequest execute;
  *execute.mutable_program() = program;
  EXPECT_THAT(runtime.Execute(execute).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no plan loaded: call LoadPlan first")));
  v1::RunCommandRequest command;
  command.set_plan_fingerprint(plan.fingerprint());
  command.set_begin_step(true);
  EXPECT_THAT(runtime.RunCommand(command).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no plan loaded")));
  EXPECT_FALSE(runtime.has_plan());

  // World size 1 needs no rendezvous store.
  ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  EXPECT_EQ(runtime.plan_fingerprint(), plan.fingerprint());
  execute.mutable_program()->set_plan_fingerprint(plan.fingerprint() + 1);
  EXPECT_THAT(runtime.Execute(execute).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("stale plan"),
                             HasSubstr(absl::StrCat("worker holds fingerprint ",
                                                    plan.fingerprint())),
                             HasSubstr(absl::StrCat("program names ",
                                                    plan.fingerprint() + 1)))));
  command.set_plan_fingerprint(plan.fingerprint() + 1);
  EXPECT_THAT(
      runtime.RunCommand(command).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale plan")));

  // Fine-grained order checks.
  command.set_plan_fingerprint(plan.fingerprint());
  command.set_begin_step(false);
  *command.mutable_command() = program.commands(0);
  EXPECT_THAT(
      runtime.RunCommand(command).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("begin_step")));
  command.set_begin_step(true);
  command.set_index(1);
  EXPECT_THAT(runtime.RunCommand(command).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("out of program order")));
  // The step opened by that request stays open: Execute is refused, the
  // right index goes on.
  execute.mutable_program()->set_plan_fingerprint(plan.fingerprint());
  EXPECT_THAT(runtime.Execute(execute).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  command.set_begin_step(false);
  command.set_index(0);
  EXPECT_THAT(runtime.RunCommand(command).status(), IsOk());
  command.set_step(5);
  command.set_index(1);
  EXPECT_THAT(runtime.RunCommand(command).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not the open step")));
}

TEST(WorkerRuntimeTest, LoadPlanRejectsBadRequestsAndKeepsTheCurrentJob) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan1 = MakePlan(model, 1, 1);
  const v1::ShardingPlan plan2 = MakePlan(model, 2, 1);
  WorkerRuntime runtime;
  ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan1, model, 0), nullptr).status(),
              IsOk());

  v1::LoadPlanRequest bad = MakeLoad(plan2, model, 0);
  bad.mutable_train()->set_global_batch(6);  // 6 % (2 x 4) != 0.
  bad.mutable_train()->set_microbatches(4);
  EXPECT_THAT(
      runtime.LoadPlan(bad, nullptr).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("microbatches")));
  bad = MakeLoad(plan2, model, 0);
  bad.mutable_train()->set_global_batch(7);
  InMemoryKeyValueClient kv;
  EXPECT_THAT(
      runtime.LoadPlan(bad, &kv).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("global_batch"), HasSubstr("world size (2)"),
                     HasSubstr("microbatches (1)"))));
  bad = MakeLoad(plan2, model, 0);
  bad.mutable_train()->set_seq_len(0);
  EXPECT_THAT(
      runtime.LoadPlan(bad, &kv).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seq_len")));
  EXPECT_THAT(runtime.LoadPlan(MakeLoad(plan2, model, 2), &kv).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("rank"), HasSubstr("[0, 2)"))));
  EXPECT_THAT(runtime.LoadPlan(MakeLoad(plan2, model, 1), nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--coordinator")));
  // A plan cut from another model.
  EXPECT_THAT(
      runtime.LoadPlan(MakeLoad(plan1, TinyMoe(40), 0), nullptr).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("model.embed_tokens.weight")));
  bad = MakeLoad(plan1, model, 0);
  bad.set_job_id("");
  EXPECT_THAT(
      runtime.LoadPlan(bad, nullptr).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  bad = MakeLoad(plan1, model, 0);
  bad.mutable_train()->set_data_path("/nonexistent/tokens.u16");
  EXPECT_FALSE(runtime.LoadPlan(bad, nullptr).ok());
  // None of them touched the loaded job, and nothing went to the store.
  EXPECT_EQ(runtime.plan_fingerprint(), plan1.fingerprint());
  EXPECT_EQ(kv.set_calls(), 0);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan1));
  v1::ExecuteRequest execute;
  *execute.mutable_program() = program;
  EXPECT_THAT(runtime.Execute(execute).status(), IsOk());
}

// A LoadPlan without the plan, with the options it was planned with: the
// worker plans the model itself and trains exactly as with the plan sent;
// a fingerprint it does not reproduce is refused with the reason that makes
// the coordinator send the plan.
TEST(WorkerRuntimeTest, DerivesThePlanFromItsOptions) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  v1::PlanOptions options;
  options.set_strategy("default");
  options.mutable_mesh()->set_dp_shard(1);
  options.mutable_mesh()->set_dp_replicate(1);
  options.set_mixed_precision(false);
  options.set_microbatches(1);
  options.set_defer_grad_sync(false);
  v1::LoadPlanRequest derived = MakeLoad(plan, model, 0);
  derived.clear_plan();
  *derived.mutable_plan_options() = options;
  derived.set_plan_fingerprint(plan.fingerprint());
  derived.set_model_id("m-derived");

  WorkerRuntime sent_runtime;
  WorkerRuntime derived_runtime;
  SHARDD_ASSERT_OK(
      sent_runtime.LoadPlan(MakeLoad(plan, model, 0), nullptr).status());
  SHARDD_ASSERT_OK(derived_runtime.LoadPlan(derived, nullptr).status());
  EXPECT_EQ(derived_runtime.plan_fingerprint(), plan.fingerprint());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  for (int s = 0; s < 2; ++s) {
    v1::ExecuteRequest execute;
    *execute.mutable_program() = program;
    execute.mutable_program()->set_step(s);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ExecuteResponse a,
                                sent_runtime.Execute(execute));
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ExecuteResponse b,
                                derived_runtime.Execute(execute));
    EXPECT_EQ(a.loss(), b.loss()) << "step " << s;
    EXPECT_EQ(a.grad_norm(), b.grad_norm()) << "step " << s;
  }

  WorkerRuntime refusing;
  derived.set_plan_fingerprint(plan.fingerprint() + 1);
  const absl::Status mismatch = refusing.LoadPlan(derived, nullptr).status();
  EXPECT_THAT(mismatch, StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("plan_options")));
  EXPECT_EQ(ErrorReasonOf(mismatch), kReasonPlanDerivationMismatch);
  derived.mutable_plan_options()->set_strategy("no_such_strategy");
  EXPECT_THAT(refusing.LoadPlan(derived, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("plan_options: planning the model here")));
}

TEST(WorkerRuntimeTest, APeerDyingFailsTheStepAndANewPlanRecovers) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 2, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  v1::ExecuteRequest execute;
  *execute.mutable_program() = program;
  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[2];
  RunRanks(2, [&](int rank) {
    ASSERT_THAT(
        runtimes[rank].LoadPlan(MakeLoad(plan, model, rank, 1), &kv).status(),
        IsOk());
  });
  // The rendezvous keys are gone once both ranks joined.
  EXPECT_EQ(kv.size(), 0);
  // Rank 1 goes away (its connections close); rank 0's step fails fast.
  runtimes[1].Reset();
  const absl::Time start = absl::Now();
  absl::Status failed = runtimes[0].Execute(execute).status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_TRUE(failed.code() == absl::StatusCode::kAborted ||
              failed.code() == absl::StatusCode::kDeadlineExceeded)
      << failed;
  EXPECT_THAT(failed.message(), HasSubstr("rank 0"));
  // The job is done for, and says why.
  EXPECT_THAT(runtimes[0].Execute(execute).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("LoadPlan again")));
  const v1::GetStatsResponse stats = runtimes[0].GetStats();
  EXPECT_GT(stats.live_bytes(), 0);  // The shards are still held.

  // A new membership epoch brings both back.
  std::vector<double> losses(2);
  RunRanks(2, [&](int rank) {
    ASSERT_THAT(
        runtimes[rank].LoadPlan(MakeLoad(plan, model, rank, 2), &kv).status(),
        IsOk());
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ExecuteResponse response,
                                runtimes[rank].Execute(execute));
    losses[rank] = response.loss();
  });
  EXPECT_TRUE(std::isfinite(losses[0]));
  EXPECT_TRUE(std::isfinite(losses[1]));
}

TEST(WorkerRuntimeTest, StatsCountTheJobsCollectivesAndMemory) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 2, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[2];
  EXPECT_EQ(runtimes[0].GetStats().live_bytes(), 0);
  constexpr int kSteps = 2;
  RunRanks(2, [&](int rank) {
    ASSERT_THAT(
        runtimes[rank].LoadPlan(MakeLoad(plan, model, rank), &kv).status(),
        IsOk());
    for (int s = 0; s < kSteps; ++s) {
      v1::ExecuteRequest execute;
      *execute.mutable_program() = program;
      execute.mutable_program()->set_step(s);
      ASSERT_THAT(runtimes[rank].Execute(execute).status(), IsOk());
    }
  });
  for (WorkerRuntime& runtime : runtimes) {
    const v1::GetStatsResponse stats = runtime.GetStats();
    // Master shards, sharded gradients and two AdamW moments (all fp32)
    // stay live between steps.
    EXPECT_GE(stats.live_bytes(), 4 * ShardBytes(plan));
    EXPECT_GE(stats.peak_bytes(),
              stats.live_bytes() + plan.memory().peak_unsharded_bytes());
    EXPECT_EQ(stats.all_gathers(), kSteps * plan.comm().all_gathers());
    EXPECT_EQ(stats.reduce_scatters(), kSteps * plan.comm().reduce_scatters());
    EXPECT_EQ(stats.all_gather_bytes(),
              kSteps * plan.comm().all_gather_bytes());
    EXPECT_EQ(stats.reduce_scatter_bytes(),
              kSteps * plan.comm().reduce_scatter_bytes());
  }
  // Dropping the job frees everything; the totals remain.
  runtimes[0].Reset();
  runtimes[1].Reset();
  const v1::GetStatsResponse after = runtimes[0].GetStats();
  EXPECT_EQ(after.live_bytes(), 0);
  EXPECT_EQ(after.all_gathers(), kSteps * plan.comm().all_gathers());
}

// Checkpoints through the runtime: paths are confined to the checkpoint
// root; a save after 2 steps loaded into a fresh runtime restores the step
// count and gives the same step-3 loss as the runtime that went on.
TEST(WorkerRuntimeTest, CheckpointPathsAreConfinedAndASaveLoadsElsewhere) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/runtime_ckpt");

  WorkerRuntime no_root;
  ASSERT_THAT(no_root.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  v1::SaveShardsRequest save;
  save.set_plan_fingerprint(plan.fingerprint());
  save.set_tmp_dir("job/x");
  EXPECT_THAT(no_root.SaveShards(save).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--checkpoint-root")));

  WorkerRuntimeOptions options;
  options.checkpoint_root = root;
  WorkerRuntime runtime(options);
  ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  v1::ExecuteRequest execute;
  *execute.mutable_program() = program;
  for (int s = 0; s < 2; ++s) {
    execute.mutable_program()->set_step(s);
    ASSERT_THAT(runtime.Execute(execute).status(), IsOk());
  }
  for (const std::string& bad :
       {std::string(""), std::string("/abs/dir"), std::string("../up"),
        std::string("job/../../up"), std::string("job//x"),
        std::string("./job")}) {
    save.set_tmp_dir(bad);
    EXPECT_THAT(
        runtime.SaveShards(save).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tmp_dir")))
        << bad;
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp_dir,
                              checkpoint::BeginCheckpoint(root + "/job", 2));
  save.set_tmp_dir(
      absl::StrCat("job/", tmp_dir.substr(tmp_dir.rfind('/') + 1)));
  v1::SaveShardsRequest stale = save;
  stale.set_plan_fingerprint(plan.fingerprint() + 1);
  EXPECT_THAT(
      runtime.SaveShards(stale).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale plan")));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::SaveShardsResponse saved,
                              runtime.SaveShards(save));
  EXPECT_EQ(saved.shard_rank(), 0);
  EXPECT_EQ(saved.file_name(), checkpoint::RankFileName(0));
  EXPECT_GT(saved.size_bytes(), 0);
  checkpoint::RankFile file;
  file.file.name = saved.file_name();
  file.file.size_bytes = saved.size_bytes();
  file.file.xxh64 = saved.xxh64();
  for (const v1::CheckpointChunk& chunk : saved.chunks()) {
    checkpoint::TensorChunk piece;
    piece.tensor = chunk.tensor();
    piece.dtype = chunk.dtype();
    piece.global_shape.assign(chunk.global_shape().begin(),
                              chunk.global_shape().end());
    piece.chunk = {chunk.file(), chunk.file_tensor(), chunk.begin(),
                   chunk.end()};
    file.chunks.push_back(std::move(piece));
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(checkpoint::CheckpointIndex index,
                              checkpoint::BuildIndex(plan, 2, {file}));
  ASSERT_THAT(
      checkpoint::CommitCheckpoint(root + "/job", tmp_dir, index).status(),
      IsOk());

  WorkerRuntime resumed(options);
  ASSERT_THAT(resumed.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  v1::LoadShardsRequest load;
  load.set_plan_fingerprint(plan.fingerprint());
  load.set_checkpoint_dir("job/../job/step-00000002");
  EXPECT_THAT(resumed.LoadShards(load).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("checkpoint_dir")));
  load.set_checkpoint_dir("job/step-00000009");
  EXPECT_THAT(resumed.LoadShards(load).status(),
              StatusIs(absl::StatusCode::kNotFound));
  load.set_checkpoint_dir("job/step-00000002");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::LoadShardsResponse loaded,
                              resumed.LoadShards(load));
  EXPECT_EQ(loaded.step(), 2);

  execute.mutable_program()->set_step(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ExecuteResponse went_on,
                              runtime.Execute(execute));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ExecuteResponse restored,
                              resumed.Execute(execute));
  EXPECT_EQ(restored.step(), 3);
  EXPECT_EQ(went_on.step(), 3);
  // The same plan on the same rank from the same state: the same arithmetic.
  EXPECT_EQ(restored.loss(), went_on.loss());
  EXPECT_EQ(restored.grad_norm(), went_on.grad_norm());
}

// ---- Recovery: keep_state, HealReplicas, job stats (worker-recovery) ----

// This rank's master shards and both AdamW moments, unit after unit.
std::vector<float> StateOf(const WorkerRuntime& runtime) {
  std::vector<float> state;
  const absl::Status status = runtime.WithExecutor([&](const StepExecutor& e) {
    const ShardStore& store = e.shards();
    for (int u = 0; u < store.num_units(); ++u) {
      const ShardStore::UnitShard s = store.shard(u);
      for (const float* part : {s.params, s.exp_avg, s.exp_avg_sq}) {
        if (part != nullptr) state.insert(state.end(), part, part + s.numel);
      }
    }
  });
  EXPECT_THAT(status, IsOk());
  return state;
}

// Bitwise equality (NaNs included) with a readable failure.
void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
      << what;
}

v1::ExecuteRequest StepRequest(const v1::StepProgram& program, int64_t step) {
  v1::ExecuteRequest request;
  *request.mutable_program() = program;
  request.mutable_program()->set_step(step);
  return request;
}

struct Reference {
  std::vector<v1::ExecuteResponse> last;  // Per rank: the last step.
  std::vector<std::vector<float>> state;  // Per rank, after it.
};

// An uninterrupted run of `steps` steps on every rank.
Reference Uninterrupted(const v1::ModelSpec& model,
                        const v1::ShardingPlan& plan, int steps) {
  const int world = plan.world_size();
  const absl::StatusOr<v1::StepProgram> program = CompileStepProgram(plan);
  EXPECT_THAT(program.status(), IsOk());
  Reference out;
  if (!program.ok()) return out;
  out.last.resize(world);
  out.state.resize(world);
  InMemoryKeyValueClient kv;
  RunRanks(world, [&](int rank) {
    WorkerRuntime runtime;
    ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, rank), &kv).status(),
                IsOk());
    for (int s = 0; s < steps; ++s) {
      SHARDD_ASSERT_OK_AND_ASSIGN(out.last[rank],
                                  runtime.Execute(StepRequest(*program, s)));
    }
    out.state[rank] = StateOf(runtime);
  });
  return out;
}

void ExpectMatches(const Reference& reference, int rank,
                   const v1::ExecuteResponse& step,
                   const std::vector<float>& state) {
  const v1::ExecuteResponse& want = reference.last[rank];
  EXPECT_EQ(step.step(), want.step()) << "rank " << rank;
  EXPECT_EQ(step.loss(), want.loss()) << "rank " << rank;
  EXPECT_EQ(step.grad_norm(), want.grad_norm()) << "rank " << rank;
  ExpectSameBits(state, reference.state[rank], absl::StrCat("rank ", rank));
}

// Two steps, a keep_state LoadPlan at a new epoch (after one that failed in
// the rendezvous, which must not lose the state), then step 3: bit for bit
// the uninterrupted run.
TEST(WorkerRuntimeRecoveryTest, KeepStateAtANewEpochContinuesExactly) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 2, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  const Reference reference = Uninterrupted(model, plan, 3);
  ASSERT_EQ(reference.last.size(), 2u);

  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[2];
  RunRanks(2, [&](int rank) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const v1::LoadPlanResponse load,
        runtimes[rank].LoadPlan(MakeLoad(plan, model, rank, 1), &kv));
    EXPECT_EQ(load.kept_step(), -1);
    for (int s = 0; s < 2; ++s) {
      ASSERT_THAT(runtimes[rank].Execute(StepRequest(program, s)).status(),
                  IsOk());
    }
  });
  const std::vector<float> before = StateOf(runtimes[0]);

  // Rank 0 alone: the rendezvous of epoch 2 times out, and leaves no job,
  // but the state stays retained (and visible in the stats).
  v1::LoadPlanRequest lonely = MakeLoad(plan, model, 0, 2);
  lonely.set_keep_state(true);
  lonely.set_collective_timeout_ms(300);
  EXPECT_FALSE(runtimes[0].LoadPlan(lonely, &kv).ok());
  EXPECT_FALSE(runtimes[0].has_plan());
  v1::GetStatsResponse stats = runtimes[0].GetStats();
  EXPECT_EQ(stats.job_id(), "job");
  EXPECT_EQ(stats.plan_fingerprint(), plan.fingerprint());
  EXPECT_EQ(stats.optimizer_steps(), 2);
  EXPECT_TRUE(stats.step_failed());

  std::vector<v1::ExecuteResponse> third(2);
  RunRanks(2, [&](int rank) {
    v1::LoadPlanRequest request = MakeLoad(plan, model, rank, 3);
    request.set_keep_state(true);
    SHARDD_ASSERT_OK_AND_ASSIGN(const v1::LoadPlanResponse load,
                                runtimes[rank].LoadPlan(request, &kv));
    EXPECT_EQ(load.kept_step(), 2) << "rank " << rank;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        third[rank], runtimes[rank].Execute(StepRequest(program, 2)));
  });
  EXPECT_NE(StateOf(runtimes[0]), before);  // Step 3 moved it.
  for (int rank = 0; rank < 2; ++rank) {
    ExpectMatches(reference, rank, third[rank], StateOf(runtimes[rank]));
  }
}

// Step 3 fails on both ranks (rank 1 stops in the middle of it: rank 0's
// Execute fails, rank 1's fine-grained step stays open); both keep their
// state of step 2 and redo step 3 exactly.
TEST(WorkerRuntimeRecoveryTest, KeepStateAfterAFailedStep) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 2, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  // Rank 1 stops before the program's last reduce-scatter, after the
  // forward and backward ran and gradients were partly reduced.
  int stop = -1;
  for (int i = 0; i < program.commands_size(); ++i) {
    if (program.commands(i).op() == v1::Command::REDUCE_SCATTER) stop = i;
  }
  ASSERT_GT(stop, 0);
  const Reference reference = Uninterrupted(model, plan, 3);
  ASSERT_EQ(reference.last.size(), 2u);

  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[2];
  std::vector<v1::ExecuteResponse> third(2);
  RunRanks(2, [&](int rank) {
    WorkerRuntime& runtime = runtimes[rank];
    v1::LoadPlanRequest load = MakeLoad(plan, model, rank, 1);
    load.set_collective_timeout_ms(3000);
    ASSERT_THAT(runtime.LoadPlan(load, &kv).status(), IsOk());
    for (int s = 0; s < 2; ++s) {
      ASSERT_THAT(runtime.Execute(StepRequest(program, s)).status(), IsOk());
    }
    if (rank == 0) {
      const absl::Status failed =
          runtime.Execute(StepRequest(program, 2)).status();
      EXPECT_TRUE(failed.code() == absl::StatusCode::kAborted ||
                  failed.code() == absl::StatusCode::kDeadlineExceeded)
          << failed;
      const v1::GetStatsResponse stats = runtime.GetStats();
      EXPECT_TRUE(stats.step_failed());
      EXPECT_EQ(stats.optimizer_steps(), 2);
    } else {
      v1::RunCommandRequest request;
      request.set_plan_fingerprint(plan.fingerprint());
      request.set_step(2);
      for (int i = 0; i < stop; ++i) {
        request.set_begin_step(i == 0);
        *request.mutable_command() = program.commands(i);
        request.set_index(i);
        ASSERT_THAT(runtime.RunCommand(request).status(), IsOk())
            << "command " << i;
      }
      EXPECT_FALSE(runtime.GetStats().step_failed());
    }
    v1::LoadPlanRequest keep = MakeLoad(plan, model, rank, 2);
    keep.set_keep_state(true);
    SHARDD_ASSERT_OK_AND_ASSIGN(const v1::LoadPlanResponse kept,
                                runtime.LoadPlan(keep, &kv));
    EXPECT_EQ(kept.kept_step(), 2) << "rank " << rank;
    EXPECT_FALSE(runtime.GetStats().step_failed());
    SHARDD_ASSERT_OK_AND_ASSIGN(third[rank],
                                runtime.Execute(StepRequest(program, 2)));
  });
  for (int rank = 0; rank < 2; ++rank) {
    ExpectMatches(reference, rank, third[rank], StateOf(runtimes[rank]));
  }
}

// keep_state keeps only the same job and plan; a bad request changes
// nothing; the stats name the job.
TEST(WorkerRuntimeRecoveryTest, KeepStateNeedsTheSameJobAndPlan) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  // The same layout under another fingerprint (as a re-planned job's).
  v1::ShardingPlan other_plan = plan;
  other_plan.set_fingerprint(plan.fingerprint() + 1);
  ASSERT_NE(plan.fingerprint(), other_plan.fingerprint());
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  WorkerRuntime fresh;
  ASSERT_THAT(fresh.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  const std::vector<float> initial = StateOf(fresh);

  WorkerRuntime runtime;
  EXPECT_EQ(runtime.GetStats().job_id(), "");
  v1::LoadPlanRequest keep = MakeLoad(plan, model, 0);
  keep.set_keep_state(true);  // Nothing held: fresh.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::LoadPlanResponse load,
                              runtime.LoadPlan(keep, nullptr));
  EXPECT_EQ(load.kept_step(), -1);
  v1::GetStatsResponse stats = runtime.GetStats();
  EXPECT_EQ(stats.job_id(), "job");
  EXPECT_EQ(stats.plan_fingerprint(), plan.fingerprint());
  EXPECT_EQ(stats.optimizer_steps(), 0);
  EXPECT_FALSE(stats.step_failed());
  for (int s = 0; s < 2; ++s) {
    ASSERT_THAT(runtime.Execute(StepRequest(program, s)).status(), IsOk());
  }
  EXPECT_EQ(runtime.GetStats().optimizer_steps(), 2);
  const std::vector<float> trained = StateOf(runtime);
  ASSERT_NE(trained, initial);

  v1::LoadPlanRequest bad = keep;
  bad.mutable_train()->set_seq_len(0);
  EXPECT_THAT(runtime.LoadPlan(bad, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectSameBits(StateOf(runtime), trained, "after a bad request");

  keep.set_membership_epoch(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(load, runtime.LoadPlan(keep, nullptr));
  EXPECT_EQ(load.kept_step(), 2);
  ExpectSameBits(StateOf(runtime), trained, "kept");
  EXPECT_EQ(runtime.GetStats().optimizer_steps(), 2);

  v1::LoadPlanRequest other_job = keep;
  other_job.set_job_id("other");
  SHARDD_ASSERT_OK_AND_ASSIGN(load, runtime.LoadPlan(other_job, nullptr));
  EXPECT_EQ(load.kept_step(), -1);
  ExpectSameBits(StateOf(runtime), initial, "another job");
  stats = runtime.GetStats();
  EXPECT_EQ(stats.job_id(), "other");
  EXPECT_EQ(stats.optimizer_steps(), 0);

  ASSERT_THAT(runtime.Execute(StepRequest(program, 0)).status(), IsOk());
  v1::LoadPlanRequest other_fingerprint = MakeLoad(other_plan, model, 0);
  other_fingerprint.set_job_id("other");
  other_fingerprint.set_keep_state(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(load,
                              runtime.LoadPlan(other_fingerprint, nullptr));
  EXPECT_EQ(load.kept_step(), -1);
  ExpectSameBits(StateOf(runtime), initial, "another plan");
  EXPECT_EQ(runtime.GetStats().plan_fingerprint(), other_plan.fingerprint());

  runtime.Reset();
  stats = runtime.GetStats();
  EXPECT_EQ(stats.job_id(), "");
  EXPECT_EQ(stats.plan_fingerprint(), 0u);
}

// HSDP 2 x 2: after 2 steps rank 3 restarts (fresh shards), the others keep
// their state at a new epoch, HealReplicas copies shard rank 1's state from
// replica 0 (and, to exercise both groups, shard rank 0's from replica 1);
// step 3 is then bit for bit the uninterrupted run's on every rank.
TEST(WorkerRuntimeRecoveryTest, HealReplicasRestoresARestartedRank) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 2, 2);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  const Reference reference = Uninterrupted(model, plan, 3);
  ASSERT_EQ(reference.last.size(), 4u);

  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[4];
  RunRanks(4, [&](int rank) {
    ASSERT_THAT(
        runtimes[rank].LoadPlan(MakeLoad(plan, model, rank, 1), &kv).status(),
        IsOk());
    for (int s = 0; s < 2; ++s) {
      ASSERT_THAT(runtimes[rank].Execute(StepRequest(program, s)).status(),
                  IsOk());
    }
  });
  runtimes[3].Reset();  // The "restarted" worker.
  RunRanks(4, [&](int rank) {
    v1::LoadPlanRequest request = MakeLoad(plan, model, rank, 2);
    request.set_keep_state(rank != 3);
    SHARDD_ASSERT_OK_AND_ASSIGN(const v1::LoadPlanResponse load,
                                runtimes[rank].LoadPlan(request, &kv));
    EXPECT_EQ(load.kept_step(), rank == 3 ? -1 : 2) << "rank " << rank;
  });
  EXPECT_EQ(runtimes[3].GetStats().optimizer_steps(), 0);

  // Requests refused before any collective.
  v1::HealReplicasRequest heal;
  heal.set_plan_fingerprint(plan.fingerprint());
  heal.add_source_replica(1);
  EXPECT_THAT(runtimes[0].HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("one entry per shard rank (2)")));
  heal.add_source_replica(2);
  EXPECT_THAT(runtimes[0].HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("source_replica[1]")));
  heal.set_source_replica(1, -2);
  EXPECT_THAT(runtimes[0].HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  heal.set_source_replica(1, 0);
  v1::HealReplicasRequest stale = heal;
  stale.set_plan_fingerprint(plan.fingerprint() + 1);
  EXPECT_THAT(
      runtimes[0].HealReplicas(stale).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stale plan")));

  std::vector<v1::HealReplicasResponse> healed(4);
  std::vector<v1::ExecuteResponse> third(4);
  RunRanks(4, [&](int rank) {
    SHARDD_ASSERT_OK_AND_ASSIGN(healed[rank],
                                runtimes[rank].HealReplicas(heal));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        third[rank], runtimes[rank].Execute(StepRequest(program, 2)));
  });
  // Receivers: rank 0 (shard rank 0, from replica 1 = rank 2) and rank 3
  // (shard rank 1, from replica 0 = rank 1): masters and two moments.
  const int64_t state_bytes = 3 * ShardBytes(plan);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(healed[rank].step(), 2) << "rank " << rank;
    EXPECT_EQ(healed[rank].received_bytes(),
              rank == 0 || rank == 3 ? state_bytes : 0)
        << "rank " << rank;
    ExpectMatches(reference, rank, third[rank], StateOf(runtimes[rank]));
    EXPECT_EQ(runtimes[rank].GetStats().optimizer_steps(), 3);
  }
}

TEST(WorkerRuntimeRecoveryTest, HealReplicasRefusesJobsWithoutReplicas) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  WorkerRuntime runtime;
  v1::HealReplicasRequest heal;
  heal.set_plan_fingerprint(plan.fingerprint());
  heal.add_source_replica(0);
  EXPECT_THAT(runtime.HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no plan loaded")));
  ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  EXPECT_THAT(runtime.HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no replicas")));
}

// A heal whose source never shows up: ABORTED, the job fails, and the
// receiver's state counts as lost (keep_state starts afresh).
TEST(WorkerRuntimeRecoveryTest, AFailedHealFailsTheJobAndLosesTheState) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 2);  // Two replicas.
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram program,
                              CompileStepProgram(plan));
  InMemoryKeyValueClient kv;
  WorkerRuntime runtimes[2];
  RunRanks(2, [&](int rank) {
    v1::LoadPlanRequest load = MakeLoad(plan, model, rank, 1);
    load.set_collective_timeout_ms(500);
    ASSERT_THAT(runtimes[rank].LoadPlan(load, &kv).status(), IsOk());
    ASSERT_THAT(runtimes[rank].Execute(StepRequest(program, 0)).status(),
                IsOk());
  });
  v1::HealReplicasRequest heal;
  heal.set_plan_fingerprint(plan.fingerprint());
  heal.add_source_replica(1);
  // Rank 1 (the source) never takes part.
  EXPECT_THAT(runtimes[0].HealReplicas(heal).status(),
              StatusIs(absl::StatusCode::kAborted,
                       AllOf(HasSubstr("rank 0"), HasSubstr("LoadPlan again"),
                             HasSubstr("lost"))));
  v1::GetStatsResponse stats = runtimes[0].GetStats();
  EXPECT_TRUE(stats.step_failed());
  EXPECT_EQ(stats.optimizer_steps(), -1);
  EXPECT_THAT(runtimes[0].Execute(StepRequest(program, 1)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("HealReplicas")));
  // -1 everywhere is a no-op that needs no peer.
  heal.set_source_replica(0, -1);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::HealReplicasResponse noop,
                              runtimes[1].HealReplicas(heal));
  EXPECT_EQ(noop.step(), 1);
  EXPECT_EQ(noop.received_bytes(), 0);

  RunRanks(2, [&](int rank) {
    v1::LoadPlanRequest keep = MakeLoad(plan, model, rank, 2);
    keep.set_keep_state(true);
    SHARDD_ASSERT_OK_AND_ASSIGN(const v1::LoadPlanResponse load,
                                runtimes[rank].LoadPlan(keep, &kv));
    EXPECT_EQ(load.kept_step(), rank == 0 ? -1 : 1) << "rank " << rank;
  });
}

// --debug-save-delay: SaveShards answers only after the delay, with the
// rank file already complete on disk.
TEST(WorkerRuntimeRecoveryTest, DebugSaveDelayHoldsTheAnswer) {
  const v1::ModelSpec model = TinyMoe();
  const v1::ShardingPlan plan = MakePlan(model, 1, 1);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/runtime_save_delay");
  WorkerRuntimeOptions options;
  options.checkpoint_root = root;
  options.debug_save_delay = absl::Milliseconds(300);
  WorkerRuntime runtime(options);
  ASSERT_THAT(runtime.LoadPlan(MakeLoad(plan, model, 0), nullptr).status(),
              IsOk());
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string tmp_dir,
                              checkpoint::BeginCheckpoint(root + "/job", 0));
  v1::SaveShardsRequest save;
  save.set_plan_fingerprint(plan.fingerprint());
  save.set_tmp_dir(
      absl::StrCat("job/", tmp_dir.substr(tmp_dir.rfind('/') + 1)));
  const absl::Time start = absl::Now();
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::SaveShardsResponse saved,
                              runtime.SaveShards(save));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  std::FILE* file =
      std::fopen((tmp_dir + "/" + saved.file_name()).c_str(), "rb");
  ASSERT_NE(file, nullptr);
  std::fseek(file, 0, SEEK_END);
  EXPECT_EQ(std::ftell(file), saved.size_bytes());
  std::fclose(file);
}

}  // namespace
}  // namespace shardd
