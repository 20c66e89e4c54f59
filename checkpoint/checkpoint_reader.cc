#include "checkpoint/checkpoint_reader.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "checkpoint/file_util.h"

namespace shardd {
namespace checkpoint {

CheckpointReader::CheckpointReader(std::string dir, CheckpointIndex index)
    : dir_(std::move(dir)), index_(std::move(index)) {}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kIndexFileName);
  absl::StatusOr<std::string> text = ReadFileToString(path, kMaxIndexBytes);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat(
          dir, " is not a committed checkpoint: ", text.status().message()));
    }
    return text.status();
  }
  absl::StatusOr<CheckpointIndex> index = ParseIndex(*text);
  if (!index.ok()) {
    return absl::Status(index.status().code(),
                        absl::StrCat(dir, ": ", index.status().message()));
  }
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(dir, *std::move(index)));
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenNamed(
    const std::string& root, const std::string& name) {
  if (!IsPlainName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint name \"", name,
        "\": must be a plain directory name (no \"/\" or \"..\")"));
  }
  return Open(absl::StrCat(root, "/", name));
}

const TensorRecord* CheckpointReader::FindTensor(
    const std::string& name) const {
  auto it = index_.tensors.find(name);
  return it == index_.tensors.end() ? nullptr : &it->second;
}

const FileRecord* CheckpointReader::FindFile(const std::string& name) const {
  for (const FileRecord& f : index_.files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

absl::Status CheckpointReader::VerifyFile(const std::string& name) const {
  if (!IsPlainName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file name \"", name, "\": must be a plain name (no \"/\" or \"..\")"));
  }
  const FileRecord* record = FindFile(name);
  if (record == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": file \"", name, "\" is not in the index"));
  }
  const std::string path = absl::StrCat(dir_, "/", name);
  SHARDD_ASSIGN_OR_RETURN(ScopedFd fd, OpenForRead(path));
  // Stream to the end of the file, not just the recorded size, so an
  // extended file is caught as well as a truncated one.
  constexpr int64_t kBlock = 1 << 20;
  std::vector<char> buffer(kBlock);
  Xxh64Hasher hasher;
  int64_t size = 0;
  while (true) {
    const ssize_t n = ::pread(fd.get(), buffer.data(), kBlock, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) break;
    hasher.Update(buffer.data(), n);
    size += n;
  }
  if (size != record->size_bytes) {
    return absl::DataLossError(absl::StrCat(
        path, ": ", size, " bytes, the index records ", record->size_bytes,
        size < record->size_bytes ? " (truncated)" : " (extended)"));
  }
  const uint64_t hash = hasher.Digest();
  if (hash != record->xxh64) {
    return absl::DataLossError(
        absl::StrCat(path, ": xxh64 ", Xxh64Hex(hash), ", the index records ",
                     Xxh64Hex(record->xxh64), " (corrupted)"));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::VerifyAll() const {
  for (const FileRecord& f : index_.files) {
    SHARDD_RETURN_IF_ERROR(VerifyFile(f.name));
  }
  return absl::OkStatus();
}

absl::StatusOr<const SafetensorsReader*> CheckpointReader::File(
    const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(name);
  if (it != files_.end()) return it->second.get();
  // Validated index: the name is plain and listed.
  const FileRecord* record = FindFile(name);
  const std::string path = absl::StrCat(dir_, "/", name);
  SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> file,
                          SafetensorsReader::Open(path));
  if (file->file_size() != record->size_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", file->file_size(),
                                            " bytes, the index records ",
                                            record->size_bytes));
  }
  const SafetensorsReader* ptr = file.get();
  files_[name] = std::move(file);
  return ptr;
}

int64_t CheckpointReader::data_bytes_read() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [name, file] : files_) total += file->data_bytes_read();
  return total;
}

absl::Status CheckpointReader::ReadElements(const std::string& tensor,
                                            int64_t begin, int64_t end,
                                            void* out) {
  const TensorRecord* record = FindTensor(tensor);
  if (record == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no tensor \"", tensor, "\" in the checkpoint"));
  }
  const int64_t esize = SafetensorsDTypeBytes(record->dtype);
  const int64_t numel = *ShapeNumel(record->shape);  // Validated.
  if (begin < 0 || begin > end || end > numel) {
    return absl::OutOfRangeError(
        absl::StrCat("tensor \"", tensor, "\": elements [", begin, ", ", end,
                     ") must lie within [0, ", numel, "]"));
  }
  // Chunks are sorted and tile [0, numel): start at the last one beginning
  // at or before `begin`.
  auto first = std::upper_bound(
      record->chunks.begin(), record->chunks.end(), begin,
      [](int64_t value, const ChunkRecord& c) { return value < c.begin; });
  if (first != record->chunks.begin()) --first;
  char* dst = static_cast<char*>(out);
  for (auto c = first; c != record->chunks.end() && c->begin < end; ++c) {
    const int64_t lo = std::max(begin, c->begin);
    const int64_t hi = std::min(end, c->end);
    if (lo >= hi) continue;
    SHARDD_ASSIGN_OR_RETURN(const SafetensorsReader* file, File(c->file));
    const SafetensorsEntry* entry = file->Find(c->tensor);
    if (entry == nullptr) {
      return absl::NotFoundError(
          absl::StrCat(file->path(), ": no tensor \"", c->tensor, "\" (chunk [",
                       c->begin, ", ", c->end, ") of \"", tensor, "\")"));
    }
    if (entry->dtype != record->dtype || entry->numel != c->end - c->begin) {
      return absl::DataLossError(absl::StrCat(
          file->path(), ": tensor \"", c->tensor, "\" is ", entry->dtype,
          " with ", entry->numel, " elements; the index records ",
          record->dtype, " with ", c->end - c->begin));
    }
    SHARDD_RETURN_IF_ERROR(file->ReadBytes(*entry, (lo - c->begin) * esize,
                                           (hi - lo) * esize,
                                           dst + (lo - begin) * esize));
  }
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace shardd
