#ifndef SHARDD_CLIENT_SHARDCTL_H_
#define SHARDD_CLIENT_SHARDCTL_H_

// The shardctl program behind main(), writing to streams so tests can run
// it in-process.

#include <ostream>
#include <string>
#include <vector>

namespace shardd {

// Exit codes.
inline constexpr int kShardctlOk = 0;
inline constexpr int kShardctlError = 1;  // Planning, file, RPC or job error.
inline constexpr int kShardctlUsage = 2;  // Bad command line.

// What shardctl learns from its process rather than its arguments.
struct ShardctlEnvironment {
  // `out` is a terminal: train draws a progress line instead of printing
  // plain lines.
  bool out_is_tty = false;
  // $SHARDD_TOKEN_FILE: the client token file when --token-file is absent.
  std::string token_file;
};

// Runs shardctl with `argv` (without the program name). Results go to `out`;
// errors go to `err` as "shardctl: CODE: message" (RPC and planning errors)
// or "shardctl: message" plus a help hint (usage errors).
int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err);
int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err, const ShardctlEnvironment& environment);

}  // namespace shardd

#endif  // SHARDD_CLIENT_SHARDCTL_H_
