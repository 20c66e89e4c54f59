#ifndef SHARDD_CHECKPOINT_CHECKPOINT_READER_H_
#define SHARDD_CHECKPOINT_CHECKPOINT_READER_H_

// Reading a committed checkpoint into any world size and strategy: a rank
// asks for the global element ranges it owns (ReadElements) and only the
// bytes of the chunks overlapping them are read, with pread, from the files
// holding them. Data is returned in the dtype it was stored in; the caller
// checks TensorRecord::dtype against what it expects.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint_index.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {

class CheckpointReader {
 public:
  // Opens the checkpoint directory `dir` (reads and validates index.json;
  // data files are opened on first use). Errors: NOT_FOUND (no directory or
  // no index.json: not a committed checkpoint); those of ParseIndex
  // (DATA_LOSS, UNIMPLEMENTED), prefixed with the path.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& dir);

  // Opens root/name. Errors: INVALID_ARGUMENT when `name` contains "/" or
  // ".." (or is empty); else those of Open.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenNamed(
      const std::string& root, const std::string& name);

  const std::string& dir() const { return dir_; }
  const CheckpointIndex& index() const { return index_; }
  // Null for a tensor the checkpoint does not hold.
  const TensorRecord* FindTensor(const std::string& name) const;

  // Streams file `name` and checks its size and XXH64 against the index.
  // Errors: INVALID_ARGUMENT (name with "/" or ".."); NOT_FOUND (not in the
  // index, or missing on disk); DATA_LOSS (size differs: truncated or
  // extended; checksum differs: corrupted), naming the file and both values.
  absl::Status VerifyFile(const std::string& name) const;
  // VerifyFile for every file of the index; the first error.
  absl::Status VerifyAll() const;

  // Fills `out` with elements [begin, end) of the global flattened tensor
  // (element size of its stored dtype), reading only the overlapping bytes of
  // the chunks that hold them. Errors: NOT_FOUND (unknown tensor; a chunk's
  // file or in-file tensor missing); OUT_OF_RANGE (not 0 <= begin <= end <=
  // numel); DATA_LOSS (a file's size differs from the index, its header is
  // invalid, or its chunk tensor's dtype or element count disagrees with the
  // index); INTERNAL for I/O errors.
  absl::Status ReadElements(const std::string& tensor, int64_t begin,
                            int64_t end, void* out);

  // Tensor data bytes pread from the data files so far, summed over the
  // files' SafetensorsReader counters (headers and VerifyFile not counted).
  int64_t data_bytes_read() const;

 private:
  CheckpointReader(std::string dir, CheckpointIndex index);
  absl::StatusOr<const SafetensorsReader*> File(const std::string& name);
  const FileRecord* FindFile(const std::string& name) const;

  const std::string dir_;
  const CheckpointIndex index_;
  mutable absl::Mutex mu_;
  // Open data files by name; entries are never removed, so pointers stay
  // valid for the reader's lifetime.
  std::map<std::string, std::unique_ptr<SafetensorsReader>> files_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_CHECKPOINT_READER_H_
