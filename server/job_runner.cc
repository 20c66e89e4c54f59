#include "server/job_runner.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/step_program.h"
#include "worker/checkpoint/checkpoint_reader.h"
#include "worker/checkpoint/checkpoint_writer.h"
#include "worker/shard_checkpoint.h"

namespace shardd {

// ---------------------------------------------------------------------------
// JobEventLog

JobEventLog::JobEventLog(std::string job_id, size_t max_events)
    : job_id_(std::move(job_id)),
      max_events_(std::max<size_t>(1, max_events)) {}

void JobEventLog::Append(v1::StepEvent event) {
  std::vector<std::shared_ptr<Listener>> listeners;
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = event.done() || !event.error().empty();
    events_.push_back(std::move(event));
    while (events_.size() > max_events_) {
      events_.pop_front();
      ++first_index_;
    }
    // Notify outside the lock (listeners read the log); drop the dead.
    std::vector<std::weak_ptr<Listener>> alive;
    for (std::weak_ptr<Listener>& weak : listeners_) {
      if (std::shared_ptr<Listener> listener = weak.lock()) {
        listeners.push_back(std::move(listener));
        alive.push_back(std::move(weak));
      }
    }
    listeners_ = std::move(alive);
  }
  for (const std::shared_ptr<Listener>& listener : listeners) {
    listener->OnEventsAvailable();
  }
}

void JobEventLog::AddListener(std::weak_ptr<Listener> listener) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(listener));
}

int64_t JobEventLog::StartIndex(int64_t from_step) const {
  absl::MutexLock lock(&mu_);
  // Steps only grow along the log, so the first match is found by bisection.
  auto it = std::lower_bound(events_.begin(), events_.end(), from_step,
                             [](const v1::StepEvent& event, int64_t step) {
                               return event.step() < step;
                             });
  return first_index_ + (it - events_.begin());
}

JobEventLog::ReadResult JobEventLog::Read(int64_t* index,
                                          v1::StepEvent* out) const {
  absl::MutexLock lock(&mu_);
  if (*index < first_index_) *index = first_index_;
  const int64_t offset = *index - first_index_;
  if (offset < static_cast<int64_t>(events_.size())) {
    *out = events_[offset];
    return ReadResult::kEvent;
  }
  return ended_ ? ReadResult::kEnded : ReadResult::kWait;
}

bool JobEventLog::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

std::vector<v1::StepEvent> JobEventLog::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return std::vector<v1::StepEvent>(events_.begin(), events_.end());
}

// ---------------------------------------------------------------------------
// JobRunner internals

struct JobRunner::Job {
  std::string id;
  std::string model_id;
  int32_t world_size = 0;
  int32_t total_steps = 0;
  // The step the job starts from (the checkpoint's, with resume_from).
  int64_t first_step = 0;
  // Read without the lock by the job's thread while it runs; cleared (under
  // JobRunner::mu_) when it ends, since plans of large worlds are big.
  JobSpec spec;
  std::shared_ptr<JobEventLog> events;
  std::thread thread;
  // The fields below are guarded by JobRunner::mu_.
  v1::JobState state = v1::JOB_QUEUED;
  int64_t steps_done = 0;
  double last_loss = 0.0;
  double tokens_per_second = 0.0;
  std::string error;
};

// One thread per rank, so that every rank's blocking call of a round is in
// flight at the same time (a collective needs all of them).
class JobRunner::RankPool {
 public:
  explicit RankPool(int ranks) : tasks_(ranks) {
    threads_.reserve(ranks);
    for (int rank = 0; rank < ranks; ++rank) {
      threads_.emplace_back([this, rank] { Loop(rank); });
    }
  }

