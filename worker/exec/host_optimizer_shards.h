#ifndef SHARDD_WORKER_EXEC_HOST_OPTIMIZER_SHARDS_H_
#define SHARDD_WORKER_EXEC_HOST_OPTIMIZER_SHARDS_H_

// OptimizerShards (optimizer_shards.h) over a host ShardStore: kernels/cpu
// arithmetic, workspace accounted on the store's MemoryTracker, the
// all-gather run where the CPU backend runs its collectives.

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/exec/optimizer_shards.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {

// Runs `collective` where the backend runs its collectives (CpuBackend: on
// its communication queue, in program order) and waits for it. `what`
// names it in errors.
using CollectiveRunner = std::function<absl::Status(
    const std::string& what, std::function<absl::Status()> collective)>;

// Runs the collective on the calling thread.
CollectiveRunner RunCollectiveHere();

class HostOptimizerShards final : public OptimizerShards {
 public:
  // Everything must outlive this object.
  HostOptimizerShards(ShardStore* store, MemoryTracker* tracker,
                      Communicator* shard_group, absl::Duration timeout,
                      CollectiveRunner run_collective)
      : store_(store),
        tracker_(tracker),
        shard_group_(shard_group),
        timeout_(timeout),
        run_collective_(std::move(run_collective)) {}

  int num_units() const override { return store_->num_units(); }
  const UnitLayout& layout(int unit) const override {
    return store_->layout(unit);
  }
  ShardBuffers buffers(int unit) const override {
    return store_->buffers(unit);
  }
  int gather_rank() const override { return shard_group_->rank(); }

  absl::Status AdamW(int unit, int64_t begin, int64_t n, int64_t step,
                     const kernels::AdamWConfig& config) override;
  absl::Status MuonNesterov(const float* grad, const float* momentum,
                            int64_t n, float beta, float* out) override;
  absl::Status MuonMomentum(const float* grad, float* momentum, int64_t n,
                            float beta) override;
  absl::Status MuonApply(int unit, int64_t begin, int64_t n,
                         const float* update, double lr,
                         double weight_decay) override;
  absl::Status Orthogonalise(float* x, int64_t rows, int64_t cols, int steps,
                             float scale) override;
  absl::Status Copy(float* to, const float* from, int64_t n) override;
  absl::Status Zero(float* x, int64_t n) override;
  absl::StatusOr<std::unique_ptr<OptimizerScratch>> Scratch(
      int64_t n) override;
  absl::Status AllGather(float* slot, float* all, int64_t count,
                         const std::string& what) override;

  ShardStore* store() const { return store_; }

 private:
  ShardStore* const store_;
  MemoryTracker* const tracker_;
  Communicator* const shard_group_;
  const absl::Duration timeout_;
  const CollectiveRunner run_collective_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_HOST_OPTIMIZER_SHARDS_H_
