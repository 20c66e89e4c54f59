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
inline constexpr int kShardctlError = 1;  // Planning, file or RPC error.
inline constexpr int kShardctlUsage = 2;  // Bad command line.

// Runs shardctl with `argv` (without the program name). Results go to `out`;
// errors go to `err` as "shardctl: CODE: message" (RPC and planning errors)
// or "shardctl: message" plus a help hint (usage errors).
int RunShardctl(const std::vector<std::string>& argv, std::ostream& out,
                std::ostream& err);

}  // namespace shardd

#endif  // SHARDD_CLIENT_SHARDCTL_H_
