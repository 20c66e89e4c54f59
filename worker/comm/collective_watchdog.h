#ifndef SHARDD_WORKER_COMM_COLLECTIVE_WATCHDOG_H_
#define SHARDD_WORKER_COMM_COLLECTIVE_WATCHDOG_H_

// A transport-free watchdog for asynchronous collectives: it tracks the
// operations in flight (each with a description and a deadline), polls a
// health probe and each operation's completion probe on its own thread, and
// aborts the transport exactly once when a probe fails or a deadline passes.
// This is the wait loop of nccl-tests' testStreamSynchronize (poll
// cudaStreamQuery and ncclCommGetAsyncError, ncclCommAbort on error or
// timeout) made reusable and testable without a GPU: for NCCL the health
// probe wraps ncclCommGetAsyncError, the completion probes wrap
// cudaEventQuery, and the abort function calls ncclCommAbort.
//
// Lifecycle of an operation: Begin() registers it; it completes when its
// completion probe returns true (polled by the watchdog thread, and by a
// thread blocked in Wait()) or when Complete() is called. Completed
// operations are forgotten at once, so an operation nobody waits for costs
// nothing after it finishes.
//
// After an abort (probe error, expired deadline or Abort()):
// - the abort function has run exactly once, on the thread that detected the
//   failure, and `first_error()` holds the cause: DEADLINE_EXCEEDED naming the
//   operation and how long it waited, the failing probe's status (its code
//   kept, its message prefixed), or the status passed to Abort();
// - Wait() on an operation that was still in flight returns the first error;
// - Begin(), and Wait() on an operation that was no longer in flight, return
//   FAILED_PRECONDITION "<name>: communicator aborted: <first error>".
// A watchdog never recovers; its owner makes a new transport (and watchdog).
//
// Probes run while at least one operation is in flight, every
// `poll_interval`; an idle watchdog sleeps. Probes and the abort function
// are called without the watchdog's lock held. They must be thread-safe: a
// completion probe may run on the watchdog thread and a waiting thread at
// the same time, and a probe that started before an abort may still be
// running when the abort function starts on another thread. Probes may call
// Abort(); the abort function must not call Abort() or Wait() (it would wait
// for itself). All methods are thread-safe.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardd {

class CollectiveWatchdog {
 public:
  // OK while the transport is healthy; any error aborts.
  using HealthProbe = std::function<absl::Status()>;
  // True once the operation finished on the device; an error aborts.
  using CompletionProbe = std::function<absl::StatusOr<bool>()>;
  // Tears the transport down (e.g. ncclCommAbort) so nothing keeps waiting
  // on dead peers. Receives the first error.
  using AbortFunction = std::function<void(const absl::Status& cause)>;
  using OperationId = int64_t;

  struct Options {
    // Prefixes every message, e.g. "nccl 'job7/inc2/shard' rank 3 of 8".
    std::string name = "collectives";
    // How often the watchdog thread runs the probes while operations are in
    // flight: the detection latency of an error or an expired deadline.
    absl::Duration poll_interval = absl::Milliseconds(2);
    // How often a thread blocked in Wait() runs its operation's completion
    // probe itself, so a blocking wait returns soon after the operation
    // finishes instead of up to one `poll_interval` later.
    absl::Duration wait_poll_interval = absl::Microseconds(50);
  };

  // Starts the watchdog thread.
  // Errors: INVALID_ARGUMENT when a function is empty or an interval is not
  // positive and finite.
  static absl::StatusOr<std::unique_ptr<CollectiveWatchdog>> Create(
      HealthProbe health_probe, AbortFunction abort_function, Options options);

  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;
  // Stops and joins the thread (after an abort in progress finishes). Does
  // not abort and does not wait for operations in flight. No thread may be
  // blocked in Wait() when the watchdog is destroyed.
  ~CollectiveWatchdog();

  // Tracks a new operation whose deadline is now + `timeout`. `done` may be
  // empty: the operation then completes only through Complete().
  // Errors: INVALID_ARGUMENT when `timeout` is not positive and finite;
  // FAILED_PRECONDITION once the watchdog aborted.
  absl::StatusOr<OperationId> Begin(std::string description,
                                    absl::Duration timeout,
                                    CompletionProbe done);

  // Marks an operation complete (for callers that observe completion
  // themselves). Unknown or already completed ids are ignored.
  void Complete(OperationId id);

  // Blocks until the operation completes or the watchdog aborts.
  // Returns OK when it completed (including before this call);
  // the first error when the watchdog aborted while it was in flight;
  // FAILED_PRECONDITION when the watchdog had aborted and the operation was
  // no longer in flight; INVALID_ARGUMENT for an id Begin() never returned.
  absl::Status Wait(OperationId id);

  // Aborts now with `cause` (which must not be OK; an OK cause becomes
  // INTERNAL) unless the watchdog already aborted. Returns true when this
  // call performed the abort. Blocks until the abort function returned.
  bool Abort(absl::Status cause);

  // OK while healthy; the first error once an abort began.
  absl::Status first_error() const;
  // True once an abort began.
  bool aborted() const;
  // Operations begun and not yet completed (after an abort: not yet
  // reported by Wait()).
  int in_flight() const;
  const std::string& name() const { return options_.name; }

 private:
  struct Operation {
    std::string description;
    absl::Time start;
    absl::Time deadline;
    CompletionProbe done;
  };
  enum class State { kHealthy, kAborting, kAborted };

  CollectiveWatchdog(HealthProbe health_probe, AbortFunction abort_function,
                     Options options);
  void Run();
  // One round of probes; returns without the lock held.
  void PollOnce();
  // Marks `id` complete; no-op when it is unknown.
  void MarkComplete(OperationId id);
  absl::Status AbortedError() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const HealthProbe health_probe_;
  const AbortFunction abort_function_;
  const Options options_;

  mutable absl::Mutex mu_;
  std::map<OperationId, std::shared_ptr<const Operation>> in_flight_
      ABSL_GUARDED_BY(mu_);
  OperationId next_id_ ABSL_GUARDED_BY(mu_) = 0;
  State state_ ABSL_GUARDED_BY(mu_) = State::kHealthy;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Last member: starts after everything it uses is constructed.
  std::thread thread_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_COLLECTIVE_WATCHDOG_H_
