#ifndef SHARDD_TESTING_STAGED_SHARD_STATE_H_
#define SHARDD_TESTING_STAGED_SHARD_STATE_H_

// A fake of a device store's ShardState, for CPU tests of the code paths a
// GPU store takes (worker/shards/shard_state.h): it holds its own copy of a
// ShardStore's state in separate "device" buffers, says they are not host
// memory, and lets them be read and written only through CopyToHost /
// CopyFromHost (counted). Writing it back into the wrapped store is
// explicit (Flush), so a path that bypassed the copies would be seen.

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/shards/shard_state.h"

namespace shardd {
namespace testing_util {

class StagedShardState final : public ShardState {
 public:
  // Copies `store`'s current state (masters, gradients, moments) into its
  // own buffers. `store` must outlive this object.
  explicit StagedShardState(ShardState* store) : store_(store) {
    units_.resize(store->num_units());
    for (int u = 0; u < store->num_units(); ++u) {
      const ShardBuffers b = store->buffers(u);
      Unit& unit = units_[u];
      unit.numel = b.numel;
      unit.state_numel = b.state_numel;
      auto take = [](const float* from, int64_t n, std::vector<float>* to,
                     bool* has) {
        *has = from != nullptr;
        if (*has) to->assign(from, from + n);
      };
      take(b.params, b.numel, &unit.params, &unit.has_params);
      take(b.grads, b.state_numel, &unit.grads, &unit.has_grads);
      take(b.exp_avg, b.state_numel, &unit.exp_avg, &unit.has_exp_avg);
      take(b.exp_avg_sq, b.state_numel, &unit.exp_avg_sq, &unit.has_exp_avg_sq);
    }
  }

  int num_units() const override { return static_cast<int>(units_.size()); }
  ShardBuffers buffers(int unit) const override {
    ShardBuffers b;
    if (unit < 0 || unit >= num_units()) return b;
    Unit& u = const_cast<Unit&>(units_[unit]);
    b.params = u.has_params ? u.params.data() : nullptr;
    b.grads = u.has_grads ? u.grads.data() : nullptr;
    b.exp_avg = u.has_exp_avg ? u.exp_avg.data() : nullptr;
    b.exp_avg_sq = u.has_exp_avg_sq ? u.exp_avg_sq.data() : nullptr;
    b.numel = u.numel;
    b.state_numel = u.state_numel;
    return b;
  }
  bool host_memory() const override { return false; }
  absl::Status CopyToHost(const float* from, int64_t n,
                          float* to) const override {
    ++copies_to_host_;
    if (n > 0) std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(const float* from, int64_t n, float* to) override {
    ++copies_from_host_;
    if (n > 0) std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    ++synchronizations_;
    return absl::OkStatus();
  }
  absl::Status ResetUnit(int unit) override {
    if (unit < 0 || unit >= num_units()) {
      return absl::NotFoundError(absl::StrCat("unit ", unit));
    }
    Unit& u = units_[unit];
    for (float& g : u.grads) g = 0.0f;
    ++resets_;
    return absl::OkStatus();
  }

  // Writes the buffers back into the wrapped store and resets its units
  // (refreshing its compute shards), so it can be compared or run.
  absl::Status Flush() {
    for (int u = 0; u < num_units(); ++u) {
      const ShardBuffers from = buffers(u);
      const ShardBuffers to = store_->buffers(u);
      auto put = [](const float* a, int64_t n, float* b) {
        if (a != nullptr && b != nullptr && n > 0) {
          std::memcpy(b, a, static_cast<size_t>(n) * sizeof(float));
        }
      };
      put(from.params, from.numel, to.params);
      put(from.exp_avg, from.state_numel, to.exp_avg);
      put(from.exp_avg_sq, from.state_numel, to.exp_avg_sq);
      const absl::Status reset = store_->ResetUnit(u);
      if (!reset.ok()) return reset;
    }
    return absl::OkStatus();
  }

  int64_t copies_to_host() const { return copies_to_host_; }
  int64_t copies_from_host() const { return copies_from_host_; }
  int64_t resets() const { return resets_; }
  int64_t synchronizations() const { return synchronizations_; }

 private:
  struct Unit {
    std::vector<float> params, grads, exp_avg, exp_avg_sq;
    bool has_params = false, has_grads = false, has_exp_avg = false,
         has_exp_avg_sq = false;
    int64_t numel = 0;
    int64_t state_numel = 0;
  };
  ShardState* store_;
  std::vector<Unit> units_;
  mutable int64_t copies_to_host_ = 0;
  int64_t copies_from_host_ = 0;
  int64_t resets_ = 0;
  int64_t synchronizations_ = 0;
};

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_STAGED_SHARD_STATE_H_
