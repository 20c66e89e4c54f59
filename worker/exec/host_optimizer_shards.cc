#include "worker/exec/host_optimizer_shards.h"

#include <cstring>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cpu/muon.h"

namespace shardd {
namespace {

class HostScratch final : public OptimizerScratch {
 public:
  HostScratch(MemoryTracker* tracker, int64_t n)
      : buffer_(tracker, MemoryKind::kWorkspace,
                n * static_cast<int64_t>(sizeof(float))) {}
  float* data() override { return buffer_.as<float>(); }

 private:
  TrackedBuffer buffer_;
};

}  // namespace

CollectiveRunner RunCollectiveHere() {
  return [](const std::string&, std::function<absl::Status()> collective) {
    return collective();
  };
}

absl::Status HostOptimizerShards::AdamW(int unit, int64_t begin, int64_t n,
                                        int64_t step,
                                        const kernels::AdamWConfig& config) {
  const ShardBuffers shard = store_->buffers(unit);
  SHARDD_RETURN_IF_ERROR(kernels::AdamWStep(
      shard.params + begin, shard.grads + begin, shard.exp_avg + begin,
      shard.exp_avg_sq + begin, n, step, config));
  // The range is still in cache: refresh its compute-dtype copy now.
  store_->RefreshComputeShard(unit, begin, n);
  return absl::OkStatus();
}

absl::Status HostOptimizerShards::MuonNesterov(const float* grad,
                                               const float* momentum,
                                               int64_t n, float beta,
                                               float* out) {
  kernels::MuonNesterovUpdate(grad, momentum, n, beta, out);
  return absl::OkStatus();
}

absl::Status HostOptimizerShards::MuonMomentum(const float* grad,
                                               float* momentum, int64_t n,
                                               float beta) {
  kernels::MuonMomentumStep(grad, momentum, n, beta);
  return absl::OkStatus();
}

absl::Status HostOptimizerShards::MuonApply(int unit, int64_t begin, int64_t n,
                                            const float* update, double lr,
                                            double weight_decay) {
  kernels::MuonApply(store_->buffers(unit).params + begin, update, n, lr,
                     weight_decay);
  store_->RefreshComputeShard(unit, begin, n);
  return absl::OkStatus();
}

absl::Status HostOptimizerShards::Orthogonalise(float* x, int64_t rows,
                                                int64_t cols, int steps,
                                                float scale) {
  HostScratch workspace(tracker_, kernels::NewtonSchulzWorkspace(rows, cols));
  SHARDD_RETURN_IF_ERROR(
      kernels::NewtonSchulz(x, rows, cols, steps, workspace.data()));
  if (scale != 1.0f) kernels::ScaleInPlace(x, rows * cols, scale);
  return absl::OkStatus();
}

absl::Status HostOptimizerShards::Copy(float* to, const float* from,
                                       int64_t n) {
  return CopyHostFloats(from, n, to);
}

absl::Status HostOptimizerShards::Zero(float* x, int64_t n) {
  if (n > 0) std::memset(x, 0, static_cast<size_t>(n) * sizeof(float));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OptimizerScratch>> HostOptimizerShards::Scratch(
    int64_t n) {
  return std::unique_ptr<OptimizerScratch>(new HostScratch(tracker_, n));
}

absl::Status HostOptimizerShards::AllGather(float* slot, float* all,
                                            int64_t count,
                                            const std::string& what) {
  Communicator* group = shard_group_;
  const absl::Duration timeout = timeout_;
  return run_collective_(what, [group, slot, all, count, timeout] {
    return group->AllGather(slot, all, count, v1::FLOAT32, timeout);
  });
}

}  // namespace shardd
