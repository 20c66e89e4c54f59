#include "worker/comm/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/collective_args.h"

namespace shardd {
namespace nccl_internal {

// Reuses CUDA events (timing enabled) across collectives: creating one per
// collective would cost a driver call each time.
class EventPool {
 public:
  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    absl::MutexLock lock(&mu_);
    for (cudaEvent_t event : free_) cudaEventDestroy(event);
  }

  // The caller has made the communicator's device current.
  absl::StatusOr<cudaEvent_t> Acquire() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    SHARDD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&event), "cudaEventCreate");
    return event;
  }

  // Only once the event's last record completed (or can never be waited
  // for again).
  void Release(cudaEvent_t event) {
    if (event == nullptr) return;
    absl::MutexLock lock(&mu_);
    free_.push_back(event);
  }

 private:
  absl::Mutex mu_;
  std::vector<cudaEvent_t> free_ ABSL_GUARDED_BY(mu_);
};

// The events of one collective, shared by its NcclWork and the watchdog's
// completion probe; back to the pool when both let go.
struct OperationEvents {
  std::shared_ptr<EventPool> pool;
  cudaEvent_t start = nullptr;
  cudaEvent_t done = nullptr;
  // Synchronize() only: the second stream's event.
  cudaEvent_t other_done = nullptr;
  // Null for Synchronize() (no stats).
  CollectiveStats CommunicatorStats::*kind = nullptr;
  int64_t bytes = 0;
  // Set once the done event(s) are recorded; before that an event query
  // would report an unrecorded event as complete.
  std::atomic<bool> enqueued{false};
  std::atomic<bool> completion_recorded{false};
  std::atomic<bool> failure_recorded{false};

  ~OperationEvents() {
    pool->Release(start);
    pool->Release(done);
    pool->Release(other_done);
  }
};

}  // namespace nccl_internal

namespace {

using nccl_internal::OperationEvents;

constexpr char kUniqueIdKeySuffix[] = "/nccl_unique_id";

// Makes `device` the calling thread's current device. The previous device
// is deliberately not restored: on a thread that never chose one,
// "restoring" device 0 would create a CUDA context there (CUDA 12+
// cudaSetDevice initializes the primary context), costing memory on a GPU
// this rank does not use.
absl::Status MakeDeviceCurrent(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  if (current == device) return absl::OkStatus();
  const cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) cudaGetLastError();
  return CudaStatus(error, absl::StrCat("cudaSetDevice(", device, ")"));
}

ncclDataType_t NcclReduceType(v1::DType dtype) {
  switch (dtype) {
    case v1::BFLOAT16:
      return ncclBfloat16;
    case v1::INT32:
      return ncclInt32;
    case v1::INT64:
      return ncclInt64;
    default:
      return ncclFloat32;
  }
}

ncclRedOp_t NcclOp(ReduceOp op) {
  return op == ReduceOp::kAvg ? ncclAvg : ncclSum;
}

const char* MemoryTypeName(cudaMemoryType type) {
  switch (type) {
    case cudaMemoryTypeUnregistered:
      return "unregistered host memory";
    case cudaMemoryTypeHost:
      return "pinned host memory";
    case cudaMemoryTypeDevice:
      return "device memory";
    case cudaMemoryTypeManaged:
      return "managed memory";
  }
  return "unknown memory";
}

}  // namespace

// Unique id exchange ----------------------------------------------------

std::string NcclUniqueIdKey(absl::string_view prefix) {
  return absl::StrCat(prefix, kUniqueIdKeySuffix);
}

absl::StatusOr<ncclUniqueId> ExchangeNcclUniqueId(KeyValueClient* kv,
                                                  absl::string_view prefix,
                                                  int rank,
                                                  absl::Duration timeout) {
  if (kv == nullptr) return absl::InvalidArgumentError("kv must not be null");
  if (prefix.empty()) {
    return absl::InvalidArgumentError("prefix must not be empty");
  }
  if (rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be >= 0, got ", rank));
  }
  const std::string key = NcclUniqueIdKey(prefix);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    SHARDD_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    const absl::Status set =
        kv->Set(key, absl::BytesToHexString(
                         absl::string_view(id.internal, sizeof(id.internal))));
    if (!set.ok()) {
      return absl::Status(
          set.code(), absl::StrCat("publishing the NCCL unique id under '", key,
                                   "': ", set.message()));
    }
    return id;
  }
  absl::StatusOr<std::string> value = kv->Get(key, timeout);
  if (!value.ok()) {
    return absl::Status(value.status().code(),
                        absl::StrCat("waiting ", absl::FormatDuration(timeout),
                                     " for rank 0's NCCL unique id under '",
                                     key, "': ", value.status().message()));
  }
  const bool well_formed =
      value->size() == 2 * sizeof(id.internal) &&
      std::all_of(value->begin(), value->end(),
                  [](char c) { return absl::ascii_isxdigit(c); });
  if (!well_formed) {
    return absl::InternalError(absl::StrCat(
        "the value under '", key, "' is not a hex-encoded NCCL unique id (",
        value->size(), " characters, expected ", 2 * sizeof(id.internal), ")"));
  }
  const std::string bytes = absl::HexStringToBytes(*value);
  std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  return id;
}

