#include "server/jobs/job_runner.h"

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
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "program/step_program.h"
#include "server/jobs/job_runner_internal.h"

namespace shardd {

using job_internal::Describe;
using job_internal::Prefixed;
using job_internal::RankLabel;
using job_internal::StepLabel;

// ---------------------------------------------------------------------------
// JobRunner internals

namespace {

// TrainConfig.max_recoveries resolved: 0 means the runner's default,
// negative never.
int MaxRecoveries(const v1::TrainConfig& config, int fallback) {
  if (config.max_recoveries() == 0) return fallback;
  return std::max(0, config.max_recoveries());
}

// The train config a checkpoint saved. Errors: DATA_LOSS naming
// config.resume_from when it does not parse.
absl::StatusOr<v1::TrainConfig> ParseSavedTrainConfig(
    const std::string& saved_json) {
  v1::TrainConfig saved;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(saved_json, &saved, options)
           .ok()) {
    return absl::DataLossError(
        "config.resume_from: the checkpoint's saved train config does not "
        "parse");
  }
  return saved;
}

// A job resumed from a checkpoint continues the checkpoint job's
// learning-rate schedule when it names none (its lr too when it leaves lr
// unset): the saved config's lr_schedule, warmup_steps, decay_steps and
// min_lr. A checkpoint without a saved config changes nothing. Errors:
// ParseSavedTrainConfig's.
absl::Status InheritLrSchedule(const std::string& saved_json,
                               v1::TrainConfig* config) {
  if (saved_json.empty() || !config->lr_schedule().empty()) {
    return absl::OkStatus();
  }
  SHARDD_ASSIGN_OR_RETURN(const v1::TrainConfig saved,
                          ParseSavedTrainConfig(saved_json));
  config->set_lr_schedule(saved.lr_schedule());
  config->set_warmup_steps(saved.warmup_steps());
  config->set_decay_steps(saved.decay_steps());
  config->set_min_lr(saved.min_lr());
  if (config->lr() == 0) config->set_lr(saved.lr());
  return absl::OkStatus();
}

// A job resumed from a checkpoint without an optimizer continues the
// checkpoint job's (its muon_* fields too, those the job leaves unset), so
// the momentum in the checkpoint's exp_avg keeps its meaning. Errors:
// ParseSavedTrainConfig's.
absl::Status InheritOptimizer(const std::string& saved_json,
                              v1::TrainConfig* config) {
  if (saved_json.empty() || !config->optimizer().empty()) {
    return absl::OkStatus();
  }
  SHARDD_ASSIGN_OR_RETURN(const v1::TrainConfig saved,
                          ParseSavedTrainConfig(saved_json));
  config->set_optimizer(saved.optimizer());
  if (config->muon_lr() == 0) config->set_muon_lr(saved.muon_lr());
  if (config->muon_momentum() == 0) {
    config->set_muon_momentum(saved.muon_momentum());
  }
  if (config->muon_ns_steps() == 0) {
    config->set_muon_ns_steps(saved.muon_ns_steps());
  }
  return absl::OkStatus();
}

// Muon orthogonalises whole matrices; flat ranges (megatron_fsdp) cut them
// anywhere. The workers refuse it too (MuonOptimizer::Create); this
// refuses it before anything runs, with both names (as NeMo's
// maybe_shard_optimizer(allow=...) does).
absl::Status CheckOptimizerFitsPlan(const v1::TrainConfig& config,
                                    const v1::ShardingPlan& plan) {
  if (config.optimizer() != "muon" || !plan.flat_buckets()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "config.optimizer: optimizer muon cannot run with strategy ",
      plan.strategy(),
      ": Muon orthogonalises whole weight matrices and that strategy shards "
      "flat ranges that cut them; use optimizer adamw, or a strategy that "
      "shards dim 0"));
}

}  // namespace

// ---------------------------------------------------------------------------
// JobRunner

