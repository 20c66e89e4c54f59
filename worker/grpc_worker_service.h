#ifndef SHARDD_WORKER_GRPC_WORKER_SERVICE_H_
#define SHARDD_WORKER_GRPC_WORKER_SERVICE_H_

// gRPC adapter of the Worker service. Shards, collectives and execution land
// with the workers issue; until then the data-path RPCs answer UNIMPLEMENTED
// with a message saying so, GetStats reports the (empty) buffer accounting and
// Shutdown asks the process to stop.

#include <functional>

#include "proto/worker.grpc.pb.h"

namespace shardd {

class GrpcWorkerService final : public v1::Worker::CallbackService {
 public:
  // `on_shutdown` runs (once per Shutdown RPC) after the reply is queued; the
  // owner stops the server from another thread.
  explicit GrpcWorkerService(std::function<void()> on_shutdown);

  grpc::ServerUnaryReactor* LoadPlan(grpc::CallbackServerContext* context,
                                     const v1::LoadPlanRequest* request,
                                     v1::LoadPlanResponse* response) override;
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* context,
                                    const v1::ExecuteRequest* request,
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
  grpc::ServerUnaryReactor* Shutdown(grpc::CallbackServerContext* context,
                                     const v1::ShutdownRequest* request,
                                     v1::ShutdownResponse* response) override;

 private:
  std::function<void()> on_shutdown_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_GRPC_WORKER_SERVICE_H_
