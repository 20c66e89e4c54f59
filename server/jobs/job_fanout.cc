// JobRunner::RunOnAllRanks: one call per rank, concurrently, with the
// registry watched while they are in flight (declared in job_runner.h).

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/jobs/job_runner.h"
#include "server/jobs/job_runner_internal.h"

namespace shardd {
namespace {

// The results of one round of calls.
struct Round {
  explicit Round(int ranks) : remaining(ranks), results(ranks) {}
  absl::Mutex mu;
  int remaining ABSL_GUARDED_BY(mu);
  std::vector<absl::Status> results ABSL_GUARDED_BY(mu);
  std::vector<bool> answered ABSL_GUARDED_BY(mu);
  // Ranks whose call failed, in the order they failed.
  std::vector<int> failures ABSL_GUARDED_BY(mu);
};

// Collective failures on healthy ranks are a consequence; a cancelled call
// was stopped by us. Either is a worse explanation than any other error.
int CauseRank(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kCancelled:
      return 2;
    case absl::StatusCode::kAborted:
      return 1;
    default:
      return 0;
  }
}

}  // namespace

using job_internal::Describe;
using job_internal::RankLabel;

absl::Status JobRunner::RunOnAllRanks(
    const std::vector<WorkerSnapshot>& workers, RankPool* pool,
    const std::function<absl::Status(int, const WorkerCallOptions&)>& call,
    absl::string_view what) {
  // `call` outlives the tasks: the round waits for every one.
  return RunOnAllRanksAsync(
      workers,
      [pool, &call](int rank, const WorkerCallOptions& options,
                    std::function<void(absl::Status)> finish) {
        pool->Run(rank, [&call, rank, options, finish = std::move(finish)] {
          finish(call(rank, options));
        });
      },
      what);
}

absl::Status JobRunner::RunOnAllRanksAsync(
    const std::vector<WorkerSnapshot>& workers, const AsyncRankCall& start,
    absl::string_view what) {
  const int world = static_cast<int>(workers.size());
  const absl::Duration timeout =
      options_.collective_timeout + options_.rpc_margin;
  const absl::Time deadline = absl::Now() + timeout;
  // Shared with the tasks, which may finish their bookkeeping after the
  // wait below saw remaining == 0.
  auto round = std::make_shared<Round>(world);
  {
    absl::MutexLock lock(&round->mu);
    round->answered.assign(world, false);
  }
  CallCanceller canceller;
  WorkerCallOptions call_options;
  call_options.deadline = deadline;
  call_options.canceller = &canceller;
  for (int rank = 0; rank < world; ++rank) {
    // `canceller` outlives the calls: this function waits for every
    // finish before it returns.
    start(rank, call_options, [round, rank](absl::Status status) {
      absl::MutexLock lock(&round->mu);
      if (!status.ok()) round->failures.push_back(rank);
      round->results[rank] = std::move(status);
      round->answered[rank] = true;
      --round->remaining;
    });
  }

  // Decided here rather than by a call's result: a dead or restarted
  // worker, shutdown, or the deadline.
  absl::Status verdict;
  bool timed_out = false;
  std::vector<int> unanswered;
  absl::Time first_failure = absl::InfiniteFuture();
  while (true) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      timed_out = true;
      absl::MutexLock lock(&round->mu);
      for (int rank = 0; rank < world; ++rank) {
        if (!round->answered[rank]) unanswered.push_back(rank);
      }
      break;
    }
    absl::Time wake = std::min(now + options_.poll_interval, deadline);
    const bool seen_failure = first_failure != absl::InfiniteFuture();
    if (seen_failure)
      wake = std::min(wake, first_failure + options_.failure_grace);
    bool finished = false;
    {
      absl::MutexLock lock(&round->mu);
      Round* r = round.get();
      auto ready = [r, seen_failure]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
        return r->remaining == 0 || (!seen_failure && !r->failures.empty());
      };
      round->mu.AwaitWithDeadline(absl::Condition(&ready), wake);
      if (round->remaining == 0) {
        finished = true;
      } else if (!round->failures.empty()) {
        if (!seen_failure) {
          first_failure = absl::Now();
        } else if (absl::Now() >= first_failure + options_.failure_grace) {
          finished = true;  // The others get cancelled below.
        }
      }
    }
    if (finished) break;
    if (stopping()) {
      verdict = absl::UnavailableError("the coordinator is shutting down");
      break;
    }
    verdict = CheckMembership(workers);
    if (!verdict.ok()) break;
  }

  canceller.Cancel();
  absl::MutexLock lock(&round->mu);
  Round* r = round.get();
  auto all_answered = [r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
    return r->remaining == 0;
  };
  // Clients end cancelled calls promptly (gRPC: TryCancel).
  round->mu.Await(absl::Condition(&all_answered));

  if (!verdict.ok()) return verdict;
  // The most likely cause among the failures: the earliest one that is not
  // a peer's aborted collective or our own cancellation.
  int cause = -1;
  for (int rank : round->failures) {
    if (cause < 0 || CauseRank(round->results[rank].code()) <
                         CauseRank(round->results[cause].code())) {
      cause = rank;
    }
  }
  if (cause >= 0 && (!timed_out || round->results[cause].code() !=
                                       absl::StatusCode::kCancelled)) {
    std::string message = absl::StrCat(RankLabel(cause, workers[cause].address),
                                       ": ", Describe(round->results[cause]));
    std::vector<std::string> others;
    for (int rank : round->failures) {
      if (rank == cause ||
          round->results[rank].code() == absl::StatusCode::kCancelled) {
        continue;
      }
      others.push_back(
          absl::StrCat("rank ", rank, " ",
                       absl::StatusCodeToString(round->results[rank].code())));
    }
    if (!others.empty()) {
      constexpr size_t kMaxOthers = 3;
      const size_t more =
          others.size() > kMaxOthers ? others.size() - kMaxOthers : 0;
      others.resize(std::min(others.size(), kMaxOthers));
      absl::StrAppend(&message, " (also failed: ", absl::StrJoin(others, ", "),
                      more > 0 ? absl::StrCat(" and ", more, " more") : "",
                      ")");
    }
    return WithMessage(round->results[cause], message);
  }
  if (timed_out) {
    const int rank = unanswered.empty() ? 0 : unanswered.front();
    std::string message = absl::StrCat(
        RankLabel(rank, workers[rank].address),
        ": DEADLINE_EXCEEDED: no answer to ", what, " within ",
        absl::FormatDuration(timeout), " (collective timeout ",
        absl::FormatDuration(options_.collective_timeout), " + margin ",
        absl::FormatDuration(options_.rpc_margin), ")");
    if (unanswered.size() > 1) {
      absl::StrAppend(&message, "; ranks ", FormatRankList(unanswered),
                      " did not answer");
    }
    return absl::DeadlineExceededError(message);
  }
  return absl::OkStatus();
}

}  // namespace shardd
