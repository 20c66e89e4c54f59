#include "worker/shards/shard_state_transfer.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

// Which moment buffers a unit holds: bit 0 exp_avg, bit 1 exp_avg_sq.
int MomentMask(const ShardBuffers& shard) {
  return (shard.exp_avg != nullptr ? 1 : 0) |
         (shard.exp_avg_sq != nullptr ? 2 : 0);
}

std::string MomentNames(int mask) {
  if (mask == 0) return "no moments";
  if (mask == 3) return "both moments";
  return mask == 1 ? "exp_avg only" : "exp_avg_sq only";
}

// FAILED_PRECONDITION unless unit `u` of the destination matches the
// source's: shard elements, moment buffers and their length.
absl::Status CheckUnit(int u, const ShardBuffers& from,
                       const ShardBuffers& to) {
  if (to.numel != from.numel) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", u, ": source shard has ", from.numel,
        " elements, destination has ", to.numel,
        " (the stores come from different plans or shard ranks)"));
  }
  const int mask = MomentMask(from);
  if (MomentMask(to) != mask) {
    return absl::FailedPreconditionError(
        absl::StrCat("unit ", u, ": source holds ", MomentNames(mask),
                     ", destination holds ", MomentNames(MomentMask(to))));
  }
  if (mask != 0 && to.state_numel != from.state_numel) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", u, ": source moments hold ", from.state_numel,
        " elements, destination's ", to.state_numel));
  }
  return absl::OkStatus();
}

absl::Status CheckStates(const ShardState& from, const ShardState& to) {
  if (from.num_units() != to.num_units()) {
    return absl::FailedPreconditionError(
        absl::StrCat("source has ", from.num_units(), " units, destination ",
                     to.num_units(), " (different plans)"));
  }
  for (int u = 0; u < from.num_units(); ++u) {
    SHARDD_RETURN_IF_ERROR(CheckUnit(u, from.buffers(u), to.buffers(u)));
  }
  return absl::OkStatus();
}

// n floats from one state's buffer to another's, through host memory when
// neither side is host memory.
absl::Status CopyBuffer(const ShardState& from, const float* src, int64_t n,
                        ShardState* to, float* dst) {
  if (src == nullptr || dst == nullptr || n <= 0) return absl::OkStatus();
  if (from.host_memory()) return to->CopyFromHost(src, n, dst);
  if (to->host_memory()) return from.CopyToHost(src, n, dst);
  std::vector<float> staging(static_cast<size_t>(n));
  SHARDD_RETURN_IF_ERROR(from.CopyToHost(src, n, staging.data()));
  return to->CopyFromHost(staging.data(), n, dst);
}

// A fingerprint of a store's layout, to compare across ranks.
int64_t LayoutHash(const ShardState& store) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(store.num_units()));
  for (int u = 0; u < store.num_units(); ++u) {
    const ShardBuffers shard = store.buffers(u);
    mix(static_cast<uint64_t>(shard.numel));
    mix(static_cast<uint64_t>(MomentMask(shard)));
  }
  return static_cast<int64_t>(h);
}

}  // namespace

