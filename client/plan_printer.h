#ifndef SHARDD_CLIENT_PLAN_PRINTER_H_
#define SHARDD_CLIENT_PLAN_PRINTER_H_

// Renders a ShardingPlan for people (a table) and for programs (one JSON
// object). Both work on the plan alone, so a plan from a coordinator and one
// planned in-process print identically.

#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"

namespace shardd {

// "0 B", "512 B", "1.50 KiB", "3.25 GiB" (binary units, 2 decimals).
std::string HumanBytes(int64_t bytes);
// "950", "1.20K", "46.70B" (decimal units, 2 decimals; B = 10^9).
std::string HumanCount(int64_t count);

// The memory of the device the plan is checked against by default: an H100.
inline constexpr int64_t kDefaultDeviceMemoryBytes = int64_t{80} << 30;
// The largest --dp a fit suggestion names.
inline constexpr int32_t kMaxSuggestedDp = 65536;

// Whether a plan's per-rank peak fits a device. Activations and workspace
// are not modelled, so "fits" means the rest is what is left for them.
struct PlanFit {
  int64_t device_memory_bytes = 0;
  bool fits = false;
  // device_memory_bytes - peak_total_bytes; negative when it does not fit.
  int64_t headroom_bytes = 0;
  // When it does not fit: the smallest N = dp_shard * 2^k (k >= 1, at most
  // kMaxSuggestedDp) estimated to fit, re-sharding this plan's units over N
  // ranks by the layout laws (padding included) with the same schedule:
  // persistent_bytes scales with the elements a rank holds, and
  // peak_unsharded_bytes with the largest growth of a unit's gathered
  // buffer. Without padding that is persistent_bytes * dp_shard / N +
  // peak_unsharded_bytes. 0: none (or it fits).
  int32_t suggested_dp = 0;
};

// Checks `plan.memory()` against `device_memory_bytes` (> 0).
PlanFit CheckPlanFit(const v1::ShardingPlan& plan, int64_t device_memory_bytes);

// The readable form: header (model, strategy, mesh, precision, totals), one
// line per unit, per-rank memory with the peak and where it happens and
// whether it fits `device_memory_bytes` (left out when <= 0), and bytes moved
// per step. `summary` may be null.
std::string FormatPlanTable(
    const v1::ShardingPlan& plan, const v1::ModelSummary* summary,
    int64_t device_memory_bytes = kDefaultDeviceMemoryBytes);

// The --json form (keys in a fixed, readable order). Always has total_params,
// strategy, world_size, units (name, kind, params: name, global_shape, dtype,
// shard_dim, padded_dim0, local_numel, ...), per_rank (sharded_param_bytes,
// grad_bytes, optimizer_bytes, peak_unsharded_bytes, ...) and comm
// (all_gather_bytes, reduce_scatter_bytes, ...). Byte counts are per rank.
// With device_memory_bytes > 0 it also has fit (device_memory_bytes, fits,
// headroom_bytes, and suggested_dp when it does not fit and one exists; see
// PlanFit). `summary` may be null.
nlohmann::ordered_json PlanToJson(
    const v1::ShardingPlan& plan, const v1::ModelSummary* summary,
    int64_t device_memory_bytes = kDefaultDeviceMemoryBytes);

// PlanToJson dumped with a 2-space indent and a trailing newline.
std::string FormatPlanJson(
    const v1::ShardingPlan& plan, const v1::ModelSummary* summary,
    int64_t device_memory_bytes = kDefaultDeviceMemoryBytes);

}  // namespace shardd

#endif  // SHARDD_CLIENT_PLAN_PRINTER_H_
