#ifndef SHARDD_WORKER_SHARDS_SHARD_STATE_H_
#define SHARDD_WORKER_SHARDS_SHARD_STATE_H_

// A rank's training state as the code that moves it sees it: per FSDP unit,
// the fp32 master shard, sharded gradient and AdamW moments, wherever they
// live. ShardStore (host memory) and DeviceShardStore (GPU memory) both
// implement it, so keep-state recovery, healing from a replica and
// checkpoint save/load (shard_state_transfer.h, shard_checkpoint.h) are
// written once for both devices. Only the memory differs: host-memory
// state is read and written in place; other state through CopyToHost /
// CopyFromHost.
//
// A state's buffers are addressed by the communicators of the same
// backend (host pointers for Gloo, device pointers for NCCL), so a
// collective may read and write them in place.
//
// Not thread-safe, and not to be used while a step runs on the store.

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"

namespace shardd {

// One unit's state buffers (fp32). Null where the unit has none (a unit
// without trainable elements has no gradient or moments).
struct ShardBuffers {
  float* params = nullptr;
  float* grads = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  // Elements of params (the unit's shard_numel).
  int64_t numel = 0;
  // Elements of grads, exp_avg and exp_avg_sq: numel, or fewer when the
  // store trims the frozen tail (ShardStoreOptions::trim_frozen_state).
  int64_t state_numel = 0;
};

// CopyToHost / CopyFromHost of a state in host memory: a memcpy.
inline absl::Status CopyHostFloats(const float* from, int64_t n, float* to) {
  if (n > 0) std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
  return absl::OkStatus();
}

class ShardState {
 public:
  virtual ~ShardState() = default;

  virtual int num_units() const = 0;
  // The buffers of unit `unit` (0 <= unit < num_units()).
  virtual ShardBuffers buffers(int unit) const = 0;
  // Whether buffers()' pointers are host memory the caller may read and
  // write directly.
  virtual bool host_memory() const = 0;

  // Copies n floats between one of this state's buffers and host memory;
  // complete when the call returns. Errors: device errors (INTERNAL, ...).
  virtual absl::Status CopyToHost(const float* from, int64_t n,
                                  float* to) const = 0;
  virtual absl::Status CopyFromHost(const float* from, int64_t n,
                                    float* to) = 0;

  // Waits until the work the store enqueued on its buffers (a device
  // store's optimizer update, ResetUnit) is complete, so that others (a
  // collective on its own stream) may read and write buffers() in place.
  // Errors: device errors.
  virtual absl::Status Synchronize() = 0;

  // After a unit's master (and moments) were overwritten: zeroes its sharded
  // gradient and refreshes its compute-dtype shard copy from the master.
  // Errors: NOT_FOUND (unit out of range), device errors.
  virtual absl::Status ResetUnit(int unit) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_SHARD_STATE_H_
