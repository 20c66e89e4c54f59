#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_size.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_util.h"
#include "checkpoint/retention.h"
#include "checkpoint/plan_index.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "program/step_program.h"
#include "server/jobs/job_runner.h"
#include "server/jobs/job_runner_internal.h"

namespace shardd {

using job_internal::Describe;
using job_internal::Prefixed;
using job_internal::RankLabel;
using job_internal::StepLabel;

// One attempt at a job's steps over the membership of the moment: the
// workers' clients, where the job starts (after a fault: what the workers
// still hold, a replica heal, or the last checkpoint), the plan loaded on
// every rank, then the steps with their checkpoints and the saves and
// rollbacks asked for on the way. A recovery starts a new attempt.
class JobRunner::Attempt {
 public:
  Attempt(JobRunner* runner, Job* job)
      : runner_(runner),
        job_(job),
        spec_(job->spec),
        world_(spec_.plan.world_size()),
        dp_shard_(spec_.plan.mesh().dp_shard()),
        dp_replicate_(std::max(1, spec_.plan.mesh().dp_replicate())),
        total_(job->total_steps),
        fingerprint_(spec_.plan.fingerprint()),
        job_root_(runner->options_.checkpoint_dir + "/" + job->id),
        pool_(world_) {}

  // `recovering`: after a fault or a restart. Returns the failure, if any.
  absl::Status Run(bool recovering) {
    SHARDD_RETURN_IF_ERROR(Connect());
    if (!runner_->options_.checkpoint_dir.empty()) {
      // No save of this job is in progress: what a crash left of one (or
      // of a retention deletion) goes.
      absl::StatusOr<int> stale = checkpoint::RemoveStaleTemporaries(job_root_);
      if (!stale.ok()) {
        SHARDD_LOG(WARNING) << "job " << job_->id << ": " << stale.status();
      } else if (*stale > 0) {
        SHARDD_LOG(INFO) << "job " << job_->id << ": removed " << *stale
                         << " unfinished save(s) or deletion(s)";
      }
    }
    // Built once: a program can be long.
    *execute_.mutable_program() = spec_.program;
    *eval_execute_.mutable_program() = spec_.eval_program;
    start_ = job_->first_step;
    load_from_ = spec_.config.resume_from();
    keep_.assign(world_, false);
    if (recovering) SHARDD_RETURN_IF_ERROR(ChooseRecovery());
    SHARDD_RETURN_IF_ERROR(LoadPlan());
    if (!heal_sources_.empty()) SHARDD_RETURN_IF_ERROR(HealReplicas());
    if (!load_from_.empty()) {
      SHARDD_RETURN_IF_ERROR(LoadCheckpoint(load_from_, start_));
      SHARDD_LOG(INFO) << "job " << job_->id << ": loaded " << load_from_
                       << " at step " << start_;
    }
    if (recovering) {
      SHARDD_LOG(INFO) << "job " << job_->id << " recovered: " << recovery_;
      v1::StepEvent event;
      event.set_job_id(job_->id);
      event.set_step(start_);
      event.set_total_steps(total_);
      event.set_recovery(recovery_);
      event.set_checkpoint(load_from_);
      SHARDD_RETURN_IF_ERROR(runner_->Publish(job_, std::move(event)));
      // An evaluation the fault interrupted runs again.
      int64_t last_eval = -1;
      {
        absl::MutexLock lock(&runner_->mu_);
        last_eval = job_->last_eval_step;
      }
      if (start_ > 0 && EvalDue(start_) && last_eval < start_) {
        SHARDD_RETURN_IF_ERROR(Evaluate(start_, load_from_));
      }
    }

    results_.assign(world_, v1::ExecuteResponse());
    for (int64_t step = start_; step < total_; ++step) {
      SHARDD_RETURN_IF_ERROR(ServeControls(&step, "", /*last=*/false));
      SHARDD_RETURN_IF_ERROR(RunStep(step));
    }
    return absl::OkStatus();
  }

 private:
  using RankCall = std::function<absl::Status(int, const WorkerCallOptions&)>;

  absl::Status OnAllRanks(const RankCall& call, absl::string_view what) {
    return runner_->RunOnAllRanks(snapshot_, &pool_, call, what);
  }

