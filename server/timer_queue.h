#ifndef SHARDD_SERVER_TIMER_QUEUE_H_
#define SHARDD_SERVER_TIMER_QUEUE_H_

// One background thread that runs callbacks at (or shortly after) given
// times. The coordinator's waiting RPCs (KV Get with wait, Barrier) use it
// to end with DEADLINE_EXCEEDED without parking a gRPC thread.
//
// Thread-safe. Callbacks run one at a time on the timer thread, outside the
// queue's lock, so they may call Schedule and Cancel; they must be quick and
// must not destroy the queue.

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardd {

class TimerQueue {
 public:
  TimerQueue();
  // Drops the timers that have not fired (without running them) and joins
  // the thread. Waits for a callback that is running.
  ~TimerQueue();

  TimerQueue(const TimerQueue&) = delete;
  TimerQueue& operator=(const TimerQueue&) = delete;

  // Runs `fn` on the timer thread once absl::Now() >= `when` (a time in the
  // past runs as soon as possible). Returns an id for Cancel; never 0.
  uint64_t Schedule(absl::Time when, std::function<void()> fn)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes a timer that has not started running. Returns false when it
  // already ran, is running, or was never scheduled.
  bool Cancel(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  // Timers not yet fired.
  size_t pending() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  // Signalled by Schedule and the destructor.
  absl::CondVar cv_;
  // (when, id) -> callback; ordered so the earliest is first.
  std::map<std::pair<absl::Time, uint64_t>, std::function<void()>> timers_
      ABSL_GUARDED_BY(mu_);
  // id -> when, to find a timer by id.
  std::map<uint64_t, absl::Time> when_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Started last in the constructor, after every field above exists.
  std::thread thread_;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_TIMER_QUEUE_H_
