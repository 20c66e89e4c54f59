#ifndef SHARDD_TESTING_FAKE_CLUSTER_H_
#define SHARDD_TESTING_FAKE_CLUSTER_H_

// A scripted in-memory cluster of fake workers for the coordinator's job
// tests: WorkerClients whose answers (losses, tokens, failures, hangs, a
// gate that holds steps) follow a Script, and which record every call.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/error_info.h"
#include "proto/coordinator.pb.h"
#include "proto/worker.pb.h"
#include "server/jobs/worker_client.h"

namespace shardd {
namespace testing_util {

// The fingerprint of the plan a LoadPlan installs: the plan's, or the one
// the worker is to derive.
inline uint64_t PlanFingerprint(const v1::LoadPlanRequest& request) {
  return request.has_plan() ? request.plan().fingerprint()
                            : request.plan_fingerprint();
}

// What a fake worker does; read under FakeCluster::mu_.
struct Script {
  // Rank r's loss and tokens at step s (0-based).
  std::function<double(int, int64_t)> loss = [](int rank, int64_t step) {
    return static_cast<double>(step + rank);
  };
  std::function<int64_t(int)> tokens = [](int rank) {
    return int64_t{10} * (rank + 1);
  };
  // Rank r's held-out loss on eval batch k (an eval program's Execute,
  // recorded as method "Eval" with step k); its tokens are tokens(r).
  std::function<double(int, int64_t)> eval_loss = [](int rank, int64_t batch) {
    return 10.0 + static_cast<double>(batch + rank);
  };
  // Fail the rank's next eval call with this status (once).
  std::map<int, absl::Status> eval_failures;
  // Ranks whose planning disagrees with the coordinator's: a LoadPlan
  // without the plan fails with reason PLAN_DERIVATION_MISMATCH.
  std::set<int> derive_mismatch;
  // Fail `fail_rank`'s call of step `fail_step` with `fail_status` (several
  // ranks may fail: one entry each).
  std::map<int, std::pair<int64_t, absl::Status>> failures;
  // Rank `hang_rank` blocks at step `hang_step` until its deadline (or only
  // until cancelled when `ignore_deadline`).
  int hang_rank = -1;
  int64_t hang_step = -1;
  bool ignore_deadline = false;
  // Execute of step >= gate_step waits for `gate` (released by the test).
  int64_t gate_step = -1;
  double entropy_rate = 1.25;
  // Failures and hangs fire once (then the step succeeds when run again).
  bool once = false;
  // Ranks whose state is lost when their scripted failure fires (a worker
  // restarted in the middle of the step).
  std::set<int> wipe_on_failure;
};

// What a fake rank holds, like a worker's GetStats: the job, its plan and
// the committed steps (-1: nothing).
struct RankState {
  std::string job;
  uint64_t fingerprint = 0;
  int64_t steps = -1;
};

struct Call {
  int rank = 0;
  std::string method;  // "LoadPlan", "Execute", "RunCommand".
  int64_t step = -1;
  int index = -1;
  bool begin = false;
  bool end = false;
  std::string job_id;
  int64_t sequence = 0;  // Global order of arrival.
};

class FakeCluster {
 public:
  Script& script() { return script_; }
  absl::Notification& gate() { return gate_; }

  std::unique_ptr<WorkerClient> MakeClient(const std::string& address);

  std::vector<Call> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  std::vector<v1::LoadPlanRequest> loads() {
    absl::MutexLock lock(&mu_);
    return loads_;
  }
  // Calls of `method` now blocked in a hang or gate.
  int blocked() {
    absl::MutexLock lock(&mu_);
    return blocked_;
  }

