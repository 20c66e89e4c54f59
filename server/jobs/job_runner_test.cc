#include "server/jobs/job_runner.h"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/error_info.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "proto/coordinator.pb.h"
#include "proto/worker.pb.h"
#include "server/jobs/job_journal.h"
#include "server/jobs/worker_client.h"
#include "server/state_store.h"
#include "server/worker_registry.h"
#include "testing/fake_cluster.h"
#include "testing/model_builder.h"

namespace shardd {
namespace {

using ::shardd::testing_util::AddressOf;
using ::shardd::testing_util::Call;
using ::shardd::testing_util::FakeCluster;
using ::shardd::testing_util::RankState;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------
// Fixture: a registry on a fake clock and a runner over FakeCluster.

class JobRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WorkerRegistryOptions registry_options;
    registry_options.heartbeat_timeout = absl::Seconds(1);
    registry_options.clock = [this] {
      absl::MutexLock lock(&clock_mu_);
      return now_;
    };
    registry_ = std::make_unique<WorkerRegistry>(registry_options);
  }

  void TearDown() override {
    // Release gated calls so that jobs can end.
    if (!cluster_.gate().HasBeenNotified()) cluster_.gate().Notify();
    if (runner_ != nullptr) runner_->Shutdown();
  }

  bool recover_ = false;

  void Advance(absl::Duration d) {
    absl::MutexLock lock(&clock_mu_);
    now_ += d;
  }

  void RegisterWorkers(int n) {
    for (int rank = 0; rank < n; ++rank) {
      WorkerRegistration worker;
      worker.address = AddressOf(rank);
      worker.incarnation = 100 + rank;
      worker.device = "cpu";
      worker.requested_rank = rank;
      ASSERT_THAT(registry_->Register(worker), IsOk());
    }
  }

  void StartRunner(JobRunnerOptions options = {}) {
    if (options.poll_interval == JobRunnerOptions().poll_interval) {
      options.poll_interval = absl::Milliseconds(10);
    }
    // Most tests check how a fault fails a job; the recovery tests opt in.
    if (!recover_) options.default_max_recoveries = 0;
    runner_ = std::make_unique<JobRunner>(
        registry_.get(),
        [this](const std::string& address)
            -> absl::StatusOr<std::unique_ptr<WorkerClient>> {
          return cluster_.MakeClient(address);
        },
        options);
  }

  // A job over `world` ranks with a three-command program.
  static JobSpec Spec(int world, int steps, bool fine_grained = false) {
    JobSpec spec;
    spec.model_id = "m-test";
    spec.plan.set_world_size(world);
    spec.plan.set_fingerprint(77);
    spec.plan.mutable_memory()->set_peak_unsharded_bytes(4242);
    spec.program.set_plan_fingerprint(77);
    spec.program.add_commands()->set_op(v1::Command::UNSHARD);
    spec.program.add_commands()->set_op(v1::Command::FORWARD);
    spec.program.add_commands()->set_op(v1::Command::OPTIMIZER_STEP);
    spec.config.set_steps(steps);
    spec.config.set_global_batch(8);
    spec.config.set_seq_len(16);
    spec.config.set_seed(9);
    spec.config.set_fine_grained(fine_grained);
    return spec;
  }

  // Waits (bounded) until the job's log ended; returns its events.
  std::vector<v1::StepEvent> WaitForEnd(
      const std::string& job_id, absl::Duration limit = absl::Seconds(20)) {
    auto log = runner_->Events(job_id);
    EXPECT_THAT(log, IsOk());
    if (!log.ok()) return {};
    const absl::Time until = absl::Now() + limit;
    while (!(*log)->ended() && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    EXPECT_TRUE((*log)->ended()) << "job " << job_id << " did not end";
    return (*log)->Snapshot();
  }

  // Waits (bounded) until `n` calls are blocked in the fake.
  void WaitForBlocked(int n) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (cluster_.blocked() < n && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(cluster_.blocked(), n);
  }

  JobSummary SummaryOf(const std::string& job_id) {
    for (JobSummary& job : runner_->ListJobs()) {
      if (job.job_id == job_id) return job;
    }
    ADD_FAILURE() << "no job " << job_id;
    return {};
  }

  // A fresh state store under the test's temporary directory and a journal
  // on it (journal_), for the runners that survive a restart.
  void OpenJournal(const std::string& name) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    SHARDD_ASSERT_OK_AND_ASSIGN(store_, StateStore::Open(dir + "/state.db"));
    journal_ = std::make_unique<JobJournal>(store_.get());
  }

  absl::Mutex clock_mu_;
  absl::Time now_ ABSL_GUARDED_BY(clock_mu_) = absl::FromUnixSeconds(1000);
  // Before the runner: it outlives them only in TearDown's Shutdown.
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<JobJournal> journal_;
  std::unique_ptr<WorkerRegistry> registry_;
  FakeCluster cluster_;
  std::unique_ptr<JobRunner> runner_;
};

