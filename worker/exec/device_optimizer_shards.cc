#include "worker/exec/device_optimizer_shards.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/muon.h"
#include "worker/memory/cuda_memory_backend.h"

namespace shardd {
namespace {

class DeviceScratch final : public OptimizerScratch {
 public:
  explicit DeviceScratch(DeviceBuffer buffer) : buffer_(std::move(buffer)) {}
  float* data() override { return buffer_.as<float>(); }

 private:
  DeviceBuffer buffer_;
};

}  // namespace

absl::Status DeviceOptimizerShards::AdamW(int unit, int64_t begin, int64_t n,
                                          int64_t step,
                                          const kernels::AdamWConfig& config) {
  const DeviceShardStore::UnitShard shard = store_->shard(unit);
  // The clip coefficient was applied to the gradients already; the bf16
  // compute shard is refreshed in the same kernel.
  return kernels::cuda::AdamWStep(
      shard.params + begin, shard.grads + begin, shard.exp_avg + begin,
      shard.exp_avg_sq + begin, n, step, config, /*grad_scale=*/nullptr,
      shard.compute_bf16 == nullptr ? nullptr : shard.compute_bf16 + begin,
      stream_);
}

absl::Status DeviceOptimizerShards::MuonNesterov(const float* grad,
                                                 const float* momentum,
                                                 int64_t n, float beta,
                                                 float* out) {
  return kernels::cuda::MuonNesterovUpdate(grad, momentum, n, beta, out,
                                           stream_);
}

absl::Status DeviceOptimizerShards::MuonMomentum(const float* grad,
                                                 float* momentum, int64_t n,
                                                 float beta) {
  return kernels::cuda::MuonMomentumStep(grad, momentum, n, beta, stream_);
}

absl::Status DeviceOptimizerShards::MuonApply(int unit, int64_t begin,
                                              int64_t n, const float* update,
                                              double lr, double weight_decay) {
  SHARDD_RETURN_IF_ERROR(kernels::cuda::MuonApply(
      store_->shard(unit).params + begin, update, n, lr, weight_decay,
      stream_));
  return Refresh(unit, begin, n);
}

absl::Status DeviceOptimizerShards::Refresh(int unit, int64_t begin,
                                            int64_t n) {
  const DeviceShardStore::UnitShard shard = store_->shard(unit);
  if (shard.compute_bf16 == nullptr || n <= 0) return absl::OkStatus();
  return kernels::cuda::CastFp32ToBf16(shard.params + begin,
                                       shard.compute_bf16 + begin, n, stream_);
}

absl::Status DeviceOptimizerShards::Orthogonalise(float* x, int64_t rows,
                                                  int64_t cols, int steps,
                                                  float scale) {
  const size_t bytes = kernels::cuda::NewtonSchulzWorkspaceBytes(rows, cols);
  SHARDD_ASSIGN_OR_RETURN(
      DeviceBuffer workspace,
      DeviceBuffer::Allocate(allocator_, static_cast<int64_t>(bytes),
                             MemoryKind::kWorkspace,
                             ToDeviceStream(stream_)));
  SHARDD_RETURN_IF_ERROR(kernels::cuda::NewtonSchulz(
      cublas_, x, rows, cols, steps, workspace.data(), bytes, stream_));
  if (scale == 1.0f) return absl::OkStatus();
  return kernels::cuda::MuonScale(x, rows * cols, scale, stream_);
}

absl::Status DeviceOptimizerShards::Copy(float* to, const float* from,
                                         int64_t n) {
  if (n <= 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(to, from, static_cast<size_t>(n) * 4,
                                    cudaMemcpyDeviceToDevice, stream_),
                    "optimizer copy");
}

absl::Status DeviceOptimizerShards::Zero(float* x, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  return CudaStatus(
      cudaMemsetAsync(x, 0, static_cast<size_t>(n) * 4, stream_),
      "optimizer zero");
}

absl::StatusOr<std::unique_ptr<OptimizerScratch>>
DeviceOptimizerShards::Scratch(int64_t n) {
  SHARDD_ASSIGN_OR_RETURN(
      DeviceBuffer buffer,
      DeviceBuffer::Allocate(allocator_, n * 4, MemoryKind::kWorkspace,
                             ToDeviceStream(stream_)));
  return std::unique_ptr<OptimizerScratch>(
      new DeviceScratch(std::move(buffer)));
}

absl::Status DeviceOptimizerShards::AllGather(float* slot, float* all,
                                              int64_t count,
                                              const std::string& what) {
  // In place (this rank's slot of the output), after the compute stream
  // wrote it; the compute stream then waits for the gather on the device,
  // and the host waits too, so that a failed gather fails Prepare before
  // anything commits.
  absl::StatusOr<NcclWork> work = shard_group_->AllGatherAsync(
      slot, all, count, v1::FLOAT32, NcclWaitFor::Stream(stream_), timeout_);
  absl::Status status = work.status();
  if (status.ok()) status = work->StreamWait(stream_);
  if (status.ok()) status = work->Wait();
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(what, ": ", status.message()));
  }
  return absl::OkStatus();
}

}  // namespace shardd
