// shardd-coordinator: serves the Coordinator gRPC service.
//
//   shardd-coordinator --listen=127.0.0.1:0 --data-dir=/tmp/shardd
//       [--workers=4] [--heartbeat-timeout=10s] [--collective-timeout=60s]
//       [--tls-cert=F --tls-key=F [--tls-client-ca=F]]
//       [--client-token-file=F] [--worker-token-file=F] [--worker-tls-ca=F]
//       [--checkpoint-dir=DIR] [--metrics-listen=HOST:PORT]
//
// Prints "shardd-coordinator listening on HOST:PORT" on stderr once serving
// and writes the bound port to DATA_DIR/coordinator.port. With
// --metrics-listen it also serves Prometheus metrics over HTTP
// (docs/observability.md) and prints "shardd-coordinator metrics listening
// on HOST:PORT". SIGTERM or SIGINT shut it down gracefully (exit 0).

#include <malloc.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/daemon/command_line.h"
#include "common/daemon/listen_policy.h"
#include "common/daemon/port_file.h"
#include "common/daemon/security_flags.h"
#include "common/daemon/stop_signals.h"
#include "common/grpc_security.h"
#include "common/logging.h"
#include "common/metrics_http_server.h"
#include "common/metrics_registry.h"
#include "planner/strategy_registry.h"
#include "server/coordinator_metrics.h"
#include "server/coordinator_server.h"
#include "server/coordinator_service.h"
#include "server/jobs/grpc_worker_client.h"
#include "server/state_store.h"
#include "server/worker_registry.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "HOST:PORT to serve on; port 0 picks a free port");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT of a plaintext listener that serves only the gRPC "
          "health service (for Kubernetes gRPC probes, which cannot speak "
          "TLS); empty: none");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT of a plaintext HTTP listener serving Prometheus "
          "metrics on /metrics (and /healthz); port 0 picks a free port; "
          "empty: none");
ABSL_FLAG(std::string, data_dir, "",
          "Directory for the coordinator's files (created if missing); the "
          "bound port is written to coordinator.port in it");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory of the jobs' checkpoints (JOB/step-NNNNNNNN); default "
          "DATA_DIR/checkpoints. Workers must get the same directory (on a "
          "shared file system) as --checkpoint-root; empty with no "
          "--data-dir: checkpoints are off");
ABSL_FLAG(bool, checkpoint_space_check, true,
          "Before a save, check the checkpoint directory's free space (the "
          "coordinator for the whole checkpoint, each worker for its file) "
          "against the plan's checkpoint size plus a margin; turn off where "
          "the reported free space is not what the file system accepts");
ABSL_FLAG(bool, log_json, false, "Log one JSON object per line");
ABSL_FLAG(int, max_models, 1024, "Most models kept at once");
ABSL_FLAG(int, workers, 0,
          "Most workers that may register (ranks 0..N-1); 0 = no limit");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(10),
          "A worker without a heartbeat for this long is dead (workers "
          "heartbeat every third of it), e.g. 10s or 500ms");
ABSL_FLAG(int, heartbeat_relay_group, 1,
          "Workers per heartbeat relay group: each worker sends its "
          "heartbeats through the first rank of its group, which forwards "
          "them with its own, so the coordinator gets one message per group "
          "and interval (for thousands of workers; docs/reliability.md). 1: "
          "every worker beats the coordinator directly");
ABSL_FLAG(absl::Duration, collective_timeout, absl::Seconds(60),
          "Training jobs: how long a worker waits for its peers in one "
          "collective; every worker RPC of a job gets this plus 30s");
ABSL_FLAG(absl::Duration, recovery_timeout, absl::Minutes(5),
          "How long a job interrupted by a fault waits for its workers to be "
          "alive again before it fails");
ABSL_FLAG(int, max_recoveries, 3,
          "Faults a job recovers from by itself when its TrainConfig leaves "
          "max_recoveries at 0 (0 here: jobs fail on their first fault)");
ABSL_FLAG(int, max_pending_jobs, 16,
          "Training jobs queued or running at once; more are refused");
