#include "common/job_state_name.h"

#include "absl/strings/ascii.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace shardd {

std::string JobStateName(v1::JobState state) {
  if (state == v1::JOB_STATE_UNSPECIFIED || !v1::JobState_IsValid(state)) {
    return "unknown";
  }
  absl::string_view name = v1::JobState_Name(state);
  absl::ConsumePrefix(&name, "JOB_");
  return absl::AsciiStrToLower(name);
}

}  // namespace shardd