TEST_F(JobRunnerTest, RunsEveryStepAndPublishesAggregatedEventsInOrder) {
  RegisterWorkers(4);
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(4, 5)));
  EXPECT_EQ(id, "j-1");
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 5u);
  for (int s = 0; s < 5; ++s) {
    const v1::StepEvent& event = events[s];
    SCOPED_TRACE(s);
    EXPECT_EQ(event.job_id(), "j-1");
    EXPECT_EQ(event.step(), s + 1);
    EXPECT_EQ(event.total_steps(), 5);
    EXPECT_EQ(event.done(), s == 4);
    EXPECT_EQ(event.error(), "");
    // Rank r: loss s + r on 10 (r + 1) tokens. Token-weighted mean:
    // s + (0*1 + 1*2 + 2*3 + 3*4) / (1 + 2 + 3 + 4) = s + 2.
    EXPECT_DOUBLE_EQ(event.loss(), s + 2.0);
    EXPECT_EQ(event.tokens(), 100);
    EXPECT_DOUBLE_EQ(event.grad_norm(), 0.5);       // Rank 0's.
    EXPECT_EQ(event.peak_unsharded_bytes(), 1003);  // Max over ranks.
    EXPECT_EQ(event.planned_peak_unsharded_bytes(), 4242);
    EXPECT_EQ(event.all_gathers(), 5);
    EXPECT_EQ(event.reduce_scatters(), 3);
    EXPECT_DOUBLE_EQ(event.data_entropy_rate(), 1.25);  // Rank 0's.
    EXPECT_GT(event.step_seconds(), 0.0);
    EXPECT_NEAR(event.tokens_per_second() * event.step_seconds(), 100, 1e-6);
  }

  // LoadPlan went to every rank with its own rank and the job's names.
  std::vector<v1::LoadPlanRequest> loads = cluster_.loads();
  ASSERT_EQ(loads.size(), 4u);
  std::vector<int> ranks;
  for (const v1::LoadPlanRequest& load : loads) {
    ranks.push_back(load.rank());
    EXPECT_EQ(load.job_id(), "j-1");
    EXPECT_EQ(load.seed(), 9u);
    EXPECT_EQ(load.plan().fingerprint(), 77u);
    EXPECT_EQ(load.train().steps(), 5);
    EXPECT_EQ(load.collective_timeout_ms(), 60000);
    EXPECT_EQ(load.membership_epoch(), registry_->membership_epoch());
  }
  std::sort(ranks.begin(), ranks.end());
  EXPECT_THAT(ranks, ElementsAre(0, 1, 2, 3));
  // Each rank executed steps 0..4 in order.
  for (int rank = 0; rank < 4; ++rank) {
    std::vector<int64_t> steps;
    for (const Call& call : cluster_.calls()) {
      if (call.rank == rank && call.method == "Execute") {
        steps.push_back(call.step);
      }
    }
    EXPECT_THAT(steps, ElementsAre(0, 1, 2, 3, 4)) << "rank " << rank;
  }
  const JobSummary summary = SummaryOf(id);
  EXPECT_EQ(summary.state, v1::JOB_DONE);
  EXPECT_EQ(summary.steps_done, 5);
  EXPECT_DOUBLE_EQ(summary.last_loss, 6.0);
}

// A job over `world` ranks that evaluates every `every` steps on
// `batches` eval batches.
JobSpec EvalSpec(int world, int steps, int every, int batches) {
  JobSpec spec;
  spec.model_id = "m-test";
  spec.plan.set_world_size(world);
  spec.plan.set_fingerprint(77);
  spec.program.set_plan_fingerprint(77);
  spec.program.add_commands()->set_op(v1::Command::FORWARD);
  spec.program.add_commands()->set_op(v1::Command::OPTIMIZER_STEP);
  spec.eval_program.set_plan_fingerprint(77);
  spec.eval_program.set_eval(true);
  spec.eval_program.add_commands()->set_op(v1::Command::FORWARD);
  spec.config.set_steps(steps);
  spec.config.set_global_batch(8);
  spec.config.set_seq_len(16);
  spec.config.set_eval_data_path("/data/held-out.bin");
  spec.config.set_eval_every(every);
  spec.config.set_eval_batches(batches);
  return spec;
}

// The (step, eval) sequence of a job's events: eval events as -step.
std::vector<int64_t> EventSequence(const std::vector<v1::StepEvent>& events) {
  std::vector<int64_t> out;
  for (const v1::StepEvent& event : events) {
    if (!event.interruption().empty() || !event.recovery().empty()) continue;
    out.push_back(event.has_eval_loss() ? -event.step() : event.step());
  }
  return out;
}

TEST_F(JobRunnerTest, EvaluatesEveryNStepsAndAfterTheLastOne) {
  RegisterWorkers(2);
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id,
                              runner_->Submit(EvalSpec(2, 5, 2, 3)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(EventSequence(events), ElementsAre(1, 2, -2, 3, 4, -4, 5, -5));
  for (const v1::StepEvent& event : events) {
    SCOPED_TRACE(event.ShortDebugString());
    // Only the evaluation after the last step ends the job.
    EXPECT_EQ(event.done(), event.has_eval_loss() && event.step() == 5);
    if (!event.has_eval_loss()) continue;
    // Rank r, batch k: loss 10 + k + r on 10 (r + 1) tokens. Token-weighted
    // over ranks and the 3 batches: 10 + 1 + (0 * 10 + 1 * 20) / 30.
    EXPECT_NEAR(event.eval_loss(), 11.0 + 2.0 / 3.0, 1e-12);
    EXPECT_EQ(event.eval_tokens(), 3 * (10 + 20));
    EXPECT_EQ(event.loss(), 0.0);
    EXPECT_EQ(event.tokens(), 0);
  }
  // Each rank ran eval batches 0..2 after steps 2, 4 and 5, in order.
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> calls;
    for (const Call& call : cluster_.calls()) {
      if (call.rank == rank && call.method != "LoadPlan") {
        calls.push_back(absl::StrCat(call.method, call.step));
      }
    }
    EXPECT_THAT(calls,
                ElementsAre("Execute0", "Execute1", "Eval0", "Eval1", "Eval2",
                            "Execute2", "Execute3", "Eval0", "Eval1", "Eval2",
                            "Execute4", "Eval0", "Eval1", "Eval2"))
        << "rank " << rank;
  }
  const JobSummary summary = SummaryOf(id);
  EXPECT_EQ(summary.state, v1::JOB_DONE);
  EXPECT_EQ(summary.steps_done, 5);
  EXPECT_DOUBLE_EQ(summary.last_loss, 4.0 + 2.0 / 3.0);  // Step 5's.
  ASSERT_TRUE(summary.last_eval_loss.has_value());
  EXPECT_NEAR(*summary.last_eval_loss, 11.0 + 2.0 / 3.0, 1e-12);
}