// NcclWaitFor / NcclWork ------------------------------------------------

NcclWaitFor NcclWaitFor::Event(cudaEvent_t event) {
  NcclWaitFor wait_for;
  wait_for.kind_ = Kind::kEvent;
  wait_for.event_ = event;
  return wait_for;
}

NcclWaitFor NcclWaitFor::Stream(cudaStream_t stream) {
  NcclWaitFor wait_for;
  wait_for.kind_ = Kind::kStream;
  wait_for.stream_ = stream;
  return wait_for;
}

NcclWork::~NcclWork() = default;

cudaEvent_t NcclWork::event() const {
  return events_ == nullptr ? nullptr : events_->done;
}

absl::Status NcclWork::StreamWait(cudaStream_t stream) const {
  if (events_ == nullptr) {
    return absl::FailedPreconditionError("StreamWait on an empty NcclWork");
  }
  return CudaStatus(cudaStreamWaitEvent(stream, events_->done, 0),
                    "cudaStreamWaitEvent on a collective's event");
}

absl::Status NcclWork::Wait() {
  if (events_ == nullptr || communicator_ == nullptr) {
    return absl::FailedPreconditionError("Wait on an empty NcclWork");
  }
  return communicator_->WaitForWork(*this);
}

// NcclCommunicator ------------------------------------------------------

NcclCommunicator::NcclCommunicator(std::string prefix, int rank, int world_size,
                                   const NcclCommunicatorOptions& options)
    : prefix_(std::move(prefix)),
      rank_(rank),
      world_size_(world_size),
      options_(options),
      args_(CollectiveArgs::Options{
          rank, world_size,
          [this](const void* ptr, int64_t bytes, absl::string_view name) {
            return CheckDeviceBuffer(ptr, bytes, name);
          },
          /*reduce_scatter_overlap_anywhere=*/false}),
      event_pool_(std::make_shared<nccl_internal::EventPool>()) {}

std::string NcclCommunicator::Name() const {
  return absl::StrCat("nccl '", prefix_, "' rank ", rank_, " of ", world_size_);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    KeyValueClient* kv, const std::string& prefix, int rank, int world_size,
    const NcclCommunicatorOptions& options) {
  if (kv == nullptr) return absl::InvalidArgumentError("kv must not be null");
  if (prefix.empty()) {
    return absl::InvalidArgumentError("prefix must not be empty");
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be >= 1, got ", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be in [0, ", world_size, "), got ", rank));
  }
  if (options.device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.device must be >= 0, got ", options.device));
  }
  SHARDD_RETURN_IF_ERROR(
      CheckPositiveFinite(options.init_timeout, "options.init_timeout"));
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(options.finalize_timeout,
                                             "options.finalize_timeout"));
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(options.watchdog_poll_interval,
                                             "options.watchdog_poll_interval"));
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(options.wait_poll_interval,
                                             "options.wait_poll_interval"));

  if (absl::Status device = CheckCudaDevice(options.device); !device.ok()) {
    // Name the field the caller set (the check itself speaks of devices).
    return absl::Status(device.code(),
                        absl::StrCat("options.device: ", device.message()));
  }
  const absl::Time deadline = absl::Now() + options.init_timeout;
  SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options.device));

  SHARDD_ASSIGN_OR_RETURN(
      const ncclUniqueId id,
      ExchangeNcclUniqueId(kv, prefix, rank, options.init_timeout));

  auto comm =
      absl::WrapUnique(new NcclCommunicator(prefix, rank, world_size, options));
  // Communication first: high-priority streams that do not synchronize
  // with the legacy default stream.
  int least_priority = 0;
  int greatest_priority = 0;
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority),
      "cudaDeviceGetStreamPriorityRange");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&comm->all_gather_stream_,
                                   cudaStreamNonBlocking, greatest_priority),
      "creating the all-gather stream");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&comm->reduce_scatter_stream_,
                                   cudaStreamNonBlocking, greatest_priority),
      "creating the reduce-scatter stream");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&comm->barrier_scratch_, sizeof(int32_t)),
      "cudaMalloc of the barrier scratch");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemset(comm->barrier_scratch_, 0, sizeof(int32_t)),
      "clearing the barrier scratch");

  SHARDD_RETURN_IF_ERROR(comm->Initialize(id, deadline));

  CollectiveWatchdog::Options watchdog_options;
  watchdog_options.name = comm->Name();
  watchdog_options.poll_interval = options.watchdog_poll_interval;
  watchdog_options.wait_poll_interval = options.wait_poll_interval;
  NcclCommunicator* raw = comm.get();
  SHARDD_ASSIGN_OR_RETURN(
      comm->watchdog_,
      CollectiveWatchdog::Create(
          [raw] { return raw->CommHealth(); },
          [raw](const absl::Status& cause) { raw->AbortComm(cause); },
          watchdog_options));
  return comm;
}

