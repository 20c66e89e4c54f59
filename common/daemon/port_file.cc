#include "common/daemon/port_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardd {

absl::Status WritePortFile(const std::string& path, int port,
                           absl::string_view flag) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  if (out == nullptr) {
    return absl::InternalError(
        absl::StrCat(flag, ": cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const bool written = std::fprintf(out, "%d\n", port) > 0;
  const bool closed = std::fclose(out) == 0;
  if (!written || !closed) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat(flag, ": cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat(flag, ": cannot rename to ", path,
                                            ": ", std::strerror(error)));
  }
  return absl::OkStatus();
}

}  // namespace shardd