TEST_F(JobRunnerTest, AnEvaluationAFaultInterruptedRunsAgainAfterRecovery) {
  recover_ = true;
  RegisterWorkers(2);
  cluster_.script().eval_failures[1] = absl::UnavailableError("peer gone");
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id,
                              runner_->Submit(EvalSpec(2, 3, 2, 1)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  // Step 2's evaluation failed; the workers still held step 2, so the job
  // went on from there, evaluating first: no step ran twice.
  EXPECT_THAT(EventSequence(events), ElementsAre(1, 2, -2, 3, -3));
  bool interrupted = false;
  for (const v1::StepEvent& event : events) {
    if (!event.interruption().empty()) {
      interrupted = true;
      EXPECT_THAT(event.interruption(),
                  AllOf(HasSubstr("evaluation after step 2/3"),
                        HasSubstr("rank 1 (fake-1:1)")));
    }
  }
  EXPECT_TRUE(interrupted);
  EXPECT_TRUE(events.back().done());
  EXPECT_EQ(SummaryOf(id).state, v1::JOB_DONE);
}

// With the plan's options the runner sends each rank a LoadPlan without the
// plan (a few kilobytes, whatever the world); a rank that derives another
// plan is sent the plan itself.
TEST_F(JobRunnerTest, WorkersDeriveThePlanAndAMismatchGetsItSent) {
  RegisterWorkers(3);
  cluster_.script().derive_mismatch = {1};
  StartRunner();
  JobSpec spec = Spec(3, 2);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(3);
  spec.plan_options = options;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(spec));
  ASSERT_TRUE(WaitForEnd(id).back().done());
  int derived = 0, sent = 0;
  for (const v1::LoadPlanRequest& load : cluster_.loads()) {
    if (load.has_plan()) {
      ++sent;
      EXPECT_EQ(load.rank(), 1);
      EXPECT_EQ(load.plan().fingerprint(), 77u);
    } else {
      ++derived;
      EXPECT_EQ(load.plan_fingerprint(), 77u);
      EXPECT_EQ(load.plan_options().mesh().dp_shard(), 3);
    }
  }
  // Ranks 0 and 2 derived it; rank 1 refused to (its refusal installs
  // nothing), then got the plan.
  EXPECT_EQ(derived, 2);
  EXPECT_EQ(sent, 1);
  int calls_of_rank_1 = 0;
  for (const Call& call : cluster_.calls()) {
    calls_of_rank_1 += call.rank == 1 && call.method == "LoadPlan";
  }
  EXPECT_EQ(calls_of_rank_1, 2);
}

TEST_F(JobRunnerTest, FineGrainedSendsEachCommandToAllRanksBeforeTheNext) {
  RegisterWorkers(3);
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id,
                              runner_->Submit(Spec(3, 2, true)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 2u);
  // Ranks 0..2 with 10, 20, 30 tokens: (0*1 + 1*2 + 2*3) / 6 = 4/3.
  EXPECT_DOUBLE_EQ(events[0].loss(), 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(events[1].loss(), 1.0 + 4.0 / 3.0);
  EXPECT_TRUE(events[1].done());

  std::vector<Call> commands;
  for (const Call& call : cluster_.calls()) {
    if (call.method == "RunCommand") commands.push_back(call);
  }
  ASSERT_EQ(commands.size(), 2u * 3u * 3u);  // steps x commands x ranks.
  // Arrival order: all ranks of (step, index) before any of the next one.
  for (size_t i = 0; i < commands.size(); ++i) {
    const int64_t round = static_cast<int64_t>(i / 3);
    EXPECT_EQ(commands[i].step, round / 3) << i;
    EXPECT_EQ(commands[i].index, round % 3) << i;
    EXPECT_EQ(commands[i].begin, commands[i].index == 0) << i;
    EXPECT_EQ(commands[i].end, commands[i].index == 2) << i;
  }
}

TEST_F(JobRunnerTest, FailingRankFailsTheJobNamingRankAddressAndError) {
  RegisterWorkers(4);
  cluster_.script().failures[2] = {2, absl::AbortedError("injected fault")};
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(4, 10)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1].error(), "");
  EXPECT_FALSE(events[1].done());
  const v1::StepEvent& failed = events[2];
  EXPECT_EQ(failed.step(), 3);
  EXPECT_FALSE(failed.done());
  EXPECT_EQ(failed.error(),
            "step 3/10: rank 2 (fake-2:1): ABORTED: injected fault");
  // No step after the failed one ran.
  for (const Call& call : cluster_.calls()) EXPECT_LE(call.step, 2);
  const JobSummary summary = SummaryOf(id);
  EXPECT_EQ(summary.state, v1::JOB_FAILED);
  EXPECT_EQ(summary.steps_done, 2);
  EXPECT_EQ(summary.error, failed.error());
}