absl::Status NcclCommunicator::Initialize(const ncclUniqueId& id,
                                          absl::Time deadline) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Non-blocking: init and every later call return at once (possibly with
  // ncclInProgress), so deadlines are ours to enforce.
  config.blocking = 0;
  config.commName = prefix_.c_str();
  ncclComm_t comm = nullptr;
  const ncclResult_t result =
      ncclCommInitRankConfig(&comm, world_size_, id, rank_, &config);
  {
    absl::WriterMutexLock lock(&comm_mu_);
    comm_ = comm;
  }
  absl::Status status;
  if (result != ncclSuccess && result != ncclInProgress) {
    status =
        NcclStatus(result, absl::StrCat(Name(), ": ncclCommInitRankConfig"));
  } else {
    status = WaitWhileInProgress("NCCL init", deadline);
  }
  if (!status.ok()) {
    absl::WriterMutexLock lock(&comm_mu_);
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      return absl::DeadlineExceededError(
          absl::StrCat(Name(), ": NCCL init did not finish within ",
                       absl::FormatDuration(options_.init_timeout),
                       " (did every rank of the group call Create?)"));
    }
  }
  return status;
}

NcclCommunicator::~NcclCommunicator() {
  // First: the watchdog's probes and abort function use comm_.
  watchdog_.reset();
  const absl::Status device = MakeDeviceCurrent(options_.device);
  if (!device.ok()) SHARDD_LOG(ERROR) << Name() << ": " << device;
  bool has_comm = false;
  ncclResult_t finalize = ncclSuccess;
  {
    absl::ReaderMutexLock lock(&comm_mu_);
    if (comm_ != nullptr) {
      has_comm = true;
      finalize = ncclCommFinalize(comm_);
    }
  }
  if (has_comm) {
    absl::Status status;
    if (finalize != ncclSuccess && finalize != ncclInProgress) {
      status = NcclStatus(finalize, "ncclCommFinalize");
    } else {
      status = WaitWhileInProgress("ncclCommFinalize",
                                   absl::Now() + options_.finalize_timeout);
    }
    absl::WriterMutexLock lock(&comm_mu_);
    if (status.ok()) {
      status = NcclStatus(ncclCommDestroy(comm_), "ncclCommDestroy");
    } else {
      SHARDD_LOG(WARNING) << Name() << ": aborting instead of a clean "
                          << "shutdown: " << status;
      status = NcclStatus(ncclCommAbort(comm_), "ncclCommAbort");
    }
    if (!status.ok()) SHARDD_LOG(ERROR) << Name() << ": " << status;
    comm_ = nullptr;
  }
  // Pending work finishes before the streams' resources go.
  if (all_gather_stream_ != nullptr) cudaStreamDestroy(all_gather_stream_);
  if (reduce_scatter_stream_ != nullptr) {
    cudaStreamDestroy(reduce_scatter_stream_);
  }
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
}

