#include "worker/grpc/coordinator_agent.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace shardd {
namespace {

// Longest wait passed to the coordinator (it caps waits at an hour).
constexpr absl::Duration kMaxWait = absl::Hours(24);
// Shortest heartbeat period, whatever the coordinator says.
constexpr absl::Duration kMinHeartbeatInterval = absl::Milliseconds(10);
// Message size for KV values (the coordinator accepts 16 MiB values).
constexpr int kMaxMessageBytes = 64 << 20;

uint64_t RandomIncarnation() {
  std::random_device device;
  uint64_t value = 0;
  while (value == 0) {
    value = (static_cast<uint64_t>(device()) << 32) ^ device() ^
            static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  }
  return value;
}

std::string Hostname() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "";
  return buffer;
}

// Milliseconds for a wait field: rounded up, at least 1, at most kMaxWait.
int64_t WaitMs(absl::Duration d) {
  d = std::min(d, kMaxWait);
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(absl::ToDoubleMilliseconds(d))));
}

// Errors that retrying the same registration cannot fix.
bool Permanent(absl::StatusCode code) {
  switch (code) {
    // RESOURCE_EXHAUSTED (every rank held by a live worker) is not here: a
    // replacement started right after a worker died waits for the
    // coordinator to notice the death and free the rank.
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

}  // namespace

// A client context registered with the agent for the duration of one call,
// so that Stop can cancel it.
class CoordinatorAgent::CallScope {
 public:
  CallScope(CoordinatorAgent* agent, absl::Duration timeout,
            bool wait_for_ready)
      : agent_(agent) {
    context_.set_deadline(
        absl::ToChronoTime(absl::Now() + std::min(timeout, 2 * kMaxWait)));
    context_.set_wait_for_ready(wait_for_ready);
    absl::MutexLock lock(&agent_->mu_);
    if (agent_->stopped_) {
      status_ = absl::FailedPreconditionError(
          "coordinator agent: stopped; no more coordinator calls");
      return;
    }
    agent_->calls_.insert(&context_);
  }
  ~CallScope() {
    absl::MutexLock lock(&agent_->mu_);
    agent_->calls_.erase(&context_);
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  const absl::Status& status() const { return status_; }
  grpc::ClientContext* context() { return &context_; }

 private:
  CoordinatorAgent* const agent_;
  grpc::ClientContext context_;
  absl::Status status_;
};

CoordinatorAgent::CoordinatorAgent(CoordinatorAgentOptions options,
                                   std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      incarnation_(options_.incarnation != 0 ? options_.incarnation
                                             : RandomIncarnation()),
      channel_(std::move(channel)),
      stub_(v1::Coordinator::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<CoordinatorAgent>> CoordinatorAgent::Start(
    CoordinatorAgentOptions options) {
  if (options.coordinator.empty()) {
    return absl::InvalidArgumentError(
        "coordinator: required (host:port of the coordinator)");
  }
  if (options.address.empty()) {
    return absl::InvalidArgumentError(
        "address: required (host:port of this worker's Worker service)");
  }
  if (options.hostname.empty()) options.hostname = Hostname();
  if (options.initial_backoff <= absl::ZeroDuration()) {
    options.initial_backoff = absl::Milliseconds(1);
  }
  options.max_backoff = std::max(options.max_backoff, options.initial_backoff);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly after a coordinator restart (gRPC's defaults back off
  // up to two minutes, longer than a heartbeat timeout).
  const int max_backoff_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(options.max_backoff), 100, 10000));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              std::min(100, max_backoff_ms));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(100, max_backoff_ms));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      CreateSecureChannel(options.coordinator, options.security, args);
  if (!channel.ok()) return channel.status();

  const absl::Time give_up = absl::Now() + options.connect_timeout;
  std::unique_ptr<CoordinatorAgent> agent(
      new CoordinatorAgent(std::move(options), *std::move(channel)));
  if (absl::Status status = agent->RegisterUntil(give_up); !status.ok()) {
    return status;
  }
  {
    absl::MutexLock lock(&agent->join_mu_);
    agent->heartbeat_thread_ =
        std::thread([raw = agent.get()] { raw->HeartbeatLoop(); });
  }
  return agent;
}

CoordinatorAgent::~CoordinatorAgent() { Stop(); }

void CoordinatorAgent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      stopped_ = true;
      for (grpc::ClientContext* context : calls_) context->TryCancel();
    }
  }
  absl::MutexLock lock(&join_mu_);
  // From on_reregistered (the heartbeat thread itself) the loop just ends.
  if (heartbeat_thread_.joinable() &&
      heartbeat_thread_.get_id() != std::this_thread::get_id()) {
    heartbeat_thread_.join();
  }
  // No beat of this worker carries its relay's pending beats any more: turn
  // the group's members away now, so they beat the coordinator directly
  // within one interval instead of losing beats until the relay goes stale
  // (with a skipped delivery that can take longer than the timeout).
  if (options_.relay != nullptr) options_.relay->Failed();
}

