#ifndef SHARDD_SERVER_JOBS_JOB_CHECKPOINTS_H_
#define SHARDD_SERVER_JOBS_JOB_CHECKPOINTS_H_

// Jobs' checkpoints on the coordinator's side: the names clients may pass,
// the listing, and the rank files workers report.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "checkpoint/checkpoint_writer.h"
#include "proto/coordinator.pb.h"
#include "proto/worker.pb.h"

namespace shardd {

// The committed checkpoints under `checkpoint_dir`, for job `job_id` (every
// job's when empty), by job then newest first; names relative to
// checkpoint_dir ("j-1/step-00000003"). A missing directory lists nothing.
// Errors: INVALID_ARGUMENT (job_id not a plain name); file system errors.
absl::StatusOr<std::vector<v1::CheckpointInfo>> ListJobCheckpoints(
    const std::string& checkpoint_dir, const std::string& job_id);

// Checks a checkpoint path a request names: non-empty, relative, without
// empty, "." or ".." components. Errors: INVALID_ARGUMENT naming `field`.
absl::Status CheckRelativeCheckpointPath(const std::string& path,
                                         absl::string_view field);

// The n of a "j-<n>" job id, or 0 for any other name.
int64_t JobNumber(absl::string_view name);

// The RankFile a worker's SaveShards reported.
checkpoint::RankFile ToRankFile(const v1::SaveShardsResponse& response);

}  // namespace shardd

#endif  // SHARDD_SERVER_JOBS_JOB_CHECKPOINTS_H_
