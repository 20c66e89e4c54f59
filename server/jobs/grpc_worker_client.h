#ifndef SHARDD_SERVER_JOBS_GRPC_WORKER_CLIENT_H_
#define SHARDD_SERVER_JOBS_GRPC_WORKER_CLIENT_H_

// WorkerClient over gRPC: blocking calls on the generated Worker stub, one
// channel per worker. A call's deadline becomes the ClientContext deadline
// and a cancellation becomes ClientContext::TryCancel, so a hung worker
// never holds a caller longer than its deadline.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/grpc_security.h"
#include "grpcpp/grpcpp.h"
#include "proto/worker.grpc.pb.h"
#include "server/jobs/worker_client.h"

namespace shardd {

class GrpcWorkerClient final : public WorkerClient {
 public:
  // Opens a channel to `address` ("host:port"); it connects lazily, on the
  // first call, with `security` (TLS to the worker, and the worker token
  // the coordinator presents). Errors: INVALID_ARGUMENT (empty address or no
  // ':port', or bad TLS files, naming the flag).
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Create(
      const std::string& address,
      const ChannelSecurity& security = ChannelSecurity());

  const std::string& address() const override { return address_; }

  absl::StatusOr<v1::LoadPlanResponse> LoadPlan(
      const v1::LoadPlanRequest& request,
      const WorkerCallOptions& options) override;
  absl::StatusOr<v1::ExecuteResponse> Execute(
      const v1::ExecuteRequest& request,
      const WorkerCallOptions& options) override;
  absl::StatusOr<v1::ExecuteResponse> RunCommand(
      const v1::RunCommandRequest& request,
      const WorkerCallOptions& options) override;
  absl::StatusOr<v1::GetStatsResponse> GetStats(
      const WorkerCallOptions& options) override;
  absl::StatusOr<v1::SaveShardsResponse> SaveShards(
      const v1::SaveShardsRequest& request,
      const WorkerCallOptions& options) override;
  absl::StatusOr<v1::LoadShardsResponse> LoadShards(
      const v1::LoadShardsRequest& request,
      const WorkerCallOptions& options) override;
  void LoadPlanAsync(const v1::LoadPlanRequest& request,
                     const WorkerCallOptions& options,
                     v1::LoadPlanResponse* response,
                     DoneCallback done) override;
  void ExecuteAsync(const v1::ExecuteRequest& request,
                    const WorkerCallOptions& options,
                    v1::ExecuteResponse* response, DoneCallback done) override;
  absl::StatusOr<v1::HealReplicasResponse> HealReplicas(
      const v1::HealReplicasRequest& request,
      const WorkerCallOptions& options) override;

 private:
  GrpcWorkerClient(std::string address, std::shared_ptr<grpc::Channel> channel);

  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

// A WorkerClientFactory making GrpcWorkerClients with `security`.
WorkerClientFactory GrpcWorkerClientFactory(
    ChannelSecurity security = ChannelSecurity());

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_GRPC_WORKER_CLIENT_H_
