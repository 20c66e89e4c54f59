#include "program/step_model.h"

// The schedule, the byte counts and the accounting rules live with the
// step program (program/step_program.h): this model is a replay of the
// compiled program, so it cannot drift from what the workers execute.

#include <utility>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "program/step_program.h"

namespace shardd {

absl::Status ModelStep(bool include_timeline, v1::ShardingPlan* plan) {
  if (plan == nullptr) return absl::InvalidArgumentError("plan: must be set");
  v1::MemoryReport memory;
  v1::CommReport comm;
  SHARDD_RETURN_IF_ERROR(
      ReplayCompiledStep(*plan, include_timeline, &memory, &comm));
  *plan->mutable_memory() = std::move(memory);
  *plan->mutable_comm() = std::move(comm);
  return absl::OkStatus();
}

}  // namespace shardd
