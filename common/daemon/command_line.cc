#include "common/daemon/command_line.h"

#include <algorithm>

#include "absl/flags/parse.h"

namespace shardd {

std::vector<std::string> NormalizeFlagDashes(int argc, char** argv) {
  std::vector<std::string> normalized(argv, argv + argc);
  for (size_t i = 1; i < normalized.size(); ++i) {
    std::string& arg = normalized[i];
    if (arg == "--") break;
    if (arg.rfind("--", 0) != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t c = 2; c < end; ++c) {
      if (arg[c] == '-') arg[c] = '_';
    }
  }
  return normalized;
}

std::vector<std::string> ParseDaemonCommandLine(int argc, char** argv) {
  std::vector<std::string> normalized = NormalizeFlagDashes(argc, argv);
  std::vector<char*> pointers;
  for (std::string& arg : normalized) pointers.push_back(arg.data());
  const std::vector<char*> rest = absl::ParseCommandLine(
      static_cast<int>(pointers.size()), pointers.data());
  return std::vector<std::string>(rest.begin(), rest.end());
}

}  // namespace shardd