  // The live workers of ranks 0..W-1 and a client for each.
  absl::Status Connect() {
    if (absl::Status alive = runner_->workers_->CheckRanksAlive(world_);
        !alive.ok()) {
      // A worker that went away while the job was queued: worth waiting for.
      return absl::UnavailableError(alive.message());
    }
    snapshot_.assign(world_, WorkerSnapshot());
    for (const WorkerState& worker : runner_->workers_->List()) {
      if (worker.rank >= 0 && worker.rank < world_) {
        snapshot_[worker.rank] = {worker.address, worker.incarnation};
      }
    }
    // A worker dying between the check and here shows up at the first poll
    // (incarnation 0 never matches a registered worker).
    epoch_ = runner_->workers_->membership_epoch();
    clients_.resize(world_);
    for (int rank = 0; rank < world_; ++rank) {
      absl::StatusOr<std::unique_ptr<WorkerClient>> client =
          runner_->factory_(snapshot_[rank].address);
      if (!client.ok()) {
        return absl::Status(
            client.status().code(),
            absl::StrCat(RankLabel(rank, snapshot_[rank].address), ": ",
                         Describe(client.status())));
      }
      clients_[rank] = *std::move(client);
    }
    return absl::OkStatus();
  }

  // After a fault: what the workers still hold decides where the job goes
  // on (start_, load_from_, keep_, heal_sources_, recovery_).
  absl::Status ChooseRecovery() {
    std::vector<int64_t> held(world_, -1);
    SHARDD_RETURN_IF_ERROR(Prefixed(
        "recovery: GetStats: ",
        OnAllRanks(
            [&](int rank, const WorkerCallOptions& options) -> absl::Status {
              SHARDD_ASSIGN_OR_RETURN(v1::GetStatsResponse stats,
                                      clients_[rank]->GetStats(options));
              if (stats.job_id() == job_->id &&
                  stats.plan_fingerprint() == fingerprint_) {
                held[rank] = stats.optimizer_steps();
              }
              return absl::OkStatus();
            },
            "GetStats")));
    int64_t committed = 0;
    std::string last_checkpoint;
    {
      absl::MutexLock lock(&runner_->mu_);
      committed = job_->steps_done;
      last_checkpoint = job_->last_checkpoint;
    }
    const int64_t highest = *std::max_element(held.begin(), held.end());
    const bool all_hold =
        std::all_of(held.begin(), held.end(),
                    [&](int64_t steps) { return steps == highest; });
    // Holders must not be behind what was acknowledged.
    const bool usable = highest >= 0 && highest >= committed;
    std::vector<int32_t> sources(dp_shard_, -1);
    bool healable = usable && dp_replicate_ > 1;
    for (int s = 0; healable && s < dp_shard_; ++s) {
      for (int r = 0; r < dp_replicate_; ++r) {
        if (held[r * dp_shard_ + s] == highest) {
          sources[s] = r;
          break;
        }
      }
      healable = sources[s] >= 0;
    }
    if (usable && all_hold) {
      start_ = highest;
      keep_.assign(world_, true);
      load_from_.clear();
      recovery_ = absl::StrCat("every worker still held step ", highest,
                               "; rebuilt the collective groups");
    } else if (healable) {
      start_ = highest;
      std::vector<int> healed;
      for (int rank = 0; rank < world_; ++rank) {
        keep_[rank] = held[rank] == highest;
        if (!keep_[rank]) healed.push_back(rank);
      }
      heal_sources_ = sources;
      load_from_.clear();
      recovery_ = absl::StrCat("healed ranks ", FormatRankList(healed),
                               " from their replica peers at step ", highest,
                               " (no checkpoint, no lost step)");
    } else if (!last_checkpoint.empty()) {
      absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
          checkpoint::CheckpointReader::Open(runner_->options_.checkpoint_dir +
                                             "/" + last_checkpoint);
      SHARDD_RETURN_IF_ERROR(
          Prefixed(absl::StrCat("recovery: checkpoint ", last_checkpoint, ": "),
                   reader.status()));
      start_ = (*reader)->index().step;
      load_from_ = last_checkpoint;
      recovery_ = absl::StrCat("reloaded checkpoint ", last_checkpoint,
                               " at step ", start_);
      if (committed > start_) {
        absl::StrAppend(&recovery_, "; steps ", start_ + 1, "-", committed,
                        " run again");
      }
    } else {
      start_ = job_->first_step;
      load_from_.clear();
      recovery_ = absl::StrCat(
          "no worker state or checkpoint to resume from: "
          "started over from step ",
          start_);
    }
    return absl::OkStatus();
  }

