#include "server/grpc_coordinator_service.h"

#include <functional>
#include <set>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "server/jobs/job_runner.h"

namespace shardd {
namespace {

// Every unary handler but Get and Barrier is quick (planning a model takes
// milliseconds), so it answers inline on the callback thread.
template <typename Response>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context,
                                absl::StatusOr<Response> result,
                                Response* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (result.ok()) *response = *std::move(result);
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

// Null when `authorizer` lets the call through; else the call's reactor,
// finished with the refusal.
grpc::ServerUnaryReactor* Refused(const Authorizer& authorizer,
                                  grpc::CallbackServerContext* context,
                                  Authorizer::Role role) {
  absl::Status status = authorizer.Check(*context, role);
  if (status.ok()) return nullptr;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

constexpr Authorizer::Role kClientRole = Authorizer::Role::kClient;
constexpr Authorizer::Role kWorkerRole = Authorizer::Role::kWorker;

// A stream that ends at once with a status (WatchStep refused).
class FinishedWriteReactor final
    : public grpc::ServerWriteReactor<v1::StepEvent> {
 public:
  explicit FinishedWriteReactor(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

// Not in an anonymous namespace: GrpcCoordinatorService::WaitingCalls names
// these types.
namespace grpc_coordinator_internal {

// One call that waits for the service. Exactly one of the service's
// completion, the client's cancellation and CancelWaitingCalls finishes it;
// the others find it finished and do nothing.
class WaitingCall : public std::enable_shared_from_this<WaitingCall> {
 public:
  WaitingCall(grpc::ServerUnaryReactor* reactor,
              std::function<void(uint64_t)> cancel_op,
              std::shared_ptr<GrpcCoordinatorService::WaitingCalls> owner,
              std::unique_ptr<RpcLatencyScope> latency = nullptr)
      : reactor_(reactor),
        cancel_op_(std::move(cancel_op)),
        owner_(std::move(owner)),
        latency_(std::move(latency)) {}

  // Finishes with `status` (after `fill` wrote the response when OK) unless
  // the call already finished.
  void Complete(const absl::Status& status, const std::function<void()>& fill);

  // Records the service's handle of the pending wait; withdraws the wait at
  // once if the call finished before the handle was known.
  void SetHandle(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);

  // Finishes with `status` and withdraws the pending wait from the service
  // (client cancelled, or the server stops).
  void Abandon(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // True for the one caller that may finish the call.
  bool Claim(uint64_t* handle) ABSL_LOCKS_EXCLUDED(mu_);
  void FinishClaimed(const absl::Status& status);

  // Valid until Finish; only the claimer touches it.
  grpc::ServerUnaryReactor* const reactor_;
  const std::function<void(uint64_t)> cancel_op_;
  const std::shared_ptr<GrpcCoordinatorService::WaitingCalls> owner_;
  // Records the call's latency when it finishes (only the claimer).
  std::unique_ptr<RpcLatencyScope> latency_;

  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t handle_ ABSL_GUARDED_BY(mu_) = 0;
};

// A reactor for a waiting call; deletes itself when gRPC is done with it.
class WaitingReactor final : public grpc::ServerUnaryReactor {
 public:
  void set_call(std::shared_ptr<WaitingCall> call) { call_ = std::move(call); }
  void OnCancel() override {
    if (call_ != nullptr) {
      call_->Abandon(absl::CancelledError(
          "the call was cancelled (client gone or its deadline passed)"));
    }
  }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<WaitingCall> call_;
};

}  // namespace grpc_coordinator_internal

using grpc_coordinator_internal::WaitingCall;

class GrpcCoordinatorService::WaitingCalls {
 public:
  // Registers a call; false (and nothing registered) once stopping.
  bool Add(const std::shared_ptr<WaitingCall>& call) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    calls_.insert(call);
    return true;
  }
  void Remove(const std::shared_ptr<WaitingCall>& call)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    calls_.erase(call);
  }
  // Sets stopping and returns the calls waiting now.
  std::set<std::shared_ptr<WaitingCall>> Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    return calls_;
  }
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return calls_.size();
  }

 private:
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::shared_ptr<WaitingCall>> calls_ ABSL_GUARDED_BY(mu_);
};

namespace grpc_coordinator_internal {

const absl::Status& ShuttingDown() {
  static const absl::Status* const kStatus = new absl::Status(
      absl::UnavailableError("the coordinator is shutting down"));
  return *kStatus;
}

bool WaitingCall::Claim(uint64_t* handle) {
  absl::MutexLock lock(&mu_);
  if (finished_) return false;
  finished_ = true;
  if (handle != nullptr) *handle = handle_;
  return true;
}

void WaitingCall::FinishClaimed(const absl::Status& status) {
  owner_->Remove(shared_from_this());
  latency_.reset();
  reactor_->Finish(ToGrpcStatus(status));
}

void WaitingCall::Complete(const absl::Status& status,
                           const std::function<void()>& fill) {
  if (!Claim(nullptr)) return;
  if (status.ok() && fill) fill();
  FinishClaimed(status);
}

void WaitingCall::SetHandle(uint64_t handle) {
  {
    absl::MutexLock lock(&mu_);
    if (!finished_) {
      handle_ = handle;
      return;
    }
  }
  if (handle != 0) cancel_op_(handle);
}

void WaitingCall::Abandon(const absl::Status& status) {
  uint64_t handle = 0;
  if (!Claim(&handle)) return;
  // Keeps this object alive past FinishClaimed (which drops the owner's
  // reference and lets the reactor go).
  std::shared_ptr<WaitingCall> self = shared_from_this();
  FinishClaimed(status);
  // The service completes the withdrawn wait with CANCELLED; Complete then
  // finds the call finished.
  if (handle != 0) cancel_op_(handle);
}

// Starts a waiting call: `start` begins the wait with a completion callback
// and returns the service's handle; `cancel` withdraws a handle.
template <typename Response>
grpc::ServerUnaryReactor* StartWaiting(
    const std::shared_ptr<GrpcCoordinatorService::WaitingCalls>& owner,
    Response* response,
    const std::function<
        uint64_t(std::function<void(absl::StatusOr<Response>)>)>& start,
    std::function<void(uint64_t)> cancel,
    std::unique_ptr<RpcLatencyScope> latency = nullptr) {
  auto* reactor = new WaitingReactor();
  auto call = std::make_shared<WaitingCall>(reactor, std::move(cancel), owner,
                                            std::move(latency));
  if (!owner->Add(call)) {
    reactor->Finish(ToGrpcStatus(ShuttingDown()));
    return reactor;
  }
  reactor->set_call(call);
  // `response` lives until the call is done; only the claimer writes it,
  // before Finish.
  const uint64_t handle =
      start([call, response](absl::StatusOr<Response> result) {
        call->Complete(result.status(),
                       [&result, response] { *response = *std::move(result); });
      });
  call->SetHandle(handle);
  return reactor;
}

// One WatchStep stream: sends the job's events from its position, then
// waits for new ones without holding any thread (the job's thread wakes it
// through the log's listener), and finishes when the log ends. At most one
// write is in flight; Finish is called once, never during a write, so the
// reactor (deleted in OnDone, after Finish) is never touched after it.
class WatchStream final : public JobEventLog::Listener {
 public:
  WatchStream(grpc::ServerWriteReactor<v1::StepEvent>* reactor,
              std::shared_ptr<JobEventLog> log, int64_t index)
      : reactor_(reactor), log_(std::move(log)), index_(index) {}

