// The coordinator's control plane at scale: a real shardd-coordinator
// process and N simulated workers (testing/simulated_workers.h: the real
// gRPC API, many per process) on loopback, for N = 256, 2048 and 8192:
// registration, heartbeats at a 1 s and a 100 ms cadence, one N-party
// barrier, one key fanned out to N - 1 waiting Gets, and a DeepSeek-V3 job
// start. Reports client latency percentiles, server-side ones (the
// coordinator's shardd_coordinator_rpc_seconds histograms, scraped before
// and after each phase; bucket upper bounds, so within a factor of 2), the
// coordinator's CPU (from /proc, as a share of one core) and resident
// memory. A fresh coordinator per N.
//
//   bazel run -c opt //bench:control_plane_bench [-- --workers=256,2048]
//
// Targets (issue 17): 8192 workers beating every second at under 25% of one
// core; a 2048-party barrier released within 100 ms of its last arrival.

#include <httplib.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/metrics_text_parser.h"
#include "server/rpc_latencies.h"
#include "testing/simulated_worker_service.h"
#include "testing/simulated_workers.h"
#include "tests/subprocess.h"

ABSL_FLAG(std::string, workers, "256,2048,8192", "Worker counts to run");
ABSL_FLAG(absl::Duration, beat_phase, absl::Seconds(10),
          "How long each heartbeat cadence runs");
ABSL_FLAG(std::string, coordinator_binary, "server/shardd-coordinator",
          "The coordinator to start");
ABSL_FLAG(int, heartbeat_relay_group, 1,
          "The coordinator's --heartbeat-relay-group; above 1 the simulated "
          "workers beat through their group's first rank as real ones do");
ABSL_FLAG(bool, heartbeats_only, false,
          "Register and beat every second, then stop (the 1 s heartbeat "
          "cost alone)");

namespace shardd {
namespace {

using testing_util::Latencies;
using testing_util::SimulatedWorkers;

// utime + stime of `pid` in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(in, line);
  // Fields after the ")" of the command name: state is field 3.
  const size_t close = line.rfind(')');
  std::vector<std::string> fields = absl::StrSplit(line.substr(close + 2), ' ');
  int64_t utime = 0, stime = 0;
  if (fields.size() > 12) {
    (void)absl::SimpleAtoi(fields[11], &utime);
    (void)absl::SimpleAtoi(fields[12], &stime);
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// The coordinator's metrics port, from its "metrics listening on" line.
int MetricsPort(const std::string& err_file, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    const std::string text = testing_util::ReadFile(err_file);
    const std::string marker = "metrics listening on 127.0.0.1:";
    const size_t at = text.find(marker);
    int port = 0;
    if (at != std::string::npos &&
        absl::SimpleAtoi(text.substr(at + marker.size(),
                                     text.find('\n', at) - at - marker.size()),
                         &port)) {
      return port;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

// The coordinator's server-side latency counts of `method`
// (shardd_coordinator_rpc_seconds), scraped over HTTP; empty on error.
RpcLatencies::Snapshot ServerSide(int port, RpcLatencies::Method method) {
  RpcLatencies::Snapshot out;
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5);
  client.set_read_timeout(30);
  httplib::Result result = client.Get("/metrics");
  if (!result || result->status != 200) return out;
  absl::StatusOr<ParsedMetrics> parsed = ParseMetricsText(result->body);
  if (!parsed.ok()) return out;
  // Cumulative counts by bound, then per bucket.
  std::vector<std::pair<double, double>> cumulative;
  for (const ParsedSample& sample : parsed->samples) {
    if (sample.name != "shardd_coordinator_rpc_seconds_bucket") continue;
    auto m = sample.labels.find("method");
    auto le = sample.labels.find("le");
    if (m == sample.labels.end() || le == sample.labels.end() ||
        m->second != RpcLatencies::Name(method)) {
      continue;
    }
    const double bound = le->second == "+Inf"
                             ? std::numeric_limits<double>::infinity()
                             : std::strtod(le->second.c_str(), nullptr);
    cumulative.emplace_back(bound, sample.value);
  }
  std::sort(cumulative.begin(), cumulative.end());
  double below = 0;
  for (const auto& [bound, count] : cumulative) {
    out.bucket_counts.push_back(static_cast<uint64_t>(count - below));
    below = count;
  }
  out.count = static_cast<uint64_t>(below);
  return out;
}

// "server p50 X / p99 Y ms" of the calls between two snapshots (bucket
// upper bounds: within a factor of 2).
std::string ServerMs(const RpcLatencies::Snapshot& after,
                     const RpcLatencies::Snapshot& before) {
  return absl::StrFormat("server p50 <= %.2f / p99 <= %.2f ms",
                         RpcLatencies::Quantile(after, before, 0.5) * 1e3,
                         RpcLatencies::Quantile(after, before, 0.99) * 1e3);
}

double RssMiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kb = 0;
      std::vector<std::string> parts =
          absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() >= 2) (void)absl::SimpleAtoi(parts[1], &kb);
      return kb / 1024.0;
    }
  }
  return 0;
}

