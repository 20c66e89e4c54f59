#ifndef SHARDD_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define SHARDD_WORKER_COMM_NCCL_COMMUNICATOR_H_

// Communicator over NCCL for device buffers (GPU ranks, CUDA builds only).
//
// Creation: rank 0 calls ncclGetUniqueId and publishes the id through the
// coordinator's key-value store under "<prefix>/nccl_unique_id"; the other
// ranks wait for it. Every rank then initializes a non-blocking NCCL
// communicator (config.blocking = 0) and polls ncclCommGetAsyncError until
// the init finished or the deadline passed (then ncclCommAbort and
// DEADLINE_EXCEEDED), so a peer that never joins cannot hang Create().
//
// Two ways to run collectives:
// - Asynchronous, stream-ordered (the training step's path): *Async()
//   enqueues the collective on the communicator's own stream and returns an
//   NcclWork whose event completes with it. All-gather and broadcast run on
//   the all-gather stream, reduce-scatter and all-reduce on the
//   reduce-scatter stream, so the parameter path and the gradient path have
//   independent dependency chains. Inputs are ordered with an NcclWaitFor
//   (an event or a stream the collective waits for on the device); results
//   are consumed with NcclWork::StreamWait(compute stream). The host never
//   blocks on the device in these calls. Note that NCCL itself runs the
//   collectives of one communicator one at a time in the order they were
//   enqueued (across both streams), so enqueue in the order they should
//   run (e.g. the next layer's all-gather before this layer's
//   reduce-scatter when it should overlap the backward pass). True
//   concurrency between the two paths would need a second communicator.
// - Blocking, the Communicator interface: AllGather() etc. take DEVICE
//   pointers (not host memory as the interface says for Gloo), wait on the
//   device for the work enqueued so far on `options.compute_stream`, enqueue
//   like *Async(), then block the host until the collective completed or
//   failed. Each blocking call counts one host synchronization.
//
// Every enqueued collective is tracked by a CollectiveWatchdog that polls
// its completion event (cudaEventQuery) and ncclCommGetAsyncError every few
// milliseconds. When an operation outlives its timeout or NCCL reports an
// asynchronous error, the watchdog calls ncclCommAbort (which makes the
// NCCL kernels on the device exit) and every later call fails with
// FAILED_PRECONDITION; create a new communicator under a new prefix.
//
// Differences from the Communicator contract (which was written for host
// buffers):
// - Buffers are device memory of `options.device` (or managed memory).
// - ReduceScatter's output may alias its input only as this rank's chunk
//   (in place); AllGather's input only as this rank's slot of the output.
//   Other overlaps are INVALID_ARGUMENT.
// - BFLOAT16 sums are NCCL's: partial sums are rounded to bf16 along the
//   reduction, not accumulated in fp32 and rounded once; kAvg is ncclAvg,
//   which for float types scales each input by 1/world_size before summing.
//   Results can differ in the last bits from GlooCommunicator's. AllReduce
//   results are identical on all ranks.
//
// Error codes (in addition to the Communicator's): FAILED_PRECONDITION from
// Create() when no CUDA device is usable (no GPU, no driver), and from
// every call after an abort ("communicator aborted: <first error>").
// NCCL's own errors go through NcclStatus (kernels/cuda/cuda_status.h):
// ncclRemoteError / ncclSystemError -> ABORTED, invalid arguments ->
// INVALID_ARGUMENT, the rest INTERNAL; CUDA errors through CudaStatus.
//
// Thread-safety: all methods are thread-safe; enqueues are serialized (the
// enqueue order is the order in which the calls took the lock, and it must
// match across ranks). Calls make `options.device` the calling thread's
// current CUDA device and leave it so (a worker drives one device).
//
// Host synchronizations (host_synchronizations()) happen only in the
// blocking calls, NcclWork::Wait() and Synchronize(); a step that uses the
// *Async() calls and one Synchronize() at its end makes exactly one.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/model.pb.h"
#include "worker/comm/collective_args.h"
#include "worker/comm/collective_watchdog.h"
#include "worker/comm/communicator.h"
#include "worker/comm/kv_client.h"