  // Writes the next event, finishes, or waits for the log to call back.
  void Pump() ABSL_LOCKS_EXCLUDED(mu_) {
    bool write = false;
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || writing_) return;
      if (cancelled_) {
        finish = grpc::Status(grpc::StatusCode::CANCELLED,
                              "the watch was cancelled");
      } else {
        switch (log_->Read(&index_, &event_)) {
          case JobEventLog::ReadResult::kEvent:
            write = true;
            break;
          case JobEventLog::ReadResult::kEnded:
            break;  // OK: the job's last event was sent.
          case JobEventLog::ReadResult::kWait:
            if (!stopping_) return;
            finish = ToGrpcStatus(ShuttingDown());
            break;
        }
      }
      if (write) {
        writing_ = true;
      } else {
        finished_ = true;
      }
    }
    // event_ is not changed while writing_ is set.
    if (write) {
      reactor_->StartWrite(&event_);
    } else {
      reactor_->Finish(finish);
    }
  }

  void OnWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ok) {
        ++index_;
      } else {
        cancelled_ = true;  // The stream broke (client gone).
      }
    }
    Pump();
  }

  void Cancel() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    Pump();
  }

  // The server stops: send what is stored, then end with UNAVAILABLE
  // instead of waiting for more.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    Pump();
  }

  void OnEventsAvailable() override { Pump(); }

 private:
  grpc::ServerWriteReactor<v1::StepEvent>* const reactor_;
  const std::shared_ptr<JobEventLog> log_;

  absl::Mutex mu_;
  int64_t index_ ABSL_GUARDED_BY(mu_);
  v1::StepEvent event_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace grpc_coordinator_internal

