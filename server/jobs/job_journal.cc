#include "server/jobs/job_journal.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

constexpr char kJobs[] = "jobs";
constexpr char kProgress[] = "job_progress";
constexpr char kMeta[] = "meta";
constexpr char kNextJob[] = "next_job";
constexpr char kGeneration[] = "generation";

}  // namespace

absl::Status JobJournal::Create(const v1::StoredJobRecord& record,
                                const v1::StoredJobProgress& progress,
                                int64_t next_job) {
  return store_->Commit({
      {kJobs, record.job_id(), record.SerializeAsString()},
      {kProgress, record.job_id(), progress.SerializeAsString()},
      {kMeta, kNextJob, absl::StrCat(next_job)},
  });
}

absl::Status JobJournal::Update(const std::string& job_id,
                                const v1::StoredJobProgress& progress) {
  return store_->Put(kProgress, job_id, progress.SerializeAsString());
}

absl::Status JobJournal::Erase(const std::string& job_id) {
  return store_->Commit(
      {{kJobs, job_id, std::nullopt}, {kProgress, job_id, std::nullopt}});
}

absl::StatusOr<std::vector<StoredJob>> JobJournal::LoadAll() const {
  SHARDD_ASSIGN_OR_RETURN(auto records, store_->List(kJobs));
  std::vector<StoredJob> jobs;
  jobs.reserve(records.size());
  for (const auto& [job_id, bytes] : records) {
    StoredJob job;
    if (!job.record.ParseFromString(bytes) || job.record.job_id() != job_id) {
      return absl::DataLossError(absl::StrCat(
          "stored job ", job_id, " in ", store_->path(), " does not parse"));
    }
    absl::StatusOr<std::string> progress = store_->Get(kProgress, job_id);
    if (!progress.ok() || !job.progress.ParseFromString(*progress)) {
      return absl::DataLossError(absl::StrCat("stored progress of job ", job_id,
                                              " in ", store_->path(),
                                              " is missing or does not parse"));
    }
    jobs.push_back(std::move(job));
  }
  return jobs;
}

absl::StatusOr<int64_t> JobJournal::NextJob() const {
  absl::StatusOr<std::string> value = store_->Get(kMeta, kNextJob);
  if (absl::IsNotFound(value.status())) return 1;
  SHARDD_RETURN_IF_ERROR(value.status());
  int64_t next = 0;
  if (!absl::SimpleAtoi(*value, &next) || next < 1) {
    return absl::DataLossError(absl::StrCat("stored next_job '", *value,
                                            "' in ", store_->path(),
                                            " is not a positive number"));
  }
  return next;
}

absl::StatusOr<uint64_t> JobJournal::BumpGeneration() {
  uint64_t generation = 0;
  absl::StatusOr<std::string> value = store_->Get(kMeta, kGeneration);
  if (value.ok()) {
    if (!absl::SimpleAtoi(*value, &generation)) {
      return absl::DataLossError(absl::StrCat("stored generation '", *value,
                                              "' in ", store_->path(),
                                              " is not a number"));
    }
  } else if (!absl::IsNotFound(value.status())) {
    return value.status();
  }
  ++generation;
  SHARDD_RETURN_IF_ERROR(
      store_->Put(kMeta, kGeneration, absl::StrCat(generation)));
  return generation;
}

}  // namespace shardd