namespace shardd {

// The key-value key under which rank 0 publishes group `prefix`'s id.
std::string NcclUniqueIdKey(absl::string_view prefix);

// Rank 0: creates a unique id (ncclGetUniqueId, no GPU needed) and
// publishes it hex-encoded under NcclUniqueIdKey(prefix). Other ranks: wait
// up to `timeout` for it and decode it. The prefix must be fresh for every
// group (the key is overwritten by rank 0 and never deleted here).
// Errors: INVALID_ARGUMENT (null kv, empty prefix, negative rank); the
// store's code with the key named (normally DEADLINE_EXCEEDED when rank 0
// never published); INTERNAL for a value that is not a hex-encoded id or a
// failing ncclGetUniqueId.
absl::StatusOr<ncclUniqueId> ExchangeNcclUniqueId(KeyValueClient* kv,
                                                  absl::string_view prefix,
                                                  int rank,
                                                  absl::Duration timeout);

// What an asynchronous collective waits for on the device before it starts.
// The host never blocks on it.
class NcclWaitFor {
 public:
  // Start as soon as the communicator's stream is free.
  static NcclWaitFor Nothing() { return NcclWaitFor(); }
  // Start after `event`'s most recent cudaEventRecord (e.g. recorded on the
  // compute stream after the kernel that produced the input). The event may
  // be re-recorded or destroyed as soon as the call returned.
  static NcclWaitFor Event(cudaEvent_t event);
  // Start after all work enqueued on `stream` so far (nullptr: the legacy
  // default stream).
  static NcclWaitFor Stream(cudaStream_t stream);

 private:
  friend class NcclCommunicator;
  enum class Kind { kNothing, kEvent, kStream };
  Kind kind_ = Kind::kNothing;
  cudaEvent_t event_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

class NcclCommunicator;

namespace nccl_internal {
class EventPool;
struct OperationEvents;
}  // namespace nccl_internal

// Completion of one asynchronous collective. Move-only. The event stays
// valid while the handle lives; Wait() needs the communicator alive.
class NcclWork {
 public:
  NcclWork() = default;
  NcclWork(NcclWork&&) noexcept = default;
  NcclWork& operator=(NcclWork&&) noexcept = default;
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;
  ~NcclWork();

  bool valid() const { return events_ != nullptr; }
  // Recorded on the communicator's stream right after the collective.
  cudaEvent_t event() const;
  // Makes `stream` wait on the device until the collective finished: the
  // way to consume its output without blocking the host. After an abort the
  // event still completes (NCCL's kernels exit) but the output is
  // unspecified: check Synchronize() or health() before trusting a step.
  // Errors: FAILED_PRECONDITION for an empty handle; CUDA errors.
  absl::Status StreamWait(cudaStream_t stream) const;
  // Blocks the host until the collective finished, failed or timed out
  // (the timeout given when it was enqueued). Counts one host
  // synchronization. Errors: as the blocking collectives.
  absl::Status Wait();

 private:
  friend class NcclCommunicator;
  NcclCommunicator* communicator_ = nullptr;
  std::shared_ptr<nccl_internal::OperationEvents> events_;
  CollectiveWatchdog::OperationId operation_ = -1;
};

struct NcclCommunicatorOptions {
  // CUDA device ordinal of this rank.
  int device = 0;
  // Bounds Create(): waiting for the unique id and NCCL's init.
  absl::Duration init_timeout = absl::Minutes(5);
  // The stream whose work the blocking collectives wait for (on the device)
  // before they start. nullptr is the legacy default stream.
  cudaStream_t compute_stream = nullptr;
  // The destructor flushes outstanding collectives (ncclCommFinalize) for
  // at most this long, then aborts.
  absl::Duration finalize_timeout = absl::Seconds(30);
  // Watchdog: how often it checks ncclCommGetAsyncError and the events of
  // the collectives in flight, and how often a blocked Wait() queries its
  // own event.
  absl::Duration watchdog_poll_interval = absl::Milliseconds(2);
  absl::Duration wait_poll_interval = absl::Microseconds(20);
};

class NcclCommunicator final : public Communicator {
 public:
  // Joins group `prefix` as `rank` of `world_size` on `options.device`. All
  // ranks use the same prefix and world_size; the prefix must be fresh for
  // every group (include job, incarnation and group name). `kv` is used
  // only during Create().
  // Errors: INVALID_ARGUMENT (null kv, empty prefix, world_size < 1, rank
  // outside [0, world_size), device out of range, durations not positive
  // and finite); FAILED_PRECONDITION when no CUDA device is usable; the
  // store's code when the unique id does not arrive; DEADLINE_EXCEEDED when
  // NCCL's init does not finish within init_timeout (a peer did not join);
  // NCCL and CUDA errors as mapped by NcclStatus / CudaStatus.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      KeyValueClient* kv, const std::string& prefix, int rank, int world_size,
      const NcclCommunicatorOptions& options);

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  // Stops the watchdog, flushes outstanding collectives (ncclCommFinalize,
  // at most finalize_timeout, else ncclCommAbort) and frees the
  // communicator. No thread may be inside a call, and NcclWork handles may
  // outlive it only to read their events.
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  int device() const { return options_.device; }
  const std::string& prefix() const { return prefix_; }
  cudaStream_t all_gather_stream() const { return all_gather_stream_; }
  cudaStream_t reduce_scatter_stream() const { return reduce_scatter_stream_; }