absl::Status NcclCommunicator::WaitWhileInProgress(absl::string_view what,
                                                   absl::Time deadline) {
  while (true) {
    ncclResult_t call = ncclSuccess;
    ncclResult_t state = ncclSuccess;
    std::string detail;
    {
      absl::ReaderMutexLock lock(&comm_mu_);
      if (comm_ == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat(Name(), ": ", what, ": the communicator was aborted"));
      }
      call = ncclCommGetAsyncError(comm_, &state);
      if (call == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        detail = ncclGetLastError(comm_);
      }
    }
    if (call != ncclSuccess) {
      return NcclStatus(
          call, absl::StrCat(Name(), ": ", what, ": ncclCommGetAsyncError"));
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return NcclStatus(state, absl::StrCat(Name(), ": ", what, ": ", detail));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          Name(), ": ", what, " still in progress at its deadline"));
    }
    absl::SleepFor(options_.wait_poll_interval);
  }
}

absl::Status NcclCommunicator::CommHealth() {
  // Runs on the watchdog thread: keep it off device 0's context.
  SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options_.device));
  absl::ReaderMutexLock lock(&comm_mu_);
  if (comm_ == nullptr) return absl::OkStatus();  // Aborted already.
  ncclResult_t state = ncclSuccess;
  const ncclResult_t call = ncclCommGetAsyncError(comm_, &state);
  if (call != ncclSuccess) return NcclStatus(call, "ncclCommGetAsyncError");
  // In progress: a non-blocking call is still being processed; not an error.
  if (state == ncclSuccess || state == ncclInProgress) return absl::OkStatus();
  return NcclStatus(state, absl::StrCat("asynchronous NCCL error: ",
                                        ncclGetLastError(comm_)));
}

void NcclCommunicator::AbortComm(const absl::Status& cause) {
  SHARDD_LOG(ERROR) << Name() << ": aborting the NCCL communicator: " << cause;
  // On the watchdog thread, or a caller's: both work on this device.
  MakeDeviceCurrent(options_.device).IgnoreError();
  absl::WriterMutexLock lock(&comm_mu_);
  if (comm_ == nullptr) return;
  const ncclResult_t result = ncclCommAbort(comm_);
  if (result != ncclSuccess) {
    SHARDD_LOG(ERROR) << Name() << ": " << NcclStatus(result, "ncclCommAbort");
  }
  comm_ = nullptr;
}

absl::Status NcclCommunicator::CheckDeviceBuffer(const void* ptr, int64_t bytes,
                                                 absl::string_view name) const {
  if (bytes == 0) return absl::OkStatus();
  if (ptr == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must not be null when the count is positive"));
  }
  cudaPointerAttributes attributes;
  const cudaError_t error = cudaPointerGetAttributes(&attributes, ptr);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        name, " is not a pointer CUDA knows: ", cudaGetErrorString(error)));
  }
  if (attributes.type == cudaMemoryTypeManaged) return absl::OkStatus();
  if (attributes.type == cudaMemoryTypeDevice &&
      attributes.device == options_.device) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      name, " must be device memory of CUDA device ", options_.device,
      " (NcclCommunicator takes device buffers), got ",
      MemoryTypeName(attributes.type),
      attributes.type == cudaMemoryTypeDevice
          ? absl::StrCat(" of device ", attributes.device)
          : std::string()));
}

