#ifndef SHARDD_CLIENT_COORDINATOR_CLIENT_H_
#define SHARDD_CLIENT_COORDINATOR_CLIENT_H_

// A blocking client of the Coordinator service. Every call carries a
// deadline; errors come back as absl::Status with the server's code and
// message (transport failures as UNAVAILABLE / DEADLINE_EXCEEDED).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/grpc_security.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/health.grpc.pb.h"

namespace shardd {

class CoordinatorClient {
 public:
  // Opens a channel to `address` ("host:port") with `security` (TLS, and
  // the client token sent with every call) and waits until it is
  // connected, at most `timeout`.
  // Errors: INVALID_ARGUMENT (empty address, timeout <= 0, bad TLS files
  // naming the flag), UNAVAILABLE (not connected within the timeout, e.g.
  // a TLS handshake failure; the message names the address).
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Connect(
      absl::string_view address, absl::Duration timeout = absl::Seconds(10),
      const ChannelSecurity& security = ChannelSecurity());

  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  // Deadline of each call, counted from its start. Default 30 s.
  void set_call_timeout(absl::Duration timeout) { call_timeout_ = timeout; }
  absl::Duration call_timeout() const { return call_timeout_; }
  const std::string& address() const { return address_; }

  // Errors: those of the RPC (see proto/coordinator.proto) plus
  // UNAVAILABLE and DEADLINE_EXCEEDED.
  absl::StatusOr<v1::ListStrategiesResponse> ListStrategies(
      const v1::ListStrategiesRequest& request = {});
  absl::StatusOr<v1::SubmitModelResponse> SubmitModel(
      const v1::SubmitModelRequest& request);
  absl::StatusOr<v1::GetPlanResponse> GetPlan(
      const v1::GetPlanRequest& request);
  absl::StatusOr<v1::GetStatusResponse> GetStatus(
      const v1::GetStatusRequest& request = {});
  absl::StatusOr<v1::SubmitStepResponse> SubmitStep(
      const v1::SubmitStepRequest& request);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(
      const v1::ListCheckpointsRequest& request);
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(
      const v1::SaveCheckpointRequest& request);
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(
      const v1::LoadCheckpointRequest& request);

  // Streams a job's events to `on_event` until the job ends (OK after the
  // event with done or error set), `on_event` returns false (OK, the
  // stream is cancelled), or the stream fails. The stream itself has no
  // deadline (jobs run for hours); instead it is cancelled when no event
  // arrives for `idle_timeout`. Errors: those of WatchStep (NOT_FOUND),
  // UNAVAILABLE (coordinator gone or shutting down), DEADLINE_EXCEEDED (no
  // event for idle_timeout; the message says so), INTERNAL (the stream
  // ended without the job's last event).
  absl::Status WatchStep(
      const v1::WatchStepRequest& request, absl::Duration idle_timeout,
      const std::function<bool(const v1::StepEvent&)>& on_event);

  // grpc.health.v1 Check of `service` ("" = the whole server).
  // Errors: NOT_FOUND (unknown service), UNAVAILABLE, DEADLINE_EXCEEDED.
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>
  CheckHealth(const std::string& service = "");

  // The generated stub, for RPCs without a wrapper here.
  v1::Coordinator::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  CoordinatorClient(std::string address,
                    std::shared_ptr<grpc::Channel> channel);

  // A context whose deadline is call_timeout_ from now.
  std::unique_ptr<grpc::ClientContext> NewContext() const;

  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
  absl::Duration call_timeout_ = absl::Seconds(30);
};

}  // namespace shardd

#endif  // SHARDD_CLIENT_COORDINATOR_CLIENT_H_