  ~RankPool() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& thread : threads_) thread.join();
  }

  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  // Runs `task` on `rank`'s thread; the rank must be idle.
  void Run(int rank, std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_[rank] = std::move(task);
  }

 private:
  void Loop(int rank) {
    while (true) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this, rank]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || tasks_[rank] != nullptr;
        };
        mu_.Await(absl::Condition(&ready));
        if (tasks_[rank] == nullptr) return;  // Stopping, nothing left.
        task = std::move(tasks_[rank]);
        tasks_[rank] = nullptr;
      }
      task();
    }
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

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

std::string RankLabel(int rank, const std::string& address) {
  return absl::StrCat("rank ", rank, " (", address, ")");
}

std::string Describe(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                      status.message());
}

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

std::string StepLabel(int64_t step, int32_t total) {
  return absl::StrCat("step ", step, "/", total);
}

// The same status with `prefix` before its message.
absl::Status Prefixed(absl::string_view prefix, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

// The n of a "j-<n>" job id, or 0.
int64_t JobNumber(absl::string_view name) {
  int64_t n = 0;
  if (!absl::ConsumePrefix(&name, "j-") || !absl::SimpleAtoi(name, &n)) {
    return 0;
  }
  return n;
}

// The RankFile a worker's SaveShards reported.
checkpoint::RankFile ToRankFile(const v1::SaveShardsResponse& response) {
  checkpoint::RankFile out;
  out.file.name = response.file_name();
  out.file.size_bytes = response.size_bytes();
  out.file.xxh64 = response.xxh64();
  for (const v1::CheckpointChunk& chunk : response.chunks()) {
    checkpoint::TensorChunk piece;
    piece.tensor = chunk.tensor();
    piece.dtype = chunk.dtype();
    piece.global_shape.assign(chunk.global_shape().begin(),
                              chunk.global_shape().end());
    piece.chunk.file = chunk.file();
    piece.chunk.tensor = chunk.file_tensor();
    piece.chunk.begin = chunk.begin();
    piece.chunk.end = chunk.end();
    out.chunks.push_back(std::move(piece));
  }
  return out;
}

}  // namespace

