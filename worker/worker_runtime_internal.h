#ifndef SHARDD_WORKER_WORKER_RUNTIME_INTERNAL_H_
#define SHARDD_WORKER_WORKER_RUNTIME_INTERNAL_H_

// WorkerRuntime's per-job state, shared by its .cc files (worker_runtime.cc:
// plans and steps; worker_runtime_checkpoints.cc: checkpoint RPCs and
// replica healing). Not part of the interface.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_runner.h"
#include "worker/shards/shard_state_transfer.h"
#include "worker/worker_runtime.h"

namespace shardd {

struct WorkerRuntime::Job {
  v1::ShardingPlan plan;
  v1::TrainConfig train;  // Resolved (defaults filled in).
  std::string job_id;
  uint64_t membership_epoch = 0;
  absl::Duration collective_timeout = absl::Seconds(60);
  int rank = 0;
  int shard_rank = 0;
  int replica_rank = 0;
  double entropy_rate = 0.0;    // SequenceSource::BestLoss.
  double one_token_loss = 0.0;  // SequenceSource::OneTokenLoss.
  std::unique_ptr<data::BatchSampler> sampler;
  // The evaluation data (train.eval_data_path, read in order); null
  // without it. Eval batch k is its step k.
  std::unique_ptr<data::BatchSampler> eval_sampler;
  std::unique_ptr<Communicator> shard_group;
  std::unique_ptr<Communicator> replicas;
  // Slice groups by size, for units resharded to a smaller group.
  std::map<int, std::unique_ptr<Communicator>> slice_groups;
  // Expert parallelism (plan.mesh.ep > 1): the ep_shard and ep groups.
  std::unique_ptr<Communicator> ep_shard_group;
  std::unique_ptr<Communicator> ep_group;
  // Declared last: destroyed first, while the communicators still exist.
  // A device runner owns its own (NCCL) communicators.
  std::unique_ptr<StepRunner> steps;

  // The fine-grained step this runtime believes open (the executor decides;
  // this only checks `step` and `index`).
  bool step_open = false;
  int64_t step = 0;
  int next_index = 0;

  // Set when a HealReplicas broadcast failed (the executor's own health
  // covers failed steps).
  absl::Status failed;
  // The shards no longer hold a committed step (a broadcast or checkpoint
  // load failed part-way): keep_state must not keep them.
  bool state_lost = false;
};

struct WorkerRuntime::KeptState {
  std::string job_id;
  uint64_t plan_fingerprint = 0;
  int64_t optimizer_steps = 0;
  ShardStateSnapshot snapshot;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_WORKER_RUNTIME_INTERNAL_H_
