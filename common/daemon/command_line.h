#ifndef SHARDD_COMMON_DAEMON_COMMAND_LINE_H_
#define SHARDD_COMMON_DAEMON_COMMAND_LINE_H_

// Command-line parsing shared by the shardd binaries: absl flags whose
// underscore names may also be spelled with dashes (--data-dir as
// --data_dir), as the README and the launchers write them.

#include <string>
#include <vector>

namespace shardd {

// Rewrites the dashes of each "--flag-name[=value]" before "=" into
// underscores (arguments after "--" and values are left alone).
std::vector<std::string> NormalizeFlagDashes(int argc, char** argv);

// Parses argv with absl::ParseCommandLine after NormalizeFlagDashes; exits
// the process as absl does on unknown flags or --help. Returns the
// positional arguments, argv[0] first.
std::vector<std::string> ParseDaemonCommandLine(int argc, char** argv);

}  // namespace shardd

#endif  // SHARDD_COMMON_DAEMON_COMMAND_LINE_H_
