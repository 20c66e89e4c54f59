#include "server/timer_queue.h"

#include <utility>

#include "absl/time/clock.h"

namespace shardd {

TimerQueue::TimerQueue() : thread_([this] { Loop(); }) {}

TimerQueue::~TimerQueue() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.Signal();
  }
  thread_.join();
}

uint64_t TimerQueue::Schedule(absl::Time when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  timers_.emplace(std::make_pair(when, id), std::move(fn));
  when_.emplace(id, when);
  cv_.Signal();
  return id;
}

bool TimerQueue::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return false;
  timers_.erase(std::make_pair(it->second, id));
  when_.erase(it);
  return true;
}

size_t TimerQueue::pending() const {
  absl::MutexLock lock(&mu_);
  return timers_.size();
}

void TimerQueue::Loop() {
  mu_.Lock();
  while (!stop_) {
    if (timers_.empty()) {
      cv_.Wait(&mu_);
      continue;
    }
    const absl::Time earliest = timers_.begin()->first.first;
    if (absl::Now() < earliest) {
      // Woken early by Schedule (maybe a new earliest timer) or stop.
      cv_.WaitWithDeadline(&mu_, earliest);
      continue;
    }
    auto first = timers_.begin();
    std::function<void()> fn = std::move(first->second);
    when_.erase(first->first.second);
    timers_.erase(first);
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
  mu_.Unlock();
}

}  // namespace shardd
