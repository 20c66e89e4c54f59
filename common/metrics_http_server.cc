#include "common/metrics_http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace shardd {
namespace {

constexpr char kMetricsContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

// Answers GET (and HEAD) on `path`; other methods get 405.
bool AnswerGetOnly(const httplib::Request& request,
                   httplib::Response& response) {
  if (request.method == "GET" || request.method == "HEAD") return true;
  response.status = 405;
  response.set_header("Allow", "GET, HEAD");
  response.set_content("method not allowed\n", "text/plain");
  return false;
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(
    const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': expected HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int port = -1;
  if (host.empty() || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", address, "': expected HOST:PORT with a port in 0..65535"));
  }
  return std::make_pair(host, port);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpServerOptions& options, MetricsRegistry* registry) {
  absl::StatusOr<std::pair<std::string, int>> host_port =
      SplitHostPort(options.listen_address);
  if (!host_port.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: ", host_port.status().message()));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError("metrics server: threads must be >= 1");
  }
  auto server = std::make_unique<httplib::Server>();
  const size_t threads = static_cast<size_t>(options.threads);
  server->new_task_queue = [threads] {
    return new httplib::ThreadPool(threads);
  };
  server->set_payload_max_length(options.max_request_body_bytes);
  server->set_read_timeout(std::chrono::microseconds(
      absl::ToInt64Microseconds(options.read_timeout)));
  server->set_write_timeout(std::chrono::microseconds(
      absl::ToInt64Microseconds(options.write_timeout)));
  // Scrapers reconnect cheaply; short keep-alive frees pool threads.
  server->set_keep_alive_max_count(10);
  server->set_keep_alive_timeout(1);
  // The library's default sets SO_REUSEPORT, which lets a second process
  // bind the same port and take half the scrapes; reuse only TIME_WAIT
  // addresses (a quick restart) instead.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const size_t max_body = options.max_request_body_bytes;
  server->set_pre_routing_handler(
      [registry, max_body](const httplib::Request& request,
                           httplib::Response& response) {
        // Handled here, before the library reads a body: refuse large ones
        // by their declared length and close the connection, so the unread
        // body is never parsed as a request.
        const bool chunked = request.has_header("Transfer-Encoding");
        if (chunked ||
            request.get_header_value<uint64_t>("Content-Length") > max_body) {
          response.status = chunked ? 411 : 413;
          response.set_header("Connection", "close");
          response.set_content("request body too large\n", "text/plain");
          return httplib::Server::HandlerResponse::Handled;
        }
        if (request.path == "/metrics") {
          if (AnswerGetOnly(request, response)) {
            response.set_content(registry->Render(), kMetricsContentType);
          }
        } else if (request.path == "/healthz") {
          if (AnswerGetOnly(request, response)) {
            response.set_content("ok\n", "text/plain");
          }
        } else {
          response.status = 404;
          response.set_content("not found\n", "text/plain");
        }
        return httplib::Server::HandlerResponse::Handled;
      });

  const auto& [host, requested_port] = *host_port;
  int port = requested_port;
  if (port == 0) {
    port = server->bind_to_any_port(host);
  } else if (!server->bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot bind ", options.listen_address));
  }
  const std::string shown_host =
      host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host;
  std::unique_ptr<MetricsHttpServer> running(new MetricsHttpServer(
      std::move(server), port, absl::StrCat(shown_host, ":", port)));
  httplib::Server* raw = running->server_.get();
  running->thread_ = std::thread([raw] { raw->listen_after_bind(); });
  // stop() is a no-op until the accept loop runs: wait for it, so that
  // Shutdown right after Start cannot leave the thread running.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!raw->is_running() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (!raw->is_running()) {
    SHARDD_LOG(WARNING) << "metrics server on " << running->address()
                        << " did not start accepting within 10s";
  }
  return running;
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<httplib::Server> server,
                                     int port, std::string address)
    : server_(std::move(server)), port_(port), address_(std::move(address)) {}

MetricsHttpServer::~MetricsHttpServer() { Shutdown(); }

void MetricsHttpServer::Shutdown() {
  if (!thread_.joinable()) return;
  server_->stop();
  thread_.join();
}

}  // namespace shardd