absl::StatusOr<NcclWork> NcclCommunicator::Enqueue(
    CollectiveStats CommunicatorStats::*kind, absl::string_view name,
    cudaStream_t stream, int64_t bytes, const NcclWaitFor& wait_for,
    absl::Duration timeout, Launch launch) {
  RecordCall(kind);
  auto fail = [&](absl::Status status) {
    RecordFailure(kind);
    return status;
  };
  const absl::Status device = MakeDeviceCurrent(options_.device);
  if (!device.ok()) return fail(device);

  auto events = std::make_shared<OperationEvents>();
  events->pool = event_pool_;
  events->kind = kind;
  events->bytes = bytes;
  absl::StatusOr<cudaEvent_t> start = event_pool_->Acquire();
  if (!start.ok()) return fail(start.status());
  events->start = *start;
  absl::StatusOr<cudaEvent_t> done = event_pool_->Acquire();
  if (!done.ok()) return fail(done.status());
  events->done = *done;

  // Registered before the enqueue so the deadline covers it, and so an
  // aborted communicator refuses here.
  const absl::Time deadline = absl::Now() + timeout;
  OperationEvents* raw = events.get();
  auto probe = [this, events]() -> absl::StatusOr<bool> {
    if (!events->enqueued.load(std::memory_order_acquire)) return false;
    // Keeps the watchdog thread off device 0's context.
    SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options_.device));
    for (cudaEvent_t event : {events->done, events->other_done}) {
      if (event == nullptr) continue;
      const cudaError_t query = cudaEventQuery(event);
      if (query == cudaErrorNotReady) {
        cudaGetLastError();  // Not an error; keep the thread's state clean.
        return false;
      }
      if (query != cudaSuccess) return CudaStatus(query, "cudaEventQuery");
    }
    if (events->kind != nullptr &&
        !events->completion_recorded.exchange(true)) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, events->start, events->done) !=
          cudaSuccess) {
        cudaGetLastError();
        ms = 0;
      }
      RecordCompletion(events->kind, events->bytes,
                       absl::Nanoseconds(static_cast<int64_t>(ms * 1e6)));
    }
    return true;
  };
  absl::StatusOr<CollectiveWatchdog::OperationId> operation = watchdog_->Begin(
      absl::StrCat(name, " of ", bytes, " bytes"), timeout, std::move(probe));
  if (!operation.ok()) return fail(operation.status());

  bool launched = false;
  absl::Status status;
  {
    absl::MutexLock lock(&enqueue_mu_);
    const int64_t sequence = next_sequence_++;
    const std::string description =
        absl::StrCat(Name(), ": ", name, " #", sequence);
    // Ordering on the device: wait for the producer, then mark the start.
    switch (wait_for.kind_) {
      case NcclWaitFor::Kind::kNothing:
        break;
      case NcclWaitFor::Kind::kEvent:
        if (wait_for.event_ == nullptr) {
          status = absl::InvalidArgumentError(
              "wait_for: NcclWaitFor::Event needs a non-null event");
        } else {
          status = CudaStatus(cudaStreamWaitEvent(stream, wait_for.event_, 0),
                              "wait_for: cudaStreamWaitEvent");
        }
        break;
      case NcclWaitFor::Kind::kStream: {
        absl::StatusOr<cudaEvent_t> marker = event_pool_->Acquire();
        if (!marker.ok()) {
          status = marker.status();
          break;
        }
        status = CudaStatus(cudaEventRecord(*marker, wait_for.stream_),
                            "wait_for: cudaEventRecord on the given stream");
        if (status.ok()) {
          status = CudaStatus(cudaStreamWaitEvent(stream, *marker, 0),
                              "wait_for: cudaStreamWaitEvent");
        }
        // Reusable at once: the wait captured the record.
        event_pool_->Release(*marker);
        break;
      }
    }
    if (status.ok()) {
      status = CudaStatus(cudaEventRecord(raw->start, stream),
                          "cudaEventRecord (start)");
    }
    if (status.ok()) {
      launched = true;
      ncclResult_t result = ncclSuccess;
      std::string detail;
      {
        absl::ReaderMutexLock comm_lock(&comm_mu_);
        if (comm_ == nullptr) {
          status = absl::FailedPreconditionError(absl::StrCat(
              description,
              ": communicator aborted: ", watchdog_->first_error().ToString()));
        } else {
          result = launch(comm_, stream);
          if (result != ncclSuccess && result != ncclInProgress) {
            detail = ncclGetLastError(comm_);
          }
        }
      }
      if (status.ok() && result == ncclInProgress) {
        enqueue_waits_.fetch_add(1);
        status = WaitWhileInProgress(description, deadline);
      } else if (status.ok() && result != ncclSuccess) {
        status = NcclStatus(result, absl::StrCat(description, ": ", detail));
      }
    }
    if (status.ok()) {
      status =
          CudaStatus(cudaEventRecord(raw->done, stream),
                     absl::StrCat(description, ": cudaEventRecord (done)"));
    }
  }
  if (!status.ok()) {
    if (launched) {
      // The collective may be half-enqueued and the peers wait for it: the
      // communicator is unusable.
      watchdog_->Abort(status);
    } else {
      watchdog_->Complete(*operation);
    }
    return fail(status);
  }
  raw->enqueued.store(true, std::memory_order_release);
  NcclWork work;
  work.communicator_ = this;
  work.events_ = std::move(events);
  work.operation_ = *operation;
  return work;
}