TEST_F(JobRunnerTest, TheCauseIsPreferredOverPeersAbortedCollectives) {
  RegisterWorkers(4);
  // Rank 1's collective aborts because rank 3 is unreachable.
  cluster_.script().failures[1] = {0, absl::AbortedError("peer closed")};
  cluster_.script().failures[3] = {0, absl::UnavailableError("refused")};
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(4, 3)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].error(),
              AllOf(HasSubstr("step 1/3: rank 3 (fake-3:1): UNAVAILABLE: "
                              "refused"),
                    HasSubstr("also failed: rank 1 ABORTED")));
}

TEST_F(JobRunnerTest, HungRankFailsTheJobAtItsDeadline) {
  RegisterWorkers(2);
  cluster_.script().hang_rank = 1;
  cluster_.script().hang_step = 1;
  JobRunnerOptions options;
  options.collective_timeout = absl::Milliseconds(200);
  options.rpc_margin = absl::Milliseconds(100);
  StartRunner(options);
  const absl::Time start = absl::Now();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(2, 4)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  const absl::Duration took = absl::Now() - start;
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[1].error(),
              HasSubstr("step 2/4: rank 1 (fake-1:1): DEADLINE_EXCEEDED"));
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(5));
}

TEST_F(JobRunnerTest, RankIgnoringItsDeadlineIsCutOffByTheRunner) {
  RegisterWorkers(2);
  cluster_.script().hang_rank = 0;
  cluster_.script().hang_step = 0;
  cluster_.script().ignore_deadline = true;  // Only cancellation ends it.
  JobRunnerOptions options;
  options.collective_timeout = absl::Milliseconds(150);
  options.rpc_margin = absl::Milliseconds(50);
  StartRunner(options);
  const absl::Time start = absl::Now();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(2, 4)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].error(),
              HasSubstr("step 1/4: rank 0 (fake-0:1): DEADLINE_EXCEEDED: no "
                        "answer to Execute within 200ms"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(JobRunnerTest, WorkerDeclaredDeadDuringAStepFailsTheJob) {
  RegisterWorkers(3);
  cluster_.script().hang_rank = 1;
  cluster_.script().hang_step = 0;
  cluster_.script().ignore_deadline = true;
  StartRunner();  // Deadlines of 90 s: only the death can end the step.
  const absl::Time start = absl::Now();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(3, 2)));
  WaitForBlocked(1);
  // Ranks 0 and 2 keep heartbeating; rank 1 misses the 1 s timeout.
  Advance(absl::Milliseconds(600));
  ASSERT_THAT(registry_->Heartbeat(0, 100), IsOk());
  ASSERT_THAT(registry_->Heartbeat(2, 102), IsOk());
  Advance(absl::Milliseconds(600));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].error(),
              HasSubstr("step 1/2: rank 1 (fake-1:1): UNAVAILABLE: the worker "
                        "was declared dead (no heartbeat for 1s)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(cluster_.blocked(), 0);  // The hung call was cancelled.
}

TEST_F(JobRunnerTest, WorkerRestartedDuringAStepFailsTheJob) {
  RegisterWorkers(2);
  cluster_.script().hang_rank = 1;
  cluster_.script().hang_step = 0;
  cluster_.script().ignore_deadline = true;
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(2, 2)));
  WaitForBlocked(1);
  // The same address comes back with a new incarnation: its shards are
  // gone even though rank 1 is alive again.
  WorkerRegistration restarted;
  restarted.address = AddressOf(1);
  restarted.incarnation = 999;
  restarted.requested_rank = 1;
  SHARDD_ASSERT_OK_AND_ASSIGN(RegisterResult result,
                              registry_->Register(restarted));
  ASSERT_EQ(result.rank, 1);
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(
      events[0].error(),
      HasSubstr("rank 1 (fake-1:1): UNAVAILABLE: the worker restarted"));
}

TEST_F(JobRunnerTest, SubmitNamesMissingAndDeadRanks) {
  RegisterWorkers(2);
  StartRunner();
  EXPECT_THAT(runner_->Submit(Spec(4, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("ranks 2-3 have not registered")));
  Advance(absl::Seconds(2));  // Both die.
  EXPECT_THAT(runner_->Submit(Spec(2, 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("0-1"), HasSubstr("fake-0:1"))));
  EXPECT_TRUE(runner_->ListJobs().empty());
  EXPECT_TRUE(cluster_.calls().empty());
}

TEST_F(JobRunnerTest, RejectsMalformedSpecs) {
  RegisterWorkers(1);
  StartRunner();
  JobSpec no_steps = Spec(1, 1);
  no_steps.config.set_steps(0);
  EXPECT_THAT(
      runner_->Submit(no_steps),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("config.steps")));
  JobSpec no_world = Spec(1, 1);
  no_world.plan.set_world_size(0);
  EXPECT_THAT(
      runner_->Submit(no_world),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size")));
  JobSpec empty = Spec(1, 1);
  empty.program.clear_commands();
  EXPECT_THAT(
      runner_->Submit(empty),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("program")));
}

