#ifndef SHARDD_SERVER_COORDINATOR_SERVER_H_
#define SHARDD_SERVER_COORDINATOR_SERVER_H_

// A running gRPC server for the Coordinator service, with the standard
// grpc.health.v1 health service and server reflection.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/grpc_security.h"
#include "common/grpc_server.h"
#include "grpcpp/grpcpp.h"
#include "server/coordinator_service.h"
#include "server/grpc_coordinator_service.h"
#include "server/rpc_latencies.h"

namespace shardd {

struct CoordinatorServerOptions {
  // "host:port"; port 0 picks a free port (see CoordinatorServer::port()).
  std::string listen_address = "127.0.0.1:7070";
  // Requests carry model descriptions (16 MiB by default) plus framing.
  int max_receive_message_bytes = 32 << 20;
  // Plans for very large worlds list per-rank rows and can be big.
  int max_send_message_bytes = 1 << 30;
  // TLS of the listening port (default: plaintext).
  ServerSecurity security;
  // Bearer tokens the calls must carry (default: none required).
  Authorizer authorizer;
  // "host:port" of a plaintext listener serving only grpc.health.v1 (for
  // Kubernetes gRPC probes, which cannot speak TLS); empty: none.
  std::string health_listen_address;
  // Where each control-plane call's server-side latency goes (not owned;
  // null: not measured).
  RpcLatencies* latencies = nullptr;
};

class CoordinatorServer {
 public:
  // Builds and starts the server. `service` is not owned and must outlive
  // the server.
  // Errors: INVALID_ARGUMENT (listen_address not HOST:PORT with a port in
  // 0..65535, a message size < 1, or bad TLS files, naming the flag),
  // UNAVAILABLE (cannot bind the address).
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const CoordinatorServerOptions& options, CoordinatorService* service);

  // Shuts down (with a deadline of 5 s) unless Shutdown ran already.
  ~CoordinatorServer();

  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // The bound port (the picked one when the address named port 0).
  int port() const { return port_; }
  // "host:port" with the bound port.
  const std::string& address() const { return address_; }
  // The bound port of the health-only listener; 0 without one.
  int health_port() const { return running_.health_port; }

  // Calls waiting now (Get with wait, Barrier); for tests and status.
  size_t waiting_calls() const { return grpc_service_->waiting_calls(); }

  // Marks the health service NOT_SERVING, ends waiting calls (Get with
  // wait, Barrier) with UNAVAILABLE, stops accepting calls and waits for
  // in-flight calls until `deadline` from now, then cancels the rest.
  // Idempotent and safe to call from any thread.
  void Shutdown(absl::Duration deadline);

 private:
  CoordinatorServer(std::unique_ptr<GrpcCoordinatorService> grpc_service,
                    RunningServer running, std::string address);

  std::unique_ptr<GrpcCoordinatorService> grpc_service_;
  // The server and the optional health-only server.
  RunningServer running_;
  const int port_;
  const std::string address_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace shardd

#endif  // SHARDD_SERVER_COORDINATOR_SERVER_H_
