// shardd-worker: one per GPU (or CPU rank). Serves the Worker service.
//
//   shardd-worker --listen=127.0.0.1:0 --device=cpu [--port_file=PATH]

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "common/grpc_server.h"
#include "common/logging.h"
#include "worker/grpc_worker_service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "host:port for the Worker service (port 0 picks a free one)");
ABSL_FLAG(std::string, coordinator, "",
          "coordinator host:port (registration lands with the workers issue)");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda:N");
ABSL_FLAG(std::string, port_file, "",
          "if set, the bound port is written here once serving");
ABSL_FLAG(bool, log_json, false, "log one JSON object per line");

namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("shardd worker: holds shards, runs commands");
  absl::ParseCommandLine(argc, argv);
  shardd::SetJsonLogging(absl::GetFlag(FLAGS_log_json));

  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "cpu" && !absl::StartsWith(device, "cuda:")) {
    std::fprintf(stderr,
                 "shardd-worker: --device: expected cpu or cuda:N, got '%s'\n",
                 device.c_str());
    return 2;
  }

  shardd::GrpcWorkerService service([] { g_stop.store(true); });
  shardd::GrpcServerOptions options;
  options.address = absl::GetFlag(FLAGS_listen);
  auto running = shardd::StartGrpcServer(options, {&service});
  if (!running.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 running.status().ToString().c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    // Write then rename so readers never see a partial file.
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << running->port << "\n";
    std::rename(tmp.c_str(), port_file.c_str());
  }
  SHARDD_LOG(INFO) << "shardd-worker listening on " << running->address
                   << " device=" << device;

  signal(SIGTERM, OnSignal);
  signal(SIGINT, OnSignal);
  while (!g_stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  running->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::seconds(5));
  SHARDD_LOG(INFO) << "shardd-worker stopped";
  return 0;
}