absl::Status CheckRelativeCheckpointPath(const std::string& path,
                                         absl::string_view field) {
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
      field,
      ": expected a checkpoint path relative to the checkpoint dir (e.g. "
      "j-1/step-00000020), without '.', '..' or empty components, got '",
      path, "'"));
  if (path.empty() || path.front() == '/') return bad;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == "." || part == "..") return bad;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> ListJobCheckpoints(
    const std::string& checkpoint_dir, const std::string& job_id) {
  if (!job_id.empty()) {
    SHARDD_RETURN_IF_ERROR(CheckRelativeCheckpointPath(job_id, "job_id"));
    if (job_id.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job_id: expected a job id (j-<n>), got '", job_id, "'"));
    }
  }
  std::vector<std::string> jobs;
  if (!job_id.empty()) {
    jobs.push_back(job_id);
  } else {
    std::error_code error;
    std::filesystem::directory_iterator it(checkpoint_dir, error);
    if (error && error != std::errc::no_such_file_or_directory) {
      return absl::InternalError(
          absl::StrCat("listing ", checkpoint_dir, ": ", error.message()));
    }
    for (; !error && it != std::filesystem::directory_iterator();
         it.increment(error)) {
      if (it->is_directory(error)) jobs.push_back(it->path().filename());
    }
    // j-2 before j-10.
    std::sort(jobs.begin(), jobs.end(),
              [](const std::string& a, const std::string& b) {
                const int64_t na = JobNumber(a);
                const int64_t nb = JobNumber(b);
                return na != nb ? na < nb : a < b;
              });
  }
  std::vector<v1::CheckpointInfo> out;
  for (const std::string& job : jobs) {
    SHARDD_ASSIGN_OR_RETURN(
        std::vector<checkpoint::CheckpointInfo> found,
        checkpoint::ListCheckpoints(checkpoint_dir + "/" + job));
    for (const checkpoint::CheckpointInfo& info : found) {
      v1::CheckpointInfo entry;
      entry.set_name(absl::StrCat(job, "/", info.name));
      entry.set_job_id(job);
      entry.set_step(info.step);
      // ListCheckpoints parsed the index already; reading it again here
      // keeps its interface small (an index is a few KiB).
      absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
          checkpoint::CheckpointReader::Open(info.path);
      if (reader.ok()) {
        const checkpoint::SavedBy& by = (*reader)->index().saved_by;
        entry.set_world_size(static_cast<int32_t>(by.world_size));
        entry.set_strategy(by.strategy);
      }
      out.push_back(std::move(entry));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// JobRunner

JobRunner::JobRunner(WorkerRegistry* workers, WorkerClientFactory factory,
                     JobRunnerOptions options)
    : workers_(workers), factory_(std::move(factory)), options_(options) {
  if (options_.checkpoint_dir.empty()) return;
  // Job ids restart at j-1 with the process; checkpoints must not collide.
  std::error_code error;
  std::filesystem::directory_iterator it(options_.checkpoint_dir, error);
  int64_t highest = 0;
  for (; !error && it != std::filesystem::directory_iterator();
       it.increment(error)) {
    highest = std::max(highest, JobNumber(it->path().filename().string()));
  }
  absl::MutexLock lock(&mu_);
  next_job_ = highest + 1;
}

JobRunner::~JobRunner() { Shutdown(); }

absl::StatusOr<std::string> JobRunner::Submit(JobSpec spec) {
  const int world = spec.plan.world_size();
  if (world < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.world_size: must be >= 1, got ", world));
  }
  if (spec.config.steps() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.steps: must be >= 1, got ", spec.config.steps()));
  }
  if (spec.program.commands_size() == 0) {
    return absl::InvalidArgumentError("program: has no commands");
  }
  if (spec.config.checkpoint_every() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.checkpoint_every: must be >= 0 (0 = never), got ",
                     spec.config.checkpoint_every()));
  }
  int64_t first_step = 0;
  const std::string& resume_from = spec.config.resume_from();
  if (!resume_from.empty()) {
    SHARDD_RETURN_IF_ERROR(
        CheckRelativeCheckpointPath(resume_from, "config.resume_from"));
  }
  if ((spec.config.checkpoint_every() > 0 || !resume_from.empty()) &&
      options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints: this coordinator has no checkpoint directory (start it "
        "with --checkpoint-dir or --data-dir)");
  }
  if (!resume_from.empty()) {
    // Refuse a missing checkpoint now; the workers verify the data files.
    absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
        checkpoint::CheckpointReader::Open(options_.checkpoint_dir + "/" +
                                           resume_from);
    if (!reader.ok()) {
      return absl::Status(
          reader.status().code(),
          absl::StrCat("config.resume_from: ", reader.status().message()));
    }
    first_step = (*reader)->index().step;
    if (first_step + spec.config.steps() >
        std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.steps: the checkpoint's step ", first_step,
                       " plus ", spec.config.steps(), " steps exceeds ",
                       std::numeric_limits<int32_t>::max()));
    }
  }
  // Refuse at once instead of queueing a job nobody can run.
  SHARDD_RETURN_IF_ERROR(workers_->CheckRanksAlive(world));

  std::vector<std::unique_ptr<Job>> reaped;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError("the coordinator is shutting down");
    }
    if (static_cast<int>(queue_.size()) >= options_.max_pending_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "jobs: ", queue_.size(), " jobs are queued or running, the limit is ",
          options_.max_pending_jobs, "; watch one to its end first"));
    }
    // Forget the oldest finished jobs beyond the limit.
    int finished = static_cast<int>(jobs_.size() - queue_.size());
    for (auto it = order_.begin();
         it != order_.end() && finished >= options_.max_finished_jobs;) {
      auto job = jobs_.find(*it);
      const v1::JobState state = job->second->state;
      if (state == v1::JOB_DONE || state == v1::JOB_FAILED) {
        reaped.push_back(std::move(job->second));
        jobs_.erase(job);
        it = order_.erase(it);
        --finished;
      } else {
        ++it;
      }
    }
    id = absl::StrCat("j-", next_job_++);
    auto job = std::make_unique<Job>();
    job->id = id;
    job->model_id = spec.model_id;
    job->world_size = world;
    job->first_step = first_step;
    job->steps_done = first_step;
    job->total_steps = static_cast<int32_t>(first_step + spec.config.steps());
    job->spec = std::move(spec);
    job->events =
        std::make_shared<JobEventLog>(id, options_.max_events_per_job);
    Job* raw = job.get();
    queue_.push_back(raw);
    order_.push_back(id);
    jobs_.emplace(id, std::move(job));
    raw->thread = std::thread([this, raw] { RunJob(raw); });
  }
  for (std::unique_ptr<Job>& job : reaped) {
    if (job->thread.joinable()) job->thread.join();
  }
  return id;
}

