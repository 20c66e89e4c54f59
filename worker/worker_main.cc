// shardd-worker: one per GPU (or CPU rank). Serves the Worker service (a
// WorkerRuntime: LoadPlan, Execute, RunCommand, GetStats) and, with
// --coordinator, registers with the coordinator (which assigns the rank) and
// heartbeats until it stops. The coordinator's key-value store is the
// rendezvous for the job's Gloo groups; without --coordinator only plans of
// world size 1 load.
//
//   shardd-worker --listen=127.0.0.1:0 --device=cpu
//       [--coordinator=HOST:PORT] [--port_file=PATH]
//       [--collective_bind=127.0.0.1]
//       [--tls_cert=F --tls_key=F [--tls_client_ca=F]] [--tls_ca=F]
//       [--worker_token_file=F] [--checkpoint_root=DIR] [--weights_root=DIR]
//       [--debug_save_delay=D (fault tests only)]
//       [--memory_timeline_svg=FILE]
//       [--health_listen=HOST:PORT]
//       [--metrics_listen=HOST:PORT]
//
// --metrics_listen serves Prometheus metrics over plaintext HTTP on /metrics
// (and /healthz), see docs/observability.md; the bound address is logged as
// "shardd-worker metrics listening on HOST:PORT".
//
// The gRPC health service (on --listen and, plaintext, on --health_listen)
// reports NOT_SERVING until the worker has registered with the coordinator
// (at once without --coordinator) and again once it is stopping, so a
// readiness probe passes only for a worker that has joined.
//
// Exits 1 when the coordinator cannot be reached within
// --coordinator_timeout. The port file is written once the worker is serving
// and (with --coordinator) registered. Dashes and underscores in flag names
// are interchangeable.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/daemon/command_line.h"
#include "common/daemon/listen_policy.h"
#include "common/daemon/port_file.h"
#include "common/daemon/security_flags.h"
#include "common/daemon/stop_signals.h"
#include "common/grpc_security.h"
#include "common/grpc_server.h"
#include "common/logging.h"
#include "common/metrics_http_server.h"
#include "common/metrics_registry.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/simd_level.h"
#include "worker/grpc/coordinator_agent.h"
#include "worker/grpc/grpc_worker_service.h"
#include "worker/worker_metrics.h"
#include "worker/worker_runtime.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "host:port for the Worker service (port 0 picks a free one)");
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext listener that serves only the gRPC "
          "health service (for Kubernetes gRPC probes, which cannot speak "
          "TLS); empty: none");
ABSL_FLAG(std::string, coordinator, "",
          "coordinator host:port to register with (empty: run standalone)");
ABSL_FLAG(absl::Duration, coordinator_timeout, absl::Seconds(30),
          "give up (exit 1) when registration with the coordinator has not "
          "succeeded within this, e.g. 30s");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port the coordinator and other workers should dial (default: "
          "the bound --listen address; set it when listening on 0.0.0.0)");
ABSL_FLAG(int, requested_rank, -1,
          "rank to ask the coordinator for (-1: any; the coordinator decides)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu, or cuda:N to run steps on CUDA device N over NCCL (CUDA "
          "builds only; other builds refuse it)");
ABSL_FLAG(std::string, port_file, "",
          "if set, the bound port is written here once serving");
ABSL_FLAG(std::string, collective_bind, "127.0.0.1",
          "address this worker's Gloo endpoints listen on; the other workers "
          "must reach it (set a routable address for multi-host jobs)");
ABSL_FLAG(bool, log_json, false, "log one JSON object per line");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port of a plaintext HTTP listener serving Prometheus "
          "metrics on /metrics (and /healthz); port 0 picks a free one; "
          "empty: none");
ABSL_FLAG(std::string, checkpoint_root, "",
          "Directory checkpoint paths are confined to: the coordinator's "
          "--checkpoint-dir on a shared file system; empty: checkpoints are "
          "refused");