  // Records a call and returns the scripted outcome of step work.
  absl::Status Work(int rank, const std::string& method, int64_t step,
                    int index, bool begin, bool end, const std::string& job,
                    const WorkerCallOptions& options) {
    bool hang = false;
    bool gated = false;
    bool ignore_deadline = false;
    absl::Status failure;
    {
      absl::MutexLock lock(&mu_);
      Call call;
      call.rank = rank;
      call.method = method;
      call.step = step;
      call.index = index;
      call.begin = begin;
      call.end = end;
      call.job_id = job;
      call.sequence = next_sequence_++;
      calls_.push_back(call);
      if (method == "LoadPlan") return absl::OkStatus();
      if (method == "Eval") {
        auto e = script_.eval_failures.find(rank);
        if (e == script_.eval_failures.end()) return absl::OkStatus();
        const absl::Status failed = e->second;
        script_.eval_failures.erase(e);
        return failed;
      }
      auto it = script_.failures.find(rank);
      if (it != script_.failures.end() && it->second.first == step) {
        failure = it->second.second;
        if (script_.wipe_on_failure.count(rank) != 0) ranks_.erase(rank);
        if (script_.once) script_.failures.erase(it);
      }
      hang = rank == script_.hang_rank && step == script_.hang_step;
      if (hang && script_.once) script_.hang_rank = -1;
      ignore_deadline = script_.ignore_deadline;
      gated = script_.gate_step >= 0 && step >= script_.gate_step;
      if (hang || gated) ++blocked_;
    }
    if (gated) {
      gate_.WaitForNotification();
      absl::MutexLock lock(&mu_);
      --blocked_;
    }
    if (hang) {
      absl::Notification cancelled;
      uint64_t handle = 0;
      if (options.canceller != nullptr) {
        handle = options.canceller->Add([&cancelled] { cancelled.Notify(); });
      }
      const bool was_cancelled =
          ignore_deadline
              ? (cancelled.WaitForNotification(), true)
              : cancelled.WaitForNotificationWithDeadline(options.deadline);
      if (options.canceller != nullptr) options.canceller->Remove(handle);
      {
        absl::MutexLock lock(&mu_);
        --blocked_;
      }
      return was_cancelled ? absl::CancelledError("cancelled")
                           : absl::DeadlineExceededError("deadline passed");
    }
    return failure;
  }

  v1::ExecuteResponse Result(int rank, int64_t step) {
    absl::MutexLock lock(&mu_);
    v1::ExecuteResponse response;
    response.set_loss(script_.loss(rank, step));
    response.set_tokens(script_.tokens(rank));
    response.set_step(step + 1);
    response.set_grad_norm(0.5 + rank);  // Rank 0's is reported.
    response.set_peak_unsharded_bytes(1000 + rank);
    response.set_all_gathers(4 + rank % 2);
    response.set_reduce_scatters(3);
    return response;
  }

  // An eval program's result: nothing is committed.
  v1::ExecuteResponse EvalResult(int rank, int64_t batch) {
    absl::MutexLock lock(&mu_);
    v1::ExecuteResponse response;
    response.set_loss(script_.eval_loss(rank, batch));
    response.set_tokens(script_.tokens(rank));
    response.set_step(ranks_[rank].steps);
    return response;
  }

  // Installs the plan on `rank` and returns the kept step (-1: fresh).
  int64_t RecordLoad(int rank, const v1::LoadPlanRequest& request) {
    absl::MutexLock lock(&mu_);
    loads_.push_back(request);
    RankState& state = ranks_[rank];
    if (request.keep_state() && state.job == request.job_id() &&
        state.fingerprint == PlanFingerprint(request) && state.steps >= 0) {
      return state.steps;
    }
    state.job = request.job_id();
    state.fingerprint = PlanFingerprint(request);
    state.steps = 0;
    return -1;
  }
  void Commit(int rank, int64_t steps) {
    absl::MutexLock lock(&mu_);
    auto it = ranks_.find(rank);
    if (it != ranks_.end()) it->second.steps = steps;
  }
  RankState State(int rank) {
    absl::MutexLock lock(&mu_);
    auto it = ranks_.find(rank);
    return it == ranks_.end() ? RankState() : it->second;
  }
  // HealReplicas on `rank` of a dp_shard x replicas mesh.
  int64_t Heal(int rank, int dp_shard, const v1::HealReplicasRequest& request) {
    absl::MutexLock lock(&mu_);
    heals_.push_back(request);
    const int source = request.source_replica(rank % dp_shard);
    if (source >= 0) {
      const RankState from = ranks_[source * dp_shard + rank % dp_shard];
      ranks_[rank].steps = from.steps;
    }
    return ranks_[rank].steps;
  }
  std::vector<v1::HealReplicasRequest> heals() {
    absl::MutexLock lock(&mu_);
    return heals_;
  }
  bool DerivesAnotherPlan(int rank) {
    absl::MutexLock lock(&mu_);
    return script_.derive_mismatch.count(rank) != 0;
  }
  double entropy_rate() {
    absl::MutexLock lock(&mu_);
    return script_.entropy_rate;
  }

