#ifndef SHARDD_SERVER_COORDINATOR_SERVICE_H_
#define SHARDD_SERVER_COORDINATOR_SERVICE_H_

// The coordinator's logic, free of any transport: strategies, submitted
// models and their plans, worker membership (worker_registry.h), the
// rendezvous key-value store (kv_store.h) and barriers (barrier.h), status.
// The gRPC adapter (grpc_coordinator_service.h) only converts statuses and
// finishes waiting calls (Get with wait, Barrier) and WatchStep streams
// asynchronously; tests drive this class directly. Training jobs
// (SubmitStep/WatchStep) run in a JobRunner (job_runner.h) that reaches the
// workers through the injected WorkerClientFactory. Checkpoints: jobs save
// and resume through TrainConfig (checkpoint_every, resume_from; see
// job_runner.h) and ListCheckpoints lists options.jobs.checkpoint_dir;
// SaveCheckpoint and LoadCheckpoint reach a running job between its steps.
// With a StateStore, jobs and their progress are durable (job_journal.h)
// and membership epochs grow across restarts.
//
// Thread-safe: every method may be called concurrently.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "server/barrier.h"
#include "server/jobs/job_journal.h"
#include "server/jobs/job_runner.h"
#include "server/kv_store.h"
#include "planner/sharding_planner.h"
#include "server/state_store.h"
#include "planner/strategy_registry.h"
#include "server/jobs/worker_client.h"
#include "server/worker_registry.h"

namespace shardd {

struct CoordinatorServiceOptions {
  // Largest accepted model description: the JSON text of hf_config_json /
  // native_spec_json, or the serialized size of a ModelSpec.
  size_t max_model_bytes = size_t{16} << 20;
  // Most models kept at once; further new models are refused.
  int max_models = 1024;
  // Most bytes of stored specs and plans together (plans of very large
  // worlds list per-rank rows and reach tens of MiB each).
  size_t max_stored_bytes = size_t{1} << 30;
  // Identifies this coordinator process to workers; 0 picks a random
  // non-zero value.
  uint64_t incarnation = 0;
  // Time source (uptime, heartbeats); defaults to absl::Now. Tests inject a
  // fake. KV and barrier timeouts use real time.
  std::function<absl::Time()> clock;
  // Most workers (the coordinator's --workers); 0 = no limit.
  int max_workers = 0;
  // Non-empty when the coordinator serves other machines without TLS or
  // tokens (--insecure): the warning, reported by GetStatus and metrics.
  std::string insecure_warning;
  // A worker without a heartbeat for this long is dead (--heartbeat-timeout).
  // Workers are told to heartbeat every third of it.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Ranks per heartbeat relay group (--heartbeat-relay-group;
  // WorkerRegistryOptions). 1: every worker beats the coordinator.
  int heartbeat_relay_group = 1;
  KvStoreOptions kv;
  BarrierTableOptions barriers;
  // How jobs reach workers (grpc_worker_client.h in the binary, fakes in
  // tests). Unset: SubmitStep answers FAILED_PRECONDITION.
  WorkerClientFactory worker_clients;
  // Job limits, the collective timeout sent to workers, RPC deadlines.
  JobRunnerOptions jobs;
  // Durable state (not owned; may be null: nothing survives a restart).
  // With a store, a submitted model is acknowledged only once it is
  // durable, and the service starts with the models stored there.
  StateStore* state = nullptr;
};

// What WatchStep streams: a job's event log and the position of the first
// event to send.
struct StepWatch {
  std::shared_ptr<JobEventLog> log;
  int64_t start_index = 0;
};

// The model id SubmitModel assigns: "m-" followed by 16 lower-case hex digits
// of the FNV-1a 64 hash of the deterministically serialized spec and options
// (an empty spec.dims counts as absent). Equal content gives an equal id in
// every process.
std::string ModelIdFor(const v1::ModelSpec& spec,
                       const v1::PlanOptions& options);

class CoordinatorService {
 public:
  // `registry` is not owned and must outlive the service.
  explicit CoordinatorService(const StrategyRegistry* registry,
                              CoordinatorServiceOptions options = {});

  // Shutdown().
  ~CoordinatorService();

  CoordinatorService(const CoordinatorService&) = delete;
  CoordinatorService& operator=(const CoordinatorService&) = delete;

  // The registered strategies (sorted by name) and the architectures
  // ModelSpecFromHfConfig understands. Errors: none.
  absl::StatusOr<v1::ListStrategiesResponse> ListStrategies(
      const v1::ListStrategiesRequest& request) const;