  // The plan on every rank (keeping the state of the ranks in keep_): its
  // options for the worker to derive it from, when the job has them (a rank
  // whose derivation disagrees is sent the plan).
  absl::Status LoadPlan() {
    v1::LoadPlanRequest load;
    if (spec_.plan_options.has_value()) {
      *load.mutable_plan_options() = *spec_.plan_options;
      load.set_plan_fingerprint(spec_.plan.fingerprint());
      load.set_model_id(spec_.plan.model_id());
    } else {
      *load.mutable_plan() = spec_.plan;
    }
    *load.mutable_model() = spec_.model;
    *load.mutable_train() = spec_.config;
    load.set_seed(spec_.config.seed());
    load.set_job_id(job_->id);
    load.set_membership_epoch(epoch_);
    load.set_collective_timeout_ms(
        absl::ToInt64Milliseconds(runner_->options_.collective_timeout));
    loaded_.assign(world_, v1::LoadPlanResponse());
    // One request per rank (rank, keep_state), alive until its call ends.
    std::vector<v1::LoadPlanRequest> requests(world_, load);
    return Prefixed(
        "LoadPlan: ",
        runner_->RunOnAllRanksAsync(
            snapshot_,
            [&](int rank, const WorkerCallOptions& options,
                std::function<void(absl::Status)> finish) {
              v1::LoadPlanRequest* request = &requests[rank];
              request->set_rank(rank);
              request->set_keep_state(keep_[rank]);
              clients_[rank]->LoadPlanAsync(
                  *request, options, &loaded_[rank],
                  [this, rank, request, options,
                   finish = std::move(finish)](absl::Status status) mutable {
                    if (ErrorReasonOf(status) ==
                        kReasonPlanDerivationMismatch) {
                      SHARDD_LOG(WARNING)
                          << "job " << job_->id << ": rank " << rank
                          << " derives another plan (" << status.message()
                          << "); sending it the plan";
                      request->clear_plan_options();
                      request->clear_plan_fingerprint();
                      request->clear_model_id();
                      *request->mutable_plan() = spec_.plan;
                      clients_[rank]->LoadPlanAsync(
                          *request, options, &loaded_[rank],
                          [this, rank,
                           finish = std::move(finish)](absl::Status again) {
                            finish(CheckLoaded(rank, std::move(again)));
                          });
                      return;
                    }
                    finish(CheckLoaded(rank, std::move(status)));
                  });
            },
            "LoadPlan"));
  }

  // A rank's LoadPlan status, and with keep_state the step it kept.
  absl::Status CheckLoaded(int rank, absl::Status status) const {
    if (!status.ok()) return status;
    if (keep_[rank] && loaded_[rank].kept_step() != start_) {
      return absl::AbortedError(
          absl::StrCat("kept step ", loaded_[rank].kept_step(), " instead of ",
                       start_, " (its state changed during the recovery)"));
    }
    return absl::OkStatus();
  }

  absl::Status HealReplicas() {
    v1::HealReplicasRequest request;
    request.set_plan_fingerprint(fingerprint_);
    for (int32_t source : heal_sources_) request.add_source_replica(source);
    return Prefixed(
        "recovery: HealReplicas: ",
        OnAllRanks(
            [&](int rank, const WorkerCallOptions& options) -> absl::Status {
              SHARDD_ASSIGN_OR_RETURN(
                  v1::HealReplicasResponse response,
                  clients_[rank]->HealReplicas(request, options));
              if (response.step() != start_) {
                return absl::AbortedError(
                    absl::StrCat("holds step ", response.step(),
                                 " after healing, not ", start_));
              }
              return absl::OkStatus();
            },
            "HealReplicas"));
  }

  // Loads committed checkpoint `name` into every rank and checks that each
  // rank holds step `expected` afterwards.
  absl::Status LoadCheckpoint(const std::string& name, int64_t expected) {
    v1::LoadShardsRequest request;
    request.set_plan_fingerprint(fingerprint_);
    request.set_checkpoint_dir(name);
    std::vector<int64_t> steps(world_, -1);
    SHARDD_RETURN_IF_ERROR(Prefixed(
        absl::StrCat("LoadShards ", name, ": "),
        OnAllRanks(
            [&](int rank, const WorkerCallOptions& options) -> absl::Status {
              SHARDD_ASSIGN_OR_RETURN(
                  v1::LoadShardsResponse response,
                  clients_[rank]->LoadShards(request, options));
              steps[rank] = response.step();
              return absl::OkStatus();
            },
            "LoadShards")));
    for (int rank = 0; rank < world_; ++rank) {
      if (steps[rank] != expected) {
        return absl::FailedPreconditionError(absl::StrCat(
            "LoadShards ", name, ": ", RankLabel(rank, snapshot_[rank].address),
            " loaded step ", steps[rank], " but the checkpoint was at step ",
            expected, " when it was chosen (it was replaced meanwhile)"));
      }
    }
    return absl::OkStatus();
  }

