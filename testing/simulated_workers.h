#ifndef SHARDD_TESTING_SIMULATED_WORKERS_H_
#define SHARDD_TESTING_SIMULATED_WORKERS_H_

// Many lightweight workers speaking the real Coordinator gRPC API (not
// worker processes): registration, heartbeats at a cadence, barriers and
// key-value waits, each call asynchronous (gRPC's callback API) over a few
// shared channels, with its client-side latency. For the control-plane
// scale benchmark and the failure-detection test (loopback only; every call
// has a deadline). Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "testing/simulated_worker_service.h"

namespace shardd {
namespace testing_util {

// Latencies of a batch of calls, in seconds.
struct Latencies {
  int64_t calls = 0;
  int64_t errors = 0;
  std::string first_error;
  double p50 = 0, p90 = 0, p99 = 0, max = 0;
  // Wall time from the first call sent to the last answer.
  double wall = 0;
};

class SimulatedWorkers {
 public:
  struct Options {
    std::string coordinator;  // host:port, plaintext.
    int workers = 0;
    int channels = 8;
    absl::Duration deadline = absl::Seconds(60);
    // The address each worker registers (SimulatedWorkerService's, to take
    // jobs); empty: 127.0.0.1:<40000 + i>, which nothing serves.
    std::vector<std::string> addresses;
    // The service behind `addresses` (not owned). When set, workers follow
    // the heartbeat relay the coordinator names (its
    // --heartbeat-relay-group), as CoordinatorAgent does: they beat through
    // that worker's RelayHeartbeat, fall back to the coordinator when it
    // refuses, and each worker's beats to the coordinator carry what its
    // relay (SimulatedWorkerService::relay) holds.
    SimulatedWorkerService* service = nullptr;
  };
  // Errors: INVALID_ARGUMENT (no address, workers < 1, channels < 1).
  static absl::StatusOr<std::unique_ptr<SimulatedWorkers>> Create(
      const Options& options);
  // Stops the heartbeats and waits for every call in flight.
  ~SimulatedWorkers();

  // Registers every worker at once (Options::addresses); ranks come back in
  // rank(). Errors: the first failure.
  absl::StatusOr<Latencies> RegisterAll();
  int rank(int index) const { return ranks_[index]; }
  // The interval the coordinator handed out at registration.
  absl::Duration heartbeat_interval() const { return interval_; }

  // Heartbeats every worker not silenced every `interval`, spread evenly
  // over it, from a driver thread, until StopHeartbeats (which returns what
  // was measured since the start).
  void StartHeartbeats(absl::Duration interval);
  Latencies StopHeartbeats();
  // Worker `index` stops heartbeating, as a crashed one would.
  void Silence(int index);

  // Every worker enters barrier `id` (sent all at once); `release` is the
  // time from the last call sent to the last answer.
  struct BarrierResult {
    Latencies calls;
    double release = 0;
  };
  absl::StatusOr<BarrierResult> Barrier(const std::string& id);

  // Workers 1..N-1 wait on `key` (Get with a wait), then worker 0 puts
  // `bytes` bytes under it; `fanout` is the time from the Put's sending to
  // the last Get's answer.
  struct FanoutResult {
    Latencies gets;
    double fanout = 0;
  };
  absl::StatusOr<FanoutResult> KvFanout(const std::string& key, int64_t bytes);

 private:
  explicit SimulatedWorkers(const Options& options);
  v1::Coordinator::Stub* stub(int index) {
    return stubs_[index % stubs_.size()].get();
  }
  std::unique_ptr<grpc::ClientContext> Context() const;
  void HeartbeatLoop(absl::Duration interval);
  // One heartbeat of worker `i` to the coordinator / through worker
  // `relay`; `start` is when the beat began (a relay's refusal falls back
  // to the coordinator within the same beat).
  void BeatCoordinator(int i, absl::Duration interval, absl::Time start);
  void BeatThroughRelay(int i, int relay, absl::Duration interval);
  // Records one finished beat.
  void BeatDone(absl::Time start, const grpc::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  // To Options::service (a call names its worker by :authority).
  std::vector<std::unique_ptr<v1::Worker::Stub>> relay_stubs_;
  // Worker index of each registered rank, and the index of the worker each
  // one beats through (-1: the coordinator).
  std::vector<int> index_of_rank_;
  std::unique_ptr<std::atomic<int>[]> relay_of_;
  std::vector<int> ranks_;
  std::vector<uint64_t> incarnations_;
  absl::Duration interval_ = absl::Seconds(1);
  std::unique_ptr<std::atomic<bool>[]> silenced_;

  std::thread heartbeats_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<double> beat_seconds_ ABSL_GUARDED_BY(mu_);
  int64_t beat_errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::string beat_first_error_ ABSL_GUARDED_BY(mu_);
  absl::Time beats_started_;
};

// p50/p90/p99/max of `seconds` (sorted in place).
void Summarize(std::vector<double>* seconds, Latencies* out);

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_SIMULATED_WORKERS_H_
