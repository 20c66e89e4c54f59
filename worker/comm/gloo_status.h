#ifndef SHARDD_WORKER_COMM_GLOO_STATUS_H_
#define SHARDD_WORKER_COMM_GLOO_STATUS_H_

// The boundary between Gloo (which reports errors by throwing) and shardd
// (absl::Status everywhere). Code that calls into Gloo catches everything and
// converts it with CurrentGlooExceptionToStatus(); code that Gloo calls into
// (a rendezvous store) reports failures by throwing GlooStatusError.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gloo/common/error.h"

namespace shardd {

// A gloo::IoException that carries the absl::Status it came from, so the
// status survives a trip through Gloo's rendezvous code unchanged.
class GlooStatusError : public gloo::IoException {
 public:
  explicit GlooStatusError(absl::Status status);

  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Converts the exception being handled (call only inside a catch block) to a
// status whose message starts with `context`. Mapping:
// - GlooStatusError: its own status.
// - gloo::IoException whose message reports a timeout ("timed out",
//   "timeout"): DEADLINE_EXCEEDED.
// - any other gloo::IoException (peer closed or reset the connection):
//   ABORTED.
// - std::bad_alloc: RESOURCE_EXHAUSTED.
// - gloo::EnforceNotMet, gloo::InvalidOperationException, any other
//   exception: INTERNAL.
absl::Status CurrentGlooExceptionToStatus(absl::string_view context);

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_GLOO_STATUS_H_