AgentRegistration CoordinatorAgent::registration() const {
  absl::MutexLock lock(&mu_);
  return registration_;
}

int CoordinatorAgent::registrations() const {
  absl::MutexLock lock(&mu_);
  return registrations_;
}

absl::StatusOr<AgentRegistration> CoordinatorAgent::RegisterOnce(
    int requested_rank, absl::Duration timeout) {
  v1::RegisterWorkerRequest request;
  request.set_address(options_.address);
  request.set_incarnation(incarnation_);
  request.set_device(options_.device);
  request.set_hostname(options_.hostname);
  request.set_requested_rank(requested_rank);
  request.set_insecure(options_.insecure);
  v1::RegisterWorkerResponse response;
  CallScope call(this, timeout, /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  const grpc::Status status =
      stub_->RegisterWorker(call.context(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  AgentRegistration registration;
  registration.rank = response.rank();
  registration.world_size = response.world_size();
  registration.coordinator_incarnation = response.coordinator_incarnation();
  registration.membership_epoch = response.membership_epoch();
  registration.heartbeat_interval =
      std::max(kMinHeartbeatInterval,
               absl::Milliseconds(response.heartbeat_interval_ms()));
  return registration;
}

absl::Status CoordinatorAgent::RegisterUntil(absl::Time give_up) {
  absl::Duration backoff = options_.initial_backoff;
  absl::Status last = absl::UnavailableError("no attempt made");
  while (true) {
    const absl::Duration remaining = give_up - absl::Now();
    if (remaining <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "could not register with the coordinator at ", options_.coordinator,
          " within ", absl::FormatDuration(options_.connect_timeout),
          " (last error: ", last.ToString(), ")"));
    }
    absl::StatusOr<AgentRegistration> registered = RegisterOnce(
        options_.requested_rank, std::min(remaining, options_.rpc_timeout));
    if (registered.ok()) {
      absl::MutexLock lock(&mu_);
      registration_ = *registered;
      ++registrations_;
      SHARDD_LOG(INFO) << "registered with coordinator " << options_.coordinator
                       << " as rank " << registered->rank << " (incarnation "
                       << incarnation_ << ", heartbeat every "
                       << absl::FormatDuration(registered->heartbeat_interval)
                       << ")";
      return absl::OkStatus();
    }
    last = registered.status();
    if (Permanent(last.code())) {
      return absl::Status(
          last.code(),
          absl::StrCat("the coordinator at ", options_.coordinator,
                       " refused the registration: ", last.message()));
    }
    absl::SleepFor(std::min(backoff, give_up - absl::Now()));
    backoff = std::min(2 * backoff, options_.max_backoff);
  }
}

bool CoordinatorAgent::Stopped() const {
  absl::MutexLock lock(&mu_);
  return stopped_;
}

bool CoordinatorAgent::SleepUnlessStopped(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&stopped_), d);
  return !stopped_;
}