  // Parses the source (hf_config_json, native_spec_json or spec), plans it
  // with request.options and stores model and plan under ModelIdFor(spec,
  // options). Submitting equal content again returns the stored entry (the
  // first submission's name is kept).
  // Errors: INVALID_ARGUMENT (no source; malformed JSON, bad sizes, unknown
  // architecture, bad spec; bad plan options such as dp 0 or an unknown
  // strategy -- the message names the field), RESOURCE_EXHAUSTED (the model
  // description is larger than max_model_bytes, max_models are stored, or
  // storing it would exceed max_stored_bytes), UNAVAILABLE (the state store
  // could not make it durable; nothing was stored).
  absl::StatusOr<v1::SubmitModelResponse> SubmitModel(
      const v1::SubmitModelRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

  // The stored plan of a model; with replan=true a fresh plan for
  // request.options (the stored plan is unchanged).
  // Errors: INVALID_ARGUMENT (empty model_id; options given without
  // replan=true; bad options when replanning), NOT_FOUND (unknown model_id).
  absl::StatusOr<v1::GetPlanResponse> GetPlan(
      const v1::GetPlanRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);

  // Stored models in submission order, workers in rank order (alive or
  // dead, with the time since their last heartbeat), kept jobs in
  // submission order, uptime and incarnation. Errors: none.
  absl::StatusOr<v1::GetStatusResponse> GetStatus(
      const v1::GetStatusRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);

  // Joins a worker; rank rules in worker_registry.h. The response carries
  // heartbeat_interval_ms = heartbeat_timeout / 3.
  // Errors: INVALID_ARGUMENT (empty address, incarnation 0, requested_rank
  // out of range), RESOURCE_EXHAUSTED (every rank held by a live worker).
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request);
  // Also records the beats the worker relays for others (each refused one
  // comes back in relayed_errors) and names the worker's relay when it has
  // one (heartbeat_relay_group).
  // Errors: NOT_FOUND (unknown rank), ABORTED (incarnation mismatch, or the
  // worker was declared dead: it must re-register), INVALID_ARGUMENT (more
  // than kMaxRelayedHeartbeats relayed).
  static constexpr int kMaxRelayedHeartbeats = 4096;
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(
      const v1::HeartbeatRequest& request);

  // Errors: as KvStore::Put.
  absl::StatusOr<v1::PutResponse> Put(const v1::PutRequest& request);
  // Non-blocking Get: `done` runs exactly once (possibly before this
  // returns, on a Put's thread or on the timer thread). wait_ms < 0 counts as
  // 0; waits are capped at kv.max_wait. Returns a handle for CancelGet, 0
  // when done already ran. Errors: as KvStore::GetAsync.
  using GetCallback = std::function<void(absl::StatusOr<v1::GetResponse>)>;
  uint64_t GetAsync(const v1::GetRequest& request, GetCallback done);
  void CancelGet(uint64_t handle);
  // Blocking GetAsync (tests, in-process callers).
  absl::StatusOr<v1::GetResponse> Get(const v1::GetRequest& request);
  // Errors: none.
  absl::StatusOr<v1::DeleteResponse> Delete(const v1::DeleteRequest& request);

  // Non-blocking Barrier (semantics in barrier.h): timeout_ms 0 waits up to
  // barriers.max_timeout. Returns a handle for CancelBarrier, 0 when done
  // already ran. Errors: INVALID_ARGUMENT (empty barrier_id, participants <
  // 1, negative timeout_ms, disagreeing counts), DEADLINE_EXCEEDED, ABORTED
  // (superseded by the same caller), RESOURCE_EXHAUSTED.
  using BarrierCallback =
      std::function<void(absl::StatusOr<v1::BarrierResponse>)>;
  uint64_t BarrierAsync(const v1::BarrierRequest& request,
                        BarrierCallback done);
  void CancelBarrier(uint64_t handle);
  // Blocking BarrierAsync.
  absl::StatusOr<v1::BarrierResponse> Barrier(
      const v1::BarrierRequest& request);

  // OK when ranks 0..world_size-1 are registered and alive. A step calls this
  // before it runs. Errors: INVALID_ARGUMENT (world_size < 1),
  // FAILED_PRECONDITION (names the missing and dead ranks).
  absl::Status CheckWorkersReady(int world_size);

  // Membership, for the step runner (thread-safe; owned by the service).
  WorkerRegistry* workers() { return &workers_; }

