#ifndef SHARDD_TESTS_SUBPROCESS_H_
#define SHARDD_TESTS_SUBPROCESS_H_

// Starting, waiting for and stopping the shardd binaries in multi-process
// tests: every wait is bounded, and Stop escalates to SIGKILL.

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/time/time.h"

namespace shardd {
namespace testing_util {

// TEST_TMPDIR, or /tmp outside bazel.
std::string TempDir();

// The whole file ("" when it cannot be read).
std::string ReadFile(const std::string& path);

// Starts `argv` (argv[0] a path) with stdout and stderr redirected to the
// two files; -1 when it cannot be started.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& out_path,
            const std::string& err_path);

// The exit code; -1 when killed by a signal (or not our child); -2 when
// still running at the deadline.
int WaitFor(pid_t pid, absl::Duration timeout);

// SIGTERM, up to 10 s, then SIGKILL. A no-op for pid <= 0.
void Stop(pid_t pid);

// Runs a command to completion (bounded by `timeout`, then SIGKILL) and
// returns its exit code (-1 signal, -2 timeout); output in *out if given.
int RunCommand(const std::vector<std::string>& argv, absl::Duration timeout,
               std::string* out = nullptr);

// Reads the port a shardd-coordinator wrote to DATA_DIR/coordinator.port,
// waiting up to `timeout` while `pid` runs; 0 when none appeared.
int WaitForPortFile(const std::string& data_dir, pid_t pid,
                    absl::Duration timeout);

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTS_SUBPROCESS_H_
