#include "worker/shards/shard_state_transfer.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

// Which moment buffers a unit holds: bit 0 exp_avg, bit 1 exp_avg_sq.
int MomentMask(const ShardStore::UnitShard& shard) {
  return (shard.exp_avg != nullptr ? 1 : 0) |
         (shard.exp_avg_sq != nullptr ? 2 : 0);
}

std::string MomentNames(int mask) {
  if (mask == 0) return "no moments";
  if (mask == 3) return "both moments";
  return mask == 1 ? "exp_avg only" : "exp_avg_sq only";
}

// FAILED_PRECONDITION unless unit `u` of the destination has `numel`
// elements and the moment buffers `mask` says.
absl::Status CheckUnit(int u, int64_t numel, int mask,
                       const ShardStore::UnitShard& to) {
  if (to.numel != numel) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", u, ": source shard has ", numel, " elements, destination has ",
        to.numel, " (the stores come from different plans or shard ranks)"));
  }
  if (MomentMask(to) != mask) {
    return absl::FailedPreconditionError(
        absl::StrCat("unit ", u, ": source holds ", MomentNames(mask),
                     ", destination holds ", MomentNames(MomentMask(to))));
  }
  return absl::OkStatus();
}

void CopyFloats(const float* from, float* to, int64_t n) {
  if (from != nullptr && to != nullptr && n > 0) {
    std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
  }
}

// Zeroes the unit's sharded gradient and refreshes its compute shard: what
// every destination does once its masters are written.
void FinishUnit(int u, ShardStore* store) {
  const ShardStore::UnitShard shard = store->shard(u);
  if (shard.grads != nullptr && shard.state_numel > 0) {
    std::memset(shard.grads, 0, static_cast<size_t>(shard.state_numel) * 4);
  }
  store->RefreshComputeShard(u, 0, shard.numel);
}

// A fingerprint of a store's layout, to compare across ranks.
int64_t LayoutHash(const ShardStore& store) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(store.num_units()));
  for (int u = 0; u < store.num_units(); ++u) {
    const ShardStore::UnitShard shard = store.shard(u);
    mix(static_cast<uint64_t>(shard.numel));
    mix(static_cast<uint64_t>(MomentMask(shard)));
  }
  return static_cast<int64_t>(h);
}

}  // namespace

absl::Status CopyShardState(const ShardStore& from, ShardStore* to) {
  if (to == nullptr) {
    return absl::InvalidArgumentError("CopyShardState: null destination");
  }
  if (from.num_units() != to->num_units()) {
    return absl::FailedPreconditionError(
        absl::StrCat("source has ", from.num_units(), " units, destination ",
                     to->num_units(), " (different plans)"));
  }
  for (int u = 0; u < from.num_units(); ++u) {
    const ShardStore::UnitShard src = from.shard(u);
    SHARDD_RETURN_IF_ERROR(
        CheckUnit(u, src.numel, MomentMask(src), to->shard(u)));
  }
  for (int u = 0; u < from.num_units(); ++u) {
    const ShardStore::UnitShard src = from.shard(u);
    const ShardStore::UnitShard dst = to->shard(u);
    CopyFloats(src.params, dst.params, src.numel);
    CopyFloats(src.exp_avg, dst.exp_avg, src.state_numel);
    CopyFloats(src.exp_avg_sq, dst.exp_avg_sq, src.state_numel);
    FinishUnit(u, to);
  }
  return absl::OkStatus();
}

int64_t ShardStateSnapshot::bytes() const {
  int64_t total = 0;
  for (const Unit& unit : units) {
    total += static_cast<int64_t>(unit.params.size() + unit.exp_avg.size() +
                                  unit.exp_avg_sq.size()) *
             static_cast<int64_t>(sizeof(float));
  }
  return total;
}

ShardStateSnapshot CaptureShardState(const ShardStore& store) {
  ShardStateSnapshot snapshot;
  snapshot.units.resize(store.num_units());
  for (int u = 0; u < store.num_units(); ++u) {
    const ShardStore::UnitShard shard = store.shard(u);
    ShardStateSnapshot::Unit& unit = snapshot.units[u];
    const int64_t n = shard.params != nullptr ? shard.numel : 0;
    unit.params.assign(shard.params, shard.params + n);
    unit.has_exp_avg = shard.exp_avg != nullptr;
    unit.has_exp_avg_sq = shard.exp_avg_sq != nullptr;
    if (unit.has_exp_avg) {
      unit.exp_avg.assign(shard.exp_avg, shard.exp_avg + shard.state_numel);
    }
    if (unit.has_exp_avg_sq) {
      unit.exp_avg_sq.assign(shard.exp_avg_sq,
                             shard.exp_avg_sq + shard.state_numel);
    }
  }
  return snapshot;
}

