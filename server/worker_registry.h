#ifndef SHARDD_SERVER_WORKER_REGISTRY_H_
#define SHARDD_SERVER_WORKER_REGISTRY_H_

// Worker membership on the coordinator: rank assignment, incarnations,
// heartbeats and liveness. Transport-free; CoordinatorService wraps it.
//
// Rules:
// - A rank is free when no worker holds it or its worker is dead. A new
//   worker gets `requested_rank` when that rank is free, else the lowest
//   free rank (so a replacement takes over a dead worker's rank).
// - A known address registering with a new incarnation is a restarted
//   worker: it takes its old rank back. The same address and incarnation
//   again is a retry and returns the same rank (reviving the worker if it
//   had been declared dead).
// - A worker is dead once `heartbeat_timeout` passed since its last
//   heartbeat (or registration). Deaths are noticed lazily, on the next call
//   into the registry, using the injected clock.
// - membership_epoch increases by one on every join, restart, revival,
//   removal and death, so a worker can tell that membership changed.
//
// Thread-safe.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardd {

struct WorkerRegistryOptions {
  // Most workers; 0 = no limit (beyond kMaxWorkersHardLimit). When set,
  // ranks are 0..max_workers-1.
  int max_workers = 0;
  // A worker without a heartbeat for this long is dead.
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Ranks per heartbeat relay group (RelayFor): rank r beats through rank
  // r - r % heartbeat_relay_group. 1: every worker beats directly.
  int heartbeat_relay_group = 1;
  // Time source; defaults to absl::Now. Tests inject a fake.
  std::function<absl::Time()> clock;
  // The membership epoch before the first join. A coordinator with durable
  // state starts each run at (generation << 32), so epochs only grow across
  // restarts.
  uint64_t initial_epoch = 0;
};

// What a worker tells the coordinator when it joins.
struct WorkerRegistration {
  std::string address;  // host:port of its Worker service.
  uint64_t incarnation = 0;
  std::string device;
  std::string hostname;
  int requested_rank = -1;  // -1: any.
  bool insecure = false;    // Serves other machines without TLS or tokens.
};

struct RegisterResult {
  int rank = -1;
  // max_workers when set, else the number of live workers after this join.
  int world_size = 0;
  uint64_t membership_epoch = 0;
  // True when the worker was already registered with this incarnation and
  // alive (nothing changed).
  bool retry = false;
};

// A snapshot of one worker.
struct WorkerState {
  int rank = -1;
  std::string address;
  uint64_t incarnation = 0;
  std::string device;
  std::string hostname;
  bool insecure = false;
  absl::Time registered_at;
  absl::Time last_heartbeat;
  bool alive = false;
};

class WorkerRegistry {
 public:
  // Upper bound on ranks even when max_workers is 0.
  static constexpr int kMaxWorkersHardLimit = 1 << 16;
  // Longest accepted address, device and hostname.
  static constexpr size_t kMaxFieldBytes = 1024;

  explicit WorkerRegistry(WorkerRegistryOptions options = {});

  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Joins (or re-joins) a worker; see the rules above.
  // Errors: INVALID_ARGUMENT (empty or over-long address, incarnation 0,
  // requested_rank < -1 or >= max_workers, over-long device/hostname),
  // RESOURCE_EXHAUSTED (every rank is held by a live worker).
  absl::StatusOr<RegisterResult> Register(const WorkerRegistration& worker)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Records a heartbeat and returns the membership epoch.
  // Errors: NOT_FOUND (no worker holds `rank`: register first), ABORTED
  // (the rank belongs to another incarnation, or the worker was declared
  // dead: register again).
  absl::StatusOr<uint64_t> Heartbeat(int rank, uint64_t incarnation)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The worker `rank` should send its heartbeats through: the first rank of
  // its relay group (rank - rank % heartbeat_relay_group) when that is
  // another rank, registered and alive; else nullopt (beat directly). The
  // pair is (relay rank, relay address).
  std::optional<std::pair<int, std::string>> RelayFor(int rank)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes the worker holding `rank`. Errors: NOT_FOUND (no such rank).
  absl::Status Remove(int rank) ABSL_LOCKS_EXCLUDED(mu_);

  // OK when ranks 0..world_size-1 are all registered and alive; this is what
  // a step checks before it runs, instead of waiting for workers forever.
  // Errors: INVALID_ARGUMENT (world_size < 1), FAILED_PRECONDITION (the
  // message names the missing and the dead ranks, with the dead workers'
  // addresses and heartbeat ages).
  absl::Status CheckRanksAlive(int world_size) ABSL_LOCKS_EXCLUDED(mu_);

  // Every known worker (alive or dead) in rank order.
  std::vector<WorkerState> List() ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t membership_epoch() ABSL_LOCKS_EXCLUDED(mu_);
  int live_workers() ABSL_LOCKS_EXCLUDED(mu_);
  // Workers declared dead for a missed heartbeat deadline since this
  // registry was created (a worker that dies, revives and dies again counts
  // twice; Remove does not count).
  int64_t declared_dead() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Duration heartbeat_timeout() const {
    return options_.heartbeat_timeout;
  }
  // How often workers should heartbeat: a third of the timeout, so two lost
  // heartbeats in a row do not yet make a worker dead.
  absl::Duration heartbeat_interval() const {
    return options_.heartbeat_timeout / 3;
  }
  int max_workers() const { return options_.max_workers; }

 private:
  // Marks workers whose heartbeat is too old dead (one epoch bump each).
  void SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lowest free rank, preferring `requested` when it is free; -1 if none.
  int PickRankLocked(int requested) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool RankFreeLocked(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int RankLimit() const;
  int LiveWorkersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets a worker's liveness and last heartbeat, keeping deadlines_ in step.
  void SetLivenessLocked(int rank, WorkerState* worker, bool alive,
                         absl::Time last_heartbeat)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerRegistryOptions options_;

  absl::Mutex mu_;
  // Rank -> worker.
  std::map<int, WorkerState> workers_ ABSL_GUARDED_BY(mu_);
  // Address -> rank, for restarts and retries.
  std::map<std::string, int> rank_of_address_ ABSL_GUARDED_BY(mu_);
  // (last heartbeat, rank) of every live worker, oldest first: a sweep looks
  // only at the workers whose timeout passed, and a heartbeat costs
  // O(log workers) (a sweep over every worker on every heartbeat made the
  // coordinator's CPU grow with the square of the workers).
  std::set<std::pair<absl::Time, int>> deadlines_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_);
  int64_t declared_dead_ ABSL_GUARDED_BY(mu_) = 0;
};

// "0-3, 5, 7-8": ranks (sorted, distinct) with consecutive runs folded.
std::string FormatRankList(const std::vector<int>& ranks);

}  // namespace shardd

#endif  // SHARDD_SERVER_WORKER_REGISTRY_H_
