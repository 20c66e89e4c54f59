#ifndef SHARDD_COMMON_GRPC_SERVER_H_
#define SHARDD_COMMON_GRPC_SERVER_H_

// Starts a gRPC server the way every shardd endpoint needs it: the default
// health service (grpc.health.v1) and server reflection on, message-size
// limits, and the bound port reported back (address "host:0" picks one).

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
};

struct RunningServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address;  // host:bound_port
};

// Registers `services` (not owned; they must outlive the server) and starts.
// Errors: INVALID_ARGUMENT (address without a port), UNAVAILABLE (could not
// bind the address).
absl::StatusOr<RunningServer> StartGrpcServer(
    const GrpcServerOptions& options,
    const std::vector<grpc::Service*>& services);

}  // namespace shardd

#endif  // SHARDD_COMMON_GRPC_SERVER_H_
