#ifndef SHARDD_COMMON_GRPC_SERVER_H_
#define SHARDD_COMMON_GRPC_SERVER_H_

// Starts a gRPC server the way every shardd endpoint needs it: the default
// health service (grpc.health.v1) and server reflection on, message-size
// limits, and the bound port reported back (address "host:0" picks one).
// Optionally a second, plaintext listener that serves only the health
// service: Kubernetes' gRPC probes cannot speak TLS, so they need one when
// the main port serves (mutual) TLS.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace shardd {

struct GrpcServerOptions {
  std::string address = "127.0.0.1:0";
  int max_receive_message_bytes = 256 << 20;
  int max_send_message_bytes = 256 << 20;
  // TLS or plaintext (common/grpc_security.h MakeServerCredentials); null:
  // plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // "host:port" of a plaintext listener with only grpc.health.v1 (and
  // reflection); empty: none. Port 0 picks one.
  std::string health_address;
};

struct RunningServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address;  // host:bound_port
  // The health-only server (null without GrpcServerOptions::health_address)
  // and its bound port.
  std::unique_ptr<grpc::Server> health_server;
  int health_port = 0;

  // Sets the overall ("") health status of both servers.
  void SetServing(bool serving) const;
};

// Sets the overall ("") and every named status of `server`'s default health
// service; a no-op for null or a server without one.
void SetHealthServing(grpc::Server* server, bool serving);

// Registers `services` (not owned; they must outlive the server) and starts.
// Both servers start SERVING. Errors: INVALID_ARGUMENT (an address without a
// port), UNAVAILABLE (could not bind an address).
absl::StatusOr<RunningServer> StartGrpcServer(
    const GrpcServerOptions& options,
    const std::vector<grpc::Service*>& services);

}  // namespace shardd

#endif  // SHARDD_COMMON_GRPC_SERVER_H_
