#include "server/jobs/grpc_worker_client.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace shardd {
namespace {

// Runs one blocking unary call with the options' deadline and cancellation.
template <typename Response, typename Call>
absl::StatusOr<Response> Invoke(const WorkerCallOptions& options,
                                const Call& call) {
  grpc::ClientContext context;
  if (options.deadline != absl::InfiniteFuture()) {
    context.set_deadline(absl::ToChronoTime(options.deadline));
  }
  uint64_t handle = 0;
  if (options.canceller != nullptr) {
    handle = options.canceller->Add([&context] { context.TryCancel(); });
  }
  Response response;
  const grpc::Status status = call(&context, &response);
  if (options.canceller != nullptr) options.canceller->Remove(handle);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// One call of gRPC's callback API: its context (deadline, cancellation)
// lives until the reaction, which unregisters it and reports.
struct AsyncCall {
  grpc::ClientContext context;
  CallCanceller* canceller = nullptr;
  uint64_t handle = 0;
  WorkerClient::DoneCallback done;
};

AsyncCall* StartAsync(const WorkerCallOptions& options,
                      WorkerClient::DoneCallback done) {
  auto* call = new AsyncCall;
  if (options.deadline != absl::InfiniteFuture()) {
    call->context.set_deadline(absl::ToChronoTime(options.deadline));
  }
  call->done = std::move(done);
  call->canceller = options.canceller;
  if (call->canceller != nullptr) {
    call->handle = call->canceller->Add([call] { call->context.TryCancel(); });
  }
  return call;
}

// The reaction: after Remove no cancel runs on the context, so it can go.
std::function<void(grpc::Status)> FinishAsync(AsyncCall* call) {
  return [call](grpc::Status status) {
    if (call->canceller != nullptr) call->canceller->Remove(call->handle);
    WorkerClient::DoneCallback done = std::move(call->done);
    delete call;
    done(status.ok() ? absl::OkStatus() : FromGrpcStatus(status));
  };
}

}  // namespace

void GrpcWorkerClient::LoadPlanAsync(const v1::LoadPlanRequest& request,
                                     const WorkerCallOptions& options,
                                     v1::LoadPlanResponse* response,
                                     DoneCallback done) {
  AsyncCall* call = StartAsync(options, std::move(done));
  stub_->async()->LoadPlan(&call->context, &request, response,
                           FinishAsync(call));
}

void GrpcWorkerClient::ExecuteAsync(const v1::ExecuteRequest& request,
                                    const WorkerCallOptions& options,
                                    v1::ExecuteResponse* response,
                                    DoneCallback done) {
  AsyncCall* call = StartAsync(options, std::move(done));
  stub_->async()->Execute(&call->context, &request, response,
                          FinishAsync(call));
}

absl::StatusOr<std::unique_ptr<WorkerClient>> GrpcWorkerClient::Create(
    const std::string& address, const ChannelSecurity& security) {
  const size_t colon = address.rfind(':');
  if (address.empty() || colon == std::string::npos || colon == 0 ||
      colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker address: expected HOST:PORT, got '", address, "'"));
  }
  grpc::ChannelArguments args;
  // Plans and models of large worlds exceed gRPC's 4 MiB default.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Each worker gets its own connection even when addresses share a
  // host, so one slow worker does not share a transport with another.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      CreateSecureChannel(address, security, args);
  if (!channel.ok()) return channel.status();
  return std::unique_ptr<WorkerClient>(
      new GrpcWorkerClient(address, *std::move(channel)));
}

GrpcWorkerClient::GrpcWorkerClient(std::string address,
                                   std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(v1::Worker::NewStub(channel_)) {}

absl::StatusOr<v1::LoadPlanResponse> GrpcWorkerClient::LoadPlan(
    const v1::LoadPlanRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::LoadPlanResponse>(
      options, [&](grpc::ClientContext* context, v1::LoadPlanResponse* out) {
        return stub_->LoadPlan(context, request, out);
      });
}

absl::StatusOr<v1::ExecuteResponse> GrpcWorkerClient::Execute(
    const v1::ExecuteRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::ExecuteResponse>(
      options, [&](grpc::ClientContext* context, v1::ExecuteResponse* out) {
        return stub_->Execute(context, request, out);
      });
}

absl::StatusOr<v1::ExecuteResponse> GrpcWorkerClient::RunCommand(
    const v1::RunCommandRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::ExecuteResponse>(
      options, [&](grpc::ClientContext* context, v1::ExecuteResponse* out) {
        return stub_->RunCommand(context, request, out);
      });
}

absl::StatusOr<v1::GetStatsResponse> GrpcWorkerClient::GetStats(
    const WorkerCallOptions& options) {
  return Invoke<v1::GetStatsResponse>(
      options, [&](grpc::ClientContext* context, v1::GetStatsResponse* out) {
        return stub_->GetStats(context, v1::GetStatsRequest(), out);
      });
}

absl::StatusOr<v1::SaveShardsResponse> GrpcWorkerClient::SaveShards(
    const v1::SaveShardsRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::SaveShardsResponse>(
      options, [&](grpc::ClientContext* context, v1::SaveShardsResponse* out) {
        return stub_->SaveShards(context, request, out);
      });
}

absl::StatusOr<v1::LoadShardsResponse> GrpcWorkerClient::LoadShards(
    const v1::LoadShardsRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::LoadShardsResponse>(
      options, [&](grpc::ClientContext* context, v1::LoadShardsResponse* out) {
        return stub_->LoadShards(context, request, out);
      });
}

absl::StatusOr<v1::HealReplicasResponse> GrpcWorkerClient::HealReplicas(
    const v1::HealReplicasRequest& request, const WorkerCallOptions& options) {
  return Invoke<v1::HealReplicasResponse>(
      options,
      [&](grpc::ClientContext* context, v1::HealReplicasResponse* out) {
        return stub_->HealReplicas(context, request, out);
      });
}

WorkerClientFactory GrpcWorkerClientFactory(ChannelSecurity security) {
  return [security = std::move(security)](const std::string& address) {
    return GrpcWorkerClient::Create(address, security);
  };
}

}  // namespace shardd
