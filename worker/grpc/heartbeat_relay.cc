#include "worker/grpc/heartbeat_relay.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardd {

HeartbeatRelay::HeartbeatRelay(HeartbeatRelayOptions options)
    : options_(std::move(options)), stale_after_(options_.stale_after) {}

void HeartbeatRelay::set_stale_after(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  stale_after_ = d;
}

absl::Time HeartbeatRelay::Now() const {
  return options_.clock ? options_.clock() : absl::Now();
}

absl::StatusOr<v1::HeartbeatResponse> HeartbeatRelay::Record(
    const v1::HeartbeatRequest& beat) {
  if (beat.rank() < 0 || beat.incarnation() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank, incarnation: a relayed heartbeat needs rank >= 0 and a "
        "non-zero incarnation, got rank ",
        beat.rank(), " incarnation ", beat.incarnation()));
  }
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  if (now - last_at_ > stale_after_) {
    return absl::UnavailableError(
        "this worker has no recent answer from the coordinator to relay; "
        "heartbeat the coordinator directly");
  }
  auto error = errors_.find(beat.rank());
  if (error != errors_.end() && error->second.first == beat.incarnation()) {
    // Said once: the caller registers again, and its next beat is new.
    absl::Status status = std::move(error->second.second);
    errors_.erase(error);
    return status;
  }
  if (pending_.count(beat.rank()) == 0 &&
      static_cast<int>(pending_.size()) >= options_.max_pending) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this worker already relays for ", options_.max_pending,
                     " workers; heartbeat the coordinator directly"));
  }
  pending_[beat.rank()] = beat.incarnation();
  v1::HeartbeatResponse response;
  response.set_coordinator_incarnation(last_.coordinator_incarnation());
  response.set_membership_epoch(last_.membership_epoch());
  return response;
}

std::vector<v1::RelayedHeartbeat> HeartbeatRelay::TakePending() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::RelayedHeartbeat> taken;
  taken.reserve(pending_.size());
  for (const auto& [rank, incarnation] : pending_) {
    v1::RelayedHeartbeat& beat = taken.emplace_back();
    beat.set_rank(rank);
    beat.set_incarnation(incarnation);
  }
  in_flight_ = std::move(pending_);
  pending_.clear();
  return taken;
}

void HeartbeatRelay::Delivered(const v1::HeartbeatResponse& response) {
  absl::MutexLock lock(&mu_);
  last_ = response;
  last_.clear_relayed_errors();
  last_at_ = Now();
  relayed_ += static_cast<int64_t>(in_flight_.size());
  errors_.clear();
  for (const v1::RelayedHeartbeatError& e : response.relayed_errors()) {
    auto it = in_flight_.find(e.rank());
    if (it == in_flight_.end()) continue;
    errors_[e.rank()] = {
        it->second,
        absl::Status(static_cast<absl::StatusCode>(e.code()), e.message())};
  }
  in_flight_.clear();
}

void HeartbeatRelay::Failed() {
  absl::MutexLock lock(&mu_);
  last_at_ = absl::InfinitePast();
  // The beats it carried are lost: their workers are told UNAVAILABLE on
  // their next beat and send it to the coordinator directly.
  in_flight_.clear();
}

int64_t HeartbeatRelay::relayed() {
  absl::MutexLock lock(&mu_);
  return relayed_;
}

}  // namespace shardd
