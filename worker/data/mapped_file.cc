#include "worker/data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace data {

namespace {

absl::Status ErrnoError(int error_number, const char* verb,
                        const std::string& what, const std::string& path) {
  return absl::ErrnoToStatus(error_number,
                             absl::StrCat(verb, " ", what, " ", path));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(
    const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open", what, path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int error_number = errno;
    ::close(fd);
    return ErrnoError(error_number, "cannot stat", what, path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is not a regular file"));
  }
  std::unique_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = static_cast<int64_t>(st.st_size);
  if (file->size_ > 0) {
    void* mapped = ::mmap(nullptr, static_cast<size_t>(file->size_),
                          PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (mapped == MAP_FAILED) {
      return ErrnoError(map_errno, "cannot map", what, path);
    }
    file->data_ = static_cast<const unsigned char*>(mapped);
  } else {
    ::close(fd);
  }
  return file;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) {
    ::munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_));
  }
}

}  // namespace data
}  // namespace shardd