absl::Status NcclCommunicator::WaitForWork(NcclWork& work) {
  host_synchronizations_.fetch_add(1);
  const absl::Status status = watchdog_->Wait(work.operation_);
  if (!status.ok() && work.events_->kind != nullptr &&
      !work.events_->failure_recorded.exchange(true)) {
    RecordFailure(work.events_->kind);
  }
  return status;
}

absl::Status NcclCommunicator::RunBlocking(absl::StatusOr<NcclWork> work) {
  if (!work.ok()) return work.status();
  return work->Wait();
}

absl::StatusOr<NcclWork> NcclCommunicator::AllGatherAsync(
    const void* input, void* output, int64_t count_per_rank, v1::DType dtype,
    const NcclWaitFor& wait_for, absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_gather;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.AllGather(input, output, count_per_rank, dtype, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t chunk = checked->chunk;
  return Enqueue(kKind, "AllGather", all_gather_stream_, checked->total,
                 wait_for, timeout, [&](ncclComm_t comm, cudaStream_t stream) {
                   if (chunk == 0) return ncclSuccess;
                   return ncclAllGather(input, output,
                                        static_cast<size_t>(chunk), ncclInt8,
                                        comm, stream);
                 });
}

absl::StatusOr<NcclWork> NcclCommunicator::ReduceScatterAsync(
    const void* input, void* output, int64_t count_per_rank, v1::DType dtype,
    ReduceOp op, const NcclWaitFor& wait_for, absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::reduce_scatter;
  const absl::StatusOr<CollectiveSizes> checked = args_.ReduceScatter(
      input, output, count_per_rank, dtype, op, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  return Enqueue(kKind, "ReduceScatter", reduce_scatter_stream_, total,
                 wait_for, timeout, [&](ncclComm_t comm, cudaStream_t stream) {
                   if (total == 0) return ncclSuccess;
                   return ncclReduceScatter(
                       input, output, static_cast<size_t>(count_per_rank),
                       NcclReduceType(dtype), NcclOp(op), comm, stream);
                 });
}

absl::StatusOr<NcclWork> NcclCommunicator::AllReduceAsync(
    void* inout, int64_t count, v1::DType dtype, ReduceOp op,
    const NcclWaitFor& wait_for, absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_reduce;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.AllReduce(inout, count, dtype, op, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  return Enqueue(kKind, "AllReduce", reduce_scatter_stream_, total, wait_for,
                 timeout, [&](ncclComm_t comm, cudaStream_t stream) {
                   if (total == 0) return ncclSuccess;
                   return ncclAllReduce(
                       inout, inout, static_cast<size_t>(count),
                       NcclReduceType(dtype), NcclOp(op), comm, stream);
                 });
}

absl::StatusOr<NcclWork> NcclCommunicator::BroadcastAsync(
    void* inout, int64_t count, v1::DType dtype, int root,
    const NcclWaitFor& wait_for, absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::broadcast;
  const absl::StatusOr<CollectiveSizes> checked =
      args_.Broadcast(inout, count, dtype, root, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const int64_t total = checked->total;
  return Enqueue(kKind, "Broadcast", all_gather_stream_, total, wait_for,
                 timeout, [&](ncclComm_t comm, cudaStream_t stream) {
                   if (total == 0) return ncclSuccess;
                   return ncclBroadcast(inout, inout,
                                        static_cast<size_t>(total), ncclInt8,
                                        root, comm, stream);
                 });
}

absl::StatusOr<NcclWork> NcclCommunicator::AllToAllVAsync(
    const void* send, const std::vector<int64_t>& send_counts, void* recv,
    const std::vector<int64_t>& recv_counts, v1::DType dtype,
    const NcclWaitFor& wait_for, absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::all_to_all;
  const absl::StatusOr<AllToAllVBytes> checked =
      args_.AllToAllV(send, send_counts, recv, recv_counts, dtype, timeout);
  if (!checked.ok()) return RecordInvalid(kKind, checked.status());
  const AllToAllVBytes bytes = *checked;
  const int64_t element = bytes.element;
  return Enqueue(
      kKind, "AllToAllV", all_gather_stream_, bytes.send, wait_for, timeout,
      [&](ncclComm_t comm, cudaStream_t stream) {
        if (bytes.send == 0 && bytes.recv == 0) return ncclSuccess;
        const char* in = static_cast<const char*>(send);
        char* out = static_cast<char*>(recv);
        ncclResult_t result = ncclGroupStart();
        if (result != ncclSuccess) return result;
        int64_t sent = 0, received = 0;
        for (int peer = 0; peer < world_size_; ++peer) {
          const int64_t s = send_counts[peer] * element;
          const int64_t r = recv_counts[peer] * element;
          if (s > 0 && result == ncclSuccess) {
            result = ncclSend(in + sent, static_cast<size_t>(s), ncclInt8,
                              peer, comm, stream);
          }
          if (r > 0 && result == ncclSuccess) {
            result = ncclRecv(out + received, static_cast<size_t>(r),
                              ncclInt8, peer, comm, stream);
          }
          sent += s;
          received += r;
        }
        // The group is closed whatever happened inside it.
        const ncclResult_t ended = ncclGroupEnd();
        return result != ncclSuccess ? result : ended;
      });
}

absl::Status NcclCommunicator::AllToAllV(
    const void* send, const std::vector<int64_t>& send_counts, void* recv,
    const std::vector<int64_t>& recv_counts, v1::DType dtype,
    absl::Duration timeout) {
  return RunBlocking(AllToAllVAsync(
      send, send_counts, recv, recv_counts, dtype,
      NcclWaitFor::Stream(options_.compute_stream), timeout));
}

absl::Status NcclCommunicator::AllGather(const void* input, void* output,
                                         int64_t count_per_rank,
                                         v1::DType dtype,
                                         absl::Duration timeout) {
  // Host memory (a control message such as expert parallelism's counts):
  // the output is staged, the input copied into its own slot there.
  if (count_per_rank > 0 && DTypeBytes(dtype) > 0 && IsHostMemory(output) &&
      IsHostMemory(input)) {
    const int64_t chunk = count_per_rank * DTypeBytes(dtype);
    std::memcpy(static_cast<char*>(output) + rank_ * chunk, input,
                static_cast<size_t>(chunk));
    return InPlaceOnDevice(
        output, count_per_rank * world_size_, dtype, [&](void* buffer) {
          return RunBlocking(AllGatherAsync(
              static_cast<char*>(buffer) + rank_ * chunk, buffer,
              count_per_rank, dtype,
              NcclWaitFor::Stream(options_.compute_stream), timeout));
        });
  }
  return RunBlocking(
      AllGatherAsync(input, output, count_per_rank, dtype,
                     NcclWaitFor::Stream(options_.compute_stream), timeout));
}

absl::Status NcclCommunicator::ReduceScatter(const void* input, void* output,
                                             int64_t count_per_rank,
                                             v1::DType dtype, ReduceOp op,
                                             absl::Duration timeout) {
  return RunBlocking(ReduceScatterAsync(
      input, output, count_per_rank, dtype, op,
      NcclWaitFor::Stream(options_.compute_stream), timeout));
}

bool NcclCommunicator::IsHostMemory(const void* ptr) {
  if (ptr == nullptr) return false;
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeUnregistered ||
         attributes.type == cudaMemoryTypeHost;
}

absl::Status NcclCommunicator::InPlaceOnDevice(
    void* buffer, int64_t count, v1::DType dtype,
    absl::FunctionRef<absl::Status(void*)> run) {
  const int64_t element = DTypeBytes(dtype);
  // Anything else goes as it is (the argument checks name a bad pointer).
  if (count <= 0 || element <= 0 || !IsHostMemory(buffer)) return run(buffer);
  SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options_.device));
  const size_t bytes = static_cast<size_t>(count * element);
  void* device = nullptr;
  SHARDD_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&device, bytes),
                                    "staging a host buffer on the device"));
  absl::Status status = CudaStatus(
      cudaMemcpy(device, buffer, bytes, cudaMemcpyHostToDevice),
      "staging a host buffer on the device");
  if (status.ok()) status = run(device);
  if (status.ok()) {
    status = CudaStatus(cudaMemcpy(buffer, device, bytes,
                                   cudaMemcpyDeviceToHost),
                        "copying a staged buffer back to the host");
  }
  cudaFree(device);
  return status;
}

