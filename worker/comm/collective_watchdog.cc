#include "worker/comm/collective_watchdog.h"

#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace {

absl::Status CheckInterval(absl::Duration interval, absl::string_view name) {
  if (interval <= absl::ZeroDuration() ||
      interval == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be positive and finite, got ",
                     absl::FormatDuration(interval)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveWatchdog>> CollectiveWatchdog::Create(
    HealthProbe health_probe, AbortFunction abort_function, Options options) {
  if (!health_probe) {
    return absl::InvalidArgumentError("health_probe must not be empty");
  }
  if (!abort_function) {
    return absl::InvalidArgumentError("abort_function must not be empty");
  }
  absl::Status status = CheckInterval(options.poll_interval, "poll_interval");
  if (!status.ok()) return status;
  status = CheckInterval(options.wait_poll_interval, "wait_poll_interval");
  if (!status.ok()) return status;
  return absl::WrapUnique(new CollectiveWatchdog(
      std::move(health_probe), std::move(abort_function), std::move(options)));
}

CollectiveWatchdog::CollectiveWatchdog(HealthProbe health_probe,
                                       AbortFunction abort_function,
                                       Options options)
    : health_probe_(std::move(health_probe)),
      abort_function_(std::move(abort_function)),
      options_(std::move(options)),
      thread_([this] { Run(); }) {}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::StatusOr<CollectiveWatchdog::OperationId> CollectiveWatchdog::Begin(
    std::string description, absl::Duration timeout, CompletionProbe done) {
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        options_.name, ": timeout of ", description,
        " must be positive and finite, got ", absl::FormatDuration(timeout)));
  }
  auto op = std::make_shared<Operation>();
  op->description = std::move(description);
  op->start = absl::Now();
  op->deadline = op->start + timeout;
  op->done = std::move(done);
  absl::MutexLock lock(&mu_);
  if (state_ != State::kHealthy) return AbortedError();
  const OperationId id = next_id_++;
  in_flight_.emplace(id, std::move(op));
  return id;
}

void CollectiveWatchdog::Complete(OperationId id) { MarkComplete(id); }

void CollectiveWatchdog::MarkComplete(OperationId id) {
  absl::MutexLock lock(&mu_);
  // After an abort the entry stays until a Wait() reports the error.
  if (state_ != State::kHealthy) return;
  in_flight_.erase(id);
}

absl::Status CollectiveWatchdog::Wait(OperationId id) {
  std::shared_ptr<const Operation> op;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (id < 0 || id >= next_id_) {
        return absl::InvalidArgumentError(absl::StrCat(
            options_.name, ": no operation with id ", id, " was begun"));
      }
      auto it = in_flight_.find(id);
      if (it == in_flight_.end()) {
        return state_ == State::kHealthy ? absl::OkStatus() : AbortedError();
      }
      // The waiter learns of an abort only once the abort function
      // returned: the transport no longer touches the caller's buffers.
      if (state_ == State::kAborted) {
        in_flight_.erase(it);
        return first_error_;
      }
      if (state_ == State::kAborting) {
        mu_.Await(absl::Condition(
            +[](State* state) { return *state == State::kAborted; }, &state_));
        continue;
      }
      op = it->second;
    }
    if (op->done) {
      absl::StatusOr<bool> done = op->done();
      if (!done.ok()) {
        Abort(absl::Status(done.status().code(),
                           absl::StrCat(options_.name, ": ", op->description,
                                        ": ", done.status().message())));
        continue;
      }
      if (*done) {
        MarkComplete(id);
        continue;
      }
    }
    absl::MutexLock lock(&mu_);
    auto finished = [this, id]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return state_ == State::kAborted || in_flight_.count(id) == 0;
    };
    // With a completion probe, poll it again soon; without one, only
    // Complete() or an abort can end the wait.
    if (op->done) {
      mu_.AwaitWithTimeout(absl::Condition(&finished),
                           options_.wait_poll_interval);
    } else {
      mu_.Await(absl::Condition(&finished));
    }
  }
}

bool CollectiveWatchdog::Abort(absl::Status cause) {
  if (cause.ok()) {
    cause = absl::InternalError(
        absl::StrCat(options_.name, ": aborted with an OK status"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kHealthy) {
      // Someone else aborts (or did): return once it is done, so every
      // caller of Abort() sees a torn-down transport.
      mu_.Await(absl::Condition(
          +[](State* state) { return *state == State::kAborted; }, &state_));
      return false;
    }
    state_ = State::kAborting;
    first_error_ = cause;
  }
  abort_function_(cause);
  absl::MutexLock lock(&mu_);
  state_ = State::kAborted;
  return true;
}

absl::Status CollectiveWatchdog::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

bool CollectiveWatchdog::aborted() const {
  absl::MutexLock lock(&mu_);
  return state_ != State::kHealthy;
}

int CollectiveWatchdog::in_flight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(in_flight_.size());
}

absl::Status CollectiveWatchdog::AbortedError() const {
  return absl::FailedPreconditionError(absl::StrCat(
      options_.name, ": communicator aborted: ", first_error_.ToString()));
}

void CollectiveWatchdog::Run() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || (state_ == State::kHealthy && !in_flight_.empty());
      };
      mu_.Await(absl::Condition(&has_work));
      if (stop_) return;
    }
    PollOnce();
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.poll_interval);
    if (stop_) return;
  }
}

void CollectiveWatchdog::PollOnce() {
  std::vector<std::pair<OperationId, std::shared_ptr<const Operation>>> ops;
  {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kHealthy) return;
    ops.assign(in_flight_.begin(), in_flight_.end());
  }
  const absl::Status health = health_probe_();
  if (!health.ok()) {
    Abort(absl::Status(health.code(),
                       absl::StrCat(options_.name, ": health check failed: ",
                                    health.message())));
    return;
  }
  for (const auto& [id, op] : ops) {
    if (op->done) {
      absl::StatusOr<bool> done = op->done();
      if (!done.ok()) {
        Abort(absl::Status(done.status().code(),
                           absl::StrCat(options_.name, ": ", op->description,
                                        ": ", done.status().message())));
        return;
      }
      if (*done) {
        MarkComplete(id);
        continue;
      }
    }
    // Checked after the completion probe: an operation that finished just
    // before its deadline counts as finished.
    const absl::Time now = absl::Now();
    if (now >= op->deadline) {
      Abort(absl::DeadlineExceededError(absl::StrCat(
          options_.name, ": ", op->description, " did not complete within ",
          absl::FormatDuration(op->deadline - op->start), " (waited ",
          absl::FormatDuration(
              absl::Trunc(now - op->start, absl::Milliseconds(1))),
          ")")));
      return;
    }
  }
}

}  // namespace shardd
