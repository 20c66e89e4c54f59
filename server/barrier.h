#ifndef SHARDD_SERVER_BARRIER_H_
#define SHARDD_SERVER_BARRIER_H_

// Named barriers for the coordinator's Barrier RPC. Arrivals wait without
// blocking a thread: each parks a callback that the last arrival, a timeout
// (on a timer thread), Cancel or the destructor completes.
//
// Generations: a barrier id names one instance at a time. The instance ends
// when `participants` callers arrived (all succeed), when one arrival's
// timeout passes (all waiting get DEADLINE_EXCEEDED), or when an arrival
// disagrees on `participants` (all get INVALID_ARGUMENT). The id is free again
// at once: the next arrival starts a new instance, so a loop may reuse one id
// for every iteration.
//
// Thread-safe. Callbacks run outside the table's lock (see KvStore).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/timer_queue.h"

namespace shardd {

struct BarrierTableOptions {
  // Most participants one barrier may name.
  int max_participants = 1 << 16;
  // Most arrivals waiting at once, over all barriers.
  size_t max_waiting = size_t{1} << 16;
  size_t max_id_bytes = 4096;
  // Timeouts <= 0 or longer than this wait this long.
  absl::Duration max_timeout = absl::Hours(1);
};

class BarrierTable {
 public:
  using Callback = std::function<void(absl::Status)>;

  explicit BarrierTable(BarrierTableOptions options = {});
  // Completes every waiting arrival with UNAVAILABLE.
  ~BarrierTable();

  BarrierTable(const BarrierTable&) = delete;
  BarrierTable& operator=(const BarrierTable&) = delete;

  // One caller arrives at barrier `id`, which completes when `participants`
  // callers arrived. A non-empty `caller` that is already waiting at this
  // instance replaces its earlier arrival (which ends with ABORTED) instead
  // of counting twice. `done` runs exactly once with:
  // - OK when the last participant arrived;
  // - INVALID_ARGUMENT at once for an empty or over-long id (or an over-long
  //   caller; ids and callers share max_id_bytes), or participants
  //   outside 1..max_participants; for every waiting arrival too when
  //   `participants` differs from the instance's count;
  // - DEADLINE_EXCEEDED for every waiting arrival once `timeout` of any of
  //   them passed (the message names who arrived);
  // - RESOURCE_EXHAUSTED at once when max_waiting arrivals wait;
  // - ABORTED (superseded by the same caller), CANCELLED (Cancel),
  //   UNAVAILABLE (the table is destroyed).
  // Returns a handle for Cancel, or 0 when `done` already ran.
  uint64_t ArriveAsync(const std::string& id, int participants,
                       const std::string& caller, absl::Duration timeout,
                       Callback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Withdraws a waiting arrival (it ends with CANCELLED; the barrier then
  // needs another arrival). Returns false when it had already completed.
  bool Cancel(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);

  // Blocking ArriveAsync. Errors: as ArriveAsync.
  absl::Status Arrive(const std::string& id, int participants,
                      const std::string& caller, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Arrivals waiting now, over all barriers.
  size_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Arrival {
    std::string barrier;
    std::string caller;
    absl::Duration timeout;
    Callback done;
    uint64_t timer = 0;
  };
  struct Instance {
    int participants = 0;
    // Handles in arrival order.
    std::vector<uint64_t> arrivals;
  };
  struct Completion {
    Callback done;
    absl::Status status;
  };

  // Removes arrival `handle` from waiters_, its instance and the timer;
  // returns its callback (empty when it is not waiting).
  Callback TakeArrivalLocked(uint64_t handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every arrival of instance `id` with `status` and erases it.
  void EndInstanceLocked(const std::string& id, const absl::Status& status,
                         std::vector<Completion>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "a, b, c" (at most a few) of the callers waiting at instance `id`.
  std::string CallersLocked(const Instance& instance) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Expire(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);

  const BarrierTableOptions options_;

  mutable absl::Mutex mu_;
  std::map<std::string, Instance> instances_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Arrival> waiters_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;

  // Reset first in the destructor (see KvStore).
  std::unique_ptr<TimerQueue> timer_;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_BARRIER_H_
