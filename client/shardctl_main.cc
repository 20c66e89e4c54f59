// shardctl: the shardd command-line client. See `shardctl --help`.

#include <iostream>
#include <string>
#include <vector>

#include "client/shardctl.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return shardd::RunShardctl(args, std::cout, std::cerr);
}
