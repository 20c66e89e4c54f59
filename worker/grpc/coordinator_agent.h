#ifndef SHARDD_WORKER_GRPC_COORDINATOR_AGENT_H_
#define SHARDD_WORKER_GRPC_COORDINATOR_AGENT_H_

// The worker's link to the coordinator: registers (rank, incarnation),
// heartbeats on a background thread, re-registers when the coordinator
// forgets it (restart, or it was declared dead), and gives worker code the
// coordinator's key-value store and barriers.
//
//   CoordinatorAgentOptions options;
//   options.coordinator = "127.0.0.1:7070";
//   options.address = bound_worker_address;
//   SHARDD_ASSIGN_OR_RETURN(auto agent, CoordinatorAgent::Start(options));
//   agent->rank();  agent->Set("key", "value");  agent->Stop();
//
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/grpc_security.h"
#include "grpcpp/grpcpp.h"
#include "proto/coordinator.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "worker/comm/kv_client.h"
#include "worker/grpc/heartbeat_relay.h"

namespace shardd {

// What the coordinator answered to the latest registration.
struct AgentRegistration {
  int rank = -1;
  int world_size = 0;
  uint64_t coordinator_incarnation = 0;
  uint64_t membership_epoch = 0;
  absl::Duration heartbeat_interval;
};

struct CoordinatorAgentOptions {
  // host:port of the coordinator.
  std::string coordinator;
  // TLS to the coordinator and the worker token sent with every call.
  ChannelSecurity security;
  // host:port of this worker's Worker service, as others should dial it.
  std::string address;
  std::string device = "cpu";
  // Empty: gethostname().
  std::string hostname;
  // Rank to ask for on the first registration (-1: any). Re-registrations
  // ask for the rank held before.
  int requested_rank = -1;
  // This worker serves other machines without TLS or tokens (--insecure);
  // reported at registration.
  bool insecure = false;
  // 0: a random non-zero id (one per agent, so per process in practice).
  uint64_t incarnation = 0;
  // Start gives up when no registration succeeded within this.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of each RPC; a waiting Get or Barrier adds its own wait.
  absl::Duration rpc_timeout = absl::Seconds(5);
  // Client deadline beyond a waiting Get's or Barrier's server-side wait, so
  // that the server's DEADLINE_EXCEEDED (with its message) arrives first.
  absl::Duration wait_margin = absl::Seconds(2);
  // Re-registration backoff: doubles from initial to max.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // This worker's relay for the others of its heartbeat relay group (the
  // Worker service's; not owned; null: it relays for no one). Each
  // heartbeat to the coordinator carries the beats it holds.
  HeartbeatRelay* relay = nullptr;
  // Runs on the heartbeat thread after each re-registration; it must be
  // quick. (Stop from inside it ends the heartbeats but cannot join.)
  std::function<void(const AgentRegistration&)> on_reregistered;
};

class CoordinatorAgent final : public KeyValueClient {
 public:
  // Connects and registers, retrying unreachable-coordinator errors with
  // backoff until connect_timeout, then starts heartbeating.
  // Errors: INVALID_ARGUMENT (empty coordinator or address, or the
  // coordinator refused the registration as invalid), RESOURCE_EXHAUSTED
  // (the coordinator has all the workers it takes), DEADLINE_EXCEEDED (no
  // registration within connect_timeout; the message has the last error).
  static absl::StatusOr<std::unique_ptr<CoordinatorAgent>> Start(
      CoordinatorAgentOptions options);

  // Stops.
  ~CoordinatorAgent() override;

  CoordinatorAgent(const CoordinatorAgent&) = delete;
  CoordinatorAgent& operator=(const CoordinatorAgent&) = delete;

