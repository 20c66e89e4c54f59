#ifndef SHARDD_SERVER_JOBS_JOB_JOURNAL_H_
#define SHARDD_SERVER_JOBS_JOB_JOURNAL_H_

// The durable side of the JobRunner: jobs and their progress in the
// coordinator's StateStore, so that a coordinator restarted after kill -9
// carries its jobs on from their last committed step.
//
// Tables: "jobs" (job id -> StoredJobRecord, written once, before SubmitStep
// answers), "job_progress" (job id -> StoredJobProgress, rewritten after
// every committed step, checkpoint and state change) and "meta" (key
// "next_job": the next job number, so that ids are never reused, and
// "generation": how many times a coordinator opened this state, which makes
// membership epochs grow across restarts).
//
// Transport-free; thread-safe (the StateStore serializes writes).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/coordinator.pb.h"
#include "server/state_store.h"

namespace shardd {

struct StoredJob {
  v1::StoredJobRecord record;
  v1::StoredJobProgress progress;
};

class JobJournal {
 public:
  // `store` is not owned and must outlive the journal.
  explicit JobJournal(StateStore* store) : store_(store) {}

  JobJournal(const JobJournal&) = delete;
  JobJournal& operator=(const JobJournal&) = delete;

  // Records a new job, its initial progress and next_job = its number + 1,
  // atomically. Errors: those of StateStore::Commit.
  absl::Status Create(const v1::StoredJobRecord& record,
                      const v1::StoredJobProgress& progress, int64_t next_job);

  // Rewrites a job's progress. Errors: those of StateStore::Commit.
  absl::Status Update(const std::string& job_id,
                      const v1::StoredJobProgress& progress);

  // Forgets a job (a finished job beyond the runner's limit).
  absl::Status Erase(const std::string& job_id);

  // Every stored job in submission order. A job whose record or progress
  // does not parse is reported, not skipped: DATA_LOSS naming the job.
  // Errors: those of StateStore::List.
  absl::StatusOr<std::vector<StoredJob>> LoadAll() const;

  // The stored next job number (1 when none was stored).
  absl::StatusOr<int64_t> NextJob() const;

  // Increments and returns the stored generation (1 on a fresh store).
  // Errors: DATA_LOSS (a malformed stored value), StateStore errors.
  absl::StatusOr<uint64_t> BumpGeneration();

 private:
  StateStore* const store_;  // Not owned.
};

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_JOB_JOURNAL_H_