absl::Status RestoreShardState(const ShardStateSnapshot& snapshot,
                               ShardStore* to) {
  if (to == nullptr) {
    return absl::InvalidArgumentError("RestoreShardState: null destination");
  }
  const int units = static_cast<int>(snapshot.units.size());
  if (units != to->num_units()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the kept state has ", units, " units, the new store ",
                     to->num_units(), " (different plans)"));
  }
  for (int u = 0; u < units; ++u) {
    const ShardStateSnapshot::Unit& unit = snapshot.units[u];
    const int mask = (unit.has_exp_avg ? 1 : 0) | (unit.has_exp_avg_sq ? 2 : 0);
    SHARDD_RETURN_IF_ERROR(CheckUnit(
        u, static_cast<int64_t>(unit.params.size()), mask, to->shard(u)));
  }
  for (int u = 0; u < units; ++u) {
    const ShardStateSnapshot::Unit& unit = snapshot.units[u];
    const ShardStore::UnitShard dst = to->shard(u);
    CopyFloats(unit.params.data(), dst.params, dst.numel);
    if (unit.has_exp_avg)
      CopyFloats(unit.exp_avg.data(), dst.exp_avg, dst.state_numel);
    if (unit.has_exp_avg_sq) {
      CopyFloats(unit.exp_avg_sq.data(), dst.exp_avg_sq, dst.state_numel);
    }
    FinishUnit(u, to);
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> BroadcastShardState(ShardStore* store,
                                            int64_t* optimizer_steps,
                                            Communicator* replicas, int root,
                                            absl::Duration timeout) {
  if (store == nullptr || optimizer_steps == nullptr || replicas == nullptr) {
    return absl::InvalidArgumentError(
        "BroadcastShardState: null store, step count or communicator");
  }
  if (root < 0 || root >= replicas->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BroadcastShardState: root ", root, " outside [0, ",
                     replicas->world_size(), ")"));
  }
  const bool is_root = replicas->rank() == root;
  const int64_t layout = LayoutHash(*store);
  // The root's step count and layout, exact as INT64.
  int64_t header[3] = {*optimizer_steps, store->num_units(), layout};
  SHARDD_RETURN_IF_ERROR(
      replicas->Broadcast(header, 3, v1::INT64, root, timeout));
  int32_t mismatches =
      (header[1] != store->num_units() || header[2] != layout) ? 1 : 0;
  SHARDD_RETURN_IF_ERROR(
      replicas->AllReduce(&mismatches, 1, v1::INT32, ReduceOp::kSum, timeout));
  if (mismatches != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BroadcastShardState: ", mismatches,
        " member(s) of the replicate group hold another shard layout than "
        "the root (replica rank ",
        root, "; this rank has ", store->num_units(),
        " units): the replicas were loaded with different plans"));
  }
  int64_t received = 0;
  for (int u = 0; u < store->num_units(); ++u) {
    const ShardStore::UnitShard shard = store->shard(u);
    if (shard.numel <= 0) continue;
    // The moments hold state_numel elements (trim_frozen_state).
    const std::pair<float*, int64_t> buffers[] = {
        {shard.params, shard.numel},
        {shard.exp_avg, shard.state_numel},
        {shard.exp_avg_sq, shard.state_numel}};
    for (const auto& [buffer, n] : buffers) {
      if (buffer == nullptr || n <= 0) continue;
      SHARDD_RETURN_IF_ERROR(
          replicas->Broadcast(buffer, n, v1::FLOAT32, root, timeout));
      if (!is_root) received += n * static_cast<int64_t>(sizeof(float));
    }
  }
  if (!is_root) {
    for (int u = 0; u < store->num_units(); ++u) FinishUnit(u, store);
    *optimizer_steps = header[0];
  }
  return received;
}

}  // namespace shardd