using grpc_coordinator_internal::WatchStream;

// The open WatchStep streams, so that a shutdown can end them.
class GrpcCoordinatorService::WatchStreams {
 public:
  // Registers a stream; false (nothing registered) once stopping.
  bool Add(const std::shared_ptr<WatchStream>& stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    streams_.insert(stream);
    return true;
  }
  void Remove(const std::shared_ptr<WatchStream>& stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    streams_.erase(stream);
  }
  std::set<std::shared_ptr<WatchStream>> Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    return streams_;
  }
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return streams_.size();
  }

 private:
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::shared_ptr<WatchStream>> streams_ ABSL_GUARDED_BY(mu_);
};

namespace grpc_coordinator_internal {

// The reactor of a WatchStep call; deletes itself when gRPC is done with it.
class WatchReactor final : public grpc::ServerWriteReactor<v1::StepEvent> {
 public:
  explicit WatchReactor(
      std::shared_ptr<GrpcCoordinatorService::WatchStreams> owner)
      : owner_(std::move(owner)) {}
  void set_stream(std::shared_ptr<WatchStream> stream) {
    stream_ = std::move(stream);
  }
  void OnWriteDone(bool ok) override { stream_->OnWriteDone(ok); }
  void OnCancel() override { stream_->Cancel(); }
  void OnDone() override {
    owner_->Remove(stream_);
    delete this;
  }

 private:
  const std::shared_ptr<GrpcCoordinatorService::WatchStreams> owner_;
  std::shared_ptr<WatchStream> stream_;
};

}  // namespace grpc_coordinator_internal

using grpc_coordinator_internal::ShuttingDown;
using grpc_coordinator_internal::StartWaiting;
using grpc_coordinator_internal::WatchReactor;

GrpcCoordinatorService::GrpcCoordinatorService(CoordinatorService* service,
                                               Authorizer authorizer,
                                               RpcLatencies* latencies)
    : service_(service),
      authorizer_(std::move(authorizer)),
      latencies_(latencies),
      waiting_(std::make_shared<WaitingCalls>()),
      watches_(std::make_shared<WatchStreams>()) {}

GrpcCoordinatorService::~GrpcCoordinatorService() { CancelWaitingCalls(); }

void GrpcCoordinatorService::CancelWaitingCalls() {
  for (const std::shared_ptr<WaitingCall>& call : waiting_->Stop()) {
    call->Abandon(ShuttingDown());
  }
  for (const std::shared_ptr<WatchStream>& stream : watches_->Stop()) {
    stream->Stop();
  }
}

size_t GrpcCoordinatorService::watch_streams() const {
  return watches_->size();
}

