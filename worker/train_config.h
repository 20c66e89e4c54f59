#ifndef SHARDD_WORKER_TRAIN_CONFIG_H_
#define SHARDD_WORKER_TRAIN_CONFIG_H_

// A job's training config as the worker uses it: zero fields take the
// defaults documented on TrainConfig in proto/coordinator.proto.

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"
#include "proto/coordinator.pb.h"
#include "worker/exec/lr_schedule.h"
#include "worker/exec/optimizer_options.h"
#include "worker/model/block_diffusion.h"

namespace shardd {

// Defaults for TrainConfig fields left at 0 (see proto/coordinator.proto).
inline constexpr double kDefaultLearningRate = 3e-3;
inline constexpr double kDefaultBeta1 = 0.9;
inline constexpr double kDefaultBeta2 = 0.95;
inline constexpr double kDefaultEps = 1e-8;
inline constexpr double kDefaultWeightDecay = 0.0;
inline constexpr double kDefaultGradClip = 1.0;
inline constexpr int64_t kDefaultCollectiveTimeoutMs = 60000;
inline constexpr double kDefaultMuonLr = 0.02;
inline constexpr double kDefaultMuonMomentum = 0.95;
inline constexpr int kDefaultMuonNsSteps = 5;

// `train` with its zero fields replaced by the defaults, for a job of
// `world_size` data-parallel ranks whose plan's step has `plan_microbatches`
// micro-batches (0 counts as 1). microbatches 0 takes the plan's. A
// negative grad_clip (clipping off) stays negative.
// Errors: INVALID_ARGUMENT naming the field: global_batch < 1, seq_len < 1,
// microbatches < 0 or different from the plan's, global_batch not divisible
// by world_size * microbatches (naming global_batch, the world size and
// microbatches), lr, eps or weight_decay negative or not finite, a beta
// outside [0, 1), grad_clip not finite, world_size < 1, a diffusion field
// out of its range (ValidateDiffusionTraining), a learning-rate schedule
// ValidateLrSchedule or ParseLrScheduleKind rejects, an optimizer
// ValidateOptimizerOptions rejects (optimizer comes back named, the muon_*
// fields with their defaults). Every diffusion field
// comes back set (its default when unset); lr_schedule comes back named and
// decay_steps 0 as the job's steps.
absl::StatusOr<v1::TrainConfig> ResolveTrainConfig(const v1::TrainConfig& train,
                                                   int world_size,
                                                   int plan_microbatches);

// The AdamW hyper-parameters of a resolved train config (lr, betas, eps,
// weight decay).
kernels::AdamWConfig AdamWConfigOf(const v1::TrainConfig& train);

// The optimizer of a resolved train config.
OptimizerOptions OptimizerOptionsOf(const v1::TrainConfig& train);

// The learning-rate schedule of a resolved train config (its peak is
// train.lr, AdamWConfigOf's).
LrSchedule LrScheduleOf(const v1::TrainConfig& train);

// The block-diffusion knobs of a train config: its set fields, the defaults
// (DiffusionTrainingOptions) for the rest.
DiffusionTrainingOptions DiffusionOptionsOf(const v1::TrainConfig& train);

}  // namespace shardd

#endif  // SHARDD_WORKER_TRAIN_CONFIG_H_
