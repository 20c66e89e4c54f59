#include "checkpoint/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "xxhash.h"

namespace shardd {
namespace checkpoint {

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ErrnoStatus(int err, absl::string_view what,
                         absl::string_view path) {
  std::string message = absl::StrCat(what, " ", path, ": ", strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EEXIST:
    case ENOTEMPTY:
      return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<ScopedFd> OpenForRead(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  return ScopedFd(fd);
}

absl::StatusOr<ScopedFd> OpenForWrite(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, "cannot create", path);
  return ScopedFd(fd);
}

absl::Status WriteFully(int fd, const void* data, int64_t size,
                        const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux transfers at most ~2 GiB per call.
    const size_t chunk = static_cast<size_t>(size < (1 << 30) ? size : 1 << 30);
    const ssize_t n = ::write(fd, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot write", path);
    }
    p += n;
    size -= n;
  }
  return absl::OkStatus();
}

absl::Status PreadFully(int fd, int64_t offset, int64_t size, void* out,
                        const std::string& path) {
  char* p = static_cast<char*>(out);
  while (size > 0) {
    const size_t chunk = static_cast<size_t>(size < (1 << 30) ? size : 1 << 30);
    const ssize_t n = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot read", path);
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat(path, ": file ends at byte ", offset, ", ", size,
                       " more bytes expected (truncated?)"));
    }
    p += n;
    offset += n;
    size -= n;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FileSize(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  return static_cast<int64_t>(st.st_size);
}

absl::Status SyncFd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) return ErrnoStatus(errno, "cannot fsync", path);
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoStatus(errno, "cannot open directory", path);
  ScopedFd dir(fd);
  return SyncFd(dir.get(), path);
}

absl::Status WriteStringToFile(const std::string& path,
                               absl::string_view contents) {
  SHARDD_ASSIGN_OR_RETURN(ScopedFd fd, OpenForWrite(path));
  SHARDD_RETURN_IF_ERROR(
      WriteFully(fd.get(), contents.data(), contents.size(), path));
  SHARDD_RETURN_IF_ERROR(SyncFd(fd.get(), path));
  if (::close(fd.release()) != 0) {
    return ErrnoStatus(errno, "cannot close", path);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             int64_t max_bytes) {
  SHARDD_ASSIGN_OR_RETURN(ScopedFd fd, OpenForRead(path));
  SHARDD_ASSIGN_OR_RETURN(int64_t size, FileSize(fd.get(), path));
  if (size > max_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": ", size, " bytes, more than the ", max_bytes, " allowed"));
  }
  std::string contents(static_cast<size_t>(size), '\0');
  SHARDD_RETURN_IF_ERROR(PreadFully(fd.get(), 0, size, contents.data(), path));
  return contents;
}

Xxh64Hasher::Xxh64Hasher() : state_(XXH64_createState()) {
  XXH64_reset(static_cast<XXH64_state_t*>(state_), 0);
}

Xxh64Hasher::~Xxh64Hasher() {
  XXH64_freeState(static_cast<XXH64_state_t*>(state_));
}

void Xxh64Hasher::Update(const void* data, int64_t size) {
  XXH64_update(static_cast<XXH64_state_t*>(state_), data,
               static_cast<size_t>(size));
}

uint64_t Xxh64Hasher::Digest() const {
  return XXH64_digest(static_cast<const XXH64_state_t*>(state_));
}

std::string Xxh64Hex(uint64_t hash) { return absl::StrFormat("%016x", hash); }

bool ParseXxh64Hex(absl::string_view text, uint64_t* hash) {
  if (text.size() != 16) return false;
  uint64_t value = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return false;
    }
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  *hash = value;
  return true;
}

bool IsPlainName(absl::string_view name) {
  return !name.empty() && name != "." &&
         name.find('/') == absl::string_view::npos &&
         name.find("..") == absl::string_view::npos &&
         name.find('\0') == absl::string_view::npos;
}

absl::StatusOr<int64_t> FreeBytes(const std::string& path) {
  struct statvfs st;
  if (::statvfs(path.c_str(), &st) != 0) {
    return ErrnoStatus(errno, "statvfs", path);
  }
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

absl::Status CheckFreeBytes(const std::string& path, int64_t required,
                            absl::string_view what) {
  if (required <= 0) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(const int64_t free, FreeBytes(path));
  if (free >= required) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, ": ", path, " has ", free, " bytes free, the checkpoint needs ",
      required, " (its size from the plan plus a margin)"));
}

}  // namespace checkpoint
}  // namespace shardd
