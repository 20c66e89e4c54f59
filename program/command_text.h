#ifndef SHARDD_PROGRAM_COMMAND_TEXT_H_
#define SHARDD_PROGRAM_COMMAND_TEXT_H_

#include <string>

#include "proto/worker.pb.h"

namespace shardd {

// One line per command, e.g. "UNSHARD u3", "UNSHARD u5 prefetch",
// "WAIT_UNSHARD u5", "RESHARD u1 group 2", "FORWARD LAYER l2 p0 m1",
// "FORWARD EMBED p0 m0 no_grad", "BACKWARD EXPERTS l1 p2 m0",
// "OPTIMIZER_STEP".
std::string CommandToString(const v1::Command& command);

}  // namespace shardd

#endif  // SHARDD_PROGRAM_COMMAND_TEXT_H_
