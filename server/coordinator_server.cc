#include "server/coordinator_server.h"

#include <chrono>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/grpc_server.h"
#include "common/logging.h"

namespace shardd {
namespace {

// Splits "host:port" at the last colon ("[::1]:0" works too).
absl::Status ParseListenAddress(absl::string_view address, std::string* host,
                                int* port) {
  const size_t colon = address.rfind(':');
  int value = -1;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &value) || value < 0 ||
      value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen: expected HOST:PORT with a port in 0..65535 "
                     "(0 picks a free port), got '",
                     address, "'"));
  }
  *host = std::string(address.substr(0, colon));
  *port = value;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorServerOptions& options, CoordinatorService* service) {
  std::string host;
  int requested_port = 0;
  absl::Status parsed =
      ParseListenAddress(options.listen_address, &host, &requested_port);
  if (!parsed.ok()) return parsed;
  if (options.max_receive_message_bytes < 1 ||
      options.max_send_message_bytes < 1) {
    return absl::InvalidArgumentError(
        "max_receive_message_bytes, max_send_message_bytes: must be >= 1");
  }

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.security);
  if (!credentials.ok()) return credentials.status();
  auto grpc_service = std::make_unique<GrpcCoordinatorService>(
      service, options.authorizer, options.latencies);
  GrpcServerOptions grpc_options;
  grpc_options.credentials = *std::move(credentials);
  grpc_options.address = options.listen_address;
  grpc_options.max_receive_message_bytes = options.max_receive_message_bytes;
  grpc_options.max_send_message_bytes = options.max_send_message_bytes;
  grpc_options.health_address = options.health_listen_address;
  // Turns on the health service and reflection as well.
  absl::StatusOr<RunningServer> running =
      StartGrpcServer(grpc_options, {grpc_service.get()});
  if (!running.ok()) return running.status();
  running->SetServing(true);
  std::string address = absl::StrCat(host, ":", running->port);
  SHARDD_LOG(INFO) << "coordinator serving on " << address;
  return std::unique_ptr<CoordinatorServer>(new CoordinatorServer(
      std::move(grpc_service), *std::move(running), std::move(address)));
}

CoordinatorServer::CoordinatorServer(
    std::unique_ptr<GrpcCoordinatorService> grpc_service, RunningServer running,
    std::string address)
    : grpc_service_(std::move(grpc_service)),
      running_(std::move(running)),
      port_(running_.port),
      address_(std::move(address)) {}

CoordinatorServer::~CoordinatorServer() { Shutdown(absl::Seconds(5)); }

void CoordinatorServer::Shutdown(absl::Duration deadline) {
  if (shut_down_.exchange(true)) return;
  running_.SetServing(false);
  // Waiting Gets and Barriers could last until their own timeouts; end them
  // now so that only short calls use the grace period.
  grpc_service_->CancelWaitingCalls();
  running_.server->Shutdown(std::chrono::system_clock::now() +
                            absl::ToChronoMilliseconds(deadline));
  running_.server->Wait();
  if (running_.health_server != nullptr) {
    running_.health_server->Shutdown(std::chrono::system_clock::now());
    running_.health_server->Wait();
  }
  SHARDD_LOG(INFO) << "coordinator on " << address_ << " stopped";
}

}  // namespace shardd