absl::StatusOr<std::shared_ptr<JobEventLog>> JobRunner::Events(
    const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job_id: no job '", job_id,
                     "' on this coordinator (finished jobs are kept for a "
                     "while, and not across restarts)"));
  }
  return it->second->events;
}

std::vector<JobSummary> JobRunner::ListJobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<JobSummary> out;
  out.reserve(order_.size());
  for (const std::string& id : order_) {
    const Job& job = *jobs_.at(id);
    JobSummary summary;
    summary.job_id = job.id;
    summary.model_id = job.model_id;
    summary.state = job.state;
    summary.world_size = job.world_size;
    summary.steps_done = job.steps_done;
    summary.total_steps = job.total_steps;
    summary.last_loss = job.last_loss;
    summary.tokens_per_second = job.tokens_per_second;
    summary.error = job.error;
    out.push_back(std::move(summary));
  }
  return out;
}

void JobRunner::Shutdown() {
  // One Shutdown at a time: a thread is joined once.
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  std::vector<Job*> jobs;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, job] : jobs_) jobs.push_back(job.get());
  }
  // Submit refuses new jobs and never forgets one while stopping, so the
  // pointers stay valid. Running jobs notice within poll_interval.
  for (Job* job : jobs) {
    if (job->thread.joinable()) job->thread.join();
  }
}

bool JobRunner::stopping() const {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void JobRunner::RunJob(Job* job) {
  {
    absl::MutexLock lock(&mu_);
    auto my_turn = [this, job]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || (!queue_.empty() && queue_.front() == job);
    };
    mu_.Await(absl::Condition(&my_turn));
    if (!stopping_) job->state = v1::JOB_RUNNING;
  }
  absl::Status status;
  if (stopping()) {
    status = absl::UnavailableError(
        "the coordinator is shutting down (the job never started)");
  } else {
    SHARDD_LOG(INFO) << "job " << job->id << ": model " << job->model_id << ", "
                     << job->total_steps << " steps on " << job->world_size
                     << " workers";
    status = RunSteps(job);
  }
  if (status.ok()) {
    SHARDD_LOG(INFO) << "job " << job->id << " done";
  } else {
    // RunSteps published the final event of a job that succeeded.
    SHARDD_LOG(WARNING) << "job " << job->id << " failed: " << status.message();
    v1::StepEvent event;
    event.set_job_id(job->id);
    {
      absl::MutexLock lock(&mu_);
      event.set_step(job->steps_done + 1);
    }
    event.set_total_steps(job->total_steps);
    event.set_error(std::string(status.message()));
    Publish(job, std::move(event));
  }
  absl::MutexLock lock(&mu_);
  job->spec = JobSpec();
}