JobRunner::JobRunner(WorkerRegistry* workers, WorkerClientFactory factory,
                     JobRunnerOptions options)
    : workers_(workers), factory_(std::move(factory)), options_(options) {
  int64_t highest = 0;
  if (!options_.checkpoint_dir.empty()) {
    // Without a journal job ids restart at j-1 with the process; their
    // checkpoint directories must not collide.
    std::error_code error;
    std::filesystem::directory_iterator it(options_.checkpoint_dir, error);
    for (; !error && it != std::filesystem::directory_iterator();
         it.increment(error)) {
      highest = std::max(highest, JobNumber(it->path().filename().string()));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    next_job_ = highest + 1;
  }
  RestoreJobs();
}

void JobRunner::RestoreJobs() {
  if (options_.journal == nullptr) return;
  absl::StatusOr<int64_t> next = options_.journal->NextJob();
  absl::StatusOr<std::vector<StoredJob>> stored = options_.journal->LoadAll();
  if (!next.ok() || !stored.ok()) {
    // Never silently: the operator must see that jobs were not carried on.
    SHARDD_LOG(ERROR) << "cannot read the stored jobs: "
                      << (next.ok() ? stored.status() : next.status());
    return;
  }
  int carried = 0;
  absl::MutexLock lock(&mu_);
  next_job_ = std::max(next_job_, *next);
  for (StoredJob& entry : *stored) {
    const v1::StoredJobRecord& record = entry.record;
    const v1::StoredJobProgress& progress = entry.progress;
    next_job_ = std::max(next_job_, JobNumber(record.job_id()) + 1);
    auto job = std::make_unique<Job>();
    job->id = record.job_id();
    job->model_id = record.model_id();
    job->world_size = record.plan().world_size();
    job->total_steps = record.total_steps();
    job->first_step = record.first_step();
    job->steps_done = progress.steps_done();
    job->last_loss = progress.last_loss();
    job->error = progress.error();
    job->recoveries = progress.recoveries();
    job->last_checkpoint = progress.last_checkpoint();
    job->events =
        std::make_shared<JobEventLog>(job->id, options_.max_events_per_job);
    Job* raw = job.get();
    jobs_.emplace(job->id, std::move(job));
    order_.push_back(raw->id);
    if (progress.state() == v1::JOB_DONE ||
        progress.state() == v1::JOB_FAILED) {
      // Finished: its end is all that is left to watch.
      raw->state = progress.state();
      v1::StepEvent end;
      end.set_job_id(raw->id);
      end.set_total_steps(raw->total_steps);
      if (raw->state == v1::JOB_DONE) {
        end.set_step(raw->steps_done);
        end.set_loss(raw->last_loss);
        end.set_done(true);
      } else {
        end.set_step(raw->steps_done + 1);
        end.set_error(raw->error);
      }
      raw->events->Append(std::move(end));
      continue;
    }
    raw->spec.model_id = record.model_id();
    raw->spec.model = record.model();
    raw->spec.plan = record.plan();
    if (record.has_plan_options())
      raw->spec.plan_options = record.plan_options();
    raw->spec.config = record.config();
    raw->restored = true;
    if (!raw->spec.program.ParseFromString(record.program()) ||
        raw->spec.program.commands_size() == 0) {
      // RunJob fails it with this error (an empty program cannot run).
      raw->spec.program.Clear();
      raw->error = "its stored step program does not parse";
    }
    if (!raw->spec.config.eval_data_path().empty()) {
      // The eval program is derived from the plan, not stored.
      absl::StatusOr<v1::StepProgram> eval = CompileEvalProgram(raw->spec.plan);
      if (eval.ok()) {
        raw->spec.eval_program = *std::move(eval);
      } else {
        raw->spec.program.Clear();
        raw->error = absl::StrCat("its eval program does not compile: ",
                                  eval.status().message());
      }
    }
    raw->state = v1::JOB_QUEUED;
    queue_.push_back(raw);
    raw->thread = std::thread([this, raw] { RunJob(raw); });
    ++carried;
  }
  SHARDD_LOG(INFO) << "loaded " << order_.size() << " stored jobs (" << carried
                   << " to carry on); next job j-" << next_job_;
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
  if (spec.config.keep_checkpoints() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.keep_checkpoints: must be >= 0 (0 = keep every one), got ",
        spec.config.keep_checkpoints()));
  }
  if (spec.config.keep_every() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.keep_every: must be >= 0 (0 = none), got ",
        spec.config.keep_every()));
  }
  const std::string& on_failure = spec.config.on_checkpoint_failure();
  if (!on_failure.empty() && on_failure != "fail" && on_failure != "skip") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.on_checkpoint_failure: \"", on_failure,
                     "\"; allowed: fail (the default), skip"));
  }
  int64_t first_step = 0;
  const std::string& resume_from = spec.config.resume_from();
  const std::string& init_from = spec.config.init_from();
  if (!init_from.empty() && !resume_from.empty()) {
    return absl::InvalidArgumentError(
        "config.init_from and config.resume_from: give at most one (a "
        "checkpoint already holds the weights)");
  }
  if (!init_from.empty() && init_from[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.init_from: must be an absolute path (every worker reads it), "
        "got \"", init_from, "\""));
  }
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
    SHARDD_RETURN_IF_ERROR(
        InheritLrSchedule((*reader)->index().train_config_json, &spec.config));
    SHARDD_RETURN_IF_ERROR(
        InheritOptimizer((*reader)->index().train_config_json, &spec.config));
    if (first_step + spec.config.steps() >
        std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config.steps: the checkpoint's step ", first_step,
                       " plus ", spec.config.steps(), " steps exceeds ",
                       std::numeric_limits<int32_t>::max()));
    }
  }
  // A decaying schedule's horizon, absolute: where the decay ends whatever
  // step a later job resumes at.
  if (!spec.config.lr_schedule().empty() &&
      spec.config.lr_schedule() != "constant" &&
      spec.config.decay_steps() == 0) {
    spec.config.set_decay_steps(first_step + spec.config.steps());
  }
  SHARDD_RETURN_IF_ERROR(CheckOptimizerFitsPlan(spec.config, spec.plan));
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
    id = absl::StrCat("j-", next_job_);
    auto job = std::make_unique<Job>();
    job->id = id;
    job->model_id = spec.model_id;
    job->world_size = world;
    job->first_step = first_step;
    job->steps_done = first_step;
    job->total_steps = static_cast<int32_t>(first_step + spec.config.steps());
    job->last_checkpoint = spec.config.resume_from();
    if (options_.journal != nullptr) {
      // Durable before it is acknowledged; ids are never reused.
      v1::StoredJobRecord record;
      record.set_job_id(id);
      record.set_model_id(spec.model_id);
      *record.mutable_model() = spec.model;
      *record.mutable_plan() = spec.plan;
      if (spec.plan_options.has_value()) {
        *record.mutable_plan_options() = *spec.plan_options;
      }
      record.set_program(spec.program.SerializeAsString());
      *record.mutable_config() = spec.config;
      record.set_first_step(first_step);
      record.set_total_steps(job->total_steps);
      const absl::Status created =
          options_.journal->Create(record, ProgressLocked(*job), next_job_ + 1);
      if (!created.ok()) {
        return absl::Status(
            created.code(),
            absl::StrCat("state store: the job could not be recorded: ",
                         created.message()));
      }
    }
    ++next_job_;
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
    if (options_.journal != nullptr) {
      const absl::Status erased = options_.journal->Erase(job->id);
      if (!erased.ok()) {
        SHARDD_LOG(WARNING) << "could not forget job " << job->id
                            << " in the state store: " << erased;
      }
    }
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
    summary.last_lr = job.last_lr;
    summary.last_eval_loss = job.last_eval_loss;
    summary.error = job.error;
    summary.recoveries = job.recoveries;
    summary.last_checkpoint = job.last_checkpoint;
    summary.checkpoint_failures = job.checkpoint_failures;
    summary.last_checkpoint_error = job.last_checkpoint_error;
    out.push_back(std::move(summary));
  }
  return out;
}

