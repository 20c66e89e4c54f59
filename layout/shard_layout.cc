#include "layout/shard_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "layout/param_init.h"
#include "model/model_util.h"

namespace shardd {
namespace {

// Sorted, merged [begin, end) ranges.
std::vector<std::pair<int64_t, int64_t>> Merge(
    std::vector<std::pair<int64_t, int64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& r : ranges) {
    if (r.first >= r.second) continue;
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace

absl::Status CheckSliceGroupSize(int group_size, int world) {
  const int g = group_size;
  if (g != 0 && (g < 2 || g >= world || world % g != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Reshard: group_size must be 0 (free) or a divisor of dp_shard (",
        world, ") between 2 and ", world - 1, ", got ", g));
  }
  return absl::OkStatus();
}

bool IsContiguous(const std::vector<CopySegment>& segments, int64_t numel) {
  return segments.size() == 1 && segments[0].dst == 0 &&
         segments[0].count == numel;
}

absl::StatusOr<std::vector<UnitLayout>> ComputeUnitLayouts(
    const v1::ShardingPlan& plan, int shard_rank) {
  const int world = plan.mesh().dp_shard();
  if (world < 1 || shard_rank < 0 || shard_rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_rank: must be in [0, ", world, "), got ", shard_rank));
  }
  const int r = shard_rank;
  std::vector<UnitLayout> layouts;
  layouts.reserve(plan.units_size());
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    // Expert parallelism: the unit is one block of its parameters, gathered
    // over the block's ep_shard ranks.
    const int ep = unit.ep() > 1 ? unit.ep() : 1;
    if (world % ep != 0 || (ep > 1 && plan.flat_buckets())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "units[", u, "] (", unit.name(), "): ep ", ep,
          " must divide mesh.dp_shard (", world,
          ") in a plan without flat buckets"));
    }
    const int group = world / ep;
    const int block = r / group;
    UnitLayout layout;
    layout.world = group;
    layout.ep = ep;
    layout.block = block;
    layout.flat = plan.flat_buckets();
    layout.shard_numel = unit.shard_numel();
    layout.gathered_numel = unit.gathered_numel();
    const int64_t shard = layout.shard_numel;
    if (layout.flat) layout.grad_chunk_numel = shard;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    bool any_trainable = false;
    for (int p = 0; p < unit.params_size(); ++p) {
      const v1::ParamLayout& param = unit.params(p);
      ParamPlacement placement;
      placement.name = param.name();
      placement.index = p;
      placement.frozen = param.frozen();
      const std::string where = absl::StrCat(
          "units[", u, "] (", unit.name(), ") parameter '", param.name(), "'");
      if (EpBlocks(param) != ep) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ep_blocks ", param.ep_blocks(), " differs from the unit's ep ",
            unit.ep()));
      }
      // The unsharded parameter the model sees: one block with EP.
      placement.numel = param.numel() / ep;
      const int64_t base = block * placement.numel;
      if (layout.flat) {
        const int64_t offset = param.unsharded_offset();
        if (offset < 0 || offset + param.numel() > layout.gathered_numel) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": falls outside the gathered bucket (",
                           layout.gathered_numel, " elements)"));
        }
        placement.gathered.push_back({offset, 0, param.numel()});
        if (!param.frozen()) {
          placement.grad.push_back({0, offset, param.numel()});
          any_trainable = true;
        }
      } else {
        if (param.global_shape_size() == 0 || param.global_shape(0) <= 0) {
          if (param.numel() == 0) {
            layout.params.push_back(std::move(placement));
            continue;
          }
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": a dim-0 sharded parameter needs a shape"));
        }
        const int64_t row_numel = RowNumel(param);
        const int64_t rows_per_rank = param.rows_per_rank();
        if (param.shard_offset() < 0 ||
            param.shard_offset() + rows_per_rank * row_numel > shard) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": falls outside shard_numel (", shard, ")"));
        }
        int64_t grad_offset = 0;
        if (!param.frozen()) {
          grad_offset = layout.grad_chunk_numel;
          layout.grad_chunk_numel += rows_per_rank * row_numel;
          any_trainable = true;
        }
        // Rank q's rows, for every q (ranks past the last row hold only
        // padding).
        for (int q = 0; q < group; ++q) {
          const std::vector<OwnedRange> runs =
              OwnedRuns(param, false, shard, block * group + q);
          if (runs.empty()) break;
          const int64_t count = runs[0].end - runs[0].begin;
          const int64_t begin = runs[0].begin - base;
          placement.gathered.push_back(
              {q * shard + runs[0].shard_offset, begin, count});
          if (!param.frozen()) {
            // Rank q's chunk offset is added once the chunk size is known.
            placement.grad.push_back({begin, grad_offset, count});
          }
        }
        if (!param.frozen()) {
          // The whole local shard (padding too) comes back reduced.
          layout.shard_grad.push_back(
              {grad_offset, param.shard_offset(), rows_per_rank * row_numel});
        }
      }
      placement.owned = OwnedRuns(param, layout.flat, shard, r);
      if (!param.frozen()) {
        for (const OwnedRange& run : placement.owned) {
          ranges.emplace_back(run.shard_offset,
                              run.shard_offset + (run.end - run.begin));
        }
      }
      layout.params.push_back(std::move(placement));
    }
    // Dim-0 gradient segments are one per rank q, in rank order: place
    // each in rank q's chunk now that the chunk size is known.
    if (!layout.flat) {
      for (ParamPlacement& placement : layout.params) {
        for (size_t q = 0; q < placement.grad.size(); ++q) {
          placement.grad[q].dst +=
              static_cast<int64_t>(q) * layout.grad_chunk_numel;
        }
      }
    }
    if (layout.flat && any_trainable) {
      layout.shard_grad.push_back({0, 0, shard});
    }
    if (!any_trainable) layout.grad_chunk_numel = 0;
    layout.trainable_ranges = Merge(std::move(ranges));
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

