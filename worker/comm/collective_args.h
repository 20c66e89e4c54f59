#ifndef SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_
#define SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_

// Argument checks every Communicator backend shares (worker/comm/communicator.h
// states the rules): which dtypes a collective may move or reduce, buffer
// sizes without overflow, non-null buffers, and timeouts.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/model.pb.h"
#include "worker/comm/communicator.h"

namespace shardd {

// FLOAT32, BFLOAT16, INT32 and INT64: the dtypes reductions accept.
bool IsReducibleDType(v1::DType dtype);

// The element size of a dtype a collective may move; with
// `needs_reduction`, also one it may reduce with `op` (kAvg: floats only).
// Errors: INVALID_ARGUMENT naming the dtype and what is allowed.
absl::StatusOr<int64_t> CollectiveElementBytes(v1::DType dtype,
                                               bool needs_reduction,
                                               ReduceOp op);

// count * ranks * element_bytes. Errors: INVALID_ARGUMENT (naming
// `count_name`) when count is negative or the product overflows int64.
absl::StatusOr<int64_t> CollectiveBufferBytes(int64_t count, int64_t ranks,
                                              int64_t element_bytes,
                                              absl::string_view count_name);

// The send and receive buffer sizes of an AllToAllV (communicator.h) of
// `rank` over `world_size` ranks, in bytes of `element_bytes` elements.
// Errors: INVALID_ARGUMENT naming send_counts / recv_counts when a list
// does not have world_size entries, holds a negative count, or its total
// overflows int64, or when the piece the rank sends itself differs from
// the one it expects.
struct AllToAllVBytes {
  int64_t send = 0;
  int64_t recv = 0;
};
absl::StatusOr<AllToAllVBytes> CollectiveAllToAllVBytes(
    const std::vector<int64_t>& send_counts,
    const std::vector<int64_t>& recv_counts, int rank, int world_size,
    int64_t element_bytes);

// INVALID_ARGUMENT naming the buffer when it is null and bytes > 0.
absl::Status CheckCollectiveBuffer(const void* ptr, int64_t bytes,
                                   absl::string_view name);

// INVALID_ARGUMENT naming `name` unless the duration is positive and
// finite.
absl::Status CheckPositiveFinite(absl::Duration duration,
                                 absl::string_view name);

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_
