#ifndef SHARDD_WORKER_SHARDS_DEVICE_SHARD_STORE_H_
#define SHARDD_WORKER_SHARDS_DEVICE_SHARD_STORE_H_

// The device counterpart of ShardStore (worker/shards/shard_store.h; read it for
// the semantics of the four operations): a worker's shards of every FSDP
// unit in GPU memory, driven by NCCL collectives that are only ENQUEUED
// (stream-ordered), never waited for on the host. CUDA builds only.
//
// State per unit, from the DeviceAllocator (kinds as the CPU store's, so
// the allocator's MemoryTracker measures what the planner predicts):
//   master, grads, exp_avg, exp_avg_sq   fp32 [shard_numel] (initialised on
//                                        the host with the CPU store's
//                                        values and copied up once)
//   compute_shard                        keep_compute_shard: bf16 copy of
//                                        the master, the gather's input
//   gathered                             [gathered_numel] compute dtype
//   slice                                Reshard(u, G): this rank's 1/G
//   unsharded_grad                       [world * grad_chunk] reduce dtype
//
// Streams. Work runs on three streams: the compute stream (the model, the
// optimizer, parameter copy-outs), the shard group's all-gather stream
// (copy-in casts, all-gathers, slice copies) and its reduce-scatter stream
// (zeroing unsharded gradients, reduce-scatters, the accumulation into the
// sharded gradient). Cross-stream order is by events only:
//   Unshard        all-gather stream waits for compute (the optimizer wrote
//                  the master), casts, gathers; Param() makes the reader's
//                  stream wait for the gather's event.
//   Reshard        all-gather stream waits for compute (the last reader),
//                  copies the slice, frees the buffer.
//   AllocGrad      zeroes on the reduce-scatter stream; compute waits.
//   ReduceScatter  folds the copied-out gradients into the buffer on
//                  compute; the reduce-scatter waits for compute; the HSDP
//                  replica all-reduce waits for it; the accumulation into
//                  the sharded gradient runs on the reduce-scatter stream
//                  after both; the buffer is freed there.
// Every buffer is freed from the host as soon as the op that ends its life
// is enqueued, to the stream it was allocated for (its "home"), after that
// stream was made to wait for every other stream that used it: the caching
// allocator reuses a block only for work on its home stream, which then
// runs after the last use (device_allocator.h).
//
// Parameters (DeviceParamSource): a view into the gathered buffer when the
// parameter is contiguous there (flat buckets, one-parameter units, one
// shard rank), else a copy-out (per-rank device-to-device copies, no
// widening: the tensor keeps the compute dtype) into a kWorkspace buffer
// that lives until the unit reshards. Gradients: a view into the unsharded
// fp32 gradient when contiguous there, else a zeroed fp32 kWorkspace buffer
// folded into the unsharded gradient (converted to the reduce dtype, one
// rounding per fold) at ReduceScatter. Note: the CPU store rounds a bf16
// reduce buffer once per accumulated backward; here once per fold, so bf16
// reduce results can differ from the CPU's in the last bits.
//
// Not thread-safe: one thread (the step executor's) drives it.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/device_param_source.h"
#include "worker/comm/nccl_communicator.h"
#include "layout/shard_layout.h"
#include "worker/shards/shard_state.h"

namespace shardd {

// Slice groups by size G (see SliceGroups in shard_store.h), over NCCL.
using DeviceSliceGroups = std::map<int, NcclCommunicator*>;

struct DeviceShardStoreOptions {
  int shard_rank = 0;
  uint64_t seed = 0;
  // As ShardStoreOptions::initial_values.
  const InitialValues* initial_values = nullptr;
  absl::Duration collective_timeout = absl::Seconds(60);
  // As ShardStoreOptions::trim_frozen_state: gradients and moments only up
  // to the end of the unit's last trainable range (a LoRA job's frozen base
  // costs no optimizer memory).
  bool trim_frozen_state = false;
};

class DeviceShardStore final : public DeviceParamSource, public ShardState {
 public:
  // Allocates this rank's shards on the shard group's device and
  // initialises them with the values ShardStore::Create gives (computed on
  // the host, copied up once; Create synchronizes the device, the step
  // loop never does). `compute_stream` is where the model and optimizer
  // run. The allocator, communicators and stream must outlive the store.
  // With expert parallelism (mesh.ep > 1) the expert units gather and
  // reduce over `ep_shard` (this rank's block of dp_shard / ep ranks).
  // Errors: INVALID_ARGUMENT (null allocator or shard group, shard_rank or
  // group size not matching the plan's mesh, an expert-parallel unit
  // without a matching ep_shard group, a plan parameter missing from
  // the model, a compute or reduce dtype other than float32 / bfloat16);
  // RESOURCE_EXHAUSTED and CUDA errors from the allocations and copies.
  static absl::StatusOr<std::unique_ptr<DeviceShardStore>> Create(
      const v1::ShardingPlan& plan, const v1::ModelSpec& model,
      const DeviceShardStoreOptions& options, DeviceAllocator* allocator,
      cudaStream_t compute_stream, NcclCommunicator* shard_group,
      NcclCommunicator* replicas, const DeviceSliceGroups& slice_groups,
      NcclCommunicator* ep_shard = nullptr);
  ~DeviceShardStore() override;

  DeviceShardStore(const DeviceShardStore&) = delete;
  DeviceShardStore& operator=(const DeviceShardStore&) = delete;