CheckpointCounters JobRunner::checkpoint_counters() const {
  absl::MutexLock lock(&mu_);
  return {checkpoint_failures_total_, checkpoints_deleted_total_};
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
  } else if (job->spec.program.commands_size() == 0) {
    absl::MutexLock lock(&mu_);
    status = absl::FailedPreconditionError(
        absl::StrCat("the stored job cannot be carried on: ", job->error));
  } else {
    SHARDD_LOG(INFO) << "job " << job->id << ": model " << job->model_id << ", "
                     << job->total_steps << " steps on " << job->world_size
                     << " workers" << (job->restored ? " (carried on)" : "");
    bool recovering = job->restored;
    while (true) {
      if (recovering) {
        // Waiting is the recovery's last resort: its failure is final.
        status = WaitForWorkers(job);
        if (!status.ok()) break;
      }
      status = RunSteps(job, recovering);
      if (status.ok() || !Recoverable(job, status)) break;
      v1::StepEvent interruption;
      interruption.set_job_id(job->id);
      int32_t recoveries = 0;
      {
        absl::MutexLock lock(&mu_);
        recoveries = ++job->recoveries;
        interruption.set_step(job->steps_done + 1);
      }
      interruption.set_total_steps(job->total_steps);
      interruption.set_interruption(absl::StrCat(
          status.message(), " (recovery ", recoveries, " of ",
          MaxRecoveries(job->spec.config, options_.default_max_recoveries),
          ": waiting up to ", absl::FormatDuration(options_.recovery_timeout),
          " for ranks 0-", job->world_size - 1, " to be alive)"));
      SHARDD_LOG(WARNING) << "job " << job->id
                          << " interrupted: " << interruption.interruption();
      status = Publish(job, std::move(interruption));
      if (!status.ok()) break;
      recovering = true;
    }
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
    // Never fails for an error event (the journal's failure is logged).
    Publish(job, std::move(event)).IgnoreError();
  }
  FailControls(job, absl::AbortedError(absl::StrCat(
                        "job ", job->id, status.ok() ? " finished" : " failed",
                        " before it got to the request")));
  absl::MutexLock lock(&mu_);
  job->spec = JobSpec();
}

