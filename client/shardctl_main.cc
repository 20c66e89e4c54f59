// shardctl: the shardd command-line client. See `shardctl --help`.

#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/shardctl.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  shardd::ShardctlEnvironment environment;
  environment.out_is_tty = isatty(STDOUT_FILENO) == 1;
  if (const char* token_file = std::getenv("SHARDD_TOKEN_FILE")) {
    environment.token_file = token_file;
  }
  return shardd::RunShardctl(args, std::cout, std::cerr, environment);
}
