#ifndef SHARDD_TESTING_SIMULATED_WORKER_SERVICE_H_
#define SHARDD_TESTING_SIMULATED_WORKER_SERVICE_H_

// The Worker gRPC service of many simulated workers in one server: each
// worker has its own loopback port, and a call is routed to the worker
// whose port it was addressed to (its :authority). It answers what a job
// asks of a worker without computing anything: LoadPlan (counting the
// bytes it was sent), Execute (a fixed loss, committing the step),
// GetStats, RelayHeartbeat (each worker has the real HeartbeatRelay that
// SimulatedWorkers' heartbeats forward from); a worker marked crashed
// answers UNAVAILABLE. For the control
// plane benchmark and the job-at-scale test. Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/worker.grpc.pb.h"
#include "worker/grpc/heartbeat_relay.h"

namespace shardd {
namespace testing_util {

class SimulatedWorkerService final : public v1::Worker::CallbackService {
 public:
  // Starts one server with `workers` ports on 127.0.0.1. Errors: UNAVAILABLE
  // when the server does not start.
  static absl::StatusOr<std::unique_ptr<SimulatedWorkerService>> Start(
      int workers);
  ~SimulatedWorkerService() override;

  // "127.0.0.1:PORT" of worker i.
  const std::string& address(int i) const { return addresses_[i]; }
  // Worker i answers UNAVAILABLE from now on (a crashed process).
  void Crash(int i) { crashed_[i] = true; }
  // Worker i's heartbeat relay (what others relayed through it).
  HeartbeatRelay* relay(int i) { return relays_[i].get(); }

  // What the workers were sent: LoadPlan calls, their serialized bytes, the
  // largest one, and how many carried the whole plan.
  struct Received {
    int64_t load_plans = 0;
    int64_t load_plan_bytes = 0;
    int64_t largest_load_plan = 0;
    int64_t plans_sent = 0;
    int64_t executes = 0;
  };
  Received received();

  grpc::ServerUnaryReactor* LoadPlan(grpc::CallbackServerContext* context,
                                     const v1::LoadPlanRequest* request,
                                     v1::LoadPlanResponse* response) override;
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* context,
                                    const v1::ExecuteRequest* request,
                                    v1::ExecuteResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;
  grpc::ServerUnaryReactor* RelayHeartbeat(
      grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
      v1::HeartbeatResponse* response) override;

 private:
  explicit SimulatedWorkerService(int workers);
  // The worker a call was addressed to; -1 when unknown.
  int WorkerOf(grpc::CallbackServerContext* context) const;

  struct Held {
    std::string job;
    uint64_t fingerprint = 0;
    int64_t steps = -1;
  };

  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> addresses_;
  absl::flat_hash_map<std::string, int> worker_of_;
  std::unique_ptr<std::atomic<bool>[]> crashed_;
  std::vector<std::unique_ptr<HeartbeatRelay>> relays_;
  absl::Mutex mu_;
  std::vector<Held> held_ ABSL_GUARDED_BY(mu_);
  Received received_ ABSL_GUARDED_BY(mu_);
};

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_SIMULATED_WORKER_SERVICE_H_