bool JobRunner::Recoverable(Job* job, const absl::Status& status) {
  if (stopping()) return false;
  {
    absl::MutexLock lock(&mu_);
    if (job->recoveries >=
        MaxRecoveries(job->spec.config, options_.default_max_recoveries)) {
      return false;
    }
  }
  switch (status.code()) {
    // A peer that died, restarted or hung, or a link that broke.
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
      return true;
    // Also what a restarted worker answers for a plan it no longer holds,
    // or one that lost a step: the worker says so with a reason
    // (common/error_info.h), never only in words.
    case absl::StatusCode::kFailedPrecondition: {
      const std::string reason = ErrorReasonOf(status);
      return reason == kReasonPlanNotHeld || reason == kReasonStepFailedEarlier;
    }
    default:
      return false;
  }
}

absl::Status JobRunner::WaitForWorkers(Job* job) {
  {
    absl::MutexLock lock(&mu_);
    job->state = v1::JOB_RECOVERING;
  }
  const absl::Time deadline = absl::Now() + options_.recovery_timeout;
  while (true) {
    absl::Status alive = workers_->CheckRanksAlive(job->world_size);
    if (alive.ok()) {
      // A killed worker stays "alive" until its heartbeat times out: ask
      // every rank directly, so that the recovery starts with all of them
      // answering.
      for (const WorkerState& worker : workers_->List()) {
        if (worker.rank < 0 || worker.rank >= job->world_size) continue;
        absl::StatusOr<std::unique_ptr<WorkerClient>> client =
            factory_(worker.address);
        WorkerCallOptions options;
        options.deadline =
            absl::Now() + std::min(absl::Seconds(2), options_.rpc_margin);
        absl::Status answered = client.ok()
                                    ? (*client)->GetStats(options).status()
                                    : client.status();
        if (!answered.ok()) {
          alive = absl::UnavailableError(
              absl::StrCat(RankLabel(worker.rank, worker.address),
                           " does not answer: ", Describe(answered)));
          break;
        }
      }
      if (alive.ok()) return alive;
    }
    if (stopping()) {
      return absl::UnavailableError("the coordinator is shutting down");
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("recovery: the workers did not come back within ",
                       absl::FormatDuration(options_.recovery_timeout), ": ",
                       alive.message()));
    }
    absl::SleepFor(options_.poll_interval);
  }
}

void JobRunner::RequestSave(const std::string& job_id,
                            CheckpointCallback done) {
  RequestControl(job_id, /*save=*/true, "", std::move(done));
}

void JobRunner::RequestLoad(const std::string& job_id,
                            const std::string& checkpoint,
                            CheckpointCallback done) {
  RequestControl(job_id, /*save=*/false, checkpoint, std::move(done));
}

