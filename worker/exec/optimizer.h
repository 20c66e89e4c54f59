#ifndef SHARDD_WORKER_EXEC_OPTIMIZER_H_
#define SHARDD_WORKER_EXEC_OPTIMIZER_H_

// The optimizer OPTIMIZER_STEP applies to a rank's master shards, one unit
// at a time, in two phases so that a step still commits fully or not at all
// on a rank (docs/design.md, "Step execution"):
//
//   Prepare(u)  computes the unit's update without changing the committed
//               state (parameters, moments); it may run collectives (Muon
//               all-gathers its update matrices) and so may fail;
//   Apply(u)    commits the prepared update: parameters, moments, the
//               compute-dtype copy. On the host it cannot fail; on a
//               device only a launch can (the shards are then lost).
//
// The backend prepares every unit before it applies any; after a failed
// Prepare it calls Discard and applies none. The gradients are already
// reduced and clipped. An optimizer is written once, against
// OptimizerShards (optimizer_shards.h): the CPU and GPU backends give it
// their memory and arithmetic. optimizer_registry.h builds one by name.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "worker/exec/optimizer_shards.h"

namespace shardd {

struct OptimizerStepContext {
  int64_t step = 1;  // 1-based: the optimizer step being applied.
  // This step's AdamW learning rate (the schedule at the peak), and the
  // schedule's factor (lr / peak) that scales other optimizers' own peaks.
  double lr = 0.0;
  double lr_factor = 1.0;
  std::string label;  // The command, for errors.
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual absl::string_view name() const = 0;
  virtual absl::Status Prepare(OptimizerShards* shards, int unit,
                               const OptimizerStepContext& step) = 0;
  virtual absl::Status Apply(OptimizerShards* shards, int unit,
                             const OptimizerStepContext& step) = 0;
  // Forgets every unit's prepared update (after a failed Prepare).
  virtual void Discard(OptimizerShards* shards) = 0;
};

// One optimizer step over every unit, as both backends run it: Prepare
// each unit (collectives included) before any Apply, so a failed Prepare
// leaves the last committed state (it discards every prepared update and
// returns its error with *partly_applied false). An Apply's error (a
// device launch) comes back with *partly_applied true: part of the update
// may be committed.
inline absl::Status StepOptimizer(Optimizer& optimizer, OptimizerShards* shards,
                                  const OptimizerStepContext& step,
                                  bool* partly_applied) {
  *partly_applied = false;
  for (int u = 0; u < shards->num_units(); ++u) {
    const absl::Status prepared = optimizer.Prepare(shards, u, step);
    if (!prepared.ok()) {
      optimizer.Discard(shards);
      return prepared;
    }
  }
  for (int u = 0; u < shards->num_units(); ++u) {
    const absl::Status applied = optimizer.Apply(shards, u, step);
    if (!applied.ok()) {
      *partly_applied = true;
      return applied;
    }
  }
  return absl::OkStatus();
}

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_OPTIMIZER_H_
