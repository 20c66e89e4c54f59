#ifndef SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_
#define SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_

// gRPC transport of the Coordinator service (callback API). It only moves
// messages to CoordinatorService and converts absl::Status to grpc::Status,
// keeping the code and message.

#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "server/coordinator_service.h"

namespace shardd {

class GrpcCoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `service` is not owned and must outlive this object and the server it is
  // registered with.
  explicit GrpcCoordinatorService(CoordinatorService* service);

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

 private:
  CoordinatorService* service_;  // Not owned.
};

}  // namespace shardd

#endif  // SHARDD_SERVER_GRPC_COORDINATOR_SERVICE_H_
