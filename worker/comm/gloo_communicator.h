#ifndef SHARDD_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define SHARDD_WORKER_COMM_GLOO_COMMUNICATOR_H_

// Communicator over Gloo's TCP transport (CPU ranks). One full mesh of TCP
// connections per communicator, set up through a Gloo rendezvous store (in
// workers: KvGlooStore, i.e. the coordinator's key-value RPCs).
//
// Which Gloo algorithm runs each collective:
// - AllGather: gloo::allgather (ring), on raw bytes; in place when `input` is
//   this rank's slot of `output`.
// - ReduceScatter: gloo::alltoall (chunk j of every rank goes to rank j), then
//   rank j reduces the world_size chunks it received in rank order 0, 1, ...
//   This sends the same (world_size - 1) / world_size of the buffer per rank
//   as a ring or halving-doubling reduce-scatter, honours the per-call
//   timeout, and makes the result independent of Gloo's schedule. (This Gloo
//   offers reduce-scatter only as ReduceScatterHalvingDoubling, an
//   old-style algorithm on bound buffers whose receive timeout is fixed per
//   connection when the mesh is built, so it cannot honour a per-call
//   deadline.) bf16 is exchanged as bf16 and widened on receipt: scratch is
//   one receive buffer of world_size * count_per_rank elements of the dtype.
// - AllReduce: gloo::allreduce (ring) with an elementwise sum; bf16 goes
//   through an fp32 copy of the buffer (Gloo has no bf16 type), which also
//   doubles its traffic.
// - Broadcast: gloo::broadcast on raw bytes. Barrier: gloo::barrier.
// - AllToAllV: gloo::alltoallv on raw bytes (this rank's own piece is a
//   local copy inside it).
// kAvg divides the sum by world_size after the collective.
//
// Error mapping from Gloo's exceptions (see gloo_status.h): a receive or send
// that times out -> DEADLINE_EXCEEDED; a connection closed or reset by a peer
// -> ABORTED; failed Gloo checks -> INTERNAL. No exception leaves this class.
// After such a failure the connections are closed (so peers fail fast too)
// and every later call returns FAILED_PRECONDITION.
//
// A world of size 1 needs no rendezvous: Create() does not touch the store
// and every collective is a local copy.
//
// Process-wide side effect: the first Create() with world_size > 1 sets
// SIGPIPE to SIG_IGN if it still has its default action, because Gloo
// relies on writes to a dead peer failing with EPIPE rather than killing
// the process.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/collective_args.h"
#include "worker/comm/communicator.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace shardd {

class GlooCommunicator final : public Communicator {
 public:
  static constexpr char kDefaultBindAddress[] = "127.0.0.1";

  // Joins the group `prefix` as `rank` of `world_size`: listens on
  // `bind_address` (an IP address or host name of this machine), publishes
  // its endpoints in `store` under keys starting with "<prefix>/" (Gloo
  // writes "<prefix>/<rank>" and "<prefix>/rank_<rank>"), waits for every
  // other rank's and connects to all of them. All ranks must use the same
  // prefix and world_size; the prefix must be fresh for every new group
  // (include the job, incarnation and group name, e.g. "job7/inc2/shard"): keys
  // are never overwritten by a later group. The caller may delete "<prefix>/"
  // from the store once every rank's Create() has returned. `store` is used
  // only during Create() and need not outlive the communicator. `timeout`
  // bounds the rendezvous (each wait for a peer's key, and each connection,
  // which Gloo allows up to 5x) and is the default for Gloo's internal waits.
  //
  // Errors: INVALID_ARGUMENT (null store, empty prefix or bind_address,
  // world_size < 1, rank outside [0, world_size), timeout not positive and
  // finite, bind_address that cannot be bound); the store's code (normally
  // DEADLINE_EXCEEDED) when a peer never publishes its key; DEADLINE_EXCEEDED
  // or ABORTED when connecting to a peer times out or fails; INTERNAL.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      gloo::rendezvous::Store* store, const std::string& prefix, int rank,
      int world_size, const std::string& bind_address, absl::Duration timeout);

  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;
  // Closes the connections; peers blocked on this rank fail with ABORTED.
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  const std::string& prefix() const { return prefix_; }

  absl::Status AllGather(const void* input, void* output,
                         int64_t count_per_rank, v1::DType dtype,
                         absl::Duration timeout) override;
  absl::Status ReduceScatter(const void* input, void* output,
                             int64_t count_per_rank, v1::DType dtype,
                             ReduceOp op, absl::Duration timeout) override;
  absl::Status AllReduce(void* inout, int64_t count, v1::DType dtype,
                         ReduceOp op, absl::Duration timeout) override;
  absl::Status Broadcast(void* inout, int64_t count, v1::DType dtype, int root,
                         absl::Duration timeout) override;
  absl::Status AllToAllV(const void* send,
                         const std::vector<int64_t>& send_counts, void* recv,
                         const std::vector<int64_t>& recv_counts,
                         v1::DType dtype, absl::Duration timeout) override;
  absl::Status Barrier(absl::Duration timeout) override;
  CommunicatorStats stats() const override;

 private:
  // Gloo tags are 32 bits and must match across ranks per operation.
  using Body = absl::FunctionRef<void(uint32_t tag)>;

  GlooCommunicator(std::string prefix, int rank, int world_size);

  // Runs `body` (which may throw Gloo exceptions) as one collective: refuses
  // when poisoned, converts exceptions, poisons on failure, and records
  // stats under `kind` (bytes only on success).
  absl::Status Run(CollectiveStats CommunicatorStats::*kind,
                   absl::string_view name, int64_t bytes, Body body);
  // Records a call that failed argument checks.
  absl::Status RecordInvalid(CollectiveStats CommunicatorStats::*kind,
                             absl::Status status);
  void Record(CollectiveStats CommunicatorStats::*kind, bool ok, int64_t bytes,
              absl::Duration time);

  const std::string prefix_;
  const int rank_;
  const int world_size_;
  const CollectiveArgs args_;  // the checks every backend shares
  // Declared before context_ so the connections close before the device's
  // event loop stops.
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;

  // Serializes collectives: a Gloo context runs one operation at a time here,
  // and every rank must issue them in the same order.
  absl::Mutex op_mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(op_mu_) = 0;
  // Non-OK once a collective failed; the connections are closed.
  absl::Status poisoned_ ABSL_GUARDED_BY(op_mu_);

  mutable absl::Mutex stats_mu_;
  CommunicatorStats stats_ ABSL_GUARDED_BY(stats_mu_);
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_GLOO_COMMUNICATOR_H_
