#ifndef SHARDD_CHECKPOINT_CHECKPOINT_WRITER_H_
#define SHARDD_CHECKPOINT_CHECKPOINT_WRITER_H_

// Atomic checkpoint saves.
//
//   root/
//     step-00000100/            committed: index.json + rank files
//     step-00000200/
//     .tmp-step-300-Xa81Qz/     a save in progress (or a crashed one)
//
// A save: BeginCheckpoint makes a temporary directory under root; every rank
// writes its file there with WriteRankFile (fsynced) and hands its RankFile
// (file record + chunk list, a few hundred bytes per tensor) to the
// committer, which folds them into a CheckpointIndex with AddRankFile and
// calls CommitCheckpoint: index.json is written and fsynced last, the
// directory is fsynced and renamed to step-NNNNNNNN, and root is fsynced. A
// crash at any point leaves either no new checkpoint (a .tmp-* directory,
// which ListCheckpoints ignores and RemoveStaleTemporaries deletes) or a
// complete one; earlier checkpoints are never touched.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "checkpoint/checkpoint_index.h"

namespace shardd {
namespace checkpoint {

// A piece of a tensor that the saving rank holds: the global flattened
// elements [begin, end) of tensor `name` (dim-0 padding removed: only valid
// rows), `bytes` being their (end - begin) * element size bytes.
struct RankTensor {
  std::string name;
  std::string dtype;  // Safetensors tag.
  std::vector<int64_t> global_shape;
  int64_t begin = 0;
  int64_t end = 0;
  absl::Span<const uint8_t> bytes;
};

// A chunk as a rank reports it: with the tensor's dtype and global shape so
// the committer can create the index entry.
struct TensorChunk {
  std::string tensor;
  std::string dtype;
  std::vector<int64_t> global_shape;
  ChunkRecord chunk;
};

// What WriteRankFile produced.
struct RankFile {
  FileRecord file;
  std::vector<TensorChunk> chunks;
};

// "rank-00003.safetensors".
std::string RankFileName(int rank);
// "step-00000123".
std::string CheckpointDirName(int64_t step);

// Writes this rank's pieces to `tmp_dir`/RankFileName(rank), fsyncs it and
// returns its record (size and XXH64 computed while writing) and chunks.
// Pieces with begin == end (a rank holding only padding) are skipped. In the
// file a piece is named after its tensor (name@begin when the rank holds
// several pieces of one tensor) and shaped [rows, ...] when it is whole
// dim-0 rows, else [end - begin]. Errors: INVALID_ARGUMENT for a negative
// rank, an empty name, an unknown dtype, a range outside [0, numel] of the
// global shape, bytes of the wrong length, two pieces of one tensor that
// overlap or disagree on dtype / shape; file system errors from the write.
absl::StatusOr<RankFile> WriteRankFile(const std::string& tmp_dir, int rank,
                                       absl::Span<const RankTensor> tensors);

// Adds a rank's file and chunks to `index` (creating tensor entries).
// Errors: INVALID_ARGUMENT when the file is already in the index or a
// tensor's dtype or global shape differs from what an earlier rank reported.
// Overlaps and coverage are checked by CommitCheckpoint.
absl::Status AddRankFile(const RankFile& rank_file, CheckpointIndex* index);

// Creates `root` if missing and a fresh temporary directory
// root/.tmp-step-<step>-<random> in it; returns its path. Errors:
// INVALID_ARGUMENT (step < 0, empty root); file system errors.
absl::StatusOr<std::string> BeginCheckpoint(const std::string& root,
                                            int64_t step);

// Commits the save in `tmp_dir` (a BeginCheckpoint directory of `root`):
// validates `index` (every tensor covered exactly once, ...), checks that
// each listed file exists in tmp_dir with the recorded size, writes
// index.json and fsyncs it, fsyncs tmp_dir, renames it to
// root/CheckpointDirName(index.step) and fsyncs root. Returns the committed
// path. Errors: INVALID_ARGUMENT (tmp_dir not a .tmp-* directory directly
// under root, an invalid index); FAILED_PRECONDITION (a listed file missing
// or of another size); ALREADY_EXISTS (a checkpoint of that step exists);
// file system errors. On error nothing committed changes.
absl::StatusOr<std::string> CommitCheckpoint(const std::string& root,
                                             const std::string& tmp_dir,
                                             const CheckpointIndex& index);

struct CheckpointInfo {
  std::string name;  // "step-00000123"
  std::string path;  // root/name
  int64_t step = 0;
};

// Committed checkpoints under `root`, newest (highest step) first: the
// step-N directories whose index.json parses, validates and records step N.
// .tmp-* directories and anything else are ignored; a missing root is an
// empty list. Errors: file system errors listing root.
absl::StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(
    const std::string& root);

// Deletes the .tmp-* directories under `root` (saves that crashed); call it
// only when no save is in progress. Returns how many were removed; a missing
// root removes none. Errors: file system errors.
absl::StatusOr<int> RemoveStaleTemporaries(const std::string& root);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_CHECKPOINT_WRITER_H_