 private:
  Script script_;  // Set up before jobs start.
  absl::Notification gate_;
  absl::Mutex mu_;
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::LoadPlanRequest> loads_ ABSL_GUARDED_BY(mu_);
  int64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, RankState> ranks_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::HealReplicasRequest> heals_ ABSL_GUARDED_BY(mu_);
};

class FakeWorker final : public WorkerClient {
 public:
  FakeWorker(FakeCluster* cluster, std::string address, int rank)
      : cluster_(cluster), address_(std::move(address)), rank_(rank) {}

  const std::string& address() const override { return address_; }

  absl::StatusOr<v1::LoadPlanResponse> LoadPlan(
      const v1::LoadPlanRequest& request,
      const WorkerCallOptions& options) override {
    absl::Status status = cluster_->Work(rank_, "LoadPlan", -1, -1, false,
                                         false, request.job_id(), options);
    if (!status.ok()) return status;
    if (!request.has_plan() && cluster_->DerivesAnotherPlan(rank_)) {
      return WithErrorReason(
          absl::FailedPreconditionError("plan_options: another fingerprint"),
          kReasonPlanDerivationMismatch);
    }
    job_ = request.job_id();
    dp_shard_ = std::max(1, request.has_plan()
                                ? request.plan().mesh().dp_shard()
                                : request.plan_options().mesh().dp_shard());
    v1::LoadPlanResponse response;
    response.set_kept_step(cluster_->RecordLoad(rank_, request));
    response.set_data_entropy_rate(rank_ == 0 ? cluster_->entropy_rate()
                                              : 99.0);
    return response;
  }

  absl::StatusOr<v1::ExecuteResponse> Execute(
      const v1::ExecuteRequest& request,
      const WorkerCallOptions& options) override {
    const int64_t step = request.program().step();
    if (request.program().eval()) {
      absl::Status status =
          cluster_->Work(rank_, "Eval", step, -1, false, false, job_, options);
      if (!status.ok()) return status;
      return cluster_->EvalResult(rank_, step);
    }
    absl::Status status =
        cluster_->Work(rank_, "Execute", step, -1, false, false, job_, options);
    if (!status.ok()) return status;
    cluster_->Commit(rank_, step + 1);
    return cluster_->Result(rank_, step);
  }

  absl::StatusOr<v1::ExecuteResponse> RunCommand(
      const v1::RunCommandRequest& request,
      const WorkerCallOptions& options) override {
    absl::Status status =
        cluster_->Work(rank_, "RunCommand", request.step(), request.index(),
                       request.begin_step(), request.end_step(), job_, options);
    if (!status.ok()) return status;
    if (!request.end_step()) return v1::ExecuteResponse();
    cluster_->Commit(rank_, request.step() + 1);
    return cluster_->Result(rank_, request.step());
  }

  absl::StatusOr<v1::GetStatsResponse> GetStats(
      const WorkerCallOptions& /*options*/) override {
    const RankState state = cluster_->State(rank_);
    v1::GetStatsResponse response;
    response.set_job_id(state.job);
    response.set_plan_fingerprint(state.fingerprint);
    response.set_optimizer_steps(state.steps);
    return response;
  }

  absl::StatusOr<v1::HealReplicasResponse> HealReplicas(
      const v1::HealReplicasRequest& request,
      const WorkerCallOptions& /*options*/) override {
    v1::HealReplicasResponse response;
    response.set_step(cluster_->Heal(rank_, dp_shard_, request));
    return response;
  }

 private:
  FakeCluster* const cluster_;
  const std::string address_;
  const int rank_;
  std::string job_;  // Set by LoadPlan, read by later calls (one thread).
  int dp_shard_ = 1;
};

// Addresses are "fake-<rank>:1" (ranks 0 to 9).
inline std::unique_ptr<WorkerClient> FakeCluster::MakeClient(
    const std::string& address) {
  const int rank = address[5] - '0';
  return std::make_unique<FakeWorker>(this, address, rank);
}

inline std::string AddressOf(int rank) {
  return absl::StrCat("fake-", rank, ":1");
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_FAKE_CLUSTER_H_
