#include "worker/grpc_worker_service.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace shardd {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* NotYet(grpc::CallbackServerContext* context,
                                 const char* rpc) {
  return Finish(context,
                absl::UnimplementedError(absl::StrCat(
                    rpc,
                    ": not implemented yet (shards, collectives and step "
                    "execution land with the workers issue)")));
}

}  // namespace

GrpcWorkerService::GrpcWorkerService(std::function<void()> on_shutdown)
    : on_shutdown_(std::move(on_shutdown)) {}

grpc::ServerUnaryReactor* GrpcWorkerService::LoadPlan(
    grpc::CallbackServerContext* context, const v1::LoadPlanRequest*,
    v1::LoadPlanResponse*) {
  return NotYet(context, "LoadPlan");
}

grpc::ServerUnaryReactor* GrpcWorkerService::Execute(
    grpc::CallbackServerContext* context, const v1::ExecuteRequest*,
    v1::ExecuteResponse*) {
  return NotYet(context, "Execute");
}

grpc::ServerUnaryReactor* GrpcWorkerService::Unshard(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  return NotYet(context, "Unshard");
}

grpc::ServerUnaryReactor* GrpcWorkerService::Reshard(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  return NotYet(context, "Reshard");
}

grpc::ServerUnaryReactor* GrpcWorkerService::ReduceScatter(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  return NotYet(context, "ReduceScatter");
}

grpc::ServerUnaryReactor* GrpcWorkerService::ExpertForward(
    grpc::CallbackServerContext* context, const v1::ExpertForwardRequest*,
    v1::ExpertForwardResponse*) {
  return NotYet(context, "ExpertForward");
}

grpc::ServerUnaryReactor* GrpcWorkerService::GetStats(
    grpc::CallbackServerContext* context, const v1::GetStatsRequest*,
    v1::GetStatsResponse* response) {
  // No plan can be loaded yet, so no buffer is live: all counters are zero.
  response->Clear();
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* GrpcWorkerService::Shutdown(
    grpc::CallbackServerContext* context, const v1::ShutdownRequest*,
    v1::ShutdownResponse*) {
  grpc::ServerUnaryReactor* reactor = Finish(context, absl::OkStatus());
  if (on_shutdown_) on_shutdown_();
  return reactor;
}

}  // namespace shardd
