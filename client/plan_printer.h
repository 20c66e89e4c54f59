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

// The readable form: header (model, strategy, mesh, precision, totals), one
// line per unit, per-rank memory with the peak and where it happens, and
// bytes moved per step. `summary` may be null.
std::string FormatPlanTable(const v1::ShardingPlan& plan,
                            const v1::ModelSummary* summary);

// The --json form (keys in a fixed, readable order). Always has total_params,
// strategy, world_size, units (name, kind, params: name, global_shape, dtype,
// shard_dim, padded_dim0, local_numel, ...), per_rank (sharded_param_bytes,
// grad_bytes, optimizer_bytes, peak_unsharded_bytes, ...) and comm
// (all_gather_bytes, reduce_scatter_bytes, ...). Byte counts are per rank.
// `summary` may be null.
nlohmann::ordered_json PlanToJson(const v1::ShardingPlan& plan,
                                  const v1::ModelSummary* summary);

// PlanToJson dumped with a 2-space indent and a trailing newline.
std::string FormatPlanJson(const v1::ShardingPlan& plan,
                           const v1::ModelSummary* summary);

}  // namespace shardd

#endif  // SHARDD_CLIENT_PLAN_PRINTER_H_
