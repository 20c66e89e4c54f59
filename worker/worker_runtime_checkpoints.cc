// WorkerRuntime's checkpoint RPCs (SaveShards, LoadShards) and replica
// healing (HealReplicas); the rest of the class is in worker_runtime.cc.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/shards/shard_checkpoint.h"
#include "worker/shards/shard_state_transfer.h"
#include "worker/worker_runtime.h"

#include "checkpoint/file_util.h"
#include "worker/worker_runtime_internal.h"

namespace shardd {

absl::StatusOr<StepExecutor*> WorkerRuntime::CheckpointExecutorLocked(
    uint64_t fingerprint) {
  if (options_.checkpoint_root.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints: this worker has no checkpoint root (start it with "
        "--checkpoint-root, the coordinator's --checkpoint-dir)");
  }
  SHARDD_RETURN_IF_ERROR(CheckJobLocked(fingerprint));
  if (job_->step_open) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoints: step ", job_->step,
                     " is open (fine-grained mode); end it first"));
  }
  // Host or device shards alike (a GPU's go through one host copy).
  return &job_->steps->executor();
}

absl::StatusOr<v1::SaveShardsResponse> WorkerRuntime::SaveShards(
    const v1::SaveShardsRequest& request) {
  absl::MutexLock lock(&mu_);
  SHARDD_ASSIGN_OR_RETURN(StepExecutor * executor,
                          CheckpointExecutorLocked(request.plan_fingerprint()));
  if (job_->replica_rank != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SaveShards: rank ", job_->rank, " is replica ", job_->replica_rank,
        "; only replica 0 saves (the replicas hold the same shards)"));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const std::string dir,
      ResolveUnderRoot(options_.checkpoint_root, request.tmp_dir(), "tmp_dir"));
  // Nothing is written when the file cannot fit: a full disk mid-write
  // would fail the same save later, after the I/O.
  SHARDD_RETURN_IF_ERROR(checkpoint::CheckFreeBytes(
      dir, request.required_free_bytes(),
      absl::StrCat("SaveShards on rank ", job_->rank)));
  absl::StatusOr<checkpoint::RankFile> saved =
      SaveRankShards(job_->plan, *executor->shard_state(), dir,
                     job_->shard_rank);
  if (!saved.ok()) return StepError(saved.status());
  v1::SaveShardsResponse response;
  response.set_file_name(saved->file.name);
  response.set_size_bytes(saved->file.size_bytes);
  response.set_xxh64(saved->file.xxh64);
  response.set_shard_rank(job_->shard_rank);
  for (const checkpoint::TensorChunk& chunk : saved->chunks) {
    v1::CheckpointChunk* out = response.add_chunks();
    out->set_tensor(chunk.tensor);
    out->set_dtype(chunk.dtype);
    out->mutable_global_shape()->Add(chunk.global_shape.begin(),
                                     chunk.global_shape.end());
    out->set_file(chunk.chunk.file);
    out->set_file_tensor(chunk.chunk.tensor);
    out->set_begin(chunk.chunk.begin);
    out->set_end(chunk.chunk.end);
  }
  SHARDD_LOG(INFO) << "rank " << job_->rank << " saved "
                   << saved->file.size_bytes << " bytes to " << dir << "/"
                   << saved->file.name;
  if (options_.debug_save_delay > absl::ZeroDuration()) {
    // The file is written and fsynced; the answer is not sent yet.
    SHARDD_LOG(WARNING) << "rank " << job_->rank << ": --debug-save-delay: "
                        << "sleeping " << options_.debug_save_delay
                        << " before answering SaveShards";
    absl::SleepFor(options_.debug_save_delay);
  }
  return response;
}

