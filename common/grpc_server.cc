#include "common/grpc_server.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace shardd {

namespace {

absl::Status CheckAddress(const std::string& address, const char* what) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", address, "': expected host:port (port 0 picks one)"));
  }
  return absl::OkStatus();
}

}  // namespace

void SetHealthServing(grpc::Server* server, bool serving) {
  if (server == nullptr) return;
  if (grpc::HealthCheckServiceInterface* health =
          server->GetHealthCheckService()) {
    health->SetServingStatus(serving);
  }
}

void RunningServer::SetServing(bool serving) const {
  SetHealthServing(server.get(), serving);
  SetHealthServing(health_server.get(), serving);
}

absl::StatusOr<RunningServer> StartGrpcServer(
    const GrpcServerOptions& options,
    const std::vector<grpc::Service*>& services) {
  const std::string& address = options.address;
  if (absl::Status status = CheckAddress(address, "listen address");
      !status.ok()) {
    return status;
  }
  if (!options.health_address.empty()) {
    if (absl::Status status =
            CheckAddress(options.health_address, "health listen address");
        !status.ok()) {
      return status;
    }
  }
  const size_t colon = address.rfind(':');
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address,
                           options.credentials != nullptr
                               ? options.credentials
                               : grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(options.max_send_message_bytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on '", address, "'"));
  }
  RunningServer running;
  if (!options.health_address.empty()) {
    // Its own server, so that plaintext callers reach nothing but health.
    grpc::ServerBuilder health_builder;
    int health_port = 0;
    health_builder.AddListeningPort(options.health_address,
                                    grpc::InsecureServerCredentials(),
                                    &health_port);
    running.health_server = health_builder.BuildAndStart();
    if (running.health_server == nullptr || health_port == 0) {
      server->Shutdown(std::chrono::system_clock::now());
      return absl::UnavailableError(absl::StrCat(
          "could not listen on health address '", options.health_address, "'"));
    }
    running.health_port = health_port;
  }
  running.server = std::move(server);
  running.port = port;
  running.address = absl::StrCat(address.substr(0, colon), ":", port);
  return running;
}

}  // namespace shardd
