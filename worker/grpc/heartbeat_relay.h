#ifndef SHARDD_WORKER_GRPC_HEARTBEAT_RELAY_H_
#define SHARDD_WORKER_GRPC_HEARTBEAT_RELAY_H_

// A worker's relay for the heartbeats of the other workers of its relay
// group (coordinator --heartbeat-relay-group): they call its
// Worker.RelayHeartbeat instead of the coordinator, and it sends their
// beats with its own next heartbeat, so the coordinator gets one message
// per group and interval instead of one per worker (docs/reliability.md).
// Transport-free: GrpcWorkerService::RelayHeartbeat calls Record, the
// CoordinatorAgent's heartbeat loop TakePending and then Delivered or
// Failed. Thread-safe.

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/coordinator.pb.h"

namespace shardd {

// How a worker uses its relay (CoordinatorAgent, and the simulated workers
// that stand in for it): the relay's answer from the coordinator goes stale
// after this many heartbeat intervals, so a member it turns away reaches
// the coordinator within 2.25 intervals of the relay's last delivered
// heartbeat, inside the timeout of 3 (docs/reliability.md: the one corner
// where that is not enough) ...
inline constexpr double kRelayStaleIntervals = 1.25;
// ... and a call to the relay gets half an interval, leaving the rest of
// the period for a direct beat.
inline constexpr double kRelayCallIntervals = 0.5;

// True when a RelayHeartbeat's status is the relay's word on the caller (OK,
// or the coordinator's refusal: register again); anything else means the
// relay cannot relay now and the caller beats the coordinator directly.
inline bool RelayAnswered(absl::StatusCode code) {
  return code == absl::StatusCode::kOk || code == absl::StatusCode::kAborted ||
         code == absl::StatusCode::kNotFound;
}

struct HeartbeatRelayOptions {
  // An answer from the coordinator older than this is no answer: the relay
  // turns callers away (UNAVAILABLE) so that they beat the coordinator
  // directly. The agent sets kRelayStaleIntervals heartbeat intervals
  // (set_stale_after).
  absl::Duration stale_after = absl::Seconds(7);
  // Most distinct workers with a beat pending (a group is a handful; this
  // bounds what a misconfigured or hostile caller can make it hold).
  int max_pending = 1024;
  // Time source; absl::Now when unset.
  std::function<absl::Time()> clock;
};

class HeartbeatRelay {
 public:
  explicit HeartbeatRelay(HeartbeatRelayOptions options = {});

  HeartbeatRelay(const HeartbeatRelay&) = delete;
  HeartbeatRelay& operator=(const HeartbeatRelay&) = delete;

  // A beat of another worker, to forward with this worker's next one.
  // Returns the coordinator's latest word for that worker: the error of its
  // previous relayed beat when the coordinator refused it (same
  // incarnation), else OK with the coordinator's incarnation and membership
  // epoch. Errors: INVALID_ARGUMENT (rank < 0, incarnation 0),
  // UNAVAILABLE (no answer from the coordinator within stale_after, or its
  // last heartbeat failed; the beat is not kept), RESOURCE_EXHAUSTED
  // (max_pending other workers pending).
  absl::StatusOr<v1::HeartbeatResponse> Record(const v1::HeartbeatRequest& beat)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The beats recorded since the last call (one per rank, the newest
  // incarnation), in rank order; they are no longer pending.
  std::vector<v1::RelayedHeartbeat> TakePending() ABSL_LOCKS_EXCLUDED(mu_);

  // The coordinator answered this worker's heartbeat that carried the
  // beats of the last TakePending.
  void Delivered(const v1::HeartbeatResponse& response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // This worker's heartbeat failed: the beats it carried are lost, and
  // callers are turned away (UNAVAILABLE, so they beat the coordinator
  // directly) until one succeeds.
  void Failed() ABSL_LOCKS_EXCLUDED(mu_);

  // Beats forwarded so far (carried by a delivered heartbeat).
  int64_t relayed() ABSL_LOCKS_EXCLUDED(mu_);

  void set_stale_after(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Time Now() const;

  const HeartbeatRelayOptions options_;

  absl::Mutex mu_;
  absl::Duration stale_after_ ABSL_GUARDED_BY(mu_);
  // Rank -> incarnation of its newest beat not yet taken.
  std::map<int, uint64_t> pending_ ABSL_GUARDED_BY(mu_);
  // The last successful answer and when it came (InfinitePast: none, or a
  // failure since).
  v1::HeartbeatResponse last_ ABSL_GUARDED_BY(mu_);
  absl::Time last_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Rank -> (incarnation, error) from the last answer's relayed_errors.
  std::map<int, std::pair<uint64_t, absl::Status>> errors_ ABSL_GUARDED_BY(mu_);
  // The incarnation each rank of the last TakePending carried.
  std::map<int, uint64_t> in_flight_ ABSL_GUARDED_BY(mu_);
  int64_t relayed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_GRPC_HEARTBEAT_RELAY_H_