  // What the plan's checkpoint takes per shard rank (computed once).
  absl::StatusOr<const std::vector<checkpoint::CheckpointBytes>*>
  CheckpointSizes() {
    if (!checkpoint_bytes_.has_value()) {
      SHARDD_ASSIGN_OR_RETURN(checkpoint_bytes_,
                              checkpoint::PlanCheckpointBytes(spec_.plan));
    }
    return &*checkpoint_bytes_;
  }

  // Free bytes a save of `bytes` asks for: 2% and 1 MiB more (the index,
  // file system overhead).
  static int64_t WithMargin(int64_t bytes) {
    return bytes + bytes / 50 + (int64_t{1} << 20);
  }

  // Saves the shards after `steps_done` steps; returns the checkpoint's
  // name relative to the checkpoint dir. `pinned` (on-demand saves): the
  // retention never deletes it. Each writing rank first checks its free
  // space against its file's size (RESOURCE_EXHAUSTED before writing).
  absl::StatusOr<std::string> Save(int64_t steps_done, bool pinned) {
    // The step may be saved already: by this step's periodic save (an
    // on-demand request then pins it), or before a rollback or a reload
    // past a corrupt checkpoint made the job run it again (the same state:
    // the steps are deterministic). A pinned one stands; another goes.
    const std::string dir_name = checkpoint::CheckpointDirName(steps_done);
    const std::string existing = absl::StrCat(job_root_, "/", dir_name);
    const std::string name = absl::StrCat(job_->id, "/", dir_name);
    std::error_code ec;
    if (std::filesystem::exists(existing, ec)) {
      absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> whole =
          checkpoint::CheckpointReader::Open(existing);
      if (whole.ok() && (pinned || checkpoint::IsPinned(existing))) {
        if (pinned) SHARDD_RETURN_IF_ERROR(checkpoint::PinCheckpoint(existing));
        return name;
      }
      SHARDD_RETURN_IF_ERROR(checkpoint::DeleteCheckpoint(
          job_root_, {dir_name, existing, steps_done}));
    }
    SHARDD_ASSIGN_OR_RETURN(const std::vector<checkpoint::CheckpointBytes>*
                                sizes,
                            CheckpointSizes());
    SHARDD_ASSIGN_OR_RETURN(const std::string tmp,
                            checkpoint::BeginCheckpoint(job_root_, steps_done));
    std::vector<checkpoint::RankFile> files(dp_shard_);
    absl::Status saved = pinned ? checkpoint::PinCheckpoint(tmp)
                                : absl::OkStatus();
    if (saved.ok()) {
      saved = OnAllRanks(
          [&](int rank, const WorkerCallOptions& options) -> absl::Status {
            // Replica 0 holds every shard once; the other replicas the same.
            if (rank >= dp_shard_) return absl::OkStatus();
            v1::SaveShardsRequest request;
            request.set_plan_fingerprint(fingerprint_);
            request.set_tmp_dir(absl::StrCat(
                job_->id, "/", std::filesystem::path(tmp).filename().string()));
            if (runner_->options_.check_checkpoint_space &&
                rank < static_cast<int>(sizes->size())) {
              request.set_required_free_bytes(
                  WithMargin((*sizes)[rank].total()));
            }
            SHARDD_ASSIGN_OR_RETURN(
                v1::SaveShardsResponse response,
                clients_[rank]->SaveShards(request, options));
            files[rank] = ToRankFile(response);
            return absl::OkStatus();
          },
          "SaveShards");
    }
    absl::StatusOr<std::string> committed;
    if (saved.ok()) {
      absl::StatusOr<checkpoint::CheckpointIndex> index =
          checkpoint::BuildIndex(spec_.plan, steps_done, files);
      if (index.ok()) {
        // The model goes with its weights (checkpoint export --hf).
        google::protobuf::util::JsonPrintOptions json_options;
        json_options.preserve_proto_field_names = true;
        const auto printed = google::protobuf::util::MessageToJsonString(
            spec_.model, &index->model_spec_json, json_options);
        if (!printed.ok()) index->model_spec_json.clear();
        // So does the schedule a resumed job continues.
        const auto train = google::protobuf::util::MessageToJsonString(
            spec_.config, &index->train_config_json, json_options);
        if (!train.ok()) index->train_config_json.clear();
      }
      committed = index.ok()
                      ? checkpoint::CommitCheckpoint(job_root_, tmp, *index)
                      : absl::StatusOr<std::string>(index.status());
    } else {
      committed = saved;
    }
    if (!committed.ok()) {
      std::error_code ignored;
      std::filesystem::remove_all(tmp, ignored);
      return committed.status();
    }
    return absl::StrCat(job_->id, "/",
                        checkpoint::CheckpointDirName(steps_done));
  }

