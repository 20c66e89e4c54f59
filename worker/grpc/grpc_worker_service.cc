#include "worker/grpc/grpc_worker_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace shardd {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* UseRunCommand(grpc::CallbackServerContext* context,
                                        const char* rpc, const char* op) {
  return Finish(
      context,
      absl::UnimplementedError(absl::StrCat(
          rpc,
          ": single commands outside a step program are not supported; send "
          "the ",
          op,
          " command inside a step with RunCommand (the fine-grained mode) or "
          "a whole program with Execute")));
}

constexpr Authorizer::Role kWorkerRole = Authorizer::Role::kWorker;

}  // namespace

GrpcWorkerService::GrpcWorkerService(WorkerRuntime* runtime,
                                     std::function<void()> on_shutdown,
                                     Authorizer authorizer)
    : runtime_(runtime),
      on_shutdown_(std::move(on_shutdown)),
      authorizer_(std::move(authorizer)) {
  SHARDD_CHECK(runtime_ != nullptr);
  thread_ = std::thread([this] { Loop(); });
}

GrpcWorkerService::~GrpcWorkerService() { Stop(); }

void GrpcWorkerService::set_kv_client(KeyValueClient* kv) {
  absl::MutexLock lock(&mu_);
  kv_ = kv;
}

KeyValueClient* GrpcWorkerService::kv_client() {
  absl::MutexLock lock(&mu_);
  return kv_;
}

void GrpcWorkerService::Stop() {
  std::deque<Call> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  for (Call& call : dropped) {
    call.reactor->Finish(
        ToGrpcStatus(absl::UnavailableError("the worker is shutting down")));
  }
  absl::MutexLock join(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

grpc::ServerUnaryReactor* GrpcWorkerService::Enqueue(
    grpc::CallbackServerContext* context, std::function<absl::Status()> run) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(Call{context, reactor, std::move(run)});
      return reactor;
    }
  }
  reactor->Finish(
      ToGrpcStatus(absl::UnavailableError("the worker is shutting down")));
  return reactor;
}

void GrpcWorkerService::Loop() {
  while (true) {
    Call call;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // Stopping.
      call = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status;
    if (call.context->IsCancelled()) {
      status = absl::CancelledError("the call was cancelled before it ran");
    } else {
      status = call.run();
    }
    call.reactor->Finish(ToGrpcStatus(status));
  }
}

grpc::ServerUnaryReactor* GrpcWorkerService::LoadPlan(
    grpc::CallbackServerContext* context, const v1::LoadPlanRequest* request,
    v1::LoadPlanResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::LoadPlanResponse> result =
        runtime_->LoadPlan(*request, kv_client());
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::Execute(
    grpc::CallbackServerContext* context, const v1::ExecuteRequest* request,
    v1::ExecuteResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::ExecuteResponse> result = runtime_->Execute(*request);
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::RunCommand(
    grpc::CallbackServerContext* context, const v1::RunCommandRequest* request,
    v1::ExecuteResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::ExecuteResponse> result = runtime_->RunCommand(*request);
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::SaveShards(
    grpc::CallbackServerContext* context, const v1::SaveShardsRequest* request,
    v1::SaveShardsResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::SaveShardsResponse> result =
        runtime_->SaveShards(*request);
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::LoadShards(
    grpc::CallbackServerContext* context, const v1::LoadShardsRequest* request,
    v1::LoadShardsResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::LoadShardsResponse> result =
        runtime_->LoadShards(*request);
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::HealReplicas(
    grpc::CallbackServerContext* context,
    const v1::HealReplicasRequest* request,
    v1::HealReplicasResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return Enqueue(context, [this, request, response]() -> absl::Status {
    absl::StatusOr<v1::HealReplicasResponse> result =
        runtime_->HealReplicas(*request);
    if (!result.ok()) return result.status();
    *response = *std::move(result);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcWorkerService::Unshard(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return UseRunCommand(context, "Unshard", "UNSHARD");
}

grpc::ServerUnaryReactor* GrpcWorkerService::Reshard(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return UseRunCommand(context, "Reshard", "RESHARD");
}

grpc::ServerUnaryReactor* GrpcWorkerService::ReduceScatter(
    grpc::CallbackServerContext* context, const v1::UnitRequest*,
    v1::CommandResponse*) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return UseRunCommand(context, "ReduceScatter", "REDUCE_SCATTER");
}

grpc::ServerUnaryReactor* GrpcWorkerService::ExpertForward(
    grpc::CallbackServerContext* context, const v1::ExpertForwardRequest*,
    v1::ExpertForwardResponse*) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  return UseRunCommand(context, "ExpertForward", "FORWARD EXPERTS");
}

grpc::ServerUnaryReactor* GrpcWorkerService::GetStats(
    grpc::CallbackServerContext* context, const v1::GetStatsRequest*,
    v1::GetStatsResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  *response = runtime_->GetStats();
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* GrpcWorkerService::RelayHeartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  absl::StatusOr<v1::HeartbeatResponse> answer = relay_.Record(*request);
  if (answer.ok()) *response = *std::move(answer);
  return Finish(context, answer.status());
}

grpc::ServerUnaryReactor* GrpcWorkerService::Shutdown(
    grpc::CallbackServerContext* context, const v1::ShutdownRequest*,
    v1::ShutdownResponse*) {
  if (absl::Status status = authorizer_.Check(*context, kWorkerRole);
      !status.ok()) {
    return Finish(context, status);
  }
  grpc::ServerUnaryReactor* reactor = Finish(context, absl::OkStatus());
  if (on_shutdown_) on_shutdown_();
  return reactor;
}

}  // namespace shardd
