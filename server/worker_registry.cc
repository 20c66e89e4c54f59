#include "server/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace shardd {
namespace {

// At most this many dead workers are described in detail in an error.
constexpr int kDeadDetails = 3;

std::string Age(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(1)));
}

}  // namespace

std::string FormatRankList(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(ranks[i])
                           : absl::StrCat(ranks[i], "-", ranks[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ", ");
}

WorkerRegistry::WorkerRegistry(WorkerRegistryOptions options)
    : options_([&options] {
        if (!options.clock) options.clock = [] { return absl::Now(); };
        return std::move(options);
      }()),
      epoch_(options_.initial_epoch) {}

int WorkerRegistry::RankLimit() const {
  return options_.max_workers > 0
             ? std::min(options_.max_workers, kMaxWorkersHardLimit)
             : kMaxWorkersHardLimit;
}

void WorkerRegistry::SweepLocked(absl::Time now) {
  while (!deadlines_.empty() &&
         now - deadlines_.begin()->first >= options_.heartbeat_timeout) {
    const int rank = deadlines_.begin()->second;
    deadlines_.erase(deadlines_.begin());
    WorkerState& worker = workers_.at(rank);
    worker.alive = false;
    ++epoch_;
    ++declared_dead_;
    SHARDD_LOG(WARNING) << "worker rank " << rank << " at " << worker.address
                        << " declared dead: no heartbeat for "
                        << Age(now - worker.last_heartbeat) << " (timeout "
                        << Age(options_.heartbeat_timeout)
                        << "), membership epoch " << epoch_;
  }
}

void WorkerRegistry::SetLivenessLocked(int rank, WorkerState* worker,
                                       bool alive, absl::Time last_heartbeat) {
  if (worker->alive) deadlines_.erase({worker->last_heartbeat, rank});
  worker->alive = alive;
  worker->last_heartbeat = last_heartbeat;
  if (alive) deadlines_.insert({last_heartbeat, rank});
}

bool WorkerRegistry::RankFreeLocked(int rank) const {
  auto it = workers_.find(rank);
  return it == workers_.end() || !it->second.alive;
}

int WorkerRegistry::PickRankLocked(int requested) const {
  if (requested >= 0 && RankFreeLocked(requested)) return requested;
  // The first rank not in the map, or the first dead one, whichever is
  // lower.
  int expected = 0;
  for (const auto& [rank, worker] : workers_) {
    if (rank != expected) break;  // `expected` is unoccupied.
    if (!worker.alive) return rank;
    ++expected;
  }
  if (expected < RankLimit()) return expected;
  return -1;
}

int WorkerRegistry::LiveWorkersLocked() const {
  return static_cast<int>(deadlines_.size());
}

void WorkerRegistry::EraseLocked(int rank) {
  auto it = workers_.find(rank);
  if (it == workers_.end()) return;
  if (it->second.alive) deadlines_.erase({it->second.last_heartbeat, rank});
  rank_of_address_.erase(it->second.address);
  workers_.erase(it);
}

absl::StatusOr<RegisterResult> WorkerRegistry::Register(
    const WorkerRegistration& worker) {
  if (worker.address.empty()) {
    return absl::InvalidArgumentError(
        "address: required (host:port of the worker's Worker service)");
  }
  if (worker.address.size() > kMaxFieldBytes ||
      worker.device.size() > kMaxFieldBytes ||
      worker.hostname.size() > kMaxFieldBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address, device, hostname: at most ", kMaxFieldBytes, " bytes each"));
  }
  if (worker.incarnation == 0) {
    return absl::InvalidArgumentError(
        "incarnation: required (a random non-zero id chosen at worker start)");
  }
  if (worker.requested_rank < -1 || worker.requested_rank >= RankLimit()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "requested_rank: ", worker.requested_rank,
        " is out of range; expected -1 (any) or 0..", RankLimit() - 1,
        options_.max_workers > 0 ? " (the coordinator's --workers)" : ""));
  }

  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  SweepLocked(now);

  RegisterResult result;
  auto known = rank_of_address_.find(worker.address);
  if (known != rank_of_address_.end()) {
    WorkerState& existing = workers_.at(known->second);
    if (existing.incarnation == worker.incarnation) {
      // A retried registration; revive it if it had been declared dead.
      result.retry = existing.alive;
      if (!existing.alive) ++epoch_;
    } else {
      // The process at this address restarted: same rank, new incarnation.
      existing.incarnation = worker.incarnation;
      existing.registered_at = now;
      ++epoch_;
    }
    existing.device = worker.device;
    existing.hostname = worker.hostname;
    existing.insecure = worker.insecure;
    SetLivenessLocked(known->second, &existing, /*alive=*/true, now);
    result.rank = existing.rank;
  } else {
    const int rank = PickRankLocked(worker.requested_rank);
    if (rank < 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "workers: all ", RankLimit(), " ranks are held by live workers",
          options_.max_workers > 0 ? " (the coordinator's --workers limit)"
                                   : ""));
    }
    // A dead worker's rank is taken over by the newcomer.
    EraseLocked(rank);
    WorkerState state;
    state.rank = rank;
    state.address = worker.address;
    state.incarnation = worker.incarnation;
    state.device = worker.device;
    state.hostname = worker.hostname;
    state.insecure = worker.insecure;
    state.registered_at = now;
    state.last_heartbeat = now;
    state.alive = true;
    workers_.emplace(rank, std::move(state));
    deadlines_.insert({now, rank});
    rank_of_address_.emplace(worker.address, rank);
    ++epoch_;
    result.rank = rank;
  }
  result.world_size =
      options_.max_workers > 0 ? options_.max_workers : LiveWorkersLocked();
  result.membership_epoch = epoch_;
  return result;
}

