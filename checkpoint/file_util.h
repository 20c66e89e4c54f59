#ifndef SHARDD_CHECKPOINT_FILE_UTIL_H_
#define SHARDD_CHECKPOINT_FILE_UTIL_H_

// POSIX file helpers for checkpoints: an owning file descriptor, full
// reads/writes that retry short transfers and EINTR, and fsync of files and
// directories (a rename or a new file is only durable once its directory is
// synced). Every error names the path and the errno text.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardd {
namespace checkpoint {

// Owns a file descriptor; closes it on destruction.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// An absl::Status for a failed system call: NOT_FOUND for ENOENT,
// ALREADY_EXISTS for EEXIST/ENOTEMPTY, PERMISSION_DENIED for EACCES/EPERM,
// INTERNAL otherwise; the message is "<what> <path>: <strerror>".
absl::Status ErrnoStatus(int err, absl::string_view what,
                         absl::string_view path);

// Opens `path` read-only. Errors: as ErrnoStatus.
absl::StatusOr<ScopedFd> OpenForRead(const std::string& path);

// Creates or truncates `path` for writing (mode 0644). Errors: as ErrnoStatus.
absl::StatusOr<ScopedFd> OpenForWrite(const std::string& path);

// Writes all of `data` at the current position. Errors: INTERNAL (ENOSPC,
// EIO, ...), naming `path`.
absl::Status WriteFully(int fd, const void* data, int64_t size,
                        const std::string& path);

// Reads exactly `size` bytes at `offset`. Errors: DATA_LOSS when the file
// ends first (it is shorter than expected), INTERNAL on an I/O error.
absl::Status PreadFully(int fd, int64_t offset, int64_t size, void* out,
                        const std::string& path);

// Size of an open file. Errors: INTERNAL.
absl::StatusOr<int64_t> FileSize(int fd, const std::string& path);

// fsync of an open file, and of a directory by path. Errors: as ErrnoStatus.
absl::Status SyncFd(int fd, const std::string& path);
absl::Status SyncDir(const std::string& path);

// Bytes an unprivileged writer may still put on the file system holding
// `path` (statvfs: f_bavail * f_frsize). Errors: as ErrnoStatus.
absl::StatusOr<int64_t> FreeBytes(const std::string& path);

// OK when the file system of `path` has at least `required` free bytes;
// RESOURCE_EXHAUSTED naming `what`, the path and both figures when not.
absl::Status CheckFreeBytes(const std::string& path, int64_t required,
                            absl::string_view what);

// Writes `contents` to `path` (created or truncated) and fsyncs it.
absl::Status WriteStringToFile(const std::string& path,
                               absl::string_view contents);

// Reads a whole small file (index files). Errors: as ErrnoStatus,
// FAILED_PRECONDITION when it is larger than `max_bytes`.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             int64_t max_bytes);

// Streaming XXH64 with seed 0 (the checksum of checkpoint files).
class Xxh64Hasher {
 public:
  Xxh64Hasher();
  ~Xxh64Hasher();
  Xxh64Hasher(const Xxh64Hasher&) = delete;
  Xxh64Hasher& operator=(const Xxh64Hasher&) = delete;

  void Update(const void* data, int64_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH64_state_t, kept out of this header.
};

// 16 lower-case hex digits, and back. ParseXxh64Hex is false for anything
// but exactly 16 hex digits.
std::string Xxh64Hex(uint64_t hash);
bool ParseXxh64Hex(absl::string_view text, uint64_t* hash);

// True when `name` is a plain file or directory name that stays inside its
// directory: not empty, not ".", no '/', no "..", no NUL.
bool IsPlainName(absl::string_view name);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_FILE_UTIL_H_
