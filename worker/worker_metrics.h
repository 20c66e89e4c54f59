#ifndef SHARDD_WORKER_WORKER_METRICS_H_
#define SHARDD_WORKER_WORKER_METRICS_H_

// The worker's Prometheus metrics (docs/observability.md lists them). Steps
// are counted as they finish (WorkerRuntimeOptions::on_step -> RecordStep);
// everything else is read at scrape time from the runtime's counters and
// memory tracker and from the coordinator agent.
//
//   auto metrics = WorkerMetrics::Create(&registry);
//   options.on_step = [m = metrics->get()](const StepResult& r) {
//     m->RecordStep(r);
//   };
//   WorkerRuntime runtime(options);
//   (*metrics)->set_runtime(&runtime);  (*metrics)->set_agent(agent.get());
//
// Thread-safe.

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics_registry.h"
#include "worker/grpc/coordinator_agent.h"
#include "worker/exec/step_executor.h"
#include "worker/worker_runtime.h"

namespace shardd {

class WorkerMetrics {
 public:
  // Registers the worker families and their collector in `registry` (not
  // owned; must outlive this object, which must outlive every Render).
  // Errors: those of MetricsRegistry::Add* (ALREADY_EXISTS when the
  // families are already registered there).
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Create(
      MetricsRegistry* registry);

  WorkerMetrics(const WorkerMetrics&) = delete;
  WorkerMetrics& operator=(const WorkerMetrics&) = delete;

  // Counts one finished step: its tokens and its time.
  void RecordStep(const StepResult& result);

  // What the collector reads; null (the default) publishes nothing for it.
  // Not owned: set null again before destroying them while rendering may
  // still happen.
  void set_runtime(const WorkerRuntime* runtime) ABSL_LOCKS_EXCLUDED(mu_);
  void set_agent(const CoordinatorAgent* agent) ABSL_LOCKS_EXCLUDED(mu_);
  // shardd_worker_insecure: 1 when --listen serves other machines without
  // TLS or tokens (--insecure).
  void set_insecure(bool insecure);

 private:
  WorkerMetrics() = default;
  // Copies the runtime's and agent's counters into the families.
  void Collect() ABSL_LOCKS_EXCLUDED(mu_);

  CounterFamily* steps_ = nullptr;
  CounterFamily* tokens_ = nullptr;
  HistogramFamily* step_seconds_ = nullptr;
  CounterFamily* collective_calls_ = nullptr;
  CounterFamily* collective_errors_ = nullptr;
  CounterFamily* collective_bytes_ = nullptr;
  CounterFamily* collective_seconds_ = nullptr;
  GaugeFamily* memory_live_ = nullptr;
  GaugeFamily* memory_peak_ = nullptr;
  GaugeFamily* optimizer_steps_ = nullptr;
  GaugeFamily* step_failed_ = nullptr;
  CounterFamily* heartbeat_failures_ = nullptr;
  GaugeFamily* rank_ = nullptr;
  GaugeFamily* insecure_ = nullptr;
  GaugeFamily* membership_epoch_ = nullptr;

  absl::Mutex mu_;
  const WorkerRuntime* runtime_ ABSL_GUARDED_BY(mu_) = nullptr;
  const CoordinatorAgent* agent_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_WORKER_METRICS_H_
