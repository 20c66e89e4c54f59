#include "server/jobs/job_checkpoints.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "checkpoint/checkpoint_reader.h"
#include "common/status_macros.h"

namespace shardd {
int64_t JobNumber(absl::string_view name) {
  int64_t n = 0;
  if (!absl::ConsumePrefix(&name, "j-") || !absl::SimpleAtoi(name, &n)) {
    return 0;
  }
  return n;
}

absl::Status CheckRelativeCheckpointPath(const std::string& path,
                                         absl::string_view field) {
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
      field,
      ": expected a checkpoint path relative to the checkpoint dir (e.g. "
      "j-1/step-00000020), without '.', '..' or empty components, got '",
      path, "'"));
  if (path.empty() || path.front() == '/') return bad;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == "." || part == "..") return bad;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> ListJobCheckpoints(
    const std::string& checkpoint_dir, const std::string& job_id) {
  if (!job_id.empty()) {
    SHARDD_RETURN_IF_ERROR(CheckRelativeCheckpointPath(job_id, "job_id"));
    if (job_id.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job_id: expected a job id (j-<n>), got '", job_id, "'"));
    }
  }
  std::vector<std::string> jobs;
  if (!job_id.empty()) {
    jobs.push_back(job_id);
  } else {
    std::error_code error;
    std::filesystem::directory_iterator it(checkpoint_dir, error);
    if (error && error != std::errc::no_such_file_or_directory) {
      return absl::InternalError(
          absl::StrCat("listing ", checkpoint_dir, ": ", error.message()));
    }
    for (; !error && it != std::filesystem::directory_iterator();
         it.increment(error)) {
      if (it->is_directory(error)) jobs.push_back(it->path().filename());
    }
    // j-2 before j-10.
    std::sort(jobs.begin(), jobs.end(),
              [](const std::string& a, const std::string& b) {
                const int64_t na = JobNumber(a);
                const int64_t nb = JobNumber(b);
                return na != nb ? na < nb : a < b;
              });
  }
  std::vector<v1::CheckpointInfo> out;
  for (const std::string& job : jobs) {
    SHARDD_ASSIGN_OR_RETURN(
        std::vector<checkpoint::CheckpointInfo> found,
        checkpoint::ListCheckpoints(checkpoint_dir + "/" + job));
    for (const checkpoint::CheckpointInfo& info : found) {
      v1::CheckpointInfo entry;
      entry.set_name(absl::StrCat(job, "/", info.name));
      entry.set_job_id(job);
      entry.set_step(info.step);
      // ListCheckpoints parsed the index already; reading it again here
      // keeps its interface small (an index is a few KiB).
      absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
          checkpoint::CheckpointReader::Open(info.path);
      if (reader.ok()) {
        const checkpoint::SavedBy& by = (*reader)->index().saved_by;
        entry.set_world_size(static_cast<int32_t>(by.world_size));
        entry.set_strategy(by.strategy);
      }
      out.push_back(std::move(entry));
    }
  }
  return out;
}

checkpoint::RankFile ToRankFile(const v1::SaveShardsResponse& response) {
  checkpoint::RankFile out;
  out.file.name = response.file_name();
  out.file.size_bytes = response.size_bytes();
  out.file.xxh64 = response.xxh64();
  for (const v1::CheckpointChunk& chunk : response.chunks()) {
    checkpoint::TensorChunk piece;
    piece.tensor = chunk.tensor();
    piece.dtype = chunk.dtype();
    piece.global_shape.assign(chunk.global_shape().begin(),
                              chunk.global_shape().end());
    piece.chunk.file = chunk.file();
    piece.chunk.tensor = chunk.file_tensor();
    piece.chunk.begin = chunk.begin();
    piece.chunk.end = chunk.end();
    out.chunks.push_back(std::move(piece));
  }
  return out;
}

}  // namespace shardd
