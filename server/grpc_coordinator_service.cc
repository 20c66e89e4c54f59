#include "server/grpc_coordinator_service.h"

#include <utility>

#include "absl/status/statusor.h"
#include "common/grpc_status.h"

namespace shardd {
namespace {

// Every unary handler is quick (planning a model takes milliseconds), so it
// answers inline on the callback thread.
template <typename Response>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context,
                                absl::StatusOr<Response> result,
                                Response* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (result.ok()) *response = *std::move(result);
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

// A stream that ends at once with a status: used while WatchStep has no
// events to send.
class FinishedWriteReactor final
    : public grpc::ServerWriteReactor<v1::StepEvent> {
 public:
  explicit FinishedWriteReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

GrpcCoordinatorService::GrpcCoordinatorService(CoordinatorService* service)
    : service_(service) {}

grpc::ServerUnaryReactor* GrpcCoordinatorService::ListStrategies(
    grpc::CallbackServerContext* context,
    const v1::ListStrategiesRequest* request,
    v1::ListStrategiesResponse* response) {
  return Reply(context, service_->ListStrategies(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SubmitModel(
    grpc::CallbackServerContext* context, const v1::SubmitModelRequest* request,
    v1::SubmitModelResponse* response) {
  return Reply(context, service_->SubmitModel(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::GetPlan(
    grpc::CallbackServerContext* context, const v1::GetPlanRequest* request,
    v1::GetPlanResponse* response) {
  return Reply(context, service_->GetPlan(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::RegisterWorker(
    grpc::CallbackServerContext* context,
    const v1::RegisterWorkerRequest* request,
    v1::RegisterWorkerResponse* response) {
  return Reply(context, service_->RegisterWorker(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Heartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  return Reply(context, service_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Put(
    grpc::CallbackServerContext* context, const v1::PutRequest* request,
    v1::PutResponse* response) {
  return Reply(context, service_->Put(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Get(
    grpc::CallbackServerContext* context, const v1::GetRequest* request,
    v1::GetResponse* response) {
  return Reply(context, service_->Get(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Delete(
    grpc::CallbackServerContext* context, const v1::DeleteRequest* request,
    v1::DeleteResponse* response) {
  return Reply(context, service_->Delete(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Barrier(
    grpc::CallbackServerContext* context, const v1::BarrierRequest* request,
    v1::BarrierResponse* response) {
  return Reply(context, service_->Barrier(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SubmitStep(
    grpc::CallbackServerContext* context, const v1::SubmitStepRequest* request,
    v1::SubmitStepResponse* response) {
  return Reply(context, service_->SubmitStep(*request), response);
}

grpc::ServerWriteReactor<v1::StepEvent>* GrpcCoordinatorService::WatchStep(
    grpc::CallbackServerContext* /*context*/,
    const v1::WatchStepRequest* request) {
  absl::Status status = service_->StartWatchStep(*request);
  if (status.ok()) {
    // Unreachable until steps exist; never leave a stream hanging.
    status = absl::InternalError("WatchStep: no event source for this job");
  }
  return new FinishedWriteReactor(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  return Reply(context, service_->SaveCheckpoint(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  return Reply(context, service_->LoadCheckpoint(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::ListCheckpoints(
    grpc::CallbackServerContext* context,
    const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  return Reply(context, service_->ListCheckpoints(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::GetStatus(
    grpc::CallbackServerContext* context, const v1::GetStatusRequest* request,
    v1::GetStatusResponse* response) {
  return Reply(context, service_->GetStatus(*request), response);
}

}  // namespace shardd
