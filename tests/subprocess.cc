#include "tests/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace shardd {
namespace testing_util {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& out_path,
            const std::string& err_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& arg : argv) {
    args.push_back(const_cast<char*>(arg.c_str()));
  }
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc =
      posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

int WaitFor(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (done < 0) return -1;
    if (absl::Now() >= deadline) return -2;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void Stop(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  if (WaitFor(pid, absl::Seconds(10)) == -2) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
}

int RunCommand(const std::vector<std::string>& argv, absl::Duration timeout,
               std::string* out) {
  static int counter = 0;
  const std::string base =
      absl::StrCat(TempDir(), "/run_", getpid(), "_", ++counter);
  const pid_t pid = Spawn(argv, base + ".out", base + ".err");
  if (pid <= 0) return -1;
  int code = WaitFor(pid, timeout);
  if (code == -2) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  if (out != nullptr) *out = ReadFile(base + ".out") + ReadFile(base + ".err");
  return code;
}

int WaitForPortFile(const std::string& data_dir, pid_t pid,
                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int port = 0;
    const std::string text = ReadFile(data_dir + "/coordinator.port");
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
      return port;
    }
    if (waitpid(pid, nullptr, WNOHANG) != 0) return 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

}  // namespace testing_util
}  // namespace shardd