TEST_F(JobRunnerTest, CheckpointOptionsAreCheckedAndJobIdsContinue) {
  RegisterWorkers(1);
  StartRunner();
  JobSpec every = Spec(1, 1);
  every.config.set_checkpoint_every(3);
  EXPECT_THAT(runner_->Submit(every),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--checkpoint-dir")));
  every.config.set_checkpoint_every(-1);
  EXPECT_THAT(runner_->Submit(every),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.checkpoint_every")));
  JobSpec keep = Spec(1, 1);
  keep.config.set_keep_checkpoints(-2);
  EXPECT_THAT(runner_->Submit(keep),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.keep_checkpoints")));
  keep.config.set_keep_checkpoints(2);
  keep.config.set_keep_every(-1);
  EXPECT_THAT(runner_->Submit(keep),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.keep_every")));
  keep.config.set_keep_every(0);
  keep.config.set_on_checkpoint_failure("ignore");
  EXPECT_THAT(runner_->Submit(keep),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("allowed: fail (the default), skip")));

  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/job_runner_ckpt");
  std::filesystem::create_directories(dir + "/j-7");
  JobRunnerOptions options;
  options.checkpoint_dir = dir;
  StartRunner(options);
  for (const std::string& bad :
       {std::string("../j-1/step-00000003"), std::string("/abs/step-1"),
        std::string("j-1//step-1"), std::string("j-1/./step-1")}) {
    JobSpec resume = Spec(1, 1);
    resume.config.set_resume_from(bad);
    EXPECT_THAT(runner_->Submit(resume),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("config.resume_from")))
        << bad;
  }
  JobSpec missing = Spec(1, 1);
  missing.config.set_resume_from("j-1/step-00000003");
  EXPECT_THAT(
      runner_->Submit(missing),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.resume_from")));
  // j-7 exists in the checkpoint dir: a restarted coordinator goes on
  // after it instead of reusing its directory.
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(1, 1)));
  EXPECT_EQ(id, "j-8");

  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<v1::CheckpointInfo> listed,
                              ListJobCheckpoints(dir, ""));
  EXPECT_TRUE(listed.empty());
  EXPECT_THAT(
      ListJobCheckpoints(dir, "../etc").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  SHARDD_ASSERT_OK_AND_ASSIGN(listed, ListJobCheckpoints(dir + "/missing", ""));
  EXPECT_TRUE(listed.empty());
}

TEST_F(JobRunnerTest, JobsRunOneAtATimeAndThePendingLimitHolds) {
  RegisterWorkers(2);
  cluster_.script().gate_step = 1;  // Job 1 stops at its second step.
  JobRunnerOptions options;
  options.max_pending_jobs = 2;
  StartRunner(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string first, runner_->Submit(Spec(2, 2)));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string second, runner_->Submit(Spec(2, 1)));
  EXPECT_EQ(second, "j-2");
  EXPECT_THAT(
      runner_->Submit(Spec(2, 1)),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("limit is 2")));
  WaitForBlocked(2);  // Both ranks of job 1, step 1.
  EXPECT_EQ(SummaryOf(first).state, v1::JOB_RUNNING);
  EXPECT_EQ(SummaryOf(second).state, v1::JOB_QUEUED);
  for (const Call& call : cluster_.calls()) EXPECT_EQ(call.job_id, first);

  cluster_.gate().Notify();
  // Job 2's step 0 is below the gate step, but it is step 0 of its own.
  WaitForEnd(first);
  WaitForEnd(second);
  EXPECT_EQ(SummaryOf(first).state, v1::JOB_DONE);
  EXPECT_EQ(SummaryOf(second).state, v1::JOB_DONE);
  // Every call of job 2 came after every call of job 1.
  int64_t last_of_first = -1;
  int64_t first_of_second = -1;
  for (const Call& call : cluster_.calls()) {
    if (call.job_id == first) last_of_first = call.sequence;
    if (call.job_id == second && first_of_second < 0) {
      first_of_second = call.sequence;
    }
  }
  EXPECT_LT(last_of_first, first_of_second);
  // A new job is accepted once the queue drained.
  EXPECT_THAT(runner_->Submit(Spec(2, 1)), IsOk());
}

TEST_F(JobRunnerTest, ShutdownFailsRunningAndQueuedJobs) {
  RegisterWorkers(2);
  cluster_.script().gate_step = 0;
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string running, runner_->Submit(Spec(2, 3)));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string queued, runner_->Submit(Spec(2, 3)));
  WaitForBlocked(2);
  // Shutdown waits for the running job's calls, released shortly after.
  std::thread release([this] {
    absl::SleepFor(absl::Milliseconds(50));
    cluster_.gate().Notify();
  });
  runner_->Shutdown();
  release.join();
  SHARDD_ASSERT_OK_AND_ASSIGN(auto queued_log, runner_->Events(queued));
  const std::vector<v1::StepEvent> events = queued_log->Snapshot();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].error(), HasSubstr("shutting down"));
  EXPECT_EQ(SummaryOf(queued).state, v1::JOB_FAILED);
  // The running job ended too (its step finished or was cut short).
  SHARDD_ASSERT_OK_AND_ASSIGN(auto running_log, runner_->Events(running));
  EXPECT_TRUE(running_log->ended());
  EXPECT_THAT(runner_->Submit(Spec(2, 1)),
              StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(JobRunnerTest, EventsOfAnUnknownJobAreNotFound) {
  StartRunner();
  EXPECT_THAT(runner_->Events("j-9"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("j-9")));
}

// ---------------------------------------------------------------------------
// Watching: replay from a step, then live events.

class CountingListener : public JobEventLog::Listener {
 public:
  void OnEventsAvailable() override { calls_.fetch_add(1); }
  int calls() const { return calls_.load(); }

 private:
  std::atomic<int> calls_{0};
};

TEST_F(JobRunnerTest, WatchReplaysStoredEventsThenStreamsLiveOnes) {
  RegisterWorkers(2);
  cluster_.script().gate_step = 3;  // Steps 1-3 run, step 4 waits.
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string id, runner_->Submit(Spec(2, 5)));
  WaitForBlocked(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::shared_ptr<JobEventLog> log,
                              runner_->Events(id));
  auto listener = std::make_shared<CountingListener>();
  log->AddListener(listener);

  // Replay from step 2: events 2 and 3 are stored.
  int64_t index = log->StartIndex(2);
  std::vector<int64_t> seen;
  v1::StepEvent event;
  while (log->Read(&index, &event) == JobEventLog::ReadResult::kEvent) {
    seen.push_back(event.step());
    ++index;
  }
  EXPECT_THAT(seen, ElementsAre(2, 3));
  EXPECT_EQ(log->Read(&index, &event), JobEventLog::ReadResult::kWait);
  EXPECT_EQ(listener->calls(), 0);

  // Live: steps 4 and 5 arrive, each telling the listener.
  cluster_.gate().Notify();
  WaitForEnd(id);
  EXPECT_EQ(listener->calls(), 2);
  while (true) {
    const JobEventLog::ReadResult result = log->Read(&index, &event);
    if (result != JobEventLog::ReadResult::kEvent) {
      EXPECT_EQ(result, JobEventLog::ReadResult::kEnded);
      break;
    }
    seen.push_back(event.step());
    ++index;
  }
  EXPECT_THAT(seen, ElementsAre(2, 3, 4, 5));
  EXPECT_TRUE(event.done());
}