void CoordinatorAgent::HeartbeatLoop() {
  int failures = 0;
  while (SleepUnlessStopped(registration().heartbeat_interval)) {
    const AgentRegistration current = registration();
    v1::HeartbeatResponse response;
    absl::Status status = absl::UnavailableError("no relay");
    bool relayed = false;
    if (relay_stub_ != nullptr) {
      status = BeatThroughRelay(current, &response);
      if (Stopped()) return;
      // The relay's word on this worker (OK, or the coordinator's refusal)
      // stands; anything else means it cannot relay now: beat the
      // coordinator at once, and ignore relays for a while.
      relayed = RelayAnswered(status.code());
      if (!relayed) {
        SHARDD_LOG(WARNING)
            << "heartbeat through relay " << relay_address_ << " failed ("
            << status << "); heartbeating the coordinator directly";
        relay_stub_.reset();
        relay_address_.clear();
        relay_retry_at_ = absl::Now() + 10 * current.heartbeat_interval;
      }
    }
    if (!relayed) status = BeatCoordinator(current, &response);
    // Stop cancelled the call: not a failed heartbeat.
    if (Stopped()) return;
    if (status.ok()) {
      failures = 0;
      if (response.coordinator_incarnation() !=
          current.coordinator_incarnation) {
        Reregister(absl::AbortedError(
            "the coordinator's incarnation changed (it restarted)"));
        continue;
      }
      absl::MutexLock lock(&mu_);
      registration_.membership_epoch = response.membership_epoch();
      continue;
    }
    heartbeat_failures_.fetch_add(1);
    if (status.code() == absl::StatusCode::kAborted ||
        status.code() == absl::StatusCode::kNotFound) {
      failures = 0;
      Reregister(status);
      continue;
    }
    // Unreachable coordinator: keep trying at the same period; it may come
    // back (then it answers NOT_FOUND and this worker registers again).
    if (failures++ % 50 == 0) {
      SHARDD_LOG(WARNING) << "heartbeat to coordinator " << options_.coordinator
                          << " failed: " << status;
    }
  }
}

absl::Status CoordinatorAgent::BeatCoordinator(
    const AgentRegistration& current, v1::HeartbeatResponse* response) {
  HeartbeatRelay* relay = options_.relay;
  v1::HeartbeatRequest request;
  request.set_rank(current.rank);
  request.set_incarnation(incarnation_);
  if (relay != nullptr) {
    // This worker hears from the coordinator every interval.
    relay->set_stale_after(current.heartbeat_interval * kRelayStaleIntervals);
    for (v1::RelayedHeartbeat& beat : relay->TakePending()) {
      *request.add_relayed() = std::move(beat);
    }
  }
  // A heartbeat that takes longer than two periods is as good as lost.
  CallScope call(this,
                 std::min(options_.rpc_timeout, 2 * current.heartbeat_interval),
                 /*wait_for_ready=*/false);
  absl::Status status = call.status();
  if (status.ok()) {
    status =
        FromGrpcStatus(stub_->Heartbeat(call.context(), request, response));
  }
  if (relay != nullptr) {
    if (status.ok()) {
      relay->Delivered(*response);
    } else {
      relay->Failed();
    }
  }
  if (status.ok()) FollowRelay(*response, current.heartbeat_interval);
  return status;
}

absl::Status CoordinatorAgent::BeatThroughRelay(
    const AgentRegistration& current, v1::HeartbeatResponse* response) {
  v1::HeartbeatRequest request;
  request.set_rank(current.rank);
  request.set_incarnation(incarnation_);
  // Short: a relay that does not answer quickly leaves time for the direct
  // beat in the same period.
  CallScope call(this,
                 std::min(options_.rpc_timeout,
                          current.heartbeat_interval * kRelayCallIntervals),
                 /*wait_for_ready=*/false);
  if (!call.status().ok()) return call.status();
  return FromGrpcStatus(
      relay_stub_->RelayHeartbeat(call.context(), request, response));
}

