#include "server/coordinator_metrics.h"

#include <map>
#include <string>

#include "common/job_state_name.h"
#include "common/status_macros.h"
#include "proto/coordinator.pb.h"

namespace shardd {

absl::Status RegisterCoordinatorMetrics(CoordinatorService* service,
                                        MetricsRegistry* registry,
                                        const RpcLatencies* latencies) {
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * uptime,
      registry->AddGauge("shardd_coordinator_uptime_seconds",
                         "Seconds since this coordinator started.", {}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * models,
      registry->AddGauge("shardd_coordinator_models",
                         "Models stored (SubmitModel).", {}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * workers,
      registry->AddGauge("shardd_coordinator_workers",
                         "Registered workers by liveness.", {"state"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * epoch,
      registry->AddGauge("shardd_coordinator_membership_epoch",
                         "Current worker membership epoch.", {}));
  SHARDD_ASSIGN_OR_RETURN(
      CounterFamily * declared_dead,
      registry->AddCounter("shardd_coordinator_workers_declared_dead_total",
                           "Workers declared dead because their heartbeat "
                           "deadline passed.",
                           {}));
  SHARDD_ASSIGN_OR_RETURN(
      CounterFamily * checkpoint_failures,
      registry->AddCounter("shardd_coordinator_checkpoint_failures_total",
                           "Periodic checkpoint saves that failed or were "
                           "skipped (no room, a write error).",
                           {}));
  SHARDD_ASSIGN_OR_RETURN(
      CounterFamily * checkpoints_deleted,
      registry->AddCounter("shardd_coordinator_checkpoints_deleted_total",
                           "Checkpoints deleted by jobs' retention "
                           "(keep_checkpoints).",
                           {}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * insecure,
      registry->AddGauge("shardd_coordinator_insecure",
                         "1 when the coordinator serves other machines "
                         "without TLS or tokens (--insecure).",
                         {}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * insecure_workers,
      registry->AddGauge("shardd_coordinator_insecure_workers",
                         "Registered workers that serve other machines "
                         "without TLS or tokens (--insecure).",
                         {}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * jobs,
      registry->AddGauge("shardd_coordinator_jobs",
                         "Kept training jobs by state.", {"state"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * steps_done,
      registry->AddGauge("shardd_coordinator_job_steps_done",
                         "Steps a job has finished.", {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * total_steps,
      registry->AddGauge("shardd_coordinator_job_total_steps",
                         "Steps a job was submitted with.", {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * loss,
      registry->AddGauge("shardd_coordinator_job_loss",
                         "Loss of a job's last finished step.", {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * lr,
      registry->AddGauge("shardd_coordinator_job_lr",
                         "Learning rate of a job's last finished step.",
                         {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * eval_loss,
      registry->AddGauge("shardd_coordinator_job_eval_loss",
                         "Held-out loss of a job's last evaluation (absent "
                         "before the first).",
                         {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * tokens_per_second,
      registry->AddGauge("shardd_coordinator_job_tokens_per_second",
                         "Training throughput of a job's recent steps.",
                         {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * recoveries,
      registry->AddGauge("shardd_coordinator_job_recoveries",
                         "Faults a job recovered from so far.", {"job_id"}));
  SHARDD_ASSIGN_OR_RETURN(
      GaugeFamily * job_state,
      registry->AddGauge("shardd_coordinator_job_state",
                         "1 for a job's current state (one series per job).",
                         {"job_id", "model_id", "state"}));

  registry->AddCollector([=] {
    // GetStatus has no error paths; an error would leave the last values.
    absl::StatusOr<v1::GetStatusResponse> status =
        service->GetStatus(v1::GetStatusRequest());
    if (!status.ok()) return;
    uptime->Set({}, status->uptime_ms() / 1000.0);
    models->Set({}, status->models_size());
    int alive = 0;
    int exposed = 0;
    for (const v1::WorkerInfo& worker : status->workers()) {
      alive += worker.alive() ? 1 : 0;
      exposed += worker.insecure() ? 1 : 0;
    }
    insecure->Set({}, status->insecure().empty() ? 0 : 1);
    insecure_workers->Set({}, exposed);
    workers->Set({"alive"}, alive);
    workers->Set({"dead"}, status->workers_size() - alive);
    epoch->Set({}, static_cast<double>(service->workers()->membership_epoch()));
    declared_dead->Set(
        {}, static_cast<double>(service->workers()->declared_dead()));
    checkpoint_failures->Set(
        {}, static_cast<double>(status->checkpoint_failures_total()));
    checkpoints_deleted->Set(
        {}, static_cast<double>(status->checkpoints_deleted_total()));

    // Every state appears (zeros included), so a rate or alert on one never
    // sees the series vanish.
    std::map<std::string, int> by_state;
    for (v1::JobState state :
         {v1::JOB_QUEUED, v1::JOB_RUNNING, v1::JOB_RECOVERING, v1::JOB_DONE,
          v1::JOB_FAILED}) {
      by_state[JobStateName(state)] = 0;
    }
    // Per-job series follow the kept jobs: forgotten jobs disappear.
    for (GaugeFamily* family : {steps_done, total_steps, loss, lr, eval_loss,
                                tokens_per_second, recoveries, job_state}) {
      family->Clear();
    }
    for (const v1::JobInfo& job : status->jobs()) {
      ++by_state[JobStateName(job.state())];
      const LabelValues id = {job.job_id()};
      steps_done->Set(id, static_cast<double>(job.steps_done()));
      total_steps->Set(id, job.total_steps());
      loss->Set(id, job.loss());
      lr->Set(id, job.lr());
      if (job.has_eval_loss()) eval_loss->Set(id, job.eval_loss());
      tokens_per_second->Set(id, job.tokens_per_second());
      recoveries->Set(id, job.recoveries());
      job_state->Set({job.job_id(), job.model_id(), JobStateName(job.state())},
                     1);
    }
    for (const auto& [state, count] : by_state) jobs->Set({state}, count);
  });
  if (latencies != nullptr) {
    SHARDD_ASSIGN_OR_RETURN(
        HistogramFamily * rpc_seconds,
        registry->AddHistogram(
            "shardd_coordinator_rpc_seconds",
            "Server-side latency of control-plane calls: from the handler's "
            "start to its answer (a Get or Barrier: to its release).",
            {"method"}, RpcLatencies::Bounds()));
    registry->AddCollector([latencies, rpc_seconds] {
      for (int m = 0; m < RpcLatencies::kMethods; ++m) {
        const auto method = static_cast<RpcLatencies::Method>(m);
        rpc_seconds->Set({RpcLatencies::Name(method)}, latencies->Get(method));
      }
    });
  }
  return absl::OkStatus();
}

}  // namespace shardd
