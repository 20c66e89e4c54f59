#ifndef SHARDD_WORKER_EXEC_OPTIMIZER_H_
#define SHARDD_WORKER_EXEC_OPTIMIZER_H_

// The optimizer a CPU backend's OPTIMIZER_STEP applies to a rank's master
// shards, one unit at a time, in two phases so that a step still commits
// fully or not at all on a rank (docs/design.md, "Step execution"):
//
//   Prepare(u)  computes the unit's update without changing the committed
//               state (parameters, moments); it may run collectives (Muon
//               all-gathers its update matrices) and so may fail;
//   Apply(u)    commits the prepared update: parameters, moments, the
//               compute-dtype copy. It cannot fail.
//
// The backend prepares every unit before it applies any; after a failed
// Prepare it calls Discard and applies none. The gradients are already
// reduced and clipped. optimizer_registry.h builds one by name.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {

// Runs `collective` where the backend runs its collectives (CpuBackend: on
// its communication queue, in program order) and waits for it. `what` names
// it in errors.
using CollectiveRunner = std::function<absl::Status(
    const std::string& what, std::function<absl::Status()> collective)>;

struct OptimizerStepContext {
  int64_t step = 1;  // 1-based: the optimizer step being applied.
  // This step's AdamW learning rate (the schedule at the peak), and the
  // schedule's factor (lr / peak) that scales other optimizers' own peaks.
  double lr = 0.0;
  double lr_factor = 1.0;
  std::string label;  // The command, for errors.
  Communicator* shard_group = nullptr;
  absl::Duration collective_timeout = absl::Seconds(60);
  CollectiveRunner run_collective;
  MemoryTracker* tracker = nullptr;  // Workspace accounting.
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual absl::string_view name() const = 0;
  virtual absl::Status Prepare(ShardStore* store, int unit,
                               const OptimizerStepContext& step) = 0;
  virtual void Apply(ShardStore* store, int unit,
                     const OptimizerStepContext& step) = 0;
  // Forgets every unit's prepared update (after a failed Prepare).
  virtual void Discard(ShardStore* store) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_OPTIMIZER_H_
