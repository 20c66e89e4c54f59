#ifndef SHARDD_COMMON_DAEMON_PORT_FILE_H_
#define SHARDD_COMMON_DAEMON_PORT_FILE_H_

// The port a daemon bound (listening on port 0) written for launchers and
// tests to read.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardd {

// Writes "PORT\n" to `path` through a temporary file beside it and a
// rename, so a reader never sees a partial number. `flag` names the flag
// that chose the path, for messages. Errors: INTERNAL naming the flag, the
// file and the system's reason when the file cannot be written or renamed
// (the temporary file is removed).
absl::Status WritePortFile(const std::string& path, int port,
                           absl::string_view flag);

}  // namespace shardd

#endif  // SHARDD_COMMON_DAEMON_PORT_FILE_H_