absl::Status CopyShardState(const ShardState& from, ShardState* to) {
  if (to == nullptr) {
    return absl::InvalidArgumentError("CopyShardState: null destination");
  }
  SHARDD_RETURN_IF_ERROR(CheckStates(from, *to));
  for (int u = 0; u < from.num_units(); ++u) {
    const ShardBuffers src = from.buffers(u);
    const ShardBuffers dst = to->buffers(u);
    SHARDD_RETURN_IF_ERROR(
        CopyBuffer(from, src.params, src.numel, to, dst.params));
    SHARDD_RETURN_IF_ERROR(
        CopyBuffer(from, src.exp_avg, src.state_numel, to, dst.exp_avg));
    SHARDD_RETURN_IF_ERROR(
        CopyBuffer(from, src.exp_avg_sq, src.state_numel, to, dst.exp_avg_sq));
    SHARDD_RETURN_IF_ERROR(to->ResetUnit(u));
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

ShardBuffers SnapshotState::buffers(int unit) const {
  ShardBuffers out;
  if (unit < 0 || unit >= num_units()) return out;
  ShardStateSnapshot::Unit& u = snapshot_->units[unit];
  out.params = u.params.data();
  out.numel = static_cast<int64_t>(u.params.size());
  if (u.has_exp_avg) {
    out.exp_avg = u.exp_avg.data();
    out.state_numel = static_cast<int64_t>(u.exp_avg.size());
  }
  if (u.has_exp_avg_sq) {
    out.exp_avg_sq = u.exp_avg_sq.data();
    out.state_numel = static_cast<int64_t>(u.exp_avg_sq.size());
  }
  return out;
}

absl::Status SnapshotState::CopyToHost(const float* from, int64_t n,
                                       float* to) const {
  return CopyHostFloats(from, n, to);
}

absl::Status SnapshotState::CopyFromHost(const float* from, int64_t n,
                                         float* to) {
  return CopyHostFloats(from, n, to);
}

absl::Status SnapshotState::ResetUnit(int unit) {
  // No gradients and no compute copies to refresh.
  if (unit < 0 || unit >= num_units()) {
    return absl::NotFoundError(absl::StrCat("unit ", unit, ": the snapshot has ",
                                            num_units(), " units"));
  }
  return absl::OkStatus();
}

ShardStateSnapshot ZeroSnapshotLike(const ShardState& store) {
  ShardStateSnapshot snapshot;
  snapshot.units.resize(store.num_units());
  for (int u = 0; u < store.num_units(); ++u) {
    const ShardBuffers shard = store.buffers(u);
    ShardStateSnapshot::Unit& unit = snapshot.units[u];
    unit.params.assign(static_cast<size_t>(shard.numel), 0.0f);
    unit.has_exp_avg = shard.exp_avg != nullptr;
    unit.has_exp_avg_sq = shard.exp_avg_sq != nullptr;
    const size_t state = static_cast<size_t>(shard.state_numel);
    if (unit.has_exp_avg) unit.exp_avg.assign(state, 0.0f);
    if (unit.has_exp_avg_sq) unit.exp_avg_sq.assign(state, 0.0f);
  }
  return snapshot;
}

absl::StatusOr<ShardStateSnapshot> CaptureShardState(const ShardState& store) {
  ShardStateSnapshot snapshot = ZeroSnapshotLike(store);
  SnapshotState view(&snapshot);
  SHARDD_RETURN_IF_ERROR(CopyShardState(store, &view));
  return snapshot;
}

absl::Status RestoreShardState(const ShardStateSnapshot& snapshot,
                               ShardState* to) {
  if (to == nullptr) {
    return absl::InvalidArgumentError("RestoreShardState: null destination");
  }
  // The view only reads through its pointers here.
  SnapshotState view(const_cast<ShardStateSnapshot*>(&snapshot));
  const absl::Status status = CopyShardState(view, to);
  if (!status.ok() && status.code() == absl::StatusCode::kFailedPrecondition) {
    return absl::FailedPreconditionError(
        absl::StrCat("the kept state does not fit the new store: ",
                     status.message()));
  }
  return status;
}

absl::StatusOr<int64_t> BroadcastShardState(ShardState* store,
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
  // The root's step count and layout, exact as INT64 (host memory: a
  // device communicator stages it).
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
  // The broadcasts read and write the buffers in place, from the
  // communicator's own stream: the store's pending writes first.
  SHARDD_RETURN_IF_ERROR(store->Synchronize());
  int64_t received = 0;
  for (int u = 0; u < store->num_units(); ++u) {
    const ShardBuffers shard = store->buffers(u);
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
    for (int u = 0; u < store->num_units(); ++u) {
      SHARDD_RETURN_IF_ERROR(store->ResetUnit(u));
    }
    SHARDD_RETURN_IF_ERROR(store->Synchronize());
    *optimizer_steps = header[0];
  }
  return received;
}

}  // namespace shardd
