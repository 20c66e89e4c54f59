#ifndef SHARDD_SERVER_JOBS_JOB_EVENT_LOG_H_
#define SHARDD_SERVER_JOBS_JOB_EVENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/coordinator.pb.h"

namespace shardd {

// The events of one job, in order. An event with `done` or `error` set ends
// the log; later appends are ignored. Thread-safe.
class JobEventLog {
 public:
  // Told when events were appended or the log ended. Called on the
  // appending thread without the log's lock held; it may read the log.
  class Listener {
   public:
    virtual ~Listener() = default;
    virtual void OnEventsAvailable() = 0;
  };

  JobEventLog(std::string job_id, size_t max_events);

  JobEventLog(const JobEventLog&) = delete;
  JobEventLog& operator=(const JobEventLog&) = delete;

  const std::string& job_id() const { return job_id_; }

  // Appends `event` (dropping the oldest stored event beyond max_events)
  // and tells the listeners.
  void Append(v1::StepEvent event) ABSL_LOCKS_EXCLUDED(mu_);

  // Adds a listener, held weakly (it goes away with its owner). Register
  // before the first Read so that no append is missed.
  void AddListener(std::weak_ptr<Listener> listener) ABSL_LOCKS_EXCLUDED(mu_);

  // The position of the first event with step >= from_step: the next event
  // to come when none is stored yet; the oldest stored one when from_step
  // is older than what is kept.
  int64_t StartIndex(int64_t from_step) const ABSL_LOCKS_EXCLUDED(mu_);

  enum class ReadResult {
    kEvent,  // *out is the event at *index.
    kWait,   // Not appended yet.
    kEnded,  // The log ended and every event before *index was read.
  };
  // Reads the event at position *index. A position older than the oldest
  // stored event moves *index to the oldest one first.
  ReadResult Read(int64_t* index, v1::StepEvent* out) const
      ABSL_LOCKS_EXCLUDED(mu_);

  bool ended() const ABSL_LOCKS_EXCLUDED(mu_);
  // The stored events (tests, status).
  std::vector<v1::StepEvent> Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string job_id_;
  const size_t max_events_;

  mutable absl::Mutex mu_;
  // Position of events_.front() among all events ever appended.
  int64_t first_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<v1::StepEvent> events_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::weak_ptr<Listener>> listeners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_JOB_EVENT_LOG_H_