  // Asynchronous collectives. Arguments and results as the blocking
  // Communicator calls (device pointers); `timeout` bounds the time from
  // enqueue to completion, including the wait for `wait_for`, and is
  // enforced by the watchdog. The buffers must stay allocated until the
  // returned work completed.
  // Errors (at enqueue; failures after it surface in NcclWork::Wait() or,
  // for everyone, as FAILED_PRECONDITION on later calls): INVALID_ARGUMENT;
  // FAILED_PRECONDITION after an abort; NCCL/CUDA errors from the enqueue
  // (which abort the communicator).
  absl::StatusOr<NcclWork> AllGatherAsync(const void* input, void* output,
                                          int64_t count_per_rank,
                                          v1::DType dtype,
                                          const NcclWaitFor& wait_for,
                                          absl::Duration timeout);
  absl::StatusOr<NcclWork> ReduceScatterAsync(const void* input, void* output,
                                              int64_t count_per_rank,
                                              v1::DType dtype, ReduceOp op,
                                              const NcclWaitFor& wait_for,
                                              absl::Duration timeout);
  absl::StatusOr<NcclWork> AllReduceAsync(void* inout, int64_t count,
                                          v1::DType dtype, ReduceOp op,
                                          const NcclWaitFor& wait_for,
                                          absl::Duration timeout);
  absl::StatusOr<NcclWork> BroadcastAsync(void* inout, int64_t count,
                                          v1::DType dtype, int root,
                                          const NcclWaitFor& wait_for,
                                          absl::Duration timeout);
  // Grouped ncclSend / ncclRecv to and from every rank (this rank's own
  // piece included), on the all-gather stream: the token exchange sits on
  // the forward path.
  absl::StatusOr<NcclWork> AllToAllVAsync(
      const void* send, const std::vector<int64_t>& send_counts, void* recv,
      const std::vector<int64_t>& recv_counts, v1::DType dtype,
      const NcclWaitFor& wait_for, absl::Duration timeout);

  // Blocking collectives on DEVICE pointers (see the file comment).
  // AllGather (input and output both), AllReduce and Broadcast also take
  // host memory, for small control
  // messages of protocols written against the Communicator interface (a
  // step count, a layout check): it is staged through a temporary device
  // buffer (cudaMalloc and two synchronous copies per call), so keep bulk
  // data in device memory.
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
  // A one-element all-reduce on a scratch buffer of the communicator.
  absl::Status Barrier(absl::Duration timeout) override;

  // Blocks the host until everything enqueued so far on both communicator
  // streams finished (e.g. once at the end of a step). Counts one host
  // synchronization. Errors: as the blocking collectives.
  absl::Status Synchronize(absl::Duration timeout);

