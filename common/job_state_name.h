#ifndef SHARDD_COMMON_JOB_STATE_NAME_H_
#define SHARDD_COMMON_JOB_STATE_NAME_H_

#include <string>

#include "proto/coordinator.pb.h"

namespace shardd {

// The short lower-case name of a job state as people and metrics see it:
// "queued", "running", "recovering", "done", "failed" (the enum value's
// name without its JOB_ prefix); "unknown" for an unset or unknown value.
std::string JobStateName(v1::JobState state);

}  // namespace shardd

#endif  // SHARDD_COMMON_JOB_STATE_NAME_H_