// ---------------------------------------------------------------------------
// Recovery

// The events of a kind: steps (loss events), interruptions, recoveries.
std::vector<int64_t> StepsOf(const std::vector<v1::StepEvent>& events) {
  std::vector<int64_t> steps;
  for (const v1::StepEvent& event : events) {
    if (event.interruption().empty() && event.recovery().empty() &&
        event.error().empty()) {
      steps.push_back(event.step());
    }
  }
  return steps;
}
std::vector<const v1::StepEvent*> Recoveries(
    const std::vector<v1::StepEvent>& events) {
  std::vector<const v1::StepEvent*> out;
  for (const v1::StepEvent& event : events) {
    if (!event.recovery().empty()) out.push_back(&event);
  }
  return out;
}

TEST_F(JobRunnerTest, AFailedStepResumesFromTheStateEveryWorkerKept) {
  recover_ = true;
  RegisterWorkers(2);
  cluster_.script().once = true;
  // Rank 1 loses its peer; rank 0's collective aborts: nothing committed.
  cluster_.script().failures[1] = {2, absl::UnavailableError("peer gone")};
  cluster_.script().failures[0] = {2, absl::AbortedError("collective")};
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(2, 5)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(StepsOf(events), ElementsAre(1, 2, 3, 4, 5));
  ASSERT_EQ(events.size(), 7u);
  EXPECT_EQ(events[2].step(), 3);
  EXPECT_THAT(events[2].interruption(),
              AllOf(HasSubstr("step 3/5"), HasSubstr("rank 1 (fake-1:1)"),
                    HasSubstr("recovery 1 of 3")));
  EXPECT_EQ(events[3].step(), 2);
  EXPECT_THAT(events[3].recovery(), HasSubstr("every worker still held"));
  EXPECT_TRUE(events.back().done());
  // The second LoadPlan kept both ranks' state.
  const std::vector<v1::LoadPlanRequest> loads = cluster_.loads();
  ASSERT_EQ(loads.size(), 4u);
  EXPECT_FALSE(loads[0].keep_state());
  EXPECT_TRUE(loads[2].keep_state());
  EXPECT_TRUE(loads[3].keep_state());
  EXPECT_EQ(cluster_.State(0).steps, 5);
  const std::vector<JobSummary> jobs = runner_->ListJobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].state, v1::JOB_DONE);
  EXPECT_EQ(jobs[0].recoveries, 1);
}

TEST_F(JobRunnerTest, ALostReplicaHealsFromItsPeerWithNoLostStep) {
  recover_ = true;
  RegisterWorkers(4);
  cluster_.script().once = true;
  for (int rank = 0; rank < 4; ++rank) {
    cluster_.script().failures[rank] = {3, absl::AbortedError("collective")};
  }
  cluster_.script().wipe_on_failure = {3};
  StartRunner();
  JobSpec spec = Spec(4, 5);
  spec.plan.mutable_mesh()->set_dp_shard(2);
  spec.plan.mutable_mesh()->set_dp_replicate(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id, runner_->Submit(spec));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(StepsOf(events), ElementsAre(1, 2, 3, 4, 5));
  const auto recoveries = Recoveries(events);
  ASSERT_EQ(recoveries.size(), 1u);
  EXPECT_EQ(recoveries[0]->step(), 3);
  EXPECT_THAT(recoveries[0]->recovery(),
              AllOf(HasSubstr("healed ranks 3"), HasSubstr("step 3")));
  // Every rank took part; both shard groups copy from replica 0.
  const std::vector<v1::HealReplicasRequest> heals = cluster_.heals();
  ASSERT_EQ(heals.size(), 4u);
  EXPECT_THAT(heals[0].source_replica(), ElementsAre(0, 0));
  const std::vector<v1::LoadPlanRequest> loads = cluster_.loads();
  ASSERT_EQ(loads.size(), 8u);
  for (size_t i = 4; i < 8; ++i) {
    EXPECT_EQ(loads[i].keep_state(), loads[i].rank() != 3) << i;
  }
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(cluster_.State(rank).steps, 5);
}