  // `bytes` and `time` count collectives once they completed on the
  // device; `time` is device time from the collective's start on the
  // communicator stream to its end (it includes waiting behind earlier
  // collectives of this communicator). `calls` counts enqueues; `failures`
  // counts calls that returned an error, including a failing Wait().
  CommunicatorStats stats() const override;
  // Times this communicator blocked the host on the device: blocking
  // collectives, NcclWork::Wait() and Synchronize() (not Create or the
  // destructor).
  int64_t host_synchronizations() const;
  // Times an enqueue found NCCL still busy (ncclInProgress from a
  // non-blocking communicator) and polled until it was accepted.
  int64_t enqueue_waits() const;
  // OK while usable; the first error once aborted.
  absl::Status health() const;

 private:
  friend class NcclWork;
  using Launch =
      absl::FunctionRef<ncclResult_t(ncclComm_t comm, cudaStream_t stream)>;

  NcclCommunicator(std::string prefix, int rank, int world_size,
                   const NcclCommunicatorOptions& options);
  absl::Status Initialize(const ncclUniqueId& id, absl::Time deadline);
  std::string Name() const;

  // Enqueues one collective on `stream` after `wait_for`, and registers it
  // with the watchdog. Aborts the communicator on NCCL/CUDA errors after
  // the collective may have been (partly) enqueued.
  absl::StatusOr<NcclWork> Enqueue(CollectiveStats CommunicatorStats::*kind,
                                   absl::string_view name, cudaStream_t stream,
                                   int64_t bytes, const NcclWaitFor& wait_for,
                                   absl::Duration timeout, Launch launch);
  // Polls ncclCommGetAsyncError while it reports ncclInProgress.
  absl::Status WaitWhileInProgress(absl::string_view what, absl::Time deadline);
  absl::Status WaitForWork(NcclWork& work);
  absl::Status CheckDeviceBuffer(const void* ptr, int64_t bytes,
                                 absl::string_view name) const;
  // Blocking call = async call + Wait() (which count the stats).
  static absl::Status RunBlocking(absl::StatusOr<NcclWork> work);
  // Runs `run` on `buffer` (count elements of dtype), or on a device copy
  // of it when it is host memory, copying the result back.
  absl::Status InPlaceOnDevice(void* buffer, int64_t count, v1::DType dtype,
                               absl::FunctionRef<absl::Status(void*)> run);
  // Pageable or pinned host memory (not device or managed memory).
  static bool IsHostMemory(const void* ptr);

  void AbortComm(const absl::Status& cause);
  absl::Status CommHealth();

  absl::Status RecordInvalid(CollectiveStats CommunicatorStats::*kind,
                             absl::Status status);
  void RecordCall(CollectiveStats CommunicatorStats::*kind);
  void RecordFailure(CollectiveStats CommunicatorStats::*kind);
  void RecordCompletion(CollectiveStats CommunicatorStats::*kind, int64_t bytes,
                        absl::Duration time);

  const std::string prefix_;
  const int rank_;
  const int world_size_;
  const NcclCommunicatorOptions options_;
  // The checks every backend shares; buffers must be device memory CUDA
  // knows (CheckDeviceBuffer), and reduce-scatter is in place only at this
  // rank's chunk.
  const CollectiveArgs args_;

  cudaStream_t all_gather_stream_ = nullptr;
  cudaStream_t reduce_scatter_stream_ = nullptr;
  // One int32 on the device for Barrier().
  void* barrier_scratch_ = nullptr;
  std::shared_ptr<nccl_internal::EventPool> event_pool_;

  // Serializes enqueues: one NCCL call sequence at a time, in one order.
  absl::Mutex enqueue_mu_ ABSL_ACQUIRED_BEFORE(comm_mu_);
  int64_t next_sequence_ ABSL_GUARDED_BY(enqueue_mu_) = 0;

  // Readers: every NCCL call on comm_ (each short: the communicator is
  // non-blocking). Writer: the abort and the destructor, which free it.
  mutable absl::Mutex comm_mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(comm_mu_) = nullptr;

  mutable absl::Mutex stats_mu_;
  CommunicatorStats stats_ ABSL_GUARDED_BY(stats_mu_);
  std::atomic<int64_t> host_synchronizations_{0};
  std::atomic<int64_t> enqueue_waits_{0};

  // Declared last: destroyed (its thread joined) first, since its probes
  // and abort function use the members above.
  std::unique_ptr<CollectiveWatchdog> watchdog_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_COMM_NCCL_COMMUNICATOR_H_
