#ifndef SHARDD_WORKER_EXEC_OPTIMIZER_SHARDS_H_
#define SHARDD_WORKER_EXEC_OPTIMIZER_SHARDS_H_

// A rank's shards as an optimizer (optimizer.h) sees them: each unit's
// layout and fp32 state buffers, and the arithmetic and collectives on the
// memory they live in. HostOptimizerShards runs kernels/cpu on a ShardStore
// over the CPU backend's communication queue; DeviceOptimizerShards runs
// kernels/cuda on a DeviceShardStore's compute stream over NCCL. Both use
// the same per-element functions (kernels/cpu/*_element.h), so an
// optimizer gives the same bits on either.
//
// Pointers passed to the arithmetic are buffers() of a unit or Scratch()
// memory of the same OptimizerShards. A device's operations are
// asynchronous on its compute stream, in call order; its AllGather blocks
// the host until the gather finished (so that Prepare's failure is known
// before anything commits).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"
#include "layout/shard_layout.h"
#include "worker/shards/shard_state.h"

namespace shardd {

// Workspace memory from OptimizerShards::Scratch, freed with the handle.
class OptimizerScratch {
 public:
  virtual ~OptimizerScratch() = default;
  virtual float* data() = 0;
};

class OptimizerShards {
 public:
  virtual ~OptimizerShards() = default;

  virtual int num_units() const = 0;
  virtual const UnitLayout& layout(int unit) const = 0;
  virtual ShardBuffers buffers(int unit) const = 0;
  // This rank's place in the shard group AllGather runs over.
  virtual int gather_rank() const = 0;

  // torch.optim.AdamW (kernels/cpu/adamw.h) on shard elements [begin,
  // begin + n) of `unit`, with `config.lr` for this step; refreshes their
  // compute-dtype copy.
  virtual absl::Status AdamW(int unit, int64_t begin, int64_t n, int64_t step,
                             const kernels::AdamWConfig& config) = 0;
  // Muon's element-wise pieces (kernels/cpu/muon.h): the Nesterov update
  // into `out` (momentum read only), the momentum step, and the decoupled
  // step param = param * (1 - lr * wd) - lr * update on shard elements
  // [begin, begin + n) of `unit` (refreshing their compute-dtype copy).
  virtual absl::Status MuonNesterov(const float* grad, const float* momentum,
                                    int64_t n, float beta, float* out) = 0;
  virtual absl::Status MuonMomentum(const float* grad, float* momentum,
                                    int64_t n, float beta) = 0;
  virtual absl::Status MuonApply(int unit, int64_t begin, int64_t n,
                                 const float* update, double lr,
                                 double weight_decay) = 0;
  // Newton-Schulz orthogonalisation of a row-major rows x cols matrix in
  // place, then x *= scale; its workspace comes and goes inside.
  virtual absl::Status Orthogonalise(float* x, int64_t rows, int64_t cols,
                                     int steps, float scale) = 0;
  virtual absl::Status Copy(float* to, const float* from, int64_t n) = 0;
  virtual absl::Status Zero(float* x, int64_t n) = 0;

  // n floats of workspace, accounted as kWorkspace.
  virtual absl::StatusOr<std::unique_ptr<OptimizerScratch>> Scratch(
      int64_t n) = 0;
  // All-gathers `count` floats per rank over the shard group: this rank's
  // are at `slot` = all + gather_rank() * count, inside `all`. `what`
  // names it in errors. Errors: the communicator's.
  virtual absl::Status AllGather(float* slot, float* all, int64_t count,
                                 const std::string& what) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_OPTIMIZER_SHARDS_H_