absl::Status NcclCommunicator::AllReduce(void* inout, int64_t count,
                                         v1::DType dtype, ReduceOp op,
                                         absl::Duration timeout) {
  return InPlaceOnDevice(inout, count, dtype, [&](void* buffer) {
    return RunBlocking(
        AllReduceAsync(buffer, count, dtype, op,
                       NcclWaitFor::Stream(options_.compute_stream), timeout));
  });
}

absl::Status NcclCommunicator::Broadcast(void* inout, int64_t count,
                                         v1::DType dtype, int root,
                                         absl::Duration timeout) {
  return InPlaceOnDevice(inout, count, dtype, [&](void* buffer) {
    return RunBlocking(
        BroadcastAsync(buffer, count, dtype, root,
                       NcclWaitFor::Stream(options_.compute_stream), timeout));
  });
}

absl::Status NcclCommunicator::Barrier(absl::Duration timeout) {
  constexpr auto kKind = &CommunicatorStats::barrier;
  const absl::Status valid = args_.Barrier(timeout);
  if (!valid.ok()) return RecordInvalid(kKind, valid);
  absl::StatusOr<NcclWork> work =
      Enqueue(kKind, "Barrier", reduce_scatter_stream_, /*bytes=*/0,
              NcclWaitFor::Nothing(), timeout,
              [this](ncclComm_t comm, cudaStream_t stream) {
                return ncclAllReduce(barrier_scratch_, barrier_scratch_, 1,
                                     ncclInt32, ncclSum, comm, stream);
              });
  return RunBlocking(std::move(work));
}

