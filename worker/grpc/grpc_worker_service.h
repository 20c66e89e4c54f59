#ifndef SHARDD_WORKER_GRPC_GRPC_WORKER_SERVICE_H_
#define SHARDD_WORKER_GRPC_GRPC_WORKER_SERVICE_H_

// gRPC adapter of the Worker service over a WorkerRuntime (worker_runtime.h).
//
// Threads. LoadPlan, Execute and RunCommand can block for as long as a
// collective timeout (rendezvous, all-gathers, a dead peer), so they never
// run on a gRPC callback thread: each is queued, in arrival order, for one
// runtime thread owned by this service, which runs it and finishes the
// call. The runtime serializes them anyway, so one thread loses nothing and
// keeps the order in which a coordinator sent them. SaveShards,
// LoadShards and HealReplicas are queued the same way. A call cancelled before
// its turn is finished with CANCELLED without running. GetStats and
// Shutdown answer inline (the runtime's stats never wait for a step).
//
// The single-unit RPCs (Unshard, Reshard, ReduceScatter, ExpertForward)
// answer UNIMPLEMENTED: a command outside a step program has no micro-batch,
// pass or gradient state to act on; RunCommand is the per-command interface
// (the fine-grained mode), with the same commands inside a step.

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_security.h"
#include "proto/worker.grpc.pb.h"
#include "worker/comm/kv_client.h"
#include "worker/grpc/heartbeat_relay.h"
#include "worker/worker_runtime.h"

namespace shardd {

class GrpcWorkerService final : public v1::Worker::CallbackService {
 public:
  // `runtime` is not owned and must outlive the service. `on_shutdown` runs
  // (once per Shutdown RPC) after the reply is queued; the owner stops the
  // server from another thread. `authorizer` checks every call for the
  // worker token (the coordinator presents it) before anything runs; a
  // refused call ends with UNAUTHENTICATED or PERMISSION_DENIED.
  GrpcWorkerService(WorkerRuntime* runtime, std::function<void()> on_shutdown,
                    Authorizer authorizer = Authorizer());
  // Stop().
  ~GrpcWorkerService() override;

  GrpcWorkerService(const GrpcWorkerService&) = delete;
  GrpcWorkerService& operator=(const GrpcWorkerService&) = delete;

  // The rendezvous store LoadPlan hands the runtime (not owned; null: none,
  // so only single-rank plans load). Clear it (or Stop) before the store
  // goes away.
  void set_kv_client(KeyValueClient* kv) ABSL_LOCKS_EXCLUDED(mu_);

  // The relay RelayHeartbeat records into; the CoordinatorAgent forwards
  // what it holds (CoordinatorAgentOptions::relay).
  HeartbeatRelay* heartbeat_relay() { return &relay_; }

  // Finishes every queued call with UNAVAILABLE, waits for the running one
  // (bounded by the job's collective timeout) and stops the runtime thread;
  // later calls get UNAVAILABLE at once. Call it before shutting the gRPC
  // server down so in-flight calls finish quickly. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  grpc::ServerUnaryReactor* LoadPlan(grpc::CallbackServerContext* context,
                                     const v1::LoadPlanRequest* request,
                                     v1::LoadPlanResponse* response) override;
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* context,
                                    const v1::ExecuteRequest* request,
                                    v1::ExecuteResponse* response) override;
  grpc::ServerUnaryReactor* RunCommand(grpc::CallbackServerContext* context,
                                       const v1::RunCommandRequest* request,
                                       v1::ExecuteResponse* response) override;
  grpc::ServerUnaryReactor* Unshard(grpc::CallbackServerContext* context,
                                    const v1::UnitRequest* request,
                                    v1::CommandResponse* response) override;
  grpc::ServerUnaryReactor* Reshard(grpc::CallbackServerContext* context,
                                    const v1::UnitRequest* request,
                                    v1::CommandResponse* response) override;
  grpc::ServerUnaryReactor* ReduceScatter(
      grpc::CallbackServerContext* context, const v1::UnitRequest* request,
      v1::CommandResponse* response) override;
  grpc::ServerUnaryReactor* ExpertForward(
      grpc::CallbackServerContext* context,
      const v1::ExpertForwardRequest* request,
      v1::ExpertForwardResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;
  // Answered inline (HeartbeatRelay::Record), never queued behind a step.
  grpc::ServerUnaryReactor* RelayHeartbeat(
      grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Shutdown(grpc::CallbackServerContext* context,
                                     const v1::ShutdownRequest* request,
                                     v1::ShutdownResponse* response) override;
  // Queued like Execute (they touch the shards between steps).
  grpc::ServerUnaryReactor* SaveShards(
      grpc::CallbackServerContext* context,
      const v1::SaveShardsRequest* request,
      v1::SaveShardsResponse* response) override;
  grpc::ServerUnaryReactor* LoadShards(
      grpc::CallbackServerContext* context,
      const v1::LoadShardsRequest* request,
      v1::LoadShardsResponse* response) override;
  // Queued like Execute: the replica broadcasts are collectives that can
  // block for a collective timeout, and run between steps.
  grpc::ServerUnaryReactor* HealReplicas(
      grpc::CallbackServerContext* context,
      const v1::HealReplicasRequest* request,
      v1::HealReplicasResponse* response) override;

 private:
  struct Call {
    grpc::CallbackServerContext* context = nullptr;
    grpc::ServerUnaryReactor* reactor = nullptr;
    // Runs on the runtime thread and fills the response.
    std::function<absl::Status()> run;
  };

  // Queues `run` for the runtime thread; returns the call's reactor.
  grpc::ServerUnaryReactor* Enqueue(grpc::CallbackServerContext* context,
                                    std::function<absl::Status()> run)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  KeyValueClient* kv_client() ABSL_LOCKS_EXCLUDED(mu_);

  HeartbeatRelay relay_;
  WorkerRuntime* const runtime_;
  const std::function<void()> on_shutdown_;
  const Authorizer authorizer_;

  absl::Mutex mu_;
  KeyValueClient* kv_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::deque<Call> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // Serializes joining the runtime thread (Stop may race the destructor).
  absl::Mutex join_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace shardd

#endif  // SHARDD_WORKER_GRPC_GRPC_WORKER_SERVICE_H_
