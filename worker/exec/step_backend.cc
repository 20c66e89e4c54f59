#include "worker/exec/step_backend.h"

namespace shardd {

StepCollectives CollectivesBetween(const CollectiveStatsSnapshot& start,
                                   const CollectiveStatsSnapshot& end) {
  auto delta = [](const CollectiveStats& a, const CollectiveStats& b) {
    CollectiveStats d;
    d.calls = b.calls - a.calls;
    d.bytes = b.bytes - a.bytes;
    d.time = b.time - a.time;
    return d;
  };
  StepCollectives c;
  const CollectiveStats gathers =
      delta(start.shard.all_gather, end.shard.all_gather);
  const CollectiveStats scatters =
      delta(start.shard.reduce_scatter, end.shard.reduce_scatter);
  const CollectiveStats norms =
      delta(start.shard.all_reduce, end.shard.all_reduce);
  const CollectiveStats replicas =
      delta(start.replicas.all_reduce, end.replicas.all_reduce);
  c.all_gathers = gathers.calls;
  c.all_gather_bytes = gathers.bytes;
  c.reduce_scatters = scatters.calls;
  c.reduce_scatter_bytes = scatters.bytes;
  c.norm_all_reduces = norms.calls;
  c.norm_all_reduce_bytes = norms.bytes;
  c.replica_all_reduces = replicas.calls;
  c.replica_all_reduce_bytes = replicas.bytes;
  absl::Duration time =
      gathers.time + scatters.time + norms.time + replicas.time;
  for (const auto& [size, now] : end.slices) {
    auto it = start.slices.find(size);
    const CollectiveStats slice = delta(
        it != start.slices.end() ? it->second.all_gather : CollectiveStats(),
        now.all_gather);
    c.all_gathers += slice.calls;
    c.slice_all_gathers += slice.calls;
    c.all_gather_bytes += slice.bytes;
    time += slice.time;
  }
  // Expert units gather and reduce over their ep_shard group; the ep
  // group's all-to-alls are the token exchanges (its all-gathers, the
  // routing counts, are not the plan's).
  const CollectiveStats ep_gathers =
      delta(start.ep_shard.all_gather, end.ep_shard.all_gather);
  const CollectiveStats ep_scatters =
      delta(start.ep_shard.reduce_scatter, end.ep_shard.reduce_scatter);
  const CollectiveStats exchanges =
      delta(start.ep.all_to_all, end.ep.all_to_all);
  c.all_gathers += ep_gathers.calls;
  c.all_gather_bytes += ep_gathers.bytes;
  c.reduce_scatters += ep_scatters.calls;
  c.reduce_scatter_bytes += ep_scatters.bytes;
  c.all_to_alls = exchanges.calls;
  c.all_to_all_bytes = exchanges.bytes;
  time += ep_gathers.time + ep_scatters.time + exchanges.time;
  c.seconds = absl::ToDoubleSeconds(time);
  return c;
}

void SetMemoryPeaks(const MemorySnapshot& memory, StepResult* result) {
  result->peak_unsharded_bytes = memory.peak_unsharded;
  result->peak_step_bytes = memory.peak_step;
  result->peak_gathered_param_bytes =
      memory.peak[static_cast<int>(MemoryKind::kGatheredParams)];
  result->peak_unsharded_grad_bytes =
      memory.peak[static_cast<int>(MemoryKind::kUnshardedGrads)];
  result->peak_workspace_bytes =
      memory.peak[static_cast<int>(MemoryKind::kWorkspace)];
}

}  // namespace shardd