absl::StatusOr<uint64_t> WorkerRegistry::Heartbeat(int rank,
                                                   uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  SweepLocked(now);
  auto it = workers_.find(rank);
  if (it == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank: no worker holds rank ", rank,
                     " on this coordinator; register first"));
  }
  WorkerState& worker = it->second;
  if (worker.incarnation != incarnation) {
    return absl::AbortedError(
        absl::StrCat("incarnation: rank ", rank, " belongs to incarnation ",
                     worker.incarnation, " (", worker.address, "), not ",
                     incarnation, "; register again"));
  }
  if (!worker.alive) {
    return absl::AbortedError(absl::StrCat(
        "rank ", rank, " was declared dead after ",
        Age(now - worker.last_heartbeat), " without a heartbeat (timeout ",
        Age(options_.heartbeat_timeout), "); register again"));
  }
  SetLivenessLocked(rank, &worker, /*alive=*/true, now);
  return epoch_;
}

std::optional<std::pair<int, std::string>> WorkerRegistry::RelayFor(int rank) {
  const int group = options_.heartbeat_relay_group;
  if (group <= 1 || rank < 0) return std::nullopt;
  const int relay = rank - rank % group;
  if (relay == rank) return std::nullopt;
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock());
  auto it = workers_.find(relay);
  if (it == workers_.end() || !it->second.alive) return std::nullopt;
  return std::make_pair(relay, it->second.address);
}

absl::Status WorkerRegistry::Remove(int rank) {
  absl::MutexLock lock(&mu_);
  if (workers_.find(rank) == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank: no worker holds rank ", rank));
  }
  EraseLocked(rank);
  ++epoch_;
  return absl::OkStatus();
}

absl::Status WorkerRegistry::CheckRanksAlive(int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be >= 1, got ", world_size));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  SweepLocked(now);
  std::vector<int> missing;
  std::vector<int> dead;
  std::vector<std::string> dead_details;
  for (int rank = 0; rank < world_size; ++rank) {
    auto it = workers_.find(rank);
    if (it == workers_.end()) {
      missing.push_back(rank);
    } else if (!it->second.alive) {
      dead.push_back(rank);
      if (static_cast<int>(dead_details.size()) < kDeadDetails) {
        dead_details.push_back(absl::StrCat(
            "rank ", rank, " at ", it->second.address, ": last heartbeat ",
            Age(now - it->second.last_heartbeat), " ago"));
      }
    }
  }
  if (missing.empty() && dead.empty()) return absl::OkStatus();
  std::vector<std::string> problems;
  if (!missing.empty()) {
    problems.push_back(absl::StrCat(
        missing.size() == 1 ? "rank " : "ranks ", FormatRankList(missing),
        missing.size() == 1 ? " has" : " have", " not registered"));
  }
  if (!dead.empty()) {
    std::string text = absl::StrCat(
        dead.size() == 1 ? "rank " : "ranks ", FormatRankList(dead),
        dead.size() == 1 ? " is" : " are", " dead (heartbeat timeout ",
        Age(options_.heartbeat_timeout), "; ",
        absl::StrJoin(dead_details, "; "));
    if (dead.size() > dead_details.size()) absl::StrAppend(&text, "; ...");
    absl::StrAppend(&text, ")");
    problems.push_back(std::move(text));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "workers: a world of ", world_size, " needs ",
      world_size == 1 ? "rank 0" : absl::StrCat("ranks 0-", world_size - 1),
      " alive, but ", absl::StrJoin(problems, " and ")));
}

std::vector<WorkerState> WorkerRegistry::List() {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock());
  std::vector<WorkerState> out;
  out.reserve(workers_.size());
  for (const auto& [rank, worker] : workers_) out.push_back(worker);
  return out;
}

uint64_t WorkerRegistry::membership_epoch() {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock());
  return epoch_;
}

int64_t WorkerRegistry::declared_dead() {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock());
  return declared_dead_;
}

int WorkerRegistry::live_workers() {
  absl::MutexLock lock(&mu_);
  SweepLocked(options_.clock());
  return LiveWorkersLocked();
}

}  // namespace shardd
