// shardctl: the shardd command-line client. See `shardctl --help`.

#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "client/shardctl.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  shardd::ShardctlEnvironment environment;
  environment.out_is_tty = isatty(STDOUT_FILENO) == 1;
  return shardd::RunShardctl(args, std::cout, std::cerr, environment);
}
