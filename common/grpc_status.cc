#include "common/grpc_status.h"

#include <string>

#include "absl/strings/cord.h"
#include "proto/status_details.pb.h"

namespace shardd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message(status.message());
  v1::StatusDetails details;
  status.ForEachPayload(
      [&details](absl::string_view type_url, const absl::Cord& payload) {
        v1::AnyDetail* detail = details.add_details();
        detail->set_type_url(std::string(type_url));
        detail->set_value(std::string(payload));
      });
  if (details.details_size() == 0) return grpc::Status(code, message);
  details.set_code(static_cast<int32_t>(status.code()));
  details.set_message(message);
  return grpc::Status(code, message, details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
  // Details that do not parse (another server's) are dropped, not an error:
  // the code and message still say what happened.
  v1::StatusDetails details;
  if (!status.error_details().empty() &&
      details.ParseFromString(status.error_details())) {
    for (const v1::AnyDetail& detail : details.details()) {
      if (detail.type_url().empty()) continue;
      result.SetPayload(detail.type_url(), absl::Cord(detail.value()));
    }
  }
  return result;
}

}  // namespace shardd
