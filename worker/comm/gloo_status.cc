#include "worker/comm/gloo_status.h"

#include <exception>
#include <new>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gloo/common/logging.h"

namespace shardd {
namespace {

bool MentionsTimeout(absl::string_view message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timed out") ||
         absl::StrContains(lower, "timeout");
}

}  // namespace

GlooStatusError::GlooStatusError(absl::Status status)
    : gloo::IoException(status.ToString()), status_(std::move(status)) {}

absl::Status CurrentGlooExceptionToStatus(absl::string_view context) {
  try {
    throw;
  } catch (const GlooStatusError& e) {
    return absl::Status(e.status().code(),
                        absl::StrCat(context, ": ", e.status().message()));
  } catch (const gloo::IoException& e) {
    const absl::StatusCode code = MentionsTimeout(e.what())
                                      ? absl::StatusCode::kDeadlineExceeded
                                      : absl::StatusCode::kAborted;
    return absl::Status(code, absl::StrCat(context, ": ", e.what()));
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat(context, ": ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(
        absl::StrCat(context, ": gloo check failed: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(context, ": unknown exception from gloo"));
  }
}

}  // namespace shardd