absl::Status NcclCommunicator::Synchronize(absl::Duration timeout) {
  SHARDD_RETURN_IF_ERROR(CheckPositiveFinite(timeout, "timeout"));
  SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options_.device));
  auto events = std::make_shared<OperationEvents>();
  events->pool = event_pool_;
  SHARDD_ASSIGN_OR_RETURN(events->done, event_pool_->Acquire());
  SHARDD_ASSIGN_OR_RETURN(events->other_done, event_pool_->Acquire());
  auto probe = [this, events]() -> absl::StatusOr<bool> {
    if (!events->enqueued.load(std::memory_order_acquire)) return false;
    SHARDD_RETURN_IF_ERROR(MakeDeviceCurrent(options_.device));
    for (cudaEvent_t event : {events->done, events->other_done}) {
      const cudaError_t query = cudaEventQuery(event);
      if (query == cudaErrorNotReady) {
        cudaGetLastError();
        return false;
      }
      if (query != cudaSuccess) return CudaStatus(query, "cudaEventQuery");
    }
    return true;
  };
  SHARDD_ASSIGN_OR_RETURN(
      const CollectiveWatchdog::OperationId operation,
      watchdog_->Begin("Synchronize (both communicator streams)", timeout,
                       std::move(probe)));
  absl::Status status;
  {
    absl::MutexLock lock(&enqueue_mu_);
    status = CudaStatus(cudaEventRecord(events->done, all_gather_stream_),
                        "Synchronize: cudaEventRecord");
    if (status.ok()) {
      status = CudaStatus(
          cudaEventRecord(events->other_done, reduce_scatter_stream_),
          "Synchronize: cudaEventRecord");
    }
  }
  if (!status.ok()) {
    watchdog_->Complete(operation);
    return status;
  }
  events->enqueued.store(true, std::memory_order_release);
  NcclWork work;
  work.communicator_ = this;
  work.events_ = std::move(events);
  work.operation_ = operation;
  return work.Wait();
}

absl::Status NcclCommunicator::RecordInvalid(
    CollectiveStats CommunicatorStats::*kind, absl::Status status) {
  absl::MutexLock lock(&stats_mu_);
  CollectiveStats& s = stats_.*kind;
  ++s.calls;
  ++s.failures;
  return status;
}

void NcclCommunicator::RecordCall(CollectiveStats CommunicatorStats::*kind) {
  absl::MutexLock lock(&stats_mu_);
  ++(stats_.*kind).calls;
}

void NcclCommunicator::RecordFailure(CollectiveStats CommunicatorStats::*kind) {
  absl::MutexLock lock(&stats_mu_);
  ++(stats_.*kind).failures;
}

void NcclCommunicator::RecordCompletion(
    CollectiveStats CommunicatorStats::*kind, int64_t bytes,
    absl::Duration time) {
  absl::MutexLock lock(&stats_mu_);
  CollectiveStats& s = stats_.*kind;
  s.bytes += bytes;
  s.time += time;
}

CommunicatorStats NcclCommunicator::stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

int64_t NcclCommunicator::host_synchronizations() const {
  return host_synchronizations_.load();
}

int64_t NcclCommunicator::enqueue_waits() const {
  return enqueue_waits_.load();
}

absl::Status NcclCommunicator::health() const {
  return watchdog_->first_error();
}

}  // namespace shardd