TEST_F(JobRunnerTest, WithoutStateOrCheckpointTheJobStartsOver) {
  recover_ = true;
  RegisterWorkers(1);
  cluster_.script().once = true;
  cluster_.script().failures[0] = {2, absl::UnavailableError("restarted")};
  cluster_.script().wipe_on_failure = {0};
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(1, 4)));
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(StepsOf(events), ElementsAre(1, 2, 1, 2, 3, 4));
  const auto recoveries = Recoveries(events);
  ASSERT_EQ(recoveries.size(), 1u);
  EXPECT_EQ(recoveries[0]->step(), 0);
  EXPECT_THAT(recoveries[0]->recovery(), HasSubstr("started over from step 0"));
  EXPECT_TRUE(events.back().done());
}

// A worker that lost its plan answers FAILED_PRECONDITION with a reason; the
// runner recovers on the reason, not on the message's wording.
TEST_F(JobRunnerTest, APlanNotHeldReasonIsRecoveredAndItsWordsAloneAreNot) {
  recover_ = true;
  RegisterWorkers(1);
  cluster_.script().once = true;
  cluster_.script().failures[0] = {
      1, WithErrorReason(absl::FailedPreconditionError("lost it"),
                         kReasonPlanNotHeld)};
  cluster_.script().wipe_on_failure = {0};
  StartRunner();
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(1, 3)));
  std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_EQ(Recoveries(events).size(), 1u);
  EXPECT_TRUE(events.back().done()) << events.back().DebugString();

  // The same words with no reason: a precondition the runner cannot fix.
  cluster_.script().once = true;
  cluster_.script().failures[0] = {
      1, absl::FailedPreconditionError("no plan loaded: call LoadPlan first")};
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string bad,
                              runner_->Submit(Spec(1, 3)));
  events = WaitForEnd(bad);
  EXPECT_TRUE(Recoveries(events).empty());
  EXPECT_THAT(events.back().error(), HasSubstr("FAILED_PRECONDITION"));
}

TEST_F(JobRunnerTest, RecoveriesAreBoundedAndBadInputIsNotRetried) {
  recover_ = true;
  RegisterWorkers(1);
  cluster_.script().failures[0] = {1, absl::AbortedError("always")};
  StartRunner();
  JobSpec spec = Spec(1, 3);
  spec.config.set_max_recoveries(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id, runner_->Submit(spec));
  std::vector<v1::StepEvent> events = WaitForEnd(id);
  int interruptions = 0;
  for (const v1::StepEvent& event : events) {
    interruptions += event.interruption().empty() ? 0 : 1;
  }
  EXPECT_EQ(interruptions, 2);
  EXPECT_THAT(events.back().error(), HasSubstr("ABORTED: always"));

  cluster_.script().failures[0] = {0, absl::InvalidArgumentError("bad")};
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string bad,
                              runner_->Submit(Spec(1, 3)));
  events = WaitForEnd(bad);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_THAT(events[0].error(), HasSubstr("INVALID_ARGUMENT: bad"));
}

TEST_F(JobRunnerTest, ARecoveringJobGivesUpWhenItsWorkerDoesNotComeBack) {
  recover_ = true;
  RegisterWorkers(2);
  cluster_.script().hang_rank = 1;
  cluster_.script().hang_step = 1;
  JobRunnerOptions options;
  options.recovery_timeout = absl::Milliseconds(300);
  StartRunner(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(2, 3)));
  WaitForBlocked(1);
  Advance(absl::Seconds(2));  // Both miss heartbeats; rank 0 comes back.
  WorkerRegistration back;
  back.address = AddressOf(0);
  back.incarnation = 100;
  back.requested_rank = 0;
  ASSERT_THAT(registry_->Register(back), IsOk());
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  ASSERT_GE(events.size(), 2u);
  EXPECT_THAT(events[events.size() - 2].interruption(),
              HasSubstr("declared dead"));
  EXPECT_THAT(events.back().error(),
              AllOf(HasSubstr("did not come back within"), HasSubstr("1")));
}

TEST_F(JobRunnerTest, ARestartedRunnerCarriesTheJobOnFromItsJournal) {
  recover_ = true;
  ASSERT_NO_FATAL_FAILURE(OpenJournal("job_runner_journal"));
  JobJournal& journal = *journal_;
  RegisterWorkers(1);
  JobRunnerOptions options;
  options.journal = &journal;
  StartRunner(options);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string done_id,
                              runner_->Submit(Spec(1, 2)));
  ASSERT_TRUE(WaitForEnd(done_id).back().done());
  // The second job is in step 4 when the coordinator goes away.
  cluster_.script().once = true;
  cluster_.script().hang_rank = 0;
  cluster_.script().hang_step = 3;
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(1, 6)));
  WaitForBlocked(1);
  runner_->Shutdown();
  EXPECT_EQ(cluster_.State(0).steps, 3);

  StartRunner(options);
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(StepsOf(events), ElementsAre(4, 5, 6));
  const auto recoveries = Recoveries(events);
  ASSERT_EQ(recoveries.size(), 1u);
  EXPECT_EQ(recoveries[0]->step(), 3);
  EXPECT_TRUE(events.back().done());
  // The finished job is still listed, and ids go on.
  const std::vector<v1::StepEvent> first = WaitForEnd(done_id);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_TRUE(first[0].done());
  EXPECT_EQ(first[0].step(), 2);
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string next,
                              runner_->Submit(Spec(1, 1)));
  EXPECT_EQ(next, "j-3");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<StoredJob> stored, journal.LoadAll());
  ASSERT_EQ(stored.size(), 3u);
  EXPECT_EQ(stored[1].progress.state(), v1::JOB_DONE);
  EXPECT_EQ(stored[1].progress.steps_done(), 6);
  EXPECT_EQ(stored[1].progress.recoveries(), 0);  // A restart is no fault.
  runner_->Shutdown();
}