absl::StatusOr<v1::LoadShardsResponse> WorkerRuntime::LoadShards(
    const v1::LoadShardsRequest& request) {
  absl::MutexLock lock(&mu_);
  SHARDD_ASSIGN_OR_RETURN(StepExecutor * executor,
                          CheckpointExecutorLocked(request.plan_fingerprint()));
  SHARDD_ASSIGN_OR_RETURN(
      const std::string dir,
      ResolveUnderRoot(options_.checkpoint_root, request.checkpoint_dir(),
                       "checkpoint_dir"));
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointReader>> reader =
      checkpoint::CheckpointReader::Open(dir);
  if (!reader.ok()) return StepError(reader.status());
  // Every file is checked before any shard changes, so a corrupted
  // checkpoint leaves the freshly initialized shards alone.
  SHARDD_RETURN_IF_ERROR(StepError((*reader)->VerifyAll()));
  absl::Cleanup publish = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    PublishJobLocked();
  };
  absl::StatusOr<int64_t> step = LoadRankShards(
      job_->plan, executor->shard_state(), reader->get(), job_->shard_rank);
  if (!step.ok()) {
    // The shards may be partly overwritten: nothing to keep_state.
    job_->state_lost = true;
    return StepError(step.status());
  }
  if (const absl::Status restored = executor->RestoreOptimizerSteps(*step);
      !restored.ok()) {
    job_->state_lost = true;
    return StepError(restored);
  }
  SHARDD_LOG(INFO) << "rank " << job_->rank << " loaded checkpoint " << dir
                   << " (step " << *step << ")";
  v1::LoadShardsResponse response;
  response.set_step(*step);
  return response;
}

absl::StatusOr<v1::HealReplicasResponse> WorkerRuntime::HealReplicas(
    const v1::HealReplicasRequest& request) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(CheckJobLocked(request.plan_fingerprint()));
  if (job_->step_open) {
    return absl::FailedPreconditionError(
        absl::StrCat("HealReplicas: step ", job_->step,
                     " is open (fine-grained mode); end it first"));
  }
  StepExecutor* executor = &job_->steps->executor();
  // The replicate group of the executor's own memory: Gloo for host
  // shards, NCCL for GPU shards (broadcast in place on the device).
  Communicator* replicas = executor->replica_group();
  const int dp_shard = job_->plan.mesh().dp_shard();
  const int dp_replicate = job_->plan.mesh().dp_replicate();
  if (dp_replicate < 2 || replicas == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("HealReplicas: the plan has no replicas (dp_replicate ",
                     dp_replicate, "): there is nothing to heal from"));
  }
  if (request.source_replica_size() != dp_shard) {
    return absl::InvalidArgumentError(
        absl::StrCat("source_replica: needs one entry per shard rank (",
                     dp_shard, "), got ", request.source_replica_size()));
  }
  for (int s = 0; s < dp_shard; ++s) {
    const int source = request.source_replica(s);
    if (source < -1 || source >= dp_replicate) {
      return absl::InvalidArgumentError(
          absl::StrCat("source_replica[", s, "]: must be in [-1, ",
                       dp_replicate, ") (-1 = leave the group), got ", source));
    }
  }
  absl::Cleanup publish = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    PublishJobLocked();
  };
  v1::HealReplicasResponse response;
  const int root = request.source_replica(job_->shard_rank);
  int64_t steps = executor->optimizer_steps();
  if (root < 0) {
    response.set_step(steps);
    return response;
  }
  absl::StatusOr<int64_t> received =
      BroadcastShardState(executor->shard_state(), &steps, replicas, root,
                          job_->collective_timeout);
  absl::Status status = received.status();
  if (status.ok()) status = executor->RestoreOptimizerSteps(steps);
  if (!status.ok()) {
    const bool receiver = job_->replica_rank != root;
    // FAILED_PRECONDITION comes before any state moved (layouts differ, or
    // the group was already broken).
    if (receiver && status.code() != absl::StatusCode::kFailedPrecondition) {
      job_->state_lost = true;
    }
    const absl::Status error = absl::AbortedError(
        absl::StrCat("rank ", job_->rank, " (job ", job_->job_id, " epoch ",
                     job_->membership_epoch, "): HealReplicas from replica ",
                     root, " of shard rank ", job_->shard_rank, " failed",
                     job_->state_lost ? " and this rank's state is lost" : "",
                     "; LoadPlan again: ", status.ToString()));
    job_->failed = error;
    SHARDD_LOG(WARNING) << error.ToString();
    return error;
  }
  SHARDD_LOG(INFO) << "rank " << job_->rank << " healed shard rank "
                   << job_->shard_rank << " from replica " << root << ": step "
                   << steps << ", received " << *received << " bytes";
  response.set_step(steps);
  response.set_received_bytes(*received);
  return response;
}

}  // namespace shardd