void JobRunner::RequestControl(const std::string& job_id, bool save,
                               const std::string& checkpoint,
                               CheckpointCallback done) {
  auto refuse = [&](absl::Status status) { done(std::move(status)); };
  if (options_.checkpoint_dir.empty()) {
    return refuse(absl::FailedPreconditionError(
        "checkpoints: this coordinator has no checkpoint directory (start it "
        "with --checkpoint-dir or --data-dir)"));
  }
  if (!save) {
    absl::Status path = CheckRelativeCheckpointPath(checkpoint, "checkpoint");
    if (!path.ok()) return refuse(std::move(path));
    absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
        checkpoint::CheckpointReader::Open(options_.checkpoint_dir + "/" +
                                           checkpoint);
    if (!reader.ok()) {
      return refuse(absl::Status(
          reader.status().code(),
          absl::StrCat("checkpoint: ", reader.status().message())));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return refuse(absl::NotFoundError(
        absl::StrCat("job_id: no job '", job_id, "' on this coordinator")));
  }
  Job* job = it->second.get();
  if (job->state != v1::JOB_RUNNING) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "job_id: job ", job_id, " is ", v1::JobState_Name(job->state),
        "; checkpoints are saved and loaded on demand while it runs")));
  }
  Control control;
  control.save = save;
  control.checkpoint = checkpoint;
  control.done = std::move(done);
  job->controls.push_back(std::move(control));
}

void JobRunner::FailControls(Job* job, const absl::Status& status) {
  std::deque<Control> controls;
  {
    absl::MutexLock lock(&mu_);
    controls.swap(job->controls);
  }
  for (Control& control : controls) control.done(status);
}

v1::StoredJobProgress JobRunner::ProgressLocked(const Job& job) const {
  v1::StoredJobProgress progress;
  progress.set_state(job.state);
  progress.set_steps_done(job.steps_done);
  progress.set_last_checkpoint(job.last_checkpoint);
  progress.set_last_loss(job.last_loss);
  progress.set_error(job.error);
  progress.set_recoveries(job.recoveries);
  return progress;
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

absl::Status JobRunner::Publish(Job* job, v1::StepEvent event) {
  const bool failed = !event.error().empty();
  v1::StoredJobProgress progress;
  bool shutting_down = false;
  {
    absl::MutexLock lock(&mu_);
    shutting_down = stopping_;
    if (!event.interruption().empty()) {
      job->state = v1::JOB_RECOVERING;
    } else if (!event.recovery().empty()) {
      job->state = v1::JOB_RUNNING;
      job->steps_done = event.step();
      if (!event.checkpoint().empty()) {
        job->last_checkpoint = event.checkpoint();
      }
    } else if (event.has_eval_loss()) {
      job->last_eval_loss = event.eval_loss();
      job->last_eval_step = event.step();
    } else if (!failed) {
      job->steps_done = event.step();
      job->last_loss = event.loss();
      job->tokens_per_second = event.tokens_per_second();
      job->last_lr = event.lr();
      if (!event.checkpoint().empty()) {
        job->last_checkpoint = event.checkpoint();
      }
    }
    if (failed || event.done()) {
      job->state = failed ? v1::JOB_FAILED : v1::JOB_DONE;
      job->error = event.error();
    }
    progress = ProgressLocked(*job);
  }
  // A shutdown leaves the job "running" in the journal: a restarted
  // coordinator carries it on.
  if (options_.journal != nullptr && !(failed && shutting_down)) {
    const absl::Status stored = options_.journal->Update(job->id, progress);
    if (!stored.ok()) {
      SHARDD_LOG(ERROR) << "job " << job->id
                        << ": progress not durable: " << stored;
      if (!failed) {
        return absl::InternalError(
            absl::StrCat("state store: the progress after step ", event.step(),
                         " could not be made durable: ", stored.message()));
      }
    }
  }
  {
    // The job's state changes before its last event is out, so a watcher
    // that saw the end finds the job finished (and the next one may start).
    absl::MutexLock lock(&mu_);
    if (failed || event.done()) {
      auto it = std::find(queue_.begin(), queue_.end(), job);
      if (it != queue_.end()) queue_.erase(it);
    }
  }
  job->events->Append(std::move(event));
  return absl::OkStatus();
}

namespace job_internal {

std::string RankLabel(int rank, const std::string& address) {
  return absl::StrCat("rank ", rank, " (", address, ")");
}

std::string Describe(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                      status.message());
}

std::string StepLabel(int64_t step, int32_t total) {
  return absl::StrCat("step ", step, "/", total);
}

// The same status (code and reason) with `prefix` before its message.
absl::Status Prefixed(absl::string_view prefix, const absl::Status& status) {
  if (status.ok()) return status;
  return WithMessage(status, absl::StrCat(prefix, status.message()));
}

}  // namespace job_internal

}  // namespace shardd
