#include "server/barrier.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace shardd {
namespace {

// Callers named in a timeout message.
constexpr size_t kNamedCallers = 8;

}  // namespace

BarrierTable::BarrierTable(BarrierTableOptions options)
    : options_(std::move(options)), timer_(std::make_unique<TimerQueue>()) {}

BarrierTable::~BarrierTable() {
  timer_.reset();
  std::vector<Callback> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [handle, arrival] : waiters_) {
      pending.push_back(std::move(arrival.done));
    }
    waiters_.clear();
    instances_.clear();
  }
  for (Callback& done : pending) {
    done(absl::UnavailableError("barrier: the coordinator is shutting down"));
  }
}

BarrierTable::Callback BarrierTable::TakeArrivalLocked(uint64_t handle) {
  auto it = waiters_.find(handle);
  if (it == waiters_.end()) return nullptr;
  auto instance = instances_.find(it->second.barrier);
  if (instance != instances_.end()) {
    std::vector<uint64_t>& arrivals = instance->second.arrivals;
    arrivals.erase(std::remove(arrivals.begin(), arrivals.end(), handle),
                   arrivals.end());
    if (arrivals.empty()) instances_.erase(instance);
  }
  if (timer_ != nullptr) timer_->Cancel(it->second.timer);
  Callback done = std::move(it->second.done);
  waiters_.erase(it);
  return done;
}

void BarrierTable::EndInstanceLocked(const std::string& id,
                                     const absl::Status& status,
                                     std::vector<Completion>* out) {
  auto instance = instances_.find(id);
  if (instance == instances_.end()) return;
  const std::vector<uint64_t> arrivals = instance->second.arrivals;
  for (uint64_t handle : arrivals) {
    Callback done = TakeArrivalLocked(handle);
    if (done) out->push_back({std::move(done), status});
  }
  // TakeArrivalLocked erased the instance with its last arrival.
}

std::string BarrierTable::CallersLocked(const Instance& instance) const {
  std::vector<std::string> names;
  for (uint64_t handle : instance.arrivals) {
    if (names.size() == kNamedCallers) {
      names.push_back("...");
      break;
    }
    const std::string& caller = waiters_.at(handle).caller;
    names.push_back(caller.empty() ? "(unnamed)" : caller);
  }
  return absl::StrJoin(names, ", ");
}

uint64_t BarrierTable::ArriveAsync(const std::string& id, int participants,
                                   const std::string& caller,
                                   absl::Duration timeout, Callback done) {
  if (id.empty() || id.size() > options_.max_id_bytes) {
    done(absl::InvalidArgumentError(absl::StrCat(
        "barrier_id: required, at most ", options_.max_id_bytes, " bytes")));
    return 0;
  }
  if (caller.size() > options_.max_id_bytes) {
    done(absl::InvalidArgumentError(
        absl::StrCat("caller: at most ", options_.max_id_bytes, " bytes")));
    return 0;
  }
  if (participants < 1 || participants > options_.max_participants) {
    done(absl::InvalidArgumentError(absl::StrCat("participants: expected 1..",
                                                 options_.max_participants,
                                                 ", got ", participants)));
    return 0;
  }
  if (timeout <= absl::ZeroDuration() || timeout > options_.max_timeout) {
    timeout = options_.max_timeout;
  }

  std::vector<Completion> completions;
  uint64_t result = 0;
  {
    absl::MutexLock lock(&mu_);
    auto existing = instances_.find(id);
    if (existing != instances_.end() &&
        existing->second.participants != participants) {
      const absl::Status mismatch = absl::InvalidArgumentError(absl::StrCat(
          "participants: barrier '", id, "' was entered with ",
          existing->second.participants, " participants (by ",
          CallersLocked(existing->second), ") but ",
          caller.empty() ? "a caller" : absl::StrCat("'", caller, "'"),
          " says ", participants,
          "; every participant must pass the same "
          "count"));
      EndInstanceLocked(id, mismatch, &completions);
      completions.push_back({std::move(done), mismatch});
    } else if (waiters_.size() >= options_.max_waiting) {
      completions.push_back(
          {std::move(done), absl::ResourceExhaustedError(absl::StrCat(
                                "barrier: ", waiters_.size(),
                                " arrivals already wait, the "
                                "limit is ",
                                options_.max_waiting, " (max_waiting)"))});
    } else {
      if (existing != instances_.end() && !caller.empty()) {
        // A retry from the same caller replaces its earlier arrival.
        for (uint64_t handle : existing->second.arrivals) {
          if (waiters_.at(handle).caller != caller) continue;
          Callback old = TakeArrivalLocked(handle);
          completions.push_back(
              {std::move(old),
               absl::AbortedError(absl::StrCat(
                   "barrier '", id, "': superseded by a newer arrival of '",
                   caller, "'"))});
          break;
        }
      }
      Instance& instance = instances_[id];
      instance.participants = participants;
      const uint64_t handle = next_handle_++;
      Arrival& arrival = waiters_[handle];
      arrival.barrier = id;
      arrival.caller = caller;
      arrival.timeout = timeout;
      arrival.done = std::move(done);
      instance.arrivals.push_back(handle);
      if (static_cast<int>(instance.arrivals.size()) == participants) {
        EndInstanceLocked(id, absl::OkStatus(), &completions);
      } else {
        arrival.timer = timer_->Schedule(absl::Now() + timeout,
                                         [this, handle] { Expire(handle); });
        result = handle;
      }
    }
  }
  for (Completion& completion : completions) {
    completion.done(completion.status);
  }
  return result;
}

void BarrierTable::Expire(uint64_t handle) {
  std::vector<Completion> completions;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(handle);
    if (it == waiters_.end()) return;
    const std::string id = it->second.barrier;
    const Instance& instance = instances_.at(id);
    const absl::Status timed_out = absl::DeadlineExceededError(
        absl::StrCat("barrier '", id, "': ", instance.arrivals.size(), " of ",
                     instance.participants, " participants arrived (",
                     CallersLocked(instance), ") before the timeout of ",
                     absl::FormatDuration(it->second.timeout),
                     it->second.caller.empty()
                         ? std::string()
                         : absl::StrCat(" set by '", it->second.caller, "'")));
    EndInstanceLocked(id, timed_out, &completions);
  }
  for (Completion& completion : completions) {
    completion.done(completion.status);
  }
}

bool BarrierTable::Cancel(uint64_t handle) {
  Callback done;
  {
    absl::MutexLock lock(&mu_);
    done = TakeArrivalLocked(handle);
  }
  if (!done) return false;
  done(absl::CancelledError("barrier: the arrival was cancelled"));
  return true;
}

absl::Status BarrierTable::Arrive(const std::string& id, int participants,
                                  const std::string& caller,
                                  absl::Duration timeout) {
  absl::Notification finished;
  absl::Status result;
  ArriveAsync(id, participants, caller, timeout, [&](absl::Status status) {
    result = std::move(status);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

size_t BarrierTable::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace shardd