// A job restored from the journal evaluates as before: its eval program is
// compiled again from the stored plan (a real one here).
TEST_F(JobRunnerTest, ARestartedRunnerKeepsEvaluating) {
  recover_ = true;
  ASSERT_NO_FATAL_FAILURE(OpenJournal("job_runner_eval_journal"));
  JobJournal& journal = *journal_;
  RegisterWorkers(1);
  JobRunnerOptions options;
  options.journal = &journal;
  StartRunner(options);
  std::unique_ptr<StrategyRegistry> strategies =
      StrategyRegistry::CreateWithBuiltins();
  ShardingPlanner planner(strategies.get());
  v1::PlanOptions plan_options;
  plan_options.mutable_mesh()->set_dp_shard(1);
  plan_options.mutable_mesh()->set_dp_replicate(1);
  JobSpec spec = EvalSpec(1, 4, 2, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      spec.plan,
      planner.Plan(testing_util::TinyMoeSpec(testing_util::TinyMoeShape()),
                   plan_options));
  SHARDD_ASSERT_OK_AND_ASSIGN(spec.program, CompileStepProgram(spec.plan));
  SHARDD_ASSERT_OK_AND_ASSIGN(spec.eval_program, CompileEvalProgram(spec.plan));
  // Step 3 hangs when the coordinator goes away.
  cluster_.script().once = true;
  cluster_.script().hang_rank = 0;
  cluster_.script().hang_step = 2;
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id, runner_->Submit(spec));
  WaitForBlocked(1);
  runner_->Shutdown();

  // The new runner's log starts at the restart. It does not know that step
  // 2's evaluation ran (evaluations are not journaled) and runs it again
  // (it changes nothing), then goes on evaluating.
  StartRunner(options);
  const std::vector<v1::StepEvent> events = WaitForEnd(id);
  EXPECT_THAT(EventSequence(events), ElementsAre(-2, 3, 4, -4));
  EXPECT_TRUE(events.back().done());
  EXPECT_TRUE(events.back().has_eval_loss());
  runner_->Shutdown();
}

TEST_F(JobRunnerTest, OnDemandCheckpointRequestsAreRefusedWhenTheyCannotRun) {
  RegisterWorkers(1);
  StartRunner();
  absl::StatusOr<CheckpointResult> result;
  runner_->RequestSave("j-1", [&](absl::StatusOr<CheckpointResult> r) {
    result = std::move(r);
  });
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("--checkpoint-dir")));
  const char* tmp = std::getenv("TEST_TMPDIR");
  JobRunnerOptions options;
  options.checkpoint_dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/job_runner_demand");
  StartRunner(options);
  runner_->RequestSave("j-9", [&](absl::StatusOr<CheckpointResult> r) {
    result = std::move(r);
  });
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kNotFound, HasSubstr("j-9")));
  runner_->RequestLoad("j-1", "../x", [&](absl::StatusOr<CheckpointResult> r) {
    result = std::move(r);
  });
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("checkpoint")));
  runner_->RequestLoad(
      "j-1", "j-1/step-00000001",
      [&](absl::StatusOr<CheckpointResult> r) { result = std::move(r); });
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kNotFound));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string id,
                              runner_->Submit(Spec(1, 1)));
  WaitForEnd(id);
  runner_->RequestSave(
      id, [&](absl::StatusOr<CheckpointResult> r) { result = std::move(r); });
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("JOB_DONE")));
}

TEST(JobEventLogTest, KeepsTheLastEventsAndEndsOnDoneOrError) {
  JobEventLog log("j-1", 3);
  for (int step = 1; step <= 5; ++step) {
    v1::StepEvent event;
    event.set_step(step);
    log.Append(event);
  }
  // Steps 3..5 are kept at positions 2..4.
  EXPECT_EQ(log.StartIndex(0), 2);
  EXPECT_EQ(log.StartIndex(4), 3);
  EXPECT_EQ(log.StartIndex(9), 5);  // The next event to come.
  int64_t index = 0;
  v1::StepEvent event;
  ASSERT_EQ(log.Read(&index, &event), JobEventLog::ReadResult::kEvent);
  EXPECT_EQ(index, 2);  // Moved past the dropped events.
  EXPECT_EQ(event.step(), 3);
  EXPECT_FALSE(log.ended());

  v1::StepEvent failed;
  failed.set_step(6);
  failed.set_error("boom");
  log.Append(failed);
  EXPECT_TRUE(log.ended());
  v1::StepEvent late;
  late.set_step(7);
  log.Append(late);  // Ignored.
  index = 5;
  ASSERT_EQ(log.Read(&index, &event), JobEventLog::ReadResult::kEvent);
  EXPECT_EQ(event.error(), "boom");
  ++index;
  EXPECT_EQ(log.Read(&index, &event), JobEventLog::ReadResult::kEnded);
}

TEST(CallCancellerTest, CancelRunsRegisteredCallbacksOnceAndLateOnesAtOnce) {
  CallCanceller canceller;
  int a = 0;
  int b = 0;
  const uint64_t ha = canceller.Add([&a] { ++a; });
  const uint64_t hb = canceller.Add([&b] { ++b; });
  canceller.Remove(hb);
  EXPECT_NE(ha, 0u);
  EXPECT_FALSE(canceller.cancelled());
  canceller.Cancel();
  canceller.Cancel();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 0);
  int c = 0;
  EXPECT_EQ(canceller.Add([&c] { ++c; }), 0u);
  EXPECT_EQ(c, 1);
  EXPECT_TRUE(canceller.cancelled());
}

}  // namespace
}  // namespace shardd
