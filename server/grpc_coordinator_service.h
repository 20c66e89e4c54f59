#ifndef SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_
#define SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_

// gRPC transport of the Coordinator service (callback API). It only moves
// messages to CoordinatorService and converts absl::Status to grpc::Status,
// keeping the code and message. Calls that wait (Get, Barrier) finish
// asynchronously, from whichever thread completes them, so no gRPC thread is
// ever parked; a cancelled call (client gone, deadline passed) withdraws its
// wait from the service. WatchStep streams write the job's stored events
// and then each new one from the job's thread as it is published (a write
// never blocks), one write in flight per stream.

#include <cstddef>
#include <memory>

#include "common/grpc_security.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "server/coordinator_service.h"
#include "server/rpc_latencies.h"

namespace shardd {

class GrpcCoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `service` is not owned and must outlive this object and the server it is
  // registered with. `authorizer` checks every call's bearer token first:
  // the worker token for RegisterWorker, Heartbeat, Put, Get, Delete and
  // Barrier, the client token for the rest; a refused call ends with
  // UNAUTHENTICATED or PERMISSION_DENIED without reaching `service`.
  // `latencies` (not owned; null: none) gets each control-plane call's
  // server-side latency (rpc_latencies.h).
  explicit GrpcCoordinatorService(CoordinatorService* service,
                                  Authorizer authorizer = Authorizer(),
                                  RpcLatencies* latencies = nullptr);
  ~GrpcCoordinatorService() override;

  GrpcCoordinatorService(const GrpcCoordinatorService&) = delete;
  GrpcCoordinatorService& operator=(const GrpcCoordinatorService&) = delete;

  grpc::ServerUnaryReactor* ListStrategies(
      grpc::CallbackServerContext* context,
      const v1::ListStrategiesRequest* request,
      v1::ListStrategiesResponse* response) override;
  grpc::ServerUnaryReactor* SubmitModel(
      grpc::CallbackServerContext* context,
      const v1::SubmitModelRequest* request,
      v1::SubmitModelResponse* response) override;
  grpc::ServerUnaryReactor* GetPlan(grpc::CallbackServerContext* context,
                                    const v1::GetPlanRequest* request,
                                    v1::GetPlanResponse* response) override;
  grpc::ServerUnaryReactor* RegisterWorker(
      grpc::CallbackServerContext* context,
      const v1::RegisterWorkerRequest* request,
      v1::RegisterWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Put(grpc::CallbackServerContext* context,
                                const v1::PutRequest* request,
                                v1::PutResponse* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::GetRequest* request,
                                v1::GetResponse* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const v1::DeleteRequest* request,
                                   v1::DeleteResponse* response) override;
  grpc::ServerUnaryReactor* Barrier(grpc::CallbackServerContext* context,
                                    const v1::BarrierRequest* request,
                                    v1::BarrierResponse* response) override;
  grpc::ServerUnaryReactor* SubmitStep(
      grpc::CallbackServerContext* context,
      const v1::SubmitStepRequest* request,
      v1::SubmitStepResponse* response) override;
  grpc::ServerWriteReactor<v1::StepEvent>* WatchStep(
      grpc::CallbackServerContext* context,
      const v1::WatchStepRequest* request) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::SaveCheckpointRequest* request,
      v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(
      grpc::CallbackServerContext* context,
      const v1::LoadCheckpointRequest* request,
      v1::LoadCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(
      grpc::CallbackServerContext* context,
      const v1::ListCheckpointsRequest* request,
      v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;

  // Ends every waiting call (Get with wait, Barrier) with UNAVAILABLE and
  // answers later ones at once with UNAVAILABLE, so a server shutdown does
  // not wait out long waits; WatchStep streams send the events stored so
  // far and then end (OK when the job ended, else UNAVAILABLE).
  // CoordinatorServer::Shutdown calls it first. Idempotent, thread-safe.
  void CancelWaitingCalls();

  // Calls waiting now.
  size_t waiting_calls() const;
  // WatchStep streams open now.
  size_t watch_streams() const;

  // The waiting calls and the watch streams, shared with each call so that a
  // late completion never touches a destroyed object. Defined in the .cc
  // file.
  class WaitingCalls;
  class WatchStreams;

 private:
  CoordinatorService* service_;  // Not owned.
  const Authorizer authorizer_;
  RpcLatencies* const latencies_;  // Not owned; may be null.
  std::shared_ptr<WaitingCalls> waiting_;
  std::shared_ptr<WatchStreams> watches_;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_