absl::Status JobRunner::CheckMembership(
    const std::vector<WorkerSnapshot>& snapshot) const {
  const std::vector<WorkerState> now = workers_->List();
  std::map<int, const WorkerState*> by_rank;
  for (const WorkerState& worker : now) by_rank[worker.rank] = &worker;
  for (int rank = 0; rank < static_cast<int>(snapshot.size()); ++rank) {
    const std::string label = RankLabel(rank, snapshot[rank].address);
    auto it = by_rank.find(rank);
    if (it == by_rank.end()) {
      return absl::UnavailableError(absl::StrCat(
          label, ": UNAVAILABLE: the worker left the coordinator"));
    }
    const WorkerState& worker = *it->second;
    if (worker.incarnation != snapshot[rank].incarnation) {
      return absl::UnavailableError(absl::StrCat(
          label, ": UNAVAILABLE: the worker restarted (", worker.address,
          " registered with a new incarnation), so its shards are gone"));
    }
    if (!worker.alive) {
      return absl::UnavailableError(absl::StrCat(
          label,
          ": UNAVAILABLE: the worker was declared dead (no heartbeat for ",
          absl::FormatDuration(workers_->heartbeat_timeout()), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status JobRunner::RunOnAllRanks(
    const std::vector<WorkerSnapshot>& workers, RankPool* pool,
    const std::function<absl::Status(int, const WorkerCallOptions&)>& call,
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
    // `call` and `canceller` outlive the task: this function waits for
    // every task before it returns.
    pool->Run(rank, [round, rank, &call, call_options] {
      absl::Status status = call(rank, call_options);
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
    return absl::Status(round->results[cause].code(), message);
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

void JobRunner::Publish(Job* job, v1::StepEvent event) {
  {
    absl::MutexLock lock(&mu_);
    const bool failed = !event.error().empty();
    if (!failed) {
      job->steps_done = event.step();
      job->last_loss = event.loss();
      job->tokens_per_second = event.tokens_per_second();
    }
    // The job's state changes before its last event is out, so a watcher
    // that saw the end finds the job finished (and the next one may start).
    if (failed || event.done()) {
      job->state = failed ? v1::JOB_FAILED : v1::JOB_DONE;
      job->error = event.error();
      auto it = std::find(queue_.begin(), queue_.end(), job);
      if (it != queue_.end()) queue_.erase(it);
    }
  }
  job->events->Append(std::move(event));
}

absl::Status JobRunner::RunSteps(Job* job) {
  // The spec is immutable once submitted.
  const JobSpec& spec = job->spec;
  const int world = spec.plan.world_size();
  const int32_t total = job->total_steps;

  SHARDD_RETURN_IF_ERROR(workers_->CheckRanksAlive(world));
  std::vector<WorkerSnapshot> snapshot(world);
  for (const WorkerState& worker : workers_->List()) {
    if (worker.rank >= 0 && worker.rank < world) {
      snapshot[worker.rank] = {worker.address, worker.incarnation};
    }
  }
  // A worker dying between the check and here shows up at the first poll
  // (incarnation 0 never matches a registered worker).
  const uint64_t epoch = workers_->membership_epoch();
  std::vector<std::unique_ptr<WorkerClient>> clients(world);
  for (int rank = 0; rank < world; ++rank) {
    absl::StatusOr<std::unique_ptr<WorkerClient>> client =
        factory_(snapshot[rank].address);
    if (!client.ok()) {
      return absl::Status(client.status().code(),
                          absl::StrCat(RankLabel(rank, snapshot[rank].address),
                                       ": ", Describe(client.status())));
    }
    clients[rank] = *std::move(client);
  }
  RankPool pool(world);

  v1::LoadPlanRequest load;
  *load.mutable_plan() = spec.plan;
  *load.mutable_model() = spec.model;
  *load.mutable_train() = spec.config;
  load.set_seed(spec.config.seed());
  load.set_job_id(job->id);
  load.set_membership_epoch(epoch);
  load.set_collective_timeout_ms(
      absl::ToInt64Milliseconds(options_.collective_timeout));
  std::vector<v1::LoadPlanResponse> loaded(world);
  SHARDD_RETURN_IF_ERROR(Prefixed(
      "LoadPlan: ",
      RunOnAllRanks(
          snapshot, &pool,
          [&](int rank, const WorkerCallOptions& options) -> absl::Status {
            v1::LoadPlanRequest request = load;
            request.set_rank(rank);
            SHARDD_ASSIGN_OR_RETURN(loaded[rank],
                                    clients[rank]->LoadPlan(request, options));
            return absl::OkStatus();
          },
          "LoadPlan")));
  if (!spec.config.resume_from().empty()) {
    v1::LoadShardsRequest request;
    request.set_plan_fingerprint(spec.plan.fingerprint());
    request.set_checkpoint_dir(spec.config.resume_from());
    std::vector<int64_t> steps(world, -1);
    SHARDD_RETURN_IF_ERROR(Prefixed(
        absl::StrCat("LoadShards ", spec.config.resume_from(), ": "),
        RunOnAllRanks(
            snapshot, &pool,
            [&](int rank, const WorkerCallOptions& options) -> absl::Status {
              SHARDD_ASSIGN_OR_RETURN(
                  v1::LoadShardsResponse response,
                  clients[rank]->LoadShards(request, options));
              steps[rank] = response.step();
              return absl::OkStatus();
            },
            "LoadShards")));
    for (int rank = 0; rank < world; ++rank) {
      if (steps[rank] != job->first_step) {
        return absl::FailedPreconditionError(absl::StrCat(
            "LoadShards ", spec.config.resume_from(), ": ",
            RankLabel(rank, snapshot[rank].address), " loaded step ",
            steps[rank], " but the checkpoint was at step ", job->first_step,
            " when the job was submitted (it was replaced meanwhile)"));
      }
    }
    SHARDD_LOG(INFO) << "job " << job->id << ": resumed from "
                     << spec.config.resume_from() << " at step "
                     << job->first_step;
  }

  // Saves the shards after `steps_done` steps; returns the checkpoint's
  // name relative to the checkpoint dir.
  const std::string job_root = options_.checkpoint_dir + "/" + job->id;
  auto save = [&](int64_t steps_done) -> absl::StatusOr<std::string> {
    SHARDD_ASSIGN_OR_RETURN(const std::string tmp,
                            checkpoint::BeginCheckpoint(job_root, steps_done));
    const int dp_shard = spec.plan.mesh().dp_shard();
    v1::SaveShardsRequest request;
    request.set_plan_fingerprint(spec.plan.fingerprint());
    request.set_tmp_dir(absl::StrCat(
        job->id, "/", std::filesystem::path(tmp).filename().string()));
    std::vector<checkpoint::RankFile> files(dp_shard);
    absl::Status saved = RunOnAllRanks(
        snapshot, &pool,
        [&](int rank, const WorkerCallOptions& options) -> absl::Status {
          // Replica 0 holds every shard once; the other replicas the same.
          if (rank >= dp_shard) return absl::OkStatus();
          SHARDD_ASSIGN_OR_RETURN(v1::SaveShardsResponse response,
                                  clients[rank]->SaveShards(request, options));
          files[rank] = ToRankFile(response);
          return absl::OkStatus();
        },
        "SaveShards");
    absl::StatusOr<std::string> committed;
    if (saved.ok()) {
      absl::StatusOr<checkpoint::CheckpointIndex> index =
          BuildIndex(spec.plan, steps_done, files);
      committed = index.ok()
                      ? checkpoint::CommitCheckpoint(job_root, tmp, *index)
                      : absl::StatusOr<std::string>(index.status());
    } else {
      committed = saved;
    }
    if (!committed.ok()) {
      std::error_code ignored;
      std::filesystem::remove_all(tmp, ignored);
      return committed.status();
    }
    return absl::StrCat(job->id, "/",
                        checkpoint::CheckpointDirName(steps_done));
  };
  const int32_t checkpoint_every = spec.config.checkpoint_every();

  const double entropy_rate = loaded[0].data_entropy_rate();
  const int64_t planned_peak = spec.plan.memory().peak_unsharded_bytes();

  v1::ExecuteRequest execute;
  *execute.mutable_program() = spec.program;
  const int commands = spec.program.commands_size();
  std::vector<v1::ExecuteResponse> results(world);
  for (int64_t step = job->first_step; step < total; ++step) {
    const std::string label = absl::StrCat(StepLabel(step + 1, total), ": ");
    if (stopping()) {
      return absl::UnavailableError(
          absl::StrCat(label, "the coordinator is shutting down"));
    }
    const absl::Time start = absl::Now();
    if (!spec.config.fine_grained()) {
      execute.mutable_program()->set_step(step);
      SHARDD_RETURN_IF_ERROR(Prefixed(
          label,
          RunOnAllRanks(
              snapshot, &pool,
              [&](int rank, const WorkerCallOptions& options) -> absl::Status {
                SHARDD_ASSIGN_OR_RETURN(
                    results[rank], clients[rank]->Execute(execute, options));
                return absl::OkStatus();
              },
              "Execute")));
    } else {
      for (int i = 0; i < commands; ++i) {
        v1::RunCommandRequest request;
        request.set_plan_fingerprint(spec.program.plan_fingerprint());
        request.set_step(step);
        *request.mutable_command() = spec.program.commands(i);
        request.set_begin_step(i == 0);
        request.set_end_step(i == commands - 1);
        request.set_index(i);
        SHARDD_RETURN_IF_ERROR(Prefixed(
            absl::StrCat(label, "commands[", i, "] (",
                         CommandToString(spec.program.commands(i)), "): "),
            RunOnAllRanks(
                snapshot, &pool,
                [&](int rank,
                    const WorkerCallOptions& options) -> absl::Status {
                  SHARDD_ASSIGN_OR_RETURN(
                      v1::ExecuteResponse response,
                      clients[rank]->RunCommand(request, options));
                  if (i == commands - 1) results[rank] = std::move(response);
                  return absl::OkStatus();
                },
                "RunCommand")));
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

    int64_t tokens = 0;
    double weighted_loss = 0.0;
    double plain_loss = 0.0;
    int64_t peak = 0;
    int64_t all_gathers = 0;
    int64_t reduce_scatters = 0;
    for (const v1::ExecuteResponse& result : results) {
      tokens += result.tokens();
      weighted_loss += result.loss() * static_cast<double>(result.tokens());
      plain_loss += result.loss();
      peak = std::max(peak, result.peak_unsharded_bytes());
      all_gathers = std::max(all_gathers, result.all_gathers());
      reduce_scatters = std::max(reduce_scatters, result.reduce_scatters());
    }
    v1::StepEvent event;
    event.set_job_id(job->id);
    event.set_step(step + 1);
    event.set_loss(tokens > 0 ? weighted_loss / static_cast<double>(tokens)
                              : plain_loss / world);
    event.set_tokens(tokens);
    event.set_step_seconds(seconds);
    event.set_tokens_per_second(
        seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
    // Every rank computes the same global norm (an all-reduce).
    event.set_grad_norm(results[0].grad_norm());
    event.set_peak_unsharded_bytes(peak);
    event.set_planned_peak_unsharded_bytes(planned_peak);
    event.set_all_gathers(all_gathers);
    event.set_reduce_scatters(reduce_scatters);
    event.set_data_entropy_rate(entropy_rate);
    event.set_total_steps(total);
    event.set_done(step + 1 == total);
    if (checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) {
      absl::StatusOr<std::string> name = save(step + 1);
      if (!name.ok()) {
        return Prefixed(absl::StrCat(label, "checkpoint: "), name.status());
      }
      SHARDD_LOG(INFO) << "job " << job->id << ": saved checkpoint " << *name;
      event.set_checkpoint(*name);
    }
    Publish(job, std::move(event));
  }
  return absl::OkStatus();
}

}  // namespace shardd