  // The job's retention policy (TrainConfig.keep_checkpoints, keep_every):
  // the checkpoint it resumed from, when it is one of its own, is kept.
  checkpoint::RetentionPolicy Retention(int keep_last) const {
    checkpoint::RetentionPolicy policy;
    policy.keep_last = keep_last;
    policy.keep_every = spec_.config.keep_every();
    const std::string own = job_->id + "/";
    const std::string& resumed = spec_.config.resume_from();
    if (absl::StartsWith(resumed, own)) {
      policy.protect.insert(resumed.substr(own.size()));
    }
    return policy;
  }

  // Deletes what `policy` chooses among the job's committed checkpoints;
  // their names (relative to the checkpoint dir) are appended to *deleted.
  // A deletion that fails is logged and ends the round (the next save
  // retries); it never fails the job.
  void Prune(const checkpoint::RetentionPolicy& policy,
             std::vector<std::string>* deleted) {
    absl::StatusOr<std::vector<checkpoint::CheckpointInfo>> committed =
        checkpoint::ListCheckpoints(job_root_);
    if (!committed.ok()) {
      SHARDD_LOG(WARNING) << "job " << job_->id << ": retention: "
                          << committed.status();
      return;
    }
    for (const checkpoint::CheckpointInfo& victim :
         checkpoint::RetentionVictims(*committed, policy)) {
      const absl::Status s = checkpoint::DeleteCheckpoint(job_root_, victim);
      if (!s.ok()) {
        SHARDD_LOG(WARNING) << "job " << job_->id << ": retention: " << s;
        return;
      }
      deleted->push_back(absl::StrCat(job_->id, "/", victim.name));
      SHARDD_LOG(INFO) << "job " << job_->id << ": retention deleted "
                       << deleted->back();
      absl::MutexLock lock(&runner_->mu_);
      ++runner_->checkpoints_deleted_total_;
    }
  }

  // A periodic save after `steps_done` steps under the job's policies:
  // the space check (freeing what retention would delete after the save
  // when short, never the newest checkpoint), the save, then retention. A
  // save that cannot start or finish fails the job, or with
  // on_checkpoint_failure "skip" is reported in `event` and the job goes
  // on (the previous checkpoints untouched either way).
  absl::Status PeriodicSave(int64_t steps_done, const std::string& label,
                            v1::StepEvent* event) {
    const int keep = spec_.config.keep_checkpoints();
    std::vector<std::string> deleted;
    absl::Status room = EnoughRoom();
    if (!room.ok() && absl::IsResourceExhausted(room) && keep > 0) {
      Prune(Retention(std::max(keep - 1, 1)), &deleted);
      room = EnoughRoom();
    }
    absl::StatusOr<std::string> name =
        room.ok() ? Save(steps_done, /*pinned=*/false)
                  : absl::StatusOr<std::string>(room);
    if (!name.ok()) {
      const absl::Status failed =
          Prefixed(absl::StrCat(label, "checkpoint: "), name.status());
      {
        absl::MutexLock lock(&runner_->mu_);
        ++job_->checkpoint_failures;
        job_->last_checkpoint_error = std::string(failed.message());
        ++runner_->checkpoint_failures_total_;
      }
      if (spec_.config.on_checkpoint_failure() != "skip") return failed;
      SHARDD_LOG(WARNING) << "job " << job_->id << ": " << failed.message()
                          << " (on_checkpoint_failure skip: training on)";
      event->set_checkpoint_error(std::string(failed.message()));
      for (const std::string& d : deleted) event->add_checkpoints_deleted(d);
      return absl::OkStatus();
    }
    SHARDD_LOG(INFO) << "job " << job_->id << ": saved checkpoint " << *name;
    event->set_checkpoint(*name);
    if (keep > 0) Prune(Retention(keep), &deleted);
    for (const std::string& d : deleted) event->add_checkpoints_deleted(d);
    return absl::OkStatus();
  }

