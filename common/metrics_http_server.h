#ifndef SHARDD_COMMON_METRICS_HTTP_SERVER_H_
#define SHARDD_COMMON_METRICS_HTTP_SERVER_H_

// A small plaintext HTTP/1.1 server for Prometheus scrapes (the binaries'
// --metrics-listen):
//   GET /metrics  the registry's Render(), Content-Type
//                 "text/plain; version=0.0.4; charset=utf-8"
//   GET /healthz  "ok"
//   anything else 404 (other methods on these paths: 405)
// Built on cpp-httplib (Debian's libcpp-httplib-dev) without TLS. Requests
// are bounded (header and URI sizes by the library, bodies by
// max_request_body_bytes, reads by read_timeout) and served by a small
// fixed thread pool.

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics_registry.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace shardd {

struct MetricsHttpServerOptions {
  // "HOST:PORT" ("[v6addr]:PORT" for IPv6); port 0 picks a free port.
  std::string listen_address = "127.0.0.1:0";
  // Larger request bodies are refused (413); scrapes send none.
  size_t max_request_body_bytes = 4096;
  // Threads serving connections.
  int threads = 2;
  absl::Duration read_timeout = absl::Seconds(5);
  absl::Duration write_timeout = absl::Seconds(5);
};

class MetricsHttpServer {
 public:
  // Binds and starts serving `registry` (not owned; must outlive the
  // server). Errors: INVALID_ARGUMENT (listen_address not HOST:PORT with a
  // port in 0..65535, threads < 1), UNAVAILABLE (cannot bind).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpServerOptions& options, MetricsRegistry* registry);

  // Shutdown().
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port.
  int port() const { return port_; }
  // "host:port" with the bound port.
  const std::string& address() const { return address_; }

  // Stops accepting, lets requests in progress finish (bounded by the read
  // and write timeouts) and joins the threads. Idempotent.
  void Shutdown();

 private:
  MetricsHttpServer(std::unique_ptr<httplib::Server> server, int port,
                    std::string address);

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  const int port_;
  const std::string address_;
};

// Splits "HOST:PORT" / "[HOST]:PORT". Errors: INVALID_ARGUMENT (no port,
// empty host, port outside 0..65535).
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(
    const std::string& address);

}  // namespace shardd

#endif  // SHARDD_COMMON_METRICS_HTTP_SERVER_H_