ABSL_FLAG(std::string, weights_root, "",
          "Directory --init-from (Hugging Face weights) paths are confined to, "
          "symlinks resolved; empty: any path this process can read");
ABSL_FLAG(absl::Duration, debug_save_delay, absl::ZeroDuration(),
          "fault-injection aid for tests only: after SaveShards wrote and "
          "fsynced this rank's checkpoint file, sleep this long (e.g. 5s) "
          "before answering, so a test can kill the worker in the middle of "
          "a checkpoint; 0 (default) in production");
ABSL_FLAG(std::string, memory_timeline_svg, "",
          "Draw the measured memory timeline (gathered parameters and "
          "unsharded gradients after every allocation and free) of the "
          "first step this worker runs on the CPU into this SVG file");
// --tls-cert, --tls-key, --tls-client-ca, --worker-token-file: see
// common/daemon/security_flags.h.
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that verifies the coordinator; set: connect to it "
          "over TLS");

int main(int argc, char** argv) {
  // As the coordinator's: no global deadlock-detection lock in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Before any thread starts. Also ignores SIGPIPE: Gloo writes to peers
  // that may have died, and such a write must fail the step with ABORTED.
  shardd::BlockStopSignals();
  absl::SetProgramUsageMessage("shardd worker: holds shards, runs commands");
  // Dashed spellings (--port-file) of the underscore flag names too.
  shardd::ParseDaemonCommandLine(argc, argv);
  shardd::SetJsonLogging(absl::GetFlag(FLAGS_log_json));

  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "cpu" && !absl::StartsWith(device, "cuda:")) {
    std::fprintf(stderr,
                 "shardd-worker: --device: expected cpu or cuda:N, got '%s'\n",
                 device.c_str());
    return 2;
  }
  int device_ordinal = -1;
  if (device != "cpu") {
    if (!absl::SimpleAtoi(device.substr(5), &device_ordinal) ||
        device_ordinal < 0) {
      std::fprintf(stderr,
                   "shardd-worker: --device: expected cuda:N with N a device "
                   "ordinal >= 0, got '%s'\n",
                   device.c_str());
      return 2;
    }
    if (!shardd::DeviceStepsSupported()) {
      // Refuse rather than train on the CPU under a GPU's name.
      std::fprintf(stderr,
                   "shardd-worker: --device %s: this worker was built "
                   "without CUDA and runs step programs on the CPU only "
                   "(--device cpu; build with --config=cuda for GPUs)\n",
                   device.c_str());
      return 2;
    }
    // A GPU worker on a node without its GPU must not join a job.
    const absl::Status usable = shardd::CheckDeviceUsable(device_ordinal);
    if (!usable.ok()) {
      std::fprintf(stderr, "shardd-worker: --device %s: %s\n", device.c_str(),
                   std::string(usable.message()).c_str());
      return 1;
    }
  }

  // A bad SHARDD_CPU_ISA would fail every step; refuse before registering.
  const absl::StatusOr<shardd::kernels::SimdLevel> simd =
      shardd::kernels::ActiveSimdLevel();
  if (!simd.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 std::string(simd.status().message()).c_str());
    return 2;
  }
  // And a bad SHARDD_CPU_THREADS would be ignored silently.
  const absl::StatusOr<int> cpu_threads =
      shardd::kernels::ComputeThreadsFromEnvironment();
  if (!cpu_threads.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 std::string(cpu_threads.status().message()).c_str());
    return 2;
  }
  SHARDD_LOG(INFO) << "shardd-worker CPU kernels at "
                   << shardd::kernels::SimdLevelName(*simd) << " (best here: "
                   << shardd::kernels::SimdLevelName(
                          shardd::kernels::SupportedSimdLevel())
                   << ") on " << shardd::kernels::ComputeThreads()
                   << " compute threads";

  shardd::WorkerRuntimeOptions runtime_options;
  runtime_options.bind_address = absl::GetFlag(FLAGS_collective_bind);
  runtime_options.device = device_ordinal;
  runtime_options.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  runtime_options.weights_root = absl::GetFlag(FLAGS_weights_root);
  runtime_options.debug_save_delay = absl::GetFlag(FLAGS_debug_save_delay);
  runtime_options.memory_timeline_svg =
      absl::GetFlag(FLAGS_memory_timeline_svg);
  if (runtime_options.debug_save_delay < absl::ZeroDuration()) {
    std::fprintf(stderr, "shardd-worker: --debug-save-delay must be >= 0\n");
    return 2;
  }
  while (runtime_options.checkpoint_root.size() > 1 &&
         runtime_options.checkpoint_root.back() == '/') {
    runtime_options.checkpoint_root.pop_back();
  }
  if (runtime_options.bind_address.empty()) {
    std::fprintf(stderr,
                 "shardd-worker: --collective_bind must not be empty\n");
    return 2;
  }
  absl::StatusOr<std::string> token = shardd::WorkerTokenFromFlags();
  if (!token.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 std::string(token.status().message()).c_str());
    return 2;
  }
  const std::string worker_token = *std::move(token);
  const shardd::ServerSecurity server_security =
      shardd::ServerSecurityFromFlags();
  // Locked by default: a reachable --listen needs TLS and the worker token.
  shardd::ListenerGuard guard;
  guard.address = absl::GetFlag(FLAGS_listen);
  guard.tls = !server_security.tls_cert_file.empty() &&
              !server_security.tls_key_file.empty();
  guard.tokens = {{"--worker-token-file", !worker_token.empty()}};
  guard.insecure = absl::GetFlag(FLAGS_insecure);
  absl::StatusOr<bool> exposed = shardd::CheckListener(guard);
  if (!exposed.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 std::string(exposed.status().message()).c_str());
    return 2;
  }
  if (*exposed) {
    const std::string warning =
        shardd::InsecureListenerWarning("shardd-worker", guard.address);
    std::fprintf(stderr, "shardd-worker: WARNING: %s\n", warning.c_str());
    SHARDD_LOG(WARNING) << warning;
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      shardd::MakeServerCredentials(server_security);
  if (!credentials.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 std::string(credentials.status().message()).c_str());
    return 2;
  }

  // Families and the step hook exist before the runtime that calls it.
  shardd::MetricsRegistry metrics;
  std::unique_ptr<shardd::WorkerMetrics> worker_metrics;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<shardd::WorkerMetrics>> created =
        shardd::WorkerMetrics::Create(&metrics);
    if (!created.ok()) {
      std::fprintf(stderr, "shardd-worker: %s\n",
                   created.status().ToString().c_str());
      return 1;
    }
    worker_metrics = *std::move(created);
    worker_metrics->set_insecure(*exposed);
    runtime_options.on_step =
        [m = worker_metrics.get()](const shardd::StepResult& result) {
          m->RecordStep(result);
        };
  }

  shardd::WorkerRuntime runtime(runtime_options);
  shardd::GrpcWorkerService service(
      &runtime, [] { shardd::RequestStop(); },
      shardd::Authorizer(/*client_token=*/"", worker_token));
  shardd::GrpcServerOptions options;
  options.address = absl::GetFlag(FLAGS_listen);
  options.credentials = *std::move(credentials);
  options.health_address = absl::GetFlag(FLAGS_health_listen);
  auto running = shardd::StartGrpcServer(options, {&service});
  if (!running.ok()) {
    std::fprintf(stderr, "shardd-worker: %s\n",
                 running.status().ToString().c_str());
    return 1;
  }
  // Declared after the runtime and stopped before the agent goes: its
  // collector reads both.
  std::unique_ptr<shardd::MetricsHttpServer> metrics_server;
  if (worker_metrics != nullptr) {
    worker_metrics->set_runtime(&runtime);
    absl::StatusOr<std::unique_ptr<shardd::MetricsHttpServer>> started =
        shardd::MetricsHttpServer::Start({metrics_listen}, &metrics);
    if (!started.ok()) {
      std::fprintf(stderr, "shardd-worker: %s\n",
                   started.status().ToString().c_str());
      running->server->Shutdown(std::chrono::system_clock::now());
      return started.status().code() == absl::StatusCode::kInvalidArgument ? 2
                                                                           : 1;
    }
    metrics_server = *std::move(started);
    SHARDD_LOG(INFO) << "shardd-worker metrics listening on "
                     << metrics_server->address();
  }
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  // Not ready until registered: gRPC's health service starts SERVING.
  running->SetServing(coordinator.empty());
  // Register only once serving, so the coordinator never hands out an
  // address that does not answer yet.
  std::unique_ptr<shardd::CoordinatorAgent> agent;
  if (!coordinator.empty()) {
    shardd::CoordinatorAgentOptions agent_options;
    agent_options.coordinator = coordinator;
    agent_options.security.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
    if (!agent_options.security.tls_ca_file.empty()) {
      // A coordinator with --tls-client-ca needs a client certificate.
      shardd::SetClientCertificateFromFlags(&agent_options.security);
    }
    agent_options.security.bearer_token = worker_token;
    agent_options.address = absl::GetFlag(FLAGS_advertise_address).empty()
                                ? running->address
                                : absl::GetFlag(FLAGS_advertise_address);
    agent_options.device = device;
    agent_options.requested_rank = absl::GetFlag(FLAGS_requested_rank);
    agent_options.insecure = *exposed;
    agent_options.relay = service.heartbeat_relay();
    agent_options.connect_timeout = absl::GetFlag(FLAGS_coordinator_timeout);
    auto started = shardd::CoordinatorAgent::Start(agent_options);
    if (!started.ok()) {
      const bool unreachable =
          started.status().code() == absl::StatusCode::kDeadlineExceeded ||
          started.status().code() == absl::StatusCode::kUnavailable;
      std::fprintf(stderr, "shardd-worker: --coordinator=%s: %s%s\n",
                   coordinator.c_str(), started.status().ToString().c_str(),
                   unreachable ? " (is the coordinator running and reachable? "
                                 "--coordinator_timeout sets how long to try)"
                               : "");
      running->server->Shutdown(std::chrono::system_clock::now());
      return 1;
    }
    agent = *std::move(started);
    service.set_kv_client(agent.get());
    if (worker_metrics != nullptr) worker_metrics->set_agent(agent.get());
    running->SetServing(true);
    SHARDD_LOG(INFO) << "shardd-worker registered with " << coordinator
                     << " as rank " << agent->rank();
  }

  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    // A launcher waiting for the file would otherwise wait in vain.
    const absl::Status written =
        shardd::WritePortFile(port_file, running->port, "--port-file");
    if (!written.ok()) {
      std::fprintf(stderr, "shardd-worker: %s\n", written.ToString().c_str());
      if (agent != nullptr) agent->Stop();
      running->server->Shutdown(std::chrono::system_clock::now());
      return 1;
    }
  }
  SHARDD_LOG(INFO) << "shardd-worker listening on " << running->address
                   << " device=" << device;

  const int signal_number = shardd::WaitForStopSignal();
  SHARDD_LOG(INFO) << "signal " << signal_number << ": shutting down";
  // Stop heartbeating first: the coordinator then sees this worker leave
  // (after its heartbeat timeout) rather than a worker that stops answering.
  // (That also cancels a rendezvous in flight.) Then finish queued calls
  // with UNAVAILABLE and wait for the running one, so the server's shutdown
  // does not wait on them; the runtime thread is gone before the agent.
  running->SetServing(false);
  if (metrics_server != nullptr) metrics_server->Shutdown();
  if (agent != nullptr) agent->Stop();
  service.Stop();
  service.set_kv_client(nullptr);
  running->server->Shutdown(std::chrono::system_clock::now() +
                            std::chrono::seconds(5));
  if (running->health_server != nullptr) {
    running->health_server->Shutdown(std::chrono::system_clock::now());
  }
  runtime.Reset();
  SHARDD_LOG(INFO) << "shardd-worker stopped";
  return 0;
}