  // Stops heartbeating (the coordinator declares this worker dead after its
  // timeout; the protocol has no leave RPC), cancels calls in flight and
  // refuses later ones with FAILED_PRECONDITION, and marks its relay
  // failed so that the relay's members beat the coordinator directly.
  // Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  AgentRegistration registration() const ABSL_LOCKS_EXCLUDED(mu_);
  int rank() const { return registration().rank; }
  uint64_t incarnation() const { return incarnation_; }
  // Successful registrations so far (1 after Start, +1 per re-registration).
  int registrations() const ABSL_LOCKS_EXCLUDED(mu_);
  // Heartbeats that failed so far (unreachable coordinator, timeouts, or
  // refused: the coordinator forgot this worker).
  int64_t heartbeat_failures() const { return heartbeat_failures_.load(); }

  // KeyValueClient over the coordinator's Put/Get/Delete. Errors: the
  // coordinator's, plus UNAVAILABLE/DEADLINE_EXCEEDED when it cannot be
  // reached, CANCELLED when Stop interrupted the call, FAILED_PRECONDITION
  // after Stop.
  absl::Status Set(const std::string& key, const std::string& value) override;
  // Waits on the coordinator (wait_ms = timeout, at least 1 ms, so an absent
  // key always ends with DEADLINE_EXCEEDED).
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Delete(const std::string& key, bool prefix) override;

  // Put without overwrite. Errors: ALREADY_EXISTS when present, else as Set.
  absl::Status Add(const std::string& key, const std::string& value);

  // Waits at barrier `id` until `participants` callers arrived (this worker
  // is named by its address). Errors: the coordinator's Barrier errors
  // (DEADLINE_EXCEEDED after `timeout`, INVALID_ARGUMENT on disagreeing
  // counts), plus those of Set.
  absl::Status Barrier(const std::string& id, int participants,
                       absl::Duration timeout);

 private:
  CoordinatorAgent(CoordinatorAgentOptions options,
                   std::shared_ptr<grpc::Channel> channel);

  // One RegisterWorker attempt with `deadline`.
  absl::StatusOr<AgentRegistration> RegisterOnce(int requested_rank,
                                                 absl::Duration deadline);
  // Registers until success, retrying transient errors, until `give_up`.
  absl::Status RegisterUntil(absl::Time give_up) ABSL_LOCKS_EXCLUDED(mu_);
  void HeartbeatLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // One heartbeat to the coordinator, carrying the relay's pending beats;
  // follows the relay the answer names.
  absl::Status BeatCoordinator(const AgentRegistration& current,
                               v1::HeartbeatResponse* response);
  // One heartbeat through this worker's relay (Worker.RelayHeartbeat).
  absl::Status BeatThroughRelay(const AgentRegistration& current,
                                v1::HeartbeatResponse* response);
  // Starts or stops beating through the relay `response` names.
  void FollowRelay(const v1::HeartbeatResponse& response,
                   absl::Duration interval);
  // Re-registers with backoff until it works or Stop.
  void Reregister(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  bool Stopped() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits `d` unless Stop comes first; returns false on Stop.
  bool SleepUnlessStopped(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);

  // Tracks a client context so that Stop can cancel it; refuses after Stop.
  class CallScope;

  const CoordinatorAgentOptions options_;
  const uint64_t incarnation_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Coordinator::Stub> stub_;

  // The relay this worker beats through (heartbeat thread only): its
  // address and stub (null: beat the coordinator directly), and when a
  // relay may be used again after one failed.
  std::string relay_address_;
  std::unique_ptr<v1::Worker::Stub> relay_stub_;
  absl::Time relay_retry_at_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  AgentRegistration registration_ ABSL_GUARDED_BY(mu_);
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Calls in flight, cancelled by Stop.
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);

  std::atomic<int64_t> heartbeat_failures_{0};

  // Serializes joining the heartbeat thread (Stop may race the destructor).
  absl::Mutex join_mu_;
  std::thread heartbeat_thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace shardd

#endif  // SHARDD_WORKER_GRPC_COORDINATOR_AGENT_H_
