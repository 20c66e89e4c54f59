#include "server/jobs/job_event_log.h"

#include <utility>

namespace shardd {

JobEventLog::JobEventLog(std::string job_id, size_t max_events)
    : job_id_(std::move(job_id)),
      max_events_(std::max<size_t>(1, max_events)) {}

void JobEventLog::Append(v1::StepEvent event) {
  std::vector<std::shared_ptr<Listener>> listeners;
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = event.done() || !event.error().empty();
    events_.push_back(std::move(event));
    while (events_.size() > max_events_) {
      events_.pop_front();
      ++first_index_;
    }
    // Notify outside the lock (listeners read the log); drop the dead.
    std::vector<std::weak_ptr<Listener>> alive;
    for (std::weak_ptr<Listener>& weak : listeners_) {
      if (std::shared_ptr<Listener> listener = weak.lock()) {
        listeners.push_back(std::move(listener));
        alive.push_back(std::move(weak));
      }
    }
    listeners_ = std::move(alive);
  }
  for (const std::shared_ptr<Listener>& listener : listeners) {
    listener->OnEventsAvailable();
  }
}

void JobEventLog::AddListener(std::weak_ptr<Listener> listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

int64_t JobEventLog::StartIndex(int64_t from_step) const {
  absl::MutexLock lock(&mu_);
  // Steps go back after a rollback to a checkpoint, so a watcher that asks
  // for a step seen before the rollback sees the rollback and the steps
  // that run again: the first match wins. Once per watch, so linear.
  auto it = std::find_if(events_.begin(), events_.end(),
                         [from_step](const v1::StepEvent& event) {
                           return event.step() >= from_step;
                         });
  return first_index_ + (it - events_.begin());
}

JobEventLog::ReadResult JobEventLog::Read(int64_t* index,
                                          v1::StepEvent* out) const {
  absl::MutexLock lock(&mu_);
  if (*index < first_index_) *index = first_index_;
  const int64_t offset = *index - first_index_;
  if (offset < static_cast<int64_t>(events_.size())) {
    *out = events_[offset];
    return ReadResult::kEvent;
  }
  return ended_ ? ReadResult::kEnded : ReadResult::kWait;
}

bool JobEventLog::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

std::vector<v1::StepEvent> JobEventLog::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return std::vector<v1::StepEvent>(events_.begin(), events_.end());
}

}  // namespace shardd
