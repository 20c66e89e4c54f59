#ifndef SHARDD_WORKER_COMM_COMMUNICATOR_H_
#define SHARDD_WORKER_COMM_COMMUNICATOR_H_

// The collectives a worker runs (FSDP unshard, gradient reduce-scatter, HSDP
// replica all-reduce, small metadata exchanges), independent of the backend.
//
// A communicator is one group of `world_size` ranks. HSDP uses two of them
// per worker (its shard group and its replicate group), created with
// different rendezvous prefixes, ranks and sizes; nothing here assumes the
// group is the whole job.
//
// Semantics shared by every collective:
// - All ranks of the group must call the same collectives in the same order
//   with the same count, dtype, op and root. A mismatch is a caller bug; it
//   usually surfaces as DEADLINE_EXCEEDED or ABORTED on some ranks.
// - Each call blocks until this rank's part is done or fails. `timeout`
//   bounds every wait for a peer: a peer that never joins makes the call fail
//   with DEADLINE_EXCEEDED after about `timeout`; a peer whose process died
//   makes it fail with ABORTED as soon as the connection drops.
// - Calls are thread-safe but serialized: one collective at a time per
//   communicator (run prefetches on one communication thread, in program
//   order).
// - Buffers are host memory. After a failed call the output contents are
//   unspecified.
//
// Data types (v1::DType):
// - AllGather, Broadcast and AllToAllV move bytes: any dtype with a known
//   element size (FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3, INT32, INT64).
// - ReduceScatter and AllReduce reduce FLOAT32, BFLOAT16, INT32 and INT64.
//   BFLOAT16 values are uint16 bit patterns; reductions widen them to fp32,
//   accumulate in fp32 and round to bf16 once at the end (round to nearest,
//   ties to even). Integer sums wrap around on overflow. kAvg is allowed for
//   the float types only.
//
// Error codes common to every call:
// - INVALID_ARGUMENT: negative count, null buffer with count > 0, unsupported
//   dtype or op, root out of range, timeout not positive and finite, or a
//   buffer size that overflows int64.
// - DEADLINE_EXCEEDED: a peer did not take part within `timeout`.
// - ABORTED: a peer failed or disconnected during the collective.
// - FAILED_PRECONDITION: an earlier call failed with one of the two codes
//   above (or INTERNAL); the group's connections are closed and every later
//   call fails. Create a new communicator (under a new prefix).
// - INTERNAL: an unexpected backend error.
// Argument errors (INVALID_ARGUMENT) do not poison the communicator, but the
// peers of a rank that rejected its arguments will time out.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/model.pb.h"

namespace shardd {

enum class ReduceOp {
  kSum,
  // Sum, then divide by world_size (in fp32 for BFLOAT16, before rounding).
  kAvg,
};

// Counters for one collective kind.
struct CollectiveStats {
  // Every call, including failed ones.
  int64_t calls = 0;
  // Calls that returned a non-OK status.
  int64_t failures = 0;
  // Sum over successful calls of the full (unsharded) buffer size in the
  // caller's dtype: AllGather's output, ReduceScatter's input, AllReduce's and
  // Broadcast's buffer, AllToAllV's send buffer. 0 for Barrier.
  int64_t bytes = 0;
  // Wall time spent inside successful calls (including waiting for peers).
  absl::Duration time = absl::ZeroDuration();
};

struct CommunicatorStats {
  CollectiveStats all_gather;
  CollectiveStats reduce_scatter;
  CollectiveStats all_reduce;
  CollectiveStats broadcast;
  CollectiveStats barrier;
  CollectiveStats all_to_all;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // output[r * count_per_rank + i] = input of rank r, element i (rank-major).
  // `output` holds world_size * count_per_rank elements. `input` may be this
  // rank's own slot inside `output` (in-place gather); otherwise the two must
  // not overlap.
  virtual absl::Status AllGather(const void* input, void* output,
                                 int64_t count_per_rank, v1::DType dtype,
                                 absl::Duration timeout) = 0;

  // `input` holds world_size * count_per_rank elements; rank r receives in
  // `output` (count_per_rank elements) the elementwise reduction over all
  // ranks of input chunk r. `output` may alias any part of `input`.
  virtual absl::Status ReduceScatter(const void* input, void* output,
                                     int64_t count_per_rank, v1::DType dtype,
                                     ReduceOp op, absl::Duration timeout) = 0;

  // In place: every rank ends with the elementwise reduction over all ranks.
  // All ranks get bitwise identical results.
  virtual absl::Status AllReduce(void* inout, int64_t count, v1::DType dtype,
                                 ReduceOp op, absl::Duration timeout) = 0;

  // Every rank ends with `root`'s buffer. Errors also: INVALID_ARGUMENT when
  // root is not in [0, world_size).
  virtual absl::Status Broadcast(void* inout, int64_t count, v1::DType dtype,
                                 int root, absl::Duration timeout) = 0;

  // Expert parallelism's token exchange: this rank sends send_counts[j]
  // elements to rank j and receives recv_counts[i] elements from rank i.
  // `send` holds the pieces for ranks 0, 1, ... back to back, `recv` gets
  // the pieces from ranks 0, 1, ... back to back; the piece for this rank
  // itself is copied. Both count lists have world_size entries, and
  // recv_counts[i] must equal rank i's send_counts[this rank] (exchange the
  // counts first, e.g. with an AllToAllV of equal counts); a mismatch is a
  // caller bug that surfaces as DEADLINE_EXCEEDED or ABORTED. `send` and
  // `recv` must not overlap. Errors also: INVALID_ARGUMENT for a count list
  // of the wrong length, a negative count, a null buffer with elements, or
  // overlapping buffers.
  virtual absl::Status AllToAllV(const void* send,
                                 const std::vector<int64_t>& send_counts,
                                 void* recv,
                                 const std::vector<int64_t>& recv_counts,
                                 v1::DType dtype, absl::Duration timeout) = 0;

  // Returns once every rank of the group has entered the barrier.
  virtual absl::Status Barrier(absl::Duration timeout) = 0;

  // A snapshot; safe to call while a collective is running.
  virtual CommunicatorStats stats() const = 0;
};

// Expert parallelism's groups (plan.mesh.ep > 1; docs/expert_parallel.md):
// `ep_shard`, the dp_shard / ep ranks of this rank's block (this rank at
// shard_rank % (dp_shard / ep)), gathers and reduces the expert units;
// `ep`, the ep ranks at the same place of every block (this rank at
// shard_rank / (dp_shard / ep)), exchanges the routed tokens.
struct ExpertGroups {
  Communicator* ep_shard = nullptr;
  Communicator* ep = nullptr;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_COMMUNICATOR_H_