size_t GrpcCoordinatorService::waiting_calls() const {
  return waiting_->size();
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::ListStrategies(
    grpc::CallbackServerContext* context,
    const v1::ListStrategiesRequest* request,
    v1::ListStrategiesResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->ListStrategies(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SubmitModel(
    grpc::CallbackServerContext* context, const v1::SubmitModelRequest* request,
    v1::SubmitModelResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kSubmitModel);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->SubmitModel(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::GetPlan(
    grpc::CallbackServerContext* context, const v1::GetPlanRequest* request,
    v1::GetPlanResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kGetPlan);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->GetPlan(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::RegisterWorker(
    grpc::CallbackServerContext* context,
    const v1::RegisterWorkerRequest* request,
    v1::RegisterWorkerResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kRegisterWorker);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  return Reply(context, service_->RegisterWorker(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Heartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kHeartbeat);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  return Reply(context, service_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Put(
    grpc::CallbackServerContext* context, const v1::PutRequest* request,
    v1::PutResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kPut);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  return Reply(context, service_->Put(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Get(
    grpc::CallbackServerContext* context, const v1::GetRequest* request,
    v1::GetResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  CoordinatorService* service = service_;
  return StartWaiting<v1::GetResponse>(
      waiting_, response,
      [service, request](CoordinatorService::GetCallback done) {
        return service->GetAsync(*request, std::move(done));
      },
      [service](uint64_t handle) { service->CancelGet(handle); },
      std::make_unique<RpcLatencyScope>(latencies_, RpcLatencies::kGet));
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Delete(
    grpc::CallbackServerContext* context, const v1::DeleteRequest* request,
    v1::DeleteResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kDelete);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  return Reply(context, service_->Delete(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::Barrier(
    grpc::CallbackServerContext* context, const v1::BarrierRequest* request,
    v1::BarrierResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kWorkerRole)) {
    return refused;
  }
  CoordinatorService* service = service_;
  return StartWaiting<v1::BarrierResponse>(
      waiting_, response,
      [service, request](CoordinatorService::BarrierCallback done) {
        return service->BarrierAsync(*request, std::move(done));
      },
      [service](uint64_t handle) { service->CancelBarrier(handle); },
      std::make_unique<RpcLatencyScope>(latencies_, RpcLatencies::kBarrier));
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SubmitStep(
    grpc::CallbackServerContext* context, const v1::SubmitStepRequest* request,
    v1::SubmitStepResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kSubmitStep);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->SubmitStep(*request), response);
}

grpc::ServerWriteReactor<v1::StepEvent>* GrpcCoordinatorService::WatchStep(
    grpc::CallbackServerContext* context, const v1::WatchStepRequest* request) {
  if (absl::Status status = authorizer_.Check(*context, kClientRole);
      !status.ok()) {
    return new FinishedWriteReactor(ToGrpcStatus(status));
  }
  absl::StatusOr<StepWatch> watch = service_->WatchStep(*request);
  if (!watch.ok())
    return new FinishedWriteReactor(ToGrpcStatus(watch.status()));
  auto* reactor = new WatchReactor(watches_);
  auto stream =
      std::make_shared<WatchStream>(reactor, watch->log, watch->start_index);
  reactor->set_stream(stream);
  if (!watches_->Add(stream)) {
    // Shutting down: finish through the stream, which owns Finish.
    stream->Stop();
    return reactor;
  }
  // Listen before the first read, so no event falls in between.
  watch->log->AddListener(stream);
  stream->Pump();
  return reactor;
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::SaveCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::SaveCheckpointRequest* request,
    v1::SaveCheckpointResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  CoordinatorService* service = service_;
  return StartWaiting<v1::SaveCheckpointResponse>(
      waiting_, response,
      [service, request](CoordinatorService::SaveCheckpointCallback done) {
        service->SaveCheckpointAsync(*request, std::move(done));
        return uint64_t{0};  // Served by the job; nothing to withdraw.
      },
      [](uint64_t) {});
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::LoadCheckpoint(
    grpc::CallbackServerContext* context,
    const v1::LoadCheckpointRequest* request,
    v1::LoadCheckpointResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  CoordinatorService* service = service_;
  return StartWaiting<v1::LoadCheckpointResponse>(
      waiting_, response,
      [service, request](CoordinatorService::LoadCheckpointCallback done) {
        service->LoadCheckpointAsync(*request, std::move(done));
        return uint64_t{0};  // Served by the job; nothing to withdraw.
      },
      [](uint64_t) {});
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::ListCheckpoints(
    grpc::CallbackServerContext* context,
    const v1::ListCheckpointsRequest* request,
    v1::ListCheckpointsResponse* response) {
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->ListCheckpoints(*request), response);
}

grpc::ServerUnaryReactor* GrpcCoordinatorService::GetStatus(
    grpc::CallbackServerContext* context, const v1::GetStatusRequest* request,
    v1::GetStatusResponse* response) {
  RpcLatencyScope latency(latencies_, RpcLatencies::kGetStatus);
  if (grpc::ServerUnaryReactor* refused =
          Refused(authorizer_, context, kClientRole)) {
    return refused;
  }
  return Reply(context, service_->GetStatus(*request), response);
}

}  // namespace shardd
