#include "common/error_info.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/types/optional.h"
#include "proto/status_details.pb.h"

namespace shardd {

absl::Status WithErrorReason(absl::Status status, absl::string_view reason) {
  if (status.ok()) return status;
  v1::ErrorInfo info;
  info.set_reason(std::string(reason));
  info.set_domain(std::string(kErrorDomain));
  status.SetPayload(kErrorInfoTypeUrl, absl::Cord(info.SerializeAsString()));
  return status;
}

std::string ErrorReasonOf(const absl::Status& status) {
  const absl::optional<absl::Cord> payload =
      status.GetPayload(kErrorInfoTypeUrl);
  if (!payload.has_value()) return "";
  v1::ErrorInfo info;
  if (!info.ParseFromString(std::string(*payload)) ||
      info.domain() != kErrorDomain) {
    return "";
  }
  return info.reason();
}

absl::Status WithMessage(const absl::Status& status,
                         absl::string_view message) {
  if (status.ok()) return status;
  absl::Status result(status.code(), message);
  status.ForEachPayload(
      [&result](absl::string_view type_url, const absl::Cord& payload) {
        result.SetPayload(type_url, payload);
      });
  return result;
}

}  // namespace shardd
