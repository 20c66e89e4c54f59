#include "worker/worker_metrics.h"

#include <utility>

#include "common/status_macros.h"
#include "worker/comm/communicator.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Create(
    MetricsRegistry* registry) {
  std::unique_ptr<WorkerMetrics> m(new WorkerMetrics());
  SHARDD_ASSIGN_OR_RETURN(
      m->steps_,
      registry->AddCounter("shardd_worker_steps_total",
                           "Training steps this worker finished.", {}));
  SHARDD_ASSIGN_OR_RETURN(
      m->tokens_,
      registry->AddCounter("shardd_worker_tokens_total",
                           "Tokens of this worker's micro-batches in "
                           "finished steps.",
                           {}));
  // 1 ms to about 9 minutes.
  SHARDD_ASSIGN_OR_RETURN(
      m->step_seconds_,
      registry->AddHistogram("shardd_worker_step_seconds",
                             "Wall time of finished steps.", {},
                             ExponentialBuckets(0.001, 2, 20)));
  SHARDD_ASSIGN_OR_RETURN(
      m->collective_calls_,
      registry->AddCounter("shardd_worker_collective_calls_total",
                           "Collective calls on the shard groups, failed "
                           "ones included.",
                           {"op"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->collective_errors_,
      registry->AddCounter("shardd_worker_collective_errors_total",
                           "Collective calls on the shard groups that "
                           "failed.",
                           {"op"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->collective_bytes_,
      registry->AddCounter("shardd_worker_collective_bytes_total",
                           "Unsharded bytes moved by successful collectives "
                           "on the shard groups (all-gather output, "
                           "reduce-scatter input).",
                           {"op"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->collective_seconds_,
      registry->AddCounter("shardd_worker_collective_seconds_total",
                           "Wall time inside successful collectives on the "
                           "shard groups, waiting for peers included.",
                           {"op"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->memory_live_,
      registry->AddGauge("shardd_worker_memory_live_bytes",
                         "Tracked bytes in use, by memory kind.", {"kind"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->memory_peak_,
      registry->AddGauge("shardd_worker_memory_peak_bytes",
                         "Peak tracked bytes since the current step (or "
                         "plan load) started, by memory kind.",
                         {"kind"}));
  SHARDD_ASSIGN_OR_RETURN(
      m->optimizer_steps_,
      registry->AddGauge("shardd_worker_optimizer_steps",
                         "Optimizer steps applied to the held job's shards "
                         "(-1: state lost).",
                         {}));
  SHARDD_ASSIGN_OR_RETURN(
      m->step_failed_,
      registry->AddGauge("shardd_worker_step_failed",
                         "1 when the held job's last step failed (it then "
                         "refuses steps until a new plan load).",
                         {}));
  SHARDD_ASSIGN_OR_RETURN(
      m->heartbeat_failures_,
      registry->AddCounter("shardd_worker_heartbeat_failures_total",
                           "Heartbeats to the coordinator that failed.", {}));
  SHARDD_ASSIGN_OR_RETURN(
      m->insecure_,
      registry->AddGauge("shardd_worker_insecure",
                         "1 when the worker serves other machines without "
                         "TLS or tokens (--insecure).",
                         {}));
  m->insecure_->Set({}, 0);
  SHARDD_ASSIGN_OR_RETURN(
      m->rank_, registry->AddGauge("shardd_worker_rank",
                                   "Rank the coordinator assigned.", {}));
  SHARDD_ASSIGN_OR_RETURN(
      m->membership_epoch_,
      registry->AddGauge("shardd_worker_membership_epoch",
                         "Membership epoch of the last heartbeat or "
                         "registration.",
                         {}));
  // Series exist from the start, so rates see them begin at 0.
  m->steps_->Add({}, 0);
  m->tokens_->Add({}, 0);
  WorkerMetrics* raw = m.get();
  registry->AddCollector([raw] { raw->Collect(); });
  return m;
}

void WorkerMetrics::RecordStep(const StepResult& result) {
  steps_->Increment({});
  tokens_->Add({}, static_cast<double>(result.tokens));
  step_seconds_->Observe({}, result.seconds);
}

void WorkerMetrics::set_insecure(bool insecure) {
  insecure_->Set({}, insecure ? 1 : 0);
}

void WorkerMetrics::set_runtime(const WorkerRuntime* runtime) {
  absl::MutexLock lock(&mu_);
  runtime_ = runtime;
}

void WorkerMetrics::set_agent(const CoordinatorAgent* agent) {
  absl::MutexLock lock(&mu_);
  agent_ = agent;
}

void WorkerMetrics::Collect() {
  absl::MutexLock lock(&mu_);
  if (runtime_ != nullptr) {
    const CommunicatorStats totals = runtime_->CollectiveTotals();
    for (const auto& [op, stats] :
         {std::make_pair("all_gather", &totals.all_gather),
          std::make_pair("reduce_scatter", &totals.reduce_scatter),
          std::make_pair("all_reduce", &totals.all_reduce),
          std::make_pair("broadcast", &totals.broadcast),
          std::make_pair("barrier", &totals.barrier)}) {
      collective_calls_->Set({op}, static_cast<double>(stats->calls));
      collective_errors_->Set({op}, static_cast<double>(stats->failures));
      collective_bytes_->Set({op}, static_cast<double>(stats->bytes));
      collective_seconds_->Set({op}, absl::ToDoubleSeconds(stats->time));
    }
    const MemorySnapshot memory = runtime_->MemoryUsage();
    for (int k = 0; k < static_cast<int>(MemoryKind::kNumKinds); ++k) {
      const char* kind = MemoryKindName(static_cast<MemoryKind>(k));
      memory_live_->Set({kind}, static_cast<double>(memory.live[k]));
      memory_peak_->Set({kind}, static_cast<double>(memory.peak[k]));
    }
    const v1::GetStatsResponse stats = runtime_->GetStats();
    optimizer_steps_->Set({}, static_cast<double>(stats.optimizer_steps()));
    step_failed_->Set({}, stats.step_failed() ? 1 : 0);
  }
  if (agent_ != nullptr) {
    heartbeat_failures_->Set({},
                             static_cast<double>(agent_->heartbeat_failures()));
    const AgentRegistration registration = agent_->registration();
    rank_->Set({}, registration.rank);
    membership_epoch_->Set({},
                           static_cast<double>(registration.membership_epoch));
  }
}

}  // namespace shardd