// --tls-cert, --tls-key, --tls-client-ca, --worker-token-file: see
// common/daemon/security_flags.h.
ABSL_FLAG(std::string, client_token_file, "",
          "File whose first line is the bearer token clients (shardctl) must "
          "send; empty: client calls need no token");
ABSL_FLAG(std::string, worker_tls_ca, "",
          "PEM CA bundle that verifies the workers' certificates; set: "
          "connect to workers over TLS");
ABSL_FLAG(int, shutdown_grace_ms, 5000,
          "How long in-flight calls may finish after SIGTERM/SIGINT");

namespace shardd {
namespace {

constexpr char kPortFile[] = "coordinator.port";

// A startup line on stderr: plain text, or with --log-json a JSON log line
// (so that every line is one JSON object), with the same text.
void Announce(const std::string& line) {
  if (absl::GetFlag(FLAGS_log_json)) {
    SHARDD_LOG(INFO) << line;
    return;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

int Run() {
  SetJsonLogging(absl::GetFlag(FLAGS_log_json));

  // Before gRPC starts threads, so every thread inherits the mask.
  BlockStopSignals();

  std::filesystem::path data_dir;
  if (!absl::GetFlag(FLAGS_data_dir).empty()) {
    data_dir = absl::GetFlag(FLAGS_data_dir);
    std::error_code error;
    std::filesystem::create_directories(data_dir, error);
    if (error) {
      std::fprintf(stderr,
                   "shardd-coordinator: --data-dir: cannot create %s: %s\n",
                   data_dir.c_str(), error.message().c_str());
      return 1;
    }
  }
  std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (checkpoint_dir.empty() && !data_dir.empty()) {
    checkpoint_dir = (data_dir / "checkpoints").string();
  }
  if (!checkpoint_dir.empty()) {
    std::error_code error;
    // Absolute, so it names the same directory as the workers' root.
    const std::filesystem::path absolute =
        std::filesystem::absolute(checkpoint_dir, error);
    if (!error) std::filesystem::create_directories(absolute, error);
    if (error) {
      std::fprintf(stderr,
                   "shardd-coordinator: --checkpoint-dir: cannot create %s: "
                   "%s\n",
                   checkpoint_dir.c_str(), error.message().c_str());
      return 1;
    }
    checkpoint_dir = absolute.lexically_normal().string();
    while (checkpoint_dir.size() > 1 && checkpoint_dir.back() == '/') {
      checkpoint_dir.pop_back();
    }
  }
  if (absl::GetFlag(FLAGS_max_models) < 1) {
    std::fprintf(stderr,
                 "shardd-coordinator: --max_models: expected an integer >= "
                 "1\n");
    return 2;
  }

  if (absl::GetFlag(FLAGS_workers) < 0 ||
      absl::GetFlag(FLAGS_workers) > WorkerRegistry::kMaxWorkersHardLimit) {
    std::fprintf(stderr,
                 "shardd-coordinator: --workers: expected 0 (no limit) to "
                 "%d, got %d\n",
                 WorkerRegistry::kMaxWorkersHardLimit,
                 absl::GetFlag(FLAGS_workers));
    return 2;
  }
  const absl::Duration heartbeat_timeout =
      absl::GetFlag(FLAGS_heartbeat_timeout);
  if (heartbeat_timeout < absl::Milliseconds(30) ||
      heartbeat_timeout > absl::Hours(24)) {
    std::fprintf(stderr,
                 "shardd-coordinator: --heartbeat_timeout: expected 30ms to "
                 "24h, got %s\n",
                 absl::FormatDuration(heartbeat_timeout).c_str());
    return 2;
  }

  const int relay_group = absl::GetFlag(FLAGS_heartbeat_relay_group);
  if (relay_group < 1 || relay_group > 1024) {
    std::fprintf(stderr,
                 "shardd-coordinator: --heartbeat_relay_group: expected 1 (no "
                 "relays) to 1024, got %d\n",
                 relay_group);
    return 2;
  }

  const absl::Duration collective_timeout =
      absl::GetFlag(FLAGS_collective_timeout);
  if (collective_timeout < absl::Milliseconds(100) ||
      collective_timeout > absl::Hours(24)) {
    std::fprintf(stderr,
                 "shardd-coordinator: --collective_timeout: expected 100ms to "
                 "24h, got %s\n",
                 absl::FormatDuration(collective_timeout).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_max_pending_jobs) < 1) {
    std::fprintf(stderr,
                 "shardd-coordinator: --max_pending_jobs: expected an integer "
                 ">= 1\n");
    return 2;
  }

  absl::StatusOr<std::string> client_token = ReadOptionalTokenFile(
      absl::GetFlag(FLAGS_client_token_file), "--client-token-file");
  absl::StatusOr<std::string> worker_token = WorkerTokenFromFlags();
  for (const absl::Status& status :
       {client_token.status(), worker_token.status()}) {
    if (!status.ok()) {
      std::fprintf(stderr, "shardd-coordinator: %s\n",
                   std::string(status.message()).c_str());
      return 2;
    }
  }
  ChannelSecurity worker_channel;
  worker_channel.bearer_token = *worker_token;
  worker_channel.tls_ca_file = absl::GetFlag(FLAGS_worker_tls_ca);
  if (!worker_channel.tls_ca_file.empty()) {
    // Workers with --tls-client-ca need a client certificate: ours.
    SetClientCertificateFromFlags(&worker_channel);
  }
  // Checks the CA now rather than at the first job (--tls-cert and
  // --tls-key are checked when the server starts).
  if (!worker_channel.tls_ca_file.empty()) {
    if (absl::StatusOr<std::string> ca =
            ReadSecurityFile(worker_channel.tls_ca_file, "--worker-tls-ca");
        !ca.ok()) {
      std::fprintf(stderr, "shardd-coordinator: %s\n",
                   std::string(ca.status().message()).c_str());
      return 2;
    }
  }

  // Locked by default: a reachable --listen needs TLS and both tokens.
  ListenerGuard guard;
  guard.address = absl::GetFlag(FLAGS_listen);
  guard.tls = !absl::GetFlag(FLAGS_tls_cert).empty() &&
              !absl::GetFlag(FLAGS_tls_key).empty();
  guard.tokens = {{"--client-token-file", !client_token->empty()},
                  {"--worker-token-file", !worker_token->empty()}};
  guard.insecure = absl::GetFlag(FLAGS_insecure);
  absl::StatusOr<bool> exposed = CheckListener(guard);
  if (!exposed.ok()) {
    std::fprintf(stderr, "shardd-coordinator: %s\n",
                 std::string(exposed.status().message()).c_str());
    return 2;
  }
  std::string insecure_warning;
  if (*exposed) {
    insecure_warning =
        InsecureListenerWarning("shardd-coordinator", guard.address);
    Announce(absl::StrCat("WARNING: ", insecure_warning));
  }

  // Durable state: models and plans survive a restart (kill -9 included)
  // with the same --data-dir.
  std::unique_ptr<StateStore> state;
  if (!data_dir.empty()) {
    absl::StatusOr<std::unique_ptr<StateStore>> opened =
        StateStore::Open((data_dir / "state.db").string());
    if (!opened.ok()) {
      std::fprintf(stderr, "shardd-coordinator: --data-dir: %s\n",
                   opened.status().ToString().c_str());
      return 1;
    }
    state = *std::move(opened);
  }

  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  CoordinatorServiceOptions service_options;
  service_options.state = state.get();
  service_options.max_models = absl::GetFlag(FLAGS_max_models);
  service_options.max_workers = absl::GetFlag(FLAGS_workers);
  service_options.insecure_warning = insecure_warning;
  service_options.heartbeat_timeout = heartbeat_timeout;
  service_options.heartbeat_relay_group = relay_group;
  service_options.worker_clients = GrpcWorkerClientFactory(worker_channel);
  service_options.jobs.collective_timeout = collective_timeout;
  service_options.jobs.max_pending_jobs = absl::GetFlag(FLAGS_max_pending_jobs);
  service_options.jobs.checkpoint_dir = checkpoint_dir;
  service_options.jobs.check_checkpoint_space =
      absl::GetFlag(FLAGS_checkpoint_space_check);
  service_options.jobs.recovery_timeout = absl::GetFlag(FLAGS_recovery_timeout);
  service_options.jobs.default_max_recoveries =
      std::max(0, absl::GetFlag(FLAGS_max_recoveries));
  CoordinatorService service(registry.get(), service_options);

  CoordinatorServerOptions server_options;
  server_options.listen_address = absl::GetFlag(FLAGS_listen);
  server_options.security = ServerSecurityFromFlags();
  server_options.authorizer = Authorizer(*client_token, *worker_token);
  server_options.health_listen_address = absl::GetFlag(FLAGS_health_listen);
  // Outlives the server, whose calls record into it.
  static RpcLatencies* const latencies = new RpcLatencies();
  server_options.latencies = latencies;
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
      CoordinatorServer::Start(server_options, &service);
  if (!server.ok()) {
    std::fprintf(stderr, "shardd-coordinator: %s\n",
                 server.status().ToString().c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (!data_dir.empty()) {
    absl::Status written = WritePortFile((data_dir / kPortFile).string(),
                                         (*server)->port(), "--data-dir");
    if (!written.ok()) {
      std::fprintf(stderr, "shardd-coordinator: %s\n",
                   written.ToString().c_str());
      (*server)->Shutdown(absl::ZeroDuration());
      return 1;
    }
  }
  Announce(
      absl::StrCat("shardd-coordinator listening on ", (*server)->address()));

  // Declared after the service, whose status its collector reads.
  MetricsRegistry metrics;
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (const std::string listen = absl::GetFlag(FLAGS_metrics_listen);
      !listen.empty()) {
    absl::Status registered =
        RegisterCoordinatorMetrics(&service, &metrics, latencies);
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> started =
        registered.ok() ? MetricsHttpServer::Start({listen}, &metrics)
                        : registered;
    if (!started.ok()) {
      std::fprintf(stderr, "shardd-coordinator: %s\n",
                   started.status().ToString().c_str());
      (*server)->Shutdown(absl::ZeroDuration());
      return started.status().code() == absl::StatusCode::kInvalidArgument ? 2
                                                                           : 1;
    }
    metrics_server = *std::move(started);
    Announce(absl::StrCat("shardd-coordinator metrics listening on ",
                          metrics_server->address()));
  }

  const int signal_number = WaitForStopSignal();
  SHARDD_LOG(INFO) << "signal " << signal_number << ": shutting down";
  if (metrics_server != nullptr) metrics_server->Shutdown();
  // Jobs first: their watchers then receive the failure event before the
  // server ends the streams.
  service.Shutdown();
  (*server)->Shutdown(
      absl::Milliseconds(absl::GetFlag(FLAGS_shutdown_grace_ms)));
  if (!data_dir.empty()) {
    std::error_code ignored;
    std::filesystem::remove(data_dir / kPortFile, ignored);
  }
  return 0;
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) {
  // absl::Mutex's deadlock detection (on in this absl build) takes a global
  // lock on every lock: with thousands of job threads it dominated the
  // coordinator's CPU. Tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // No glibc fastbins: a job start over thousands of workers frees and
  // allocates many mid-sized buffers (requests, connections), and each
  // large allocation then consolidated the fastbins (malloc_consolidate,
  // 10% of a 4096-rank start's CPU). Without them the start takes 25% less
  // time (docs/performance.md).
  mallopt(M_MXFAST, 0);
  // --help lists this file's flags (absl matches files by program name,
  // which differs here).
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "coordinator_main");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "Serves the shardd Coordinator gRPC service.\n"
      "  shardd-coordinator --listen=127.0.0.1:7070 --data-dir=DIR "
      "[--workers=N] [--heartbeat-timeout=10s] [--collective-timeout=60s]\n"
      "Dashes and underscores in flag names are interchangeable.");
  // Dashed spellings (--data-dir) of the underscore flag names too.
  const std::vector<std::string> rest =
      shardd::ParseDaemonCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr,
                 "shardd-coordinator: unexpected argument '%s' (flags only; "
                 "see --help)\n",
                 rest[1].c_str());
    return 2;
  }
  return shardd::Run();
}