absl::Status InitMasterShards(const v1::ShardingPlan& plan,
                              const v1::ModelSpec& model, int shard_rank,
                              uint64_t seed,
                              const std::vector<float*>& shards,
                              const InitialValues* values) {
  const int world = plan.mesh().dp_shard();
  if (world < 1 || shard_rank < 0 || shard_rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shard_rank: must be in [0, ", world, "), got ", shard_rank));
  }
  if (static_cast<int>(shards.size()) != plan.units_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards: need one per unit (", plan.units_size(),
                     "), got ", shards.size()));
  }
  struct Owner {
    const v1::TensorSpec* tensor;
    v1::ModuleKind kind;
  };
  absl::flat_hash_map<std::string, Owner> owners;
  for (const ParamRef& ref : ListParams(model)) {
    owners[ref.fqn] =
        Owner{ref.tensor,
              ref.path.empty() ? v1::MODULE_GENERIC : ref.path.back()->kind()};
  }
  SHARDD_ASSIGN_OR_RETURN(const std::vector<UnitLayout> layouts,
                          ComputeUnitLayouts(plan, shard_rank));
  for (int u = 0; u < plan.units_size(); ++u) {
    float* master = shards[u];
    if (layouts[u].shard_numel > 0) {
      std::memset(master, 0, static_cast<size_t>(layouts[u].shard_numel) * 4);
    }
    for (const ParamPlacement& param : layouts[u].params) {
      auto owner = owners.find(param.name);
      if (owner == owners.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan parameter '", param.name, "' is not in the model"));
      }
      if (values != nullptr && values->Provides(param.name)) {
        for (const OwnedRange& run : param.owned) {
          SHARDD_RETURN_IF_ERROR(values->Read(param.name,
                                              *owner->second.tensor, run.begin,
                                              run.end, master + run.shard_offset));
        }
        continue;
      }
      const InitRule rule =
          InitRuleFor(*owner->second.tensor, owner->second.kind, param.name);
      for (const OwnedRange& run : param.owned) {
        InitParamRange(seed, param.name, rule, run.begin, run.end - run.begin,
                       master + run.shard_offset);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardd
