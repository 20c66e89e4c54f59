#ifndef SHARDD_WORKER_EXEC_DEVICE_OPTIMIZER_SHARDS_H_
#define SHARDD_WORKER_EXEC_DEVICE_OPTIMIZER_SHARDS_H_

// OptimizerShards (optimizer_shards.h) over a DeviceShardStore: kernels/cuda
// arithmetic on the compute stream (AdamW fused with the bf16 refresh of
// the compute shard, Muon's element steps, cuBLAS Newton-Schulz), workspace
// from the caching DeviceAllocator (kWorkspace, freed stream-ordered), and
// NCCL all-gathers ordered after the compute stream and waited for on the
// host. CUDA builds only; not run on a GPU yet.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/exec/optimizer_shards.h"
#include "worker/memory/device_allocator.h"
#include "worker/shards/device_shard_store.h"

namespace shardd {

class DeviceOptimizerShards final : public OptimizerShards {
 public:
  // Everything must outlive this object; `cublas` is bound to `stream`.
  DeviceOptimizerShards(DeviceShardStore* store, DeviceAllocator* allocator,
                        cudaStream_t stream, cublasHandle_t cublas,
                        NcclCommunicator* shard_group, absl::Duration timeout)
      : store_(store),
        allocator_(allocator),
        stream_(stream),
        cublas_(cublas),
        shard_group_(shard_group),
        timeout_(timeout) {}

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

 private:
  // The bf16 compute copy of shard elements [begin, begin + n), refreshed
  // from the master after an update (no-op without keep_compute_shard).
  absl::Status Refresh(int unit, int64_t begin, int64_t n);

  DeviceShardStore* const store_;
  DeviceAllocator* const allocator_;
  const cudaStream_t stream_;
  const cublasHandle_t cublas_;
  NcclCommunicator* const shard_group_;
  const absl::Duration timeout_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_DEVICE_OPTIMIZER_SHARDS_H_