  // Errors (all): NOT_FOUND (unit out of range), FAILED_PRECONDITION (the
  // unit is not in the state the op needs), INVALID_ARGUMENT (bad
  // group_size, missing slice group), and the communicator's enqueue
  // errors. Failures of the collectives themselves surface later, through
  // the communicators' health() (the watchdog aborts them).
  absl::Status Unshard(int unit);
  absl::Status Reshard(int unit, int group_size = 0);
  // Frees the slice a re-gather consumed (the point the plan's replay
  // frees it: when the gather is waited for); a no-op without one.
  absl::Status DropSlice(int unit);
  absl::Status AllocGrad(int unit);
  absl::Status ReduceScatter(int unit);

  // Makes `stream` wait (on the device) for unit's all-gather.
  // Errors: NOT_FOUND, FAILED_PRECONDITION (not gathered), CUDA errors.
  absl::Status WaitForGather(int unit, cudaStream_t stream);
  // Makes `stream` wait (on the device) for every reduce-scatter and
  // gradient accumulation enqueued so far, and every all-gather.
  absl::Status WaitForCollectives(cudaStream_t stream);

  // DeviceParamSource.
  absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                     void* stream) override;
  absl::StatusOr<float*> Grad(const std::string& name, void* stream) override;

  bool gathered(int unit) const;
  bool grad_allocated(int unit) const;
  int slice_group_size(int unit) const;
  int num_units() const override { return static_cast<int>(units_.size()); }
  const UnitLayout& layout(int unit) const { return layouts_[unit]; }

  // Device pointers of a unit's shard state (fp32: params numel elements,
  // the rest state_numel); compute_bf16 is the keep_compute_shard copy or
  // null.
  struct UnitShard {
    float* params = nullptr;
    float* grads = nullptr;
    float* exp_avg = nullptr;
    float* exp_avg_sq = nullptr;
    uint16_t* compute_bf16 = nullptr;
    int64_t numel = 0;
    int64_t state_numel = 0;
  };
  UnitShard shard(int unit) const;

  // Zeroes every sharded gradient on the compute stream.
  absl::Status ZeroShardGrads();

  // Frees everything of a step left behind after a failure: gathered
  // buffers, slices, copies, unsharded gradients (stream-ordered, no wait).
  void ReleaseStepBuffers();

  // Host copies, for tests and checkpoints: synchronizes the device (never
  // call inside a step). CopyOwnedParamSlice as ShardStore's.
  // Errors: NOT_FOUND, CUDA errors.
  absl::Status CopyOwnedParamSlice(const std::string& name, float* out) const;

  // ShardState (shard_state.h): device memory. The copies wait for the
  // compute stream first and are complete when they return; ResetUnit
  // enqueues on the compute stream (the next step runs after it). Not
  // while a step runs.
  ShardBuffers buffers(int unit) const override;
  bool host_memory() const override { return false; }
  absl::Status CopyToHost(const float* from, int64_t n,
                          float* to) const override;
  absl::Status CopyFromHost(const float* from, int64_t n, float* to) override;
  // Waits for the compute stream (and the collectives it waited for).
  absl::Status Synchronize() override;
  absl::Status ResetUnit(int unit) override;

 private:
  struct UnitState {
    v1::DType compute = v1::FLOAT32;
    v1::DType reduce = v1::FLOAT32;
    // The ranks it is gathered and reduced over (the shard group, or an
    // expert-parallel block's ep_shard group), this rank's place there, and
    // the expert-parallel degree (1: none).
    NcclCommunicator* group = nullptr;
    int group_rank = 0;
    int ep = 1;
    // Elements of grads, exp_avg, exp_avg_sq (shard numel unless trimmed).
    int64_t state_numel = 0;
    DeviceBuffer master;
    DeviceBuffer grads;
    DeviceBuffer exp_avg;
    DeviceBuffer exp_avg_sq;
    DeviceBuffer compute_shard;
    DeviceBuffer gathered;
    NcclWork gather;  // The gather that filled `gathered`.
    DeviceBuffer slice;
    int slice_group = 0;
    // The re-gather reading `slice` (DropSlice waits for it).
    NcclWork slice_reader;
    bool slice_consumed = false;
    DeviceBuffer unsharded_grad;
    std::vector<DeviceBuffer> copies;      // By param index.
    std::vector<DeviceBuffer> grad_temps;  // By param index.
  };
  struct ParamRef {
    int unit = -1;
    int index = -1;
  };

  DeviceShardStore(DeviceAllocator* allocator, cudaStream_t compute_stream,
                   NcclCommunicator* shard_group, NcclCommunicator* replicas,
                   const DeviceSliceGroups& slice_groups,
                   const DeviceShardStoreOptions& options);

  absl::StatusOr<UnitState*> Unit(int unit);
  absl::StatusOr<ParamRef> Find(const std::string& name) const;
  // `waiter` waits (on the device) for the work enqueued on `signaler`.
  absl::Status StreamWaitStream(cudaStream_t waiter, cudaStream_t signaler);

  DeviceAllocator* const allocator_;
  const cudaStream_t compute_stream_;
  NcclCommunicator* const shard_group_;
  NcclCommunicator* const replicas_;
  const DeviceSliceGroups slice_groups_;
  const DeviceShardStoreOptions options_;
  // Expert parallelism's ep_shard group (null without it): expert units
  // gather and reduce over it, on its own two streams.
  NcclCommunicator* ep_shard_ = nullptr;
  cudaStream_t gather_stream_ = nullptr;  // shard_group_'s all-gather stream.
  cudaStream_t reduce_stream_ = nullptr;  // Its reduce-scatter stream.
  // Recorded and waited for at once (a wait captures the record's state),
  // so one event serves every cross-stream edge.
  cudaEvent_t edge_event_ = nullptr;
  std::vector<UnitLayout> layouts_;
  std::vector<UnitState> units_;
  absl::flat_hash_map<std::string, ParamRef> params_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_DEVICE_SHARD_STORE_H_