  // Whether the checkpoint directory's file system holds the plan's whole
  // checkpoint (every rank's file; the workers share the directory) plus
  // the margin. RESOURCE_EXHAUSTED with both figures when not.
  absl::Status EnoughRoom() {
    if (!runner_->options_.check_checkpoint_space) return absl::OkStatus();
    SHARDD_ASSIGN_OR_RETURN(const std::vector<checkpoint::CheckpointBytes>*
                                sizes,
                            CheckpointSizes());
    const int64_t need =
        WithMargin(checkpoint::SumCheckpointBytes(*sizes).total());
    std::error_code ec;
    std::filesystem::create_directories(job_root_, ec);
    SHARDD_ASSIGN_OR_RETURN(const int64_t free,
                            checkpoint::FreeBytes(job_root_));
    if (free >= need) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        "not saved: ", job_root_, " has ", free,
        " bytes free, the checkpoint needs ", need,
        " (its size from the plan plus a margin)"));
  }

  // Serves the on-demand saves and rollbacks queued so far, between steps
  // (`*step` steps done; `saved`: the checkpoint already committed for it).
  // A rollback moves *step back and publishes a recovery event; with
  // `last`, the job is about to end and rollbacks are refused.
  absl::Status ServeControls(int64_t* step, std::string saved, bool last) {
    while (true) {
      Control control;
      {
        absl::MutexLock lock(&runner_->mu_);
        if (job_->controls.empty()) return absl::OkStatus();
        control = std::move(job_->controls.front());
        job_->controls.pop_front();
      }
      if (control.save) {
        absl::StatusOr<std::string> name =
            saved.empty() ? Save(*step, /*pinned=*/true)
                          : absl::StatusOr<std::string>(saved);
        // A periodic save of this step counts as the asked-for one; pin it.
        if (name.ok() && !saved.empty()) {
          const absl::Status pinned = checkpoint::PinCheckpoint(
              runner_->options_.checkpoint_dir + "/" + saved);
          if (!pinned.ok()) {
            SHARDD_LOG(WARNING) << "job " << job_->id << ": " << pinned;
          }
        }
        if (!name.ok()) {
          control.done(name.status());
          // The workers may be gone: the job's next step tells.
          continue;
        }
        saved = *name;
        {
          absl::MutexLock lock(&runner_->mu_);
          job_->last_checkpoint = saved;
        }
        SHARDD_LOG(INFO) << "job " << job_->id << ": saved checkpoint " << saved
                         << " on request";
        control.done(CheckpointResult{saved, *step});
        continue;
      }
      absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
          checkpoint::CheckpointReader::Open(runner_->options_.checkpoint_dir +
                                             "/" + control.checkpoint);
      if (!reader.ok()) {
        control.done(reader.status());
        continue;
      }
      const int64_t target = (*reader)->index().step;
      if (last || target >= total_) {
        control.done(absl::InvalidArgumentError(absl::StrCat(
            "checkpoint: ", control.checkpoint, " holds step ", target,
            (last ? " but the job has just run its last step"
                  : absl::StrCat(", not before the job's last step ",
                                 total_)))));
        continue;
      }
      const absl::Status loaded_status =
          LoadCheckpoint(control.checkpoint, target);
      if (!loaded_status.ok()) {
        control.done(loaded_status);
        // The shards may be half overwritten: recover (or fail) the job.
        return loaded_status;
      }
      *step = target;
      saved.clear();
      control.done(CheckpointResult{control.checkpoint, target});
      v1::StepEvent event;
      event.set_job_id(job_->id);
      event.set_step(target);
      event.set_total_steps(total_);
      event.set_checkpoint(control.checkpoint);
      event.set_recovery(absl::StrCat("rolled back to checkpoint ",
                                      control.checkpoint, " at step ", target,
                                      " on request"));
      SHARDD_RETURN_IF_ERROR(runner_->Publish(job_, std::move(event)));
    }
  }

  // Step `step` (0-based) on every rank, one call per step or per command,
  // then its event (with the periodic checkpoint, and the last step's
  // queued saves).
  absl::Status RunStep(int64_t step) {
    const std::string label = absl::StrCat(StepLabel(step + 1, total_), ": ");
    if (runner_->stopping()) {
      return absl::UnavailableError(
          absl::StrCat(label, "the coordinator is shutting down"));
    }
    const absl::Time begin = absl::Now();
    std::vector<v1::ExecuteResponse>& results = results_;
    if (!spec_.config.fine_grained()) {
      execute_.mutable_program()->set_step(step);
      SHARDD_RETURN_IF_ERROR(
          Prefixed(label, runner_->RunOnAllRanksAsync(
                              snapshot_,
                              [&](int rank, const WorkerCallOptions& options,
                                  std::function<void(absl::Status)> finish) {
                                clients_[rank]->ExecuteAsync(execute_, options,
                                                             &results[rank],
                                                             std::move(finish));
                              },
                              "Execute")));
    } else {
      const int commands = spec_.program.commands_size();
      for (int i = 0; i < commands; ++i) {
        v1::RunCommandRequest request;
        request.set_plan_fingerprint(spec_.program.plan_fingerprint());
        request.set_step(step);
        *request.mutable_command() = spec_.program.commands(i);
        request.set_begin_step(i == 0);
        request.set_end_step(i == commands - 1);
        request.set_index(i);
        SHARDD_RETURN_IF_ERROR(Prefixed(
            absl::StrCat(label, "commands[", i, "] (",
                         CommandToString(spec_.program.commands(i)), "): "),
            OnAllRanks(
                [&](int rank,
                    const WorkerCallOptions& options) -> absl::Status {
                  SHARDD_ASSIGN_OR_RETURN(
                      v1::ExecuteResponse response,
                      clients_[rank]->RunCommand(request, options));
                  if (i == commands - 1) results[rank] = std::move(response);
                  return absl::OkStatus();
                },
                "RunCommand")));
      }
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
    v1::StepEvent event = StepEventOf(step, results, seconds);
    const int32_t checkpoint_every = spec_.config.checkpoint_every();
    if (checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) {
      SHARDD_RETURN_IF_ERROR(PeriodicSave(step + 1, label, &event));
    }
    // With an evaluation after it, the evaluation's event ends the job.
    const bool eval = EvalDue(step + 1);
    event.set_done(event.done() && !eval);
    const std::string checkpoint = event.checkpoint();
    if (event.done()) {
      // Saves asked for during the last step are served before the end.
      int64_t steps_done = step + 1;
      SHARDD_RETURN_IF_ERROR(
          ServeControls(&steps_done, checkpoint, /*last=*/true));
    }
    SHARDD_RETURN_IF_ERROR(runner_->Publish(job_, std::move(event)));
    return eval ? Evaluate(step + 1, checkpoint) : absl::OkStatus();
  }

  // Whether the job evaluates after `steps_done` steps: every eval_every
  // steps and after the last one.
  bool EvalDue(int64_t steps_done) const {
    if (spec_.eval_program.commands().empty()) return false;
    const int32_t every = spec_.config.eval_every();
    return steps_done == total_ || (every > 0 && steps_done % every == 0);
  }

  // The held-out loss after `steps_done` steps: the eval program on every
  // rank for eval batches 0..K-1, token-weighted over ranks and batches,
  // published as its own event (which ends the job after its last step;
  // `saved` names a checkpoint committed for that step).
  absl::Status Evaluate(int64_t steps_done, const std::string& saved) {
    const std::string label =
        absl::StrCat("evaluation after step ", steps_done, "/", total_, ": ");
    if (runner_->stopping()) {
      return absl::UnavailableError(
          absl::StrCat(label, "the coordinator is shutting down"));
    }
    int64_t tokens = 0;
    int64_t all_gathers = 0;
    double weighted_loss = 0.0;
    std::vector<v1::ExecuteResponse> results(world_);
    for (int32_t k = 0; k < spec_.config.eval_batches(); ++k) {
      eval_execute_.mutable_program()->set_step(k);
      SHARDD_RETURN_IF_ERROR(Prefixed(
          absl::StrCat(label, "eval batch ", k, ": "),
          runner_->RunOnAllRanksAsync(
              snapshot_,
              [&](int rank, const WorkerCallOptions& options,
                  std::function<void(absl::Status)> finish) {
                clients_[rank]->ExecuteAsync(eval_execute_, options,
                                             &results[rank], std::move(finish));
              },
              "Execute")));
      int64_t batch_gathers = 0;
      for (const v1::ExecuteResponse& result : results) {
        tokens += result.tokens();
        weighted_loss += result.loss() * static_cast<double>(result.tokens());
        batch_gathers = std::max(batch_gathers, result.all_gathers());
      }
      all_gathers += batch_gathers;
    }
    v1::StepEvent event;
    event.set_job_id(job_->id);
    event.set_step(steps_done);
    event.set_total_steps(total_);
    event.set_eval_loss(tokens > 0 ? weighted_loss / static_cast<double>(tokens)
                                   : 0.0);
    event.set_eval_tokens(tokens);
    event.set_all_gathers(all_gathers);
    event.set_done(steps_done == total_);
    if (event.done()) {
      int64_t at = steps_done;
      SHARDD_RETURN_IF_ERROR(ServeControls(&at, saved, /*last=*/true));
    }
    SHARDD_LOG(INFO) << "job " << job_->id << ": eval loss "
                     << event.eval_loss() << " after step " << steps_done;
    return runner_->Publish(job_, std::move(event));
  }

  // The event of step `step` from every rank's result: the token-weighted
  // loss, rank 0's global norm, the largest peaks and collective counts.
  v1::StepEvent StepEventOf(int64_t step,
                            const std::vector<v1::ExecuteResponse>& results,
                            double seconds) const {
    int64_t tokens = 0;
    double weighted_loss = 0.0;
    double plain_loss = 0.0;
    int64_t peak = 0;
    int64_t activations = 0;
    int64_t all_gathers = 0;
    int64_t reduce_scatters = 0;
    int64_t all_to_alls = 0;
    int64_t all_to_all_bytes = 0;
    for (const v1::ExecuteResponse& result : results) {
      all_to_alls = std::max(all_to_alls, result.all_to_alls());
      all_to_all_bytes = std::max(all_to_all_bytes, result.all_to_all_bytes());
      tokens += result.tokens();
      weighted_loss += result.loss() * static_cast<double>(result.tokens());
      plain_loss += result.loss();
      peak = std::max(peak, result.peak_unsharded_bytes());
      activations = std::max(activations, result.peak_activation_bytes());
      all_gathers = std::max(all_gathers, result.all_gathers());
      reduce_scatters = std::max(reduce_scatters, result.reduce_scatters());
    }
    v1::StepEvent event;
    event.set_job_id(job_->id);
    event.set_step(step + 1);
    event.set_loss(tokens > 0 ? weighted_loss / static_cast<double>(tokens)
                              : plain_loss / world_);
    event.set_tokens(tokens);
    event.set_step_seconds(seconds);
    event.set_tokens_per_second(
        seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
    // Every rank computes the same global norm (an all-reduce).
    event.set_grad_norm(results[0].grad_norm());
    event.set_lr(results[0].lr());
    event.set_peak_unsharded_bytes(peak);
    event.set_planned_peak_unsharded_bytes(
        spec_.plan.memory().peak_unsharded_bytes());
    event.set_peak_activation_bytes(activations);
    event.set_planned_peak_activation_bytes(
        spec_.plan.memory().peak_activation_bytes());
    event.set_all_gathers(all_gathers);
    event.set_reduce_scatters(reduce_scatters);
    event.set_all_to_alls(all_to_alls);
    event.set_all_to_all_bytes(all_to_all_bytes);
    event.set_data_entropy_rate(loaded_[0].data_entropy_rate());
    event.set_data_one_token_loss(loaded_[0].data_one_token_loss());
    event.set_total_steps(total_);
    event.set_done(step + 1 == total_);
    return event;
  }

  JobRunner* const runner_;
  Job* const job_;
  // The spec is immutable once submitted.
  const JobSpec& spec_;
  const int world_;
  const int dp_shard_;
  const int dp_replicate_;
  const int32_t total_;
  const uint64_t fingerprint_;
  const std::string job_root_;
  std::optional<std::vector<checkpoint::CheckpointBytes>> checkpoint_bytes_;
  RankPool pool_;
  std::vector<WorkerSnapshot> snapshot_;
  uint64_t epoch_ = 0;
  std::vector<std::unique_ptr<WorkerClient>> clients_;
  // Where the job starts and how: the state the ranks keep, the replicas
  // that heal the others (by shard rank; empty: none), the checkpoint to
  // load, and the recovery's description.
  int64_t start_ = 0;
  std::vector<bool> keep_;
  std::vector<int32_t> heal_sources_;
  std::string load_from_;
  std::string recovery_;
  std::vector<v1::LoadPlanResponse> loaded_;
  // The steps' request (the program) and every rank's last result.
  v1::ExecuteRequest execute_;
  v1::ExecuteRequest eval_execute_;  // The eval program (batch in `step`).
  std::vector<v1::ExecuteResponse> results_;
};

absl::Status JobRunner::RunSteps(Job* job, bool recovering) {
  return Attempt(this, job).Run(recovering);
}

}  // namespace shardd
