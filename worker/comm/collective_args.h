#ifndef SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_
#define SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_

// Argument checks every Communicator backend shares (worker/comm/communicator.h
// states the rules): which dtypes a collective may move or reduce, buffer
// sizes without overflow, non-null buffers, and timeouts. CollectiveArgs
// below is the front end both backends (Gloo, NCCL) call first: every
// check of a collective, in one order, before a byte moves.

#include <cstdint>
#include <functional>
#include <utility>
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
  int64_t element = 0;  // bytes of one element
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

// The checked sizes of one call, in bytes.
struct CollectiveSizes {
  int64_t element = 0;
  // AllGather: this rank's input; ReduceScatter: this rank's output; the
  // others: the whole buffer.
  int64_t chunk = 0;
  // AllGather's output, ReduceScatter's input, the others' buffer.
  int64_t total = 0;
  // AllGather: input is this rank's slot of output; ReduceScatter: output
  // is this rank's chunk of input.
  bool in_place = false;
};

// The front end of a backend's collectives. Each method runs all the
// checks of its collective in one order (dtype and op, sizes, timeout,
// buffers, aliasing) and returns the sizes the backend then moves.
// Errors: INVALID_ARGUMENT naming the argument and what is allowed
// (communicator.h lists the rules).
class CollectiveArgs {
 public:
  // Checks one buffer of `bytes` bytes named `name`: the host's rule is
  // CheckCollectiveBuffer (non-null when bytes > 0); NCCL's also asks CUDA
  // that it is device memory.
  using BufferCheck =
      std::function<absl::Status(const void*, int64_t, absl::string_view)>;

  struct Options {
    int rank = 0;
    int world_size = 1;
    BufferCheck check_buffer = CheckCollectiveBuffer;
    // Gloo reduces from a copy, so ReduceScatter's output may overlap its
    // input anywhere; NCCL only in place (output = this rank's chunk).
    bool reduce_scatter_overlap_anywhere = true;
  };

  explicit CollectiveArgs(Options options) : options_(std::move(options)) {}

  absl::StatusOr<CollectiveSizes> AllGather(const void* input,
                                            const void* output,
                                            int64_t count_per_rank,
                                            v1::DType dtype,
                                            absl::Duration timeout) const;
  absl::StatusOr<CollectiveSizes> ReduceScatter(const void* input,
                                                const void* output,
                                                int64_t count_per_rank,
                                                v1::DType dtype, ReduceOp op,
                                                absl::Duration timeout) const;
  absl::StatusOr<CollectiveSizes> AllReduce(const void* inout, int64_t count,
                                            v1::DType dtype, ReduceOp op,
                                            absl::Duration timeout) const;
  absl::StatusOr<CollectiveSizes> Broadcast(const void* inout, int64_t count,
                                            v1::DType dtype, int root,
                                            absl::Duration timeout) const;
  absl::StatusOr<AllToAllVBytes> AllToAllV(
      const void* send, const std::vector<int64_t>& send_counts,
      const void* recv, const std::vector<int64_t>& recv_counts,
      v1::DType dtype, absl::Duration timeout) const;
  absl::Status Barrier(absl::Duration timeout) const;

 private:
  // Every collective's prelude: the element bytes of `dtype` (reducible
  // with `op` when `reduces`), one rank's `count` elements (chunk) and
  // `ranks` ranks' (total), and the timeout.
  absl::StatusOr<CollectiveSizes> Sizes(v1::DType dtype, bool reduces,
                                        ReduceOp op, int64_t count, int ranks,
                                        absl::string_view count_name,
                                        absl::Duration timeout) const;

  Options options_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_COLLECTIVE_ARGS_H_
