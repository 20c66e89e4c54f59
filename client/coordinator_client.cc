#include "client/coordinator_client.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace shardd {
namespace {

std::chrono::system_clock::time_point DeadlineIn(absl::Duration timeout) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Connect(
    absl::string_view address, absl::Duration timeout,
    const ChannelSecurity& security) {
  if (address.empty()) {
    return absl::InvalidArgumentError(
        "coordinator: address required (HOST:PORT)");
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout: must be > 0");
  }
  grpc::ChannelArguments args;
  // Plans for very large worlds can exceed gRPC's 4 MiB default.
  args.SetMaxReceiveMessageSize(-1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> secure_channel =
      CreateSecureChannel(std::string(address), security, args);
  if (!secure_channel.ok()) return secure_channel.status();
  std::shared_ptr<grpc::Channel> channel = *std::move(secure_channel);
  if (!channel->WaitForConnected(DeadlineIn(timeout))) {
    return absl::UnavailableError(
        absl::StrFormat("coordinator at %s: not reachable within %s", address,
                        absl::FormatDuration(timeout)));
  }
  return std::unique_ptr<CoordinatorClient>(
      new CoordinatorClient(std::string(address), std::move(channel)));
}

CoordinatorClient::CoordinatorClient(std::string address,
                                     std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(v1::Coordinator::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

std::unique_ptr<grpc::ClientContext> CoordinatorClient::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(DeadlineIn(call_timeout_));
  return context;
}

absl::StatusOr<v1::ListStrategiesResponse> CoordinatorClient::ListStrategies(
    const v1::ListStrategiesRequest& request) {
  v1::ListStrategiesResponse response;
  grpc::Status status =
      stub_->ListStrategies(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::SubmitModelResponse> CoordinatorClient::SubmitModel(
    const v1::SubmitModelRequest& request) {
  v1::SubmitModelResponse response;
  grpc::Status status =
      stub_->SubmitModel(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::GetPlanResponse> CoordinatorClient::GetPlan(
    const v1::GetPlanRequest& request) {
  v1::GetPlanResponse response;
  grpc::Status status = stub_->GetPlan(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::GetStatusResponse> CoordinatorClient::GetStatus(
    const v1::GetStatusRequest& request) {
  v1::GetStatusResponse response;
  grpc::Status status =
      stub_->GetStatus(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::ListCheckpointsResponse> CoordinatorClient::ListCheckpoints(
    const v1::ListCheckpointsRequest& request) {
  v1::ListCheckpointsResponse response;
  grpc::Status status =
      stub_->ListCheckpoints(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::SaveCheckpointResponse> CoordinatorClient::SaveCheckpoint(
    const v1::SaveCheckpointRequest& request) {
  v1::SaveCheckpointResponse response;
  grpc::Status status =
      stub_->SaveCheckpoint(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::LoadCheckpointResponse> CoordinatorClient::LoadCheckpoint(
    const v1::LoadCheckpointRequest& request) {
  v1::LoadCheckpointResponse response;
  grpc::Status status =
      stub_->LoadCheckpoint(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::SubmitStepResponse> CoordinatorClient::SubmitStep(
    const v1::SubmitStepRequest& request) {
  v1::SubmitStepResponse response;
  grpc::Status status =
      stub_->SubmitStep(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status CoordinatorClient::WatchStep(
    const v1::WatchStepRequest& request, absl::Duration idle_timeout,
    const std::function<bool(const v1::StepEvent&)>& on_event) {
  if (idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("idle_timeout: must be > 0");
  }
  grpc::ClientContext context;
  // A watchdog cancels the stream when it goes quiet for too long.
  absl::Mutex mu;
  absl::Time last_event = absl::Now();
  bool stop = false;
  bool idle = false;
  std::thread watchdog([&] {
    absl::MutexLock lock(&mu);
    while (!stop) {
      const absl::Time due = last_event + idle_timeout;
      if (absl::Now() >= due) {
        idle = true;
        context.TryCancel();
        return;
      }
      mu.AwaitWithDeadline(absl::Condition(&stop), due);
    }
  });
  std::unique_ptr<grpc::ClientReader<v1::StepEvent>> reader =
      stub_->WatchStep(&context, request);
  v1::StepEvent event;
  bool ended = false;
  bool stopped_early = false;
  while (reader->Read(&event)) {
    {
      absl::MutexLock lock(&mu);
      last_event = absl::Now();
    }
    ended = ended || event.done() || !event.error().empty();
    if (!on_event(event)) {
      stopped_early = true;
      context.TryCancel();
      break;
    }
    // After the last event the server finishes; Read then returns false.
  }
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  watchdog.join();
  const grpc::Status status = reader->Finish();
  if (ended || stopped_early) return absl::OkStatus();
  if (idle) {
    return absl::DeadlineExceededError(
        absl::StrCat("WatchStep: no event from the coordinator at ", address_,
                     " for ", absl::FormatDuration(idle_timeout)));
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return absl::InternalError(
      "WatchStep: the stream ended before the job's last event");
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
CoordinatorClient::CheckHealth(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status =
      health_stub_->Check(NewContext().get(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

}  // namespace shardd
