#ifndef SHARDD_WORKER_EXEC_LR_SCHEDULE_H_
#define SHARDD_WORKER_EXEC_LR_SCHEDULE_H_

// The learning rate of each optimizer step (TrainConfig.lr_schedule), as
// PyTorch's schedulers compute it, so a job equals the same schedule there:
//
//   constant  lr at every step
//   cosine    warmup, then lr_min + (lr - lr_min) (1 + cos(pi t / T)) / 2
//   linear    warmup, then lr + (lr_min - lr) t / T
//
// for the t-th step after the warmup (t in [0, T], held at T after),
// T = decay_steps - warmup_steps. The warmup is linear from lr / W to lr
// over the first W steps: step i < W runs at lr (i + 1) / W.
// torch.optim.lr_scheduler's equivalents: SequentialLR of LinearLR(1 / W,
// 1, W - 1) and CosineAnnealingLR(T, lr_min) or LinearLR(1, lr_min / lr, T),
// milestone W (tests/reference/lr_schedule_test.py checks the sequences).

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace shardd {

// The shape of a schedule; its peak `lr` (AdamW's) is given to At.
struct LrSchedule {
  enum class Kind { kConstant, kCosine, kLinear };
  Kind kind = Kind::kConstant;
  int64_t warmup_steps = 0;  // W >= 0
  int64_t decay_steps = 0;   // W + T: where the decay reaches lr_min
  double min_lr = 0.0;       // in [0, lr]

  // The rate of optimizer step `step` (0-based: the job's first step is
  // 0, a resumed one continues the count) at peak `lr`.
  double At(double lr, int64_t step) const;
};

// "constant", "cosine" or "linear"; INVALID_ARGUMENT naming
// train.lr_schedule and the allowed values otherwise.
absl::Status ParseLrScheduleKind(const std::string& name,
                                 LrSchedule::Kind* kind);
const char* LrScheduleKindName(LrSchedule::Kind kind);

// INVALID_ARGUMENT naming the field (train.lr, train.warmup_steps,
// train.decay_steps, train.min_lr): the peak lr not finite or <= 0, a
// negative warmup, decay_steps below warmup_steps for a decaying schedule,
// min_lr not finite, negative or above lr.
absl::Status ValidateLrSchedule(const LrSchedule& s, double lr);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_LR_SCHEDULE_H_