  // Queues a training job of `config.steps` steps for a stored model. The
  // model is planned again with its stored options and the config's step
  // shape (microbatches, defer_grad_sync; passes come from the model's
  // options), so the plan's memory model matches what workers run; the
  // step program is compiled once here. The plan's world size W must be
  // served by live workers of ranks 0..W-1. microbatches 0 means 1; the
  // other zero values reach the workers, which fill in the defaults
  // documented on TrainConfig.
  // Errors: INVALID_ARGUMENT (empty model_id; steps outside [1, 10^8];
  // global_batch, seq_len < 1; microbatches outside [0, 1024]; global_batch
  // not divisible by W * microbatches; lr, eps or weight_decay negative or
  // not finite, a beta outside [0, 1), grad_clip not finite; data_path over
  // 4096 bytes; the step
  // shape does not compile), NOT_FOUND (unknown model), FAILED_PRECONDITION
  // (workers missing or dead: the message names the ranks; no worker
  // transport), RESOURCE_EXHAUSTED (too many jobs pending), UNAVAILABLE
  // (shutting down).
  absl::StatusOr<v1::SubmitStepResponse> SubmitStep(
      const v1::SubmitStepRequest& request);
  // The events WatchStep streams: the job's log, from the first event whose
  // step is >= from_step (0: from the start). The transport sends stored
  // events, then new ones until the job ends.
  // Errors: INVALID_ARGUMENT (empty job_id, negative from_step), NOT_FOUND
  // (unknown job).
  absl::StatusOr<StepWatch> WatchStep(const v1::WatchStepRequest& request);

  // Fails queued and running jobs and waits for their threads (bounded by
  // the jobs' poll interval and their calls' cancellation). The destructor
  // does it too. Idempotent.
  void Shutdown();

  // On-demand checkpoints of a running job (JobRunner::RequestSave /
  // RequestLoad): `done` runs once, when the job served the request (between
  // steps) or at once for a refusal. Errors: INVALID_ARGUMENT (no job_id),
  // then those of RequestSave / RequestLoad.
  using SaveCheckpointCallback =
      std::function<void(absl::StatusOr<v1::SaveCheckpointResponse>)>;
  using LoadCheckpointCallback =
      std::function<void(absl::StatusOr<v1::LoadCheckpointResponse>)>;
  void SaveCheckpointAsync(const v1::SaveCheckpointRequest& request,
                           SaveCheckpointCallback done);
  void LoadCheckpointAsync(const v1::LoadCheckpointRequest& request,
                           LoadCheckpointCallback done);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const v1::ListCheckpointsRequest& request);

  uint64_t incarnation() const { return incarnation_; }

 private:
  struct StoredModel {
    std::string name;
    v1::ModelSpec spec;
    v1::PlanOptions options;  // As submitted; jobs plan with them again.
    v1::ModelSummary summary;
    v1::ShardingPlan plan;
    size_t bytes = 0;  // Serialized size of spec and plan.
  };

  // Loads the models of options_.state (constructor).
  void LoadStoredModels();

  // Parses and validates the request's source. Errors: as SubmitModel.
  absl::StatusOr<v1::ModelSpec> ParseSource(
      const v1::SubmitModelRequest& request) const;

  // Plans `spec` and stamps the plan with `model_id`.
  absl::StatusOr<v1::ShardingPlan> PlanModel(
      const std::string& model_id, const v1::ModelSpec& spec,
      const v1::PlanOptions& options) const;

  // Constant after construction.
  const StrategyRegistry* registry_;  // Not owned.
  const ShardingPlanner planner_;
  const CoordinatorServiceOptions options_;
  const uint64_t incarnation_;
  const absl::Time start_time_;
  // Durable jobs (null without options_.state) and this run's generation;
  // declared before workers_ and jobs_, which are built from them.
  const std::unique_ptr<JobJournal> journal_;
  const uint64_t generation_;

  // Each is thread-safe on its own. mutable: GetStatus lists workers (which
  // notices deaths) from a const method.
  mutable WorkerRegistry workers_;
  KvStore kv_;
  BarrierTable barriers_;
  // Declared after workers_, which it uses: destroyed (and joined) first.
  std::unique_ptr<JobRunner> jobs_;

  mutable absl::Mutex mu_;
  // Model id -> model and its plan.
  std::map<std::string, StoredModel> models_ ABSL_GUARDED_BY(mu_);
  // Model ids in submission order (GetStatus lists them this way).
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);
  // Sum of StoredModel::bytes.
  size_t stored_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_COORDINATOR_SERVICE_H_
