#ifndef SHARDD_WORKER_DATA_MAPPED_FILE_H_
#define SHARDD_WORKER_DATA_MAPPED_FILE_H_

// A whole file memory-mapped read-only, unmapped when the object goes.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace shardd {
namespace data {

class MappedFile {
 public:
  // Errors: the errno's code (NOT_FOUND, PERMISSION_DENIED, ...) when the
  // file cannot be opened, stat'ed or mapped, INVALID_ARGUMENT when it is
  // not a regular file; messages name it as `what` and the path ("cannot
  // open token file PATH"). An empty file maps to size 0 and a null
  // data().
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(
      const std::string& path, const std::string& what = "file");

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  MappedFile() = default;

  std::string path_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace data
}  // namespace shardd

#endif  // SHARDD_WORKER_DATA_MAPPED_FILE_H_
