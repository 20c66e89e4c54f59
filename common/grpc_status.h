#ifndef SHARDD_COMMON_GRPC_STATUS_H_
#define SHARDD_COMMON_GRPC_STATUS_H_

// gRPC 1.51 cannot convert absl::Status. The canonical code numbers are the
// same in both, so conversion keeps the code and the message exactly. The
// status' payloads (e.g. the reason of common/error_info.h) travel in the
// standard details trailer as a google.rpc.Status-compatible message
// (proto/status_details.proto).

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace shardd {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace shardd

#endif  // SHARDD_COMMON_GRPC_STATUS_H_