std::string Ms(const Latencies& l) {
  return absl::StrFormat("p50 %.2f / p99 %.2f / max %.1f ms", l.p50 * 1e3,
                         l.p99 * 1e3, l.max * 1e3);
}

int RunOne(int n) {
  const std::string dir = absl::StrCat(testing_util::TempDir(),
                                       "/control_plane_", getpid(), "_", n);
  const pid_t coordinator = testing_util::Spawn(
      {absl::GetFlag(FLAGS_coordinator_binary), "--listen=127.0.0.1:0",
       absl::StrCat("--data-dir=", dir), "--heartbeat-timeout=10s",
       "--metrics-listen=127.0.0.1:0",
       absl::StrCat("--heartbeat-relay-group=",
                    absl::GetFlag(FLAGS_heartbeat_relay_group))},
      dir + ".out", dir + ".err");
  const int port =
      testing_util::WaitForPortFile(dir, coordinator, absl::Seconds(30));
  if (port <= 0) {
    std::fprintf(stderr, "coordinator did not start: %s\n",
                 testing_util::ReadFile(dir + ".err").c_str());
    return 1;
  }
  const int metrics = MetricsPort(dir + ".err", absl::Seconds(30));
  auto server_side = [&](RpcLatencies::Method method) {
    return ServerSide(metrics, method);
  };
  // The workers' own ports, for the job at the end.
  absl::StatusOr<std::unique_ptr<testing_util::SimulatedWorkerService>>
      service = testing_util::SimulatedWorkerService::Start(n);
  if (!service.ok()) {
    std::fprintf(stderr, "%s\n", service.status().ToString().c_str());
    testing_util::Stop(coordinator);
    return 1;
  }
  SimulatedWorkers::Options options;
  options.coordinator = absl::StrCat("127.0.0.1:", port);
  options.workers = n;
  for (int i = 0; i < n; ++i)
    options.addresses.push_back((*service)->address(i));
  if (absl::GetFlag(FLAGS_heartbeat_relay_group) > 1) {
    options.service = service->get();
  }
  absl::StatusOr<std::unique_ptr<SimulatedWorkers>> workers =
      SimulatedWorkers::Create(options);
  if (!workers.ok()) return 1;
  const double idle_cpu = CpuSeconds(coordinator);
  const RpcLatencies::Snapshot register0 =
      server_side(RpcLatencies::kRegisterWorker);
  absl::StatusOr<Latencies> registered = (*workers)->RegisterAll();
  if (!registered.ok()) {
    std::fprintf(stderr, "%s\n", registered.status().ToString().c_str());
    testing_util::Stop(coordinator);
    return 1;
  }
  std::printf(
      "N=%d register: %.2f s for all, %s, %s; coordinator CPU %.2f s\n", n,
      registered->wall, Ms(*registered).c_str(),
      ServerMs(server_side(RpcLatencies::kRegisterWorker), register0).c_str(),
      CpuSeconds(coordinator) - idle_cpu);
  // One heartbeat cadence for --beat_phase, with the coordinator's CPU.
  auto beat = [&](absl::Duration cadence) {
    const RpcLatencies::Snapshot beats0 = server_side(RpcLatencies::kHeartbeat);
    const double cpu0 = CpuSeconds(coordinator);
    const absl::Time t0 = absl::Now();
    (*workers)->StartHeartbeats(cadence);
    absl::SleepFor(absl::GetFlag(FLAGS_beat_phase));
    const Latencies beats = (*workers)->StopHeartbeats();
    const double wall = absl::ToDoubleSeconds(absl::Now() - t0);
    const double cpu = CpuSeconds(coordinator) - cpu0;
    std::printf(
        "N=%d heartbeats every %s: %.0f/s answered of %.0f/s asked, %lld "
        "errors, %s, %s; coordinator %.1f%% of one core\n",
        n, absl::FormatDuration(cadence).c_str(), beats.calls / wall,
        n / absl::ToDoubleSeconds(cadence),
        static_cast<long long>(beats.errors), Ms(beats).c_str(),
        ServerMs(server_side(RpcLatencies::kHeartbeat), beats0).c_str(),
        100.0 * cpu / wall);
    if (beats.errors > 0) {
      std::printf("N=%d the first heartbeat error: %s\n", n,
                  beats.first_error.c_str());
    }
    // What the coordinator made of them: every worker must still be alive.
    absl::StatusOr<std::unique_ptr<CoordinatorClient>> status_client =
        CoordinatorClient::Connect(options.coordinator);
    absl::StatusOr<v1::GetStatusResponse> status =
        status_client.ok()
            ? (*status_client)->GetStatus()
            : absl::StatusOr<v1::GetStatusResponse>(status_client.status());
    if (status.ok()) {
      int alive = 0;
      int64_t oldest = 0;
      for (const v1::WorkerInfo& w : status->workers()) {
        alive += w.alive() ? 1 : 0;
        oldest = std::max(oldest, w.last_heartbeat_ms_ago());
      }
      int64_t relayed = 0;
      for (int i = 0; i < n; ++i) relayed += (*service)->relay(i)->relayed();
      std::printf(
          "N=%d after them: %d of %d workers alive, the oldest heartbeat "
          "%lld ms ago; %lld beats relayed so far\n",
          n, alive, n, static_cast<long long>(oldest),
          static_cast<long long>(relayed));
    } else {
      std::printf("N=%d GetStatus: %s\n", n,
                  status.status().ToString().c_str());
    }
  };
  // The coordinator's totals, then everything stopped.
  auto finish = [&] {
    std::printf("N=%d coordinator: %.2f s CPU in all, %.0f MiB resident\n", n,
                CpuSeconds(coordinator), RssMiB(coordinator));
    std::fflush(stdout);
    workers->reset();
    testing_util::Stop(coordinator);
    service->reset();
    return 0;
  };
  beat(absl::Seconds(1));
  if (absl::GetFlag(FLAGS_heartbeats_only)) return finish();
  // Before the 100 ms cadence, which can saturate the coordinator.
  const RpcLatencies::Snapshot barrier0 = server_side(RpcLatencies::kBarrier);
  absl::StatusOr<SimulatedWorkers::BarrierResult> barrier =
      (*workers)->Barrier(absl::StrCat("bench-", n));
  if (barrier.ok()) {
    // Server-side, the last arrival's call is the shortest: its time from
    // arrival to release.
    const RpcLatencies::Snapshot barrier1 = server_side(RpcLatencies::kBarrier);
    std::printf(
        "N=%d barrier: released %.1f ms after the last arrival was "
        "sent; calls %s, %s, the shortest <= %.2f ms\n",
        n, barrier->release * 1e3, Ms(barrier->calls).c_str(),
        ServerMs(barrier1, barrier0).c_str(),
        RpcLatencies::Quantile(barrier1, barrier0, 1e-9) * 1e3);
  } else {
    std::printf("N=%d barrier: %s\n", n, barrier.status().ToString().c_str());
  }
  const RpcLatencies::Snapshot get0 = server_side(RpcLatencies::kGet);
  absl::StatusOr<SimulatedWorkers::FanoutResult> fanout =
      (*workers)->KvFanout(absl::StrCat("bench/key-", n), 128);
  if (fanout.ok()) {
    std::printf(
        "N=%d KV fan-out of 128 B to %d waiting Gets: %.1f ms after "
        "the Put was sent; Gets %s\n",
        n, n - 1, fanout->fanout * 1e3,
        ServerMs(server_side(RpcLatencies::kGet), get0).c_str());
  } else {
    std::printf("N=%d KV fan-out: %s\n", n, fanout.status().ToString().c_str());
  }
  // A DeepSeek-V3 job over the N workers, two steps, while they beat every
  // second: SubmitStep to the first step's event, and what LoadPlan sent.
  (*workers)->StartHeartbeats(absl::Seconds(1));
  absl::StatusOr<std::unique_ptr<CoordinatorClient>> client =
      CoordinatorClient::Connect(options.coordinator);
  if (client.ok()) {
    (*client)->set_call_timeout(absl::Minutes(5));
    v1::SubmitModelRequest model;
    model.set_hf_config_json(
        testing_util::ReadFile("tests/data/deepseek_v3.json"));
    model.mutable_options()->mutable_mesh()->set_dp_shard(n);
    model.mutable_options()->mutable_mesh()->set_dp_replicate(1);
    absl::StatusOr<v1::SubmitModelResponse> submitted =
        (*client)->SubmitModel(model);
    v1::GetPlanRequest get;
    if (submitted.ok()) get.set_model_id(submitted->model_id());
    absl::StatusOr<v1::GetPlanResponse> plan =
        submitted.ok()
            ? (*client)->GetPlan(get)
            : absl::StatusOr<v1::GetPlanResponse>(submitted.status());
    const double cpu0 = CpuSeconds(coordinator);
    const absl::Time t0 = absl::Now();
    absl::Time first = absl::InfiniteFuture();
    std::string error;
    absl::Status run = plan.status();
    if (run.ok()) {
      v1::SubmitStepRequest step;
      step.set_model_id(submitted->model_id());
      step.mutable_config()->set_steps(2);
      step.mutable_config()->set_global_batch(n);
      step.mutable_config()->set_seq_len(16);
      absl::StatusOr<v1::SubmitStepResponse> job = (*client)->SubmitStep(step);
      run = job.status();
      if (run.ok()) {
        v1::WatchStepRequest watch;
        watch.set_job_id(job->job_id());
        run = (*client)->WatchStep(
            watch, absl::Minutes(5), [&](const v1::StepEvent& event) {
              if (!event.error().empty()) error = event.error();
              if (event.step() == 1 && first == absl::InfiniteFuture()) {
                first = absl::Now();
              }
              return true;
            });
      }
    }
    const testing_util::SimulatedWorkerService::Received got =
        (*service)->received();
    if (run.ok() && error.empty()) {
      std::printf(
          "N=%d DeepSeek-V3 job start: first step %.2f s after SubmitStep "
          "(coordinator CPU %.2f s for the 2 steps); LoadPlan %lld B per "
          "worker, %.1f MB in all (the plan itself: %.2f MB, x%d = %.1f "
          "MB)\n",
          n, absl::ToDoubleSeconds(first - t0), CpuSeconds(coordinator) - cpu0,
          static_cast<long long>(got.largest_load_plan),
          got.load_plan_bytes / 1e6, plan->plan().ByteSizeLong() / 1e6, n,
          plan->plan().ByteSizeLong() * static_cast<double>(n) / 1e6);
    } else {
      std::printf("N=%d DeepSeek-V3 job: %s %s\n", n, run.ToString().c_str(),
                  error.c_str());
    }
  }
  (*workers)->StopHeartbeats();

  beat(absl::Milliseconds(100));
  return finish();
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  // A port and two sockets per simulated worker.
  rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  int failed = 0;
  for (absl::string_view n :
       absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
    int workers = 0;
    if (!absl::SimpleAtoi(n, &workers) || workers < 2) {
      std::fprintf(stderr, "--workers: expected counts >= 2, got %s\n",
                   std::string(n).c_str());
      return 2;
    }
    failed += shardd::RunOne(workers);
  }
  return failed == 0 ? 0 : 1;
}
