#ifndef SHARDD_CHECKPOINT_RETENTION_H_
#define SHARDD_CHECKPOINT_RETENTION_H_

// Which of a job's committed checkpoints to keep, and deleting the others
// without ever leaving a half-deleted checkpoint that lists.
//
// A checkpoint is pinned when its directory holds kPinnedMarker (written
// into the save's temporary directory before it commits: saves asked for on
// demand); pinned checkpoints, and names a caller protects (the checkpoint
// a job resumed from), are never chosen.
//
// Deleting renames root/step-N to root/.tmp-deleted-step-N-XXXXXX, fsyncs
// root, then removes that directory. ListCheckpoints ignores .tmp-*
// directories, so a crash in between leaves only whole, listed checkpoints;
// RemoveStaleTemporaries deletes the leftover.

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint_writer.h"

namespace shardd {
namespace checkpoint {

inline constexpr char kPinnedMarker[] = "PINNED";

struct RetentionPolicy {
  // Keep the newest keep_last committed checkpoints (0: keep every one).
  int keep_last = 0;
  // Also keep those whose step is a multiple of keep_every (0: none).
  int keep_every = 0;
  // Names (CheckpointInfo::name) never chosen.
  std::set<std::string> protect;
};

// Writes the pin marker into a save's temporary directory (before
// CommitCheckpoint). Errors: file system errors.
absl::Status PinCheckpoint(const std::string& tmp_dir);

// Whether the checkpoint directory holds the pin marker.
bool IsPinned(const std::string& checkpoint_path);

// The checkpoints of `committed` (ListCheckpoints' order: newest first) the
// policy deletes, oldest first: those beyond the keep_last newest that are
// not pinned, protected or kept by keep_every. Pinned and protected ones
// count towards keep_last only when they are among the newest. Nothing
// with keep_last 0.
std::vector<CheckpointInfo> RetentionVictims(
    const std::vector<CheckpointInfo>& committed,
    const RetentionPolicy& policy);

// Deletes committed checkpoint `info` of `root` as described above.
// Errors: INVALID_ARGUMENT when info.name is not a step directory name;
// file system errors (the checkpoint still lists when the rename failed).
absl::Status DeleteCheckpoint(const std::string& root,
                              const CheckpointInfo& info);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_RETENTION_H_
