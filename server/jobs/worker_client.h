#ifndef SHARDD_SERVER_JOBS_WORKER_CLIENT_H_
#define SHARDD_SERVER_JOBS_WORKER_CLIENT_H_

// The coordinator's view of one worker: the Worker RPCs a training job needs
// (proto/worker.proto), blocking, each with a deadline and a cancellation
// token. The job runner (job_runner.h) is written against this interface;
// grpc_worker_client.h implements it over the generated stub and tests use
// in-memory fakes.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/worker.pb.h"

namespace shardd {

// Cancels the in-flight calls of one round of RPCs (e.g. one step on every
// rank) at once. A call registers how to abort itself while it runs.
// Thread-safe.
class CallCanceller {
 public:
  CallCanceller() = default;
  CallCanceller(const CallCanceller&) = delete;
  CallCanceller& operator=(const CallCanceller&) = delete;

  // Registers `cancel`, run once by Cancel(). When Cancel() already ran,
  // `cancel` runs here at once and 0 is returned. Callbacks run under this
  // object's lock: they must be quick (ClientContext::TryCancel, signalling
  // a condition) and must not call back into the canceller.
  uint64_t Add(std::function<void()> cancel) ABSL_LOCKS_EXCLUDED(mu_);
  // Unregisters a handle from Add; after it returns the callback neither
  // runs nor is running. 0 is ignored.
  void Remove(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs every registered callback; later Adds run theirs at once.
  // Idempotent.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

struct WorkerCallOptions {
  // The call fails with DEADLINE_EXCEEDED when it has not finished by then.
  absl::Time deadline = absl::InfiniteFuture();
  // When set, CallCanceller::Cancel() ends the call with CANCELLED. Not
  // owned; outlives the call.
  CallCanceller* canceller = nullptr;
};

class WorkerClient {
 public:
  virtual ~WorkerClient() = default;

  // The worker's address ("host:port"), for messages.
  virtual const std::string& address() const = 0;

  // Every method blocks until the worker answers, the deadline passes
  // (DEADLINE_EXCEEDED) or the call is cancelled (CANCELLED). Errors: those
  // of the RPC (proto/worker.proto) plus UNAVAILABLE when the worker cannot
  // be reached. Thread-safe: a job calls different workers concurrently and
  // may call one worker from several threads.
  virtual absl::StatusOr<v1::LoadPlanResponse> LoadPlan(
      const v1::LoadPlanRequest& request, const WorkerCallOptions& options) = 0;
  virtual absl::StatusOr<v1::ExecuteResponse> Execute(
      const v1::ExecuteRequest& request, const WorkerCallOptions& options) = 0;
  virtual absl::StatusOr<v1::ExecuteResponse> RunCommand(
      const v1::RunCommandRequest& request,
      const WorkerCallOptions& options) = 0;
  virtual absl::StatusOr<v1::GetStatsResponse> GetStats(
      const WorkerCallOptions& options) = 0;
  // Checkpoints. The defaults answer UNIMPLEMENTED (fakes that never save).
  virtual absl::StatusOr<v1::SaveShardsResponse> SaveShards(
      const v1::SaveShardsRequest& request, const WorkerCallOptions& options);
  virtual absl::StatusOr<v1::LoadShardsResponse> LoadShards(
      const v1::LoadShardsRequest& request, const WorkerCallOptions& options);
  // HSDP healing. The default answers UNIMPLEMENTED.
  virtual absl::StatusOr<v1::HealReplicasResponse> HealReplicas(
      const v1::HealReplicasRequest& request, const WorkerCallOptions& options);

  // Asynchronous forms of the calls a job makes on every rank at once, so
  // that thousands of ranks need no thread each: `done` runs exactly once,
  // on another thread, with the call's status (and *response filled when
  // it is OK). `request`, `response` and options.canceller outlive the
  // call. The defaults run the blocking form on a thread of their own
  // (fakes); the gRPC client uses gRPC's callback API.
  using DoneCallback = std::function<void(absl::Status)>;
  virtual void LoadPlanAsync(const v1::LoadPlanRequest& request,
                             const WorkerCallOptions& options,
                             v1::LoadPlanResponse* response, DoneCallback done);
  virtual void ExecuteAsync(const v1::ExecuteRequest& request,
                            const WorkerCallOptions& options,
                            v1::ExecuteResponse* response, DoneCallback done);
};

// Makes a client for the worker at `address`. Errors: INVALID_ARGUMENT
// (malformed address); implementations may add their own.
using WorkerClientFactory =
    std::function<absl::StatusOr<std::unique_ptr<WorkerClient>>(
        const std::string& address)>;

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_WORKER_CLIENT_H_
