#ifndef SHARDD_COMMON_ERROR_INFO_H_
#define SHARDD_COMMON_ERROR_INFO_H_

// Machine-readable reasons on error statuses, so that a caller acts on what
// went wrong without parsing the human-readable message. A reason is an
// absl::Status payload holding a google.rpc.ErrorInfo-compatible message
// (proto/status_details.proto); common/grpc_status.h carries payloads across
// gRPC, so a worker's reason reaches the coordinator intact.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardd {

// The payload's type URL (that of google.rpc.ErrorInfo) and our domain.
inline constexpr absl::string_view kErrorInfoTypeUrl =
    "type.googleapis.com/google.rpc.ErrorInfo";
inline constexpr absl::string_view kErrorDomain = "shardd.dev";

// Reasons a worker gives with FAILED_PRECONDITION when it cannot run a step
// of the job it is asked about; the coordinator recovers the job from them.
//
// The worker holds no plan, or another plan than the step names (it
// restarted, or the job moved on without it).
inline constexpr absl::string_view kReasonPlanNotHeld = "PLAN_NOT_HELD";
// The worker holds the plan, but an earlier step of it failed there; it
// refuses steps until the plan is loaded again.
inline constexpr absl::string_view kReasonStepFailedEarlier =
    "STEP_FAILED_EARLIER";
// LoadPlan with plan_options: the worker's own planning of the model gave
// another fingerprint than the coordinator's (another build); the
// coordinator sends the plan itself instead.
inline constexpr absl::string_view kReasonPlanDerivationMismatch =
    "PLAN_DERIVATION_MISMATCH";

// `status` with `reason` attached (replacing any earlier reason). An OK
// status is returned unchanged: reasons belong to errors.
absl::Status WithErrorReason(absl::Status status, absl::string_view reason);

// The reason attached to `status`; empty when there is none or it is not in
// kErrorDomain.
std::string ErrorReasonOf(const absl::Status& status);

// `status`' code and payloads (its reason among them) with a new message:
// for adding context to an error without losing what it carries. An OK
// status is returned unchanged.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

}  // namespace shardd

#endif  // SHARDD_COMMON_ERROR_INFO_H_
