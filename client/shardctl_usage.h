#ifndef SHARDD_CLIENT_SHARDCTL_USAGE_H_
#define SHARDD_CLIENT_SHARDCTL_USAGE_H_

// shardctl's help texts (`shardctl --help`, `shardctl help CMD`, `CMD
// --help`): the flags each command takes and what they mean. Kept beside the
// parser's flag sets (shardctl_args.cc); shardctl_args_test checks that
// every flag a command accepts is documented in its text.

#include <string>

#include "client/shardctl_args.h"

namespace shardd {

// Help texts: the overview (kHelp) or one command's.
std::string ShardctlUsage(ShardctlCommand command);

}  // namespace shardd

#endif  // SHARDD_CLIENT_SHARDCTL_USAGE_H_