void CoordinatorAgent::FollowRelay(const v1::HeartbeatResponse& response,
                                   absl::Duration interval) {
  const std::string& address = response.relay_address();
  if (address.empty() || absl::Now() < relay_retry_at_) {
    relay_stub_.reset();
    relay_address_.clear();
    return;
  }
  if (address == relay_address_ && relay_stub_ != nullptr) return;
  grpc::ChannelArguments args;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      CreateSecureChannel(address, options_.security, args);
  if (!channel.ok()) {
    SHARDD_LOG(WARNING) << "cannot dial heartbeat relay " << address << ": "
                        << channel.status();
    relay_retry_at_ = absl::Now() + 10 * interval;
    return;
  }
  relay_address_ = address;
  relay_stub_ = v1::Worker::NewStub(*channel);
  SHARDD_LOG(INFO) << "heartbeating through relay rank "
                   << response.relay_rank() << " at " << address;
}

void CoordinatorAgent::Reregister(const absl::Status& why) {
  SHARDD_LOG(WARNING) << "coordinator " << options_.coordinator
                      << " no longer knows this worker (" << why
                      << "); registering again";
  absl::Duration backoff = options_.initial_backoff;
  int requested = registration().rank;
  int attempts = 0;
  while (true) {
    absl::StatusOr<AgentRegistration> registered =
        RegisterOnce(requested, options_.rpc_timeout);
    if (registered.ok()) {
      {
        absl::MutexLock lock(&mu_);
        registration_ = *registered;
        ++registrations_;
      }
      SHARDD_LOG(INFO) << "registered again with coordinator "
                       << options_.coordinator << " as rank "
                       << registered->rank;
      if (options_.on_reregistered) options_.on_reregistered(*registered);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
    }
    // The old rank may be out of range for a coordinator with a smaller
    // --workers: ask for any rank next time.
    if (registered.status().code() == absl::StatusCode::kInvalidArgument) {
      requested = -1;
    }
    if (attempts++ % 20 == 0) {
      SHARDD_LOG(WARNING) << "registering again with coordinator "
                          << options_.coordinator
                          << " failed: " << registered.status();
    }
    if (!SleepUnlessStopped(backoff)) return;
    backoff = std::min(2 * backoff, options_.max_backoff);
  }
}

absl::Status CoordinatorAgent::Set(const std::string& key,
                                   const std::string& value) {
  v1::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_overwrite(true);
  v1::PutResponse response;
  CallScope call(this, options_.rpc_timeout, /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  return FromGrpcStatus(stub_->Put(call.context(), request, &response));
}

absl::Status CoordinatorAgent::Add(const std::string& key,
                                   const std::string& value) {
  v1::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_overwrite(false);
  v1::PutResponse response;
  CallScope call(this, options_.rpc_timeout, /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  return FromGrpcStatus(stub_->Put(call.context(), request, &response));
}

absl::StatusOr<std::string> CoordinatorAgent::Get(const std::string& key,
                                                  absl::Duration timeout) {
  v1::GetRequest request;
  request.set_key(key);
  request.set_wait_ms(WaitMs(timeout));
  v1::GetResponse response;
  CallScope call(this,
                 absl::Milliseconds(request.wait_ms()) + options_.wait_margin,
                 /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  const grpc::Status status = stub_->Get(call.context(), request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::move(*response.mutable_value());
}

absl::Status CoordinatorAgent::Delete(const std::string& key, bool prefix) {
  v1::DeleteRequest request;
  request.set_key(key);
  request.set_prefix(prefix);
  v1::DeleteResponse response;
  CallScope call(this, options_.rpc_timeout, /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  return FromGrpcStatus(stub_->Delete(call.context(), request, &response));
}

absl::Status CoordinatorAgent::Barrier(const std::string& id, int participants,
                                       absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout: must be > 0, got ", absl::FormatDuration(timeout)));
  }
  v1::BarrierRequest request;
  request.set_barrier_id(id);
  request.set_participants(participants);
  request.set_caller(options_.address);
  request.set_timeout_ms(WaitMs(timeout));
  v1::BarrierResponse response;
  CallScope call(
      this, absl::Milliseconds(request.timeout_ms()) + options_.wait_margin,
      /*wait_for_ready=*/true);
  if (!call.status().ok()) return call.status();
  return FromGrpcStatus(stub_->Barrier(call.context(), request, &response));
}

}  // namespace shardd
