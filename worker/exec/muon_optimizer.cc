#include "worker/exec/muon_optimizer.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "layout/shard_ranges.h"
#include "worker/exec/adamw_optimizer.h"
#include "worker/exec/optimizer_options.h"

namespace shardd {
namespace {

bool PathHas(const ParamRef& param, v1::ModuleKind kind) {
  for (const v1::ModuleSpec* module : param.path) {
    if (module->kind() == kind) return true;
  }
  return false;
}

// Sorts and merges [begin, end) ranges.
void Merge(std::vector<std::pair<int64_t, int64_t>>* ranges) {
  std::sort(ranges->begin(), ranges->end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& r : *ranges) {
    if (r.second <= r.first) continue;
    if (!merged.empty() && merged.back().second >= r.first) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  *ranges = std::move(merged);
}

}  // namespace

MuonRole MuonRoleOf(const ParamRef& param) {
  const v1::TensorSpec& tensor = *param.tensor;
  if (tensor.frozen() || !tensor.tied_to().empty() || param.path.empty()) {
    return MuonRole::kAdamW;
  }
  switch (param.path.back()->kind()) {
    case v1::MODULE_EMBEDDING:
    case v1::MODULE_LM_HEAD:
    case v1::MODULE_NORM:
    case v1::MODULE_ROUTER:
      return MuonRole::kAdamW;
    default:
      break;
  }
  if (absl::EndsWith(param.fqn, "bias")) return MuonRole::kAdamW;
  const int ndim = tensor.shape_size();
  if (PathHas(param, v1::MODULE_GROUPED_EXPERTS)) {
    return ndim == 3 ? MuonRole::kExperts : MuonRole::kAdamW;
  }
  if (ndim == 2 && (PathHas(param, v1::MODULE_ATTENTION) ||
                    PathHas(param, v1::MODULE_MLP))) {
    return MuonRole::kMatrix;
  }
  return MuonRole::kAdamW;
}

absl::StatusOr<std::unique_ptr<MuonOptimizer>> MuonOptimizer::Create(
    const kernels::MuonConfig& muon, const kernels::AdamWConfig& adamw,
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const OptimizerShards& store) {
  OptimizerOptions options;
  options.name = kMuonOptimizer;
  options.muon = muon;
  SHARDD_RETURN_IF_ERROR(ValidateOptimizerOptions(options, "train."));
  absl::flat_hash_map<std::string, MuonRole> roles;
  ForEachParam(model, [&roles](const ParamRef& param) {
    roles[param.fqn] = MuonRoleOf(param);
  });
  auto optimizer =
      std::unique_ptr<MuonOptimizer>(new MuonOptimizer(muon, adamw));
  optimizer->units_.resize(store.num_units());
  for (int u = 0; u < store.num_units(); ++u) {
    const UnitLayout& layout = store.layout(u);
    const v1::FsdpUnit& plan_unit = plan.units(u);
    Unit& unit = optimizer->units_[u];
    for (int i = 0; i < static_cast<int>(layout.params.size()); ++i) {
      const ParamPlacement& placement = layout.params[i];
      if (placement.frozen) continue;
      auto role = roles.find(placement.name);
      if (role == roles.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer muon: plan parameter ", placement.name,
                         " is not in the model"));
      }
      if (role->second == MuonRole::kAdamW) {
        for (const OwnedRange& r : placement.owned) {
          unit.adamw_ranges.push_back(
              {r.shard_offset, r.shard_offset + (r.end - r.begin)});
        }
        continue;
      }
      if (layout.flat) {
        return absl::InvalidArgumentError(absl::StrCat(
            "optimizer muon: unit ", u, " (", plan_unit.name(),
            ") is a flat range (strategy ", plan.strategy(),
            "): Muon orthogonalises whole matrices, and ", placement.name,
            " is cut across ranks at arbitrary elements; use optimizer "
            "adamw, or a strategy that shards dim 0"));
      }
      const std::vector<int64_t> shape =
          GlobalShape(plan_unit.params(placement.index));
      MuonParam p;
      p.placement = i;
      p.role = role->second;
      if (p.role == MuonRole::kMatrix) {
        p.rows = shape[0];
        p.cols = shape[1];
        p.scale =
            static_cast<float>(kernels::MuonShapeScale(shape[0], shape[1]));
        unit.gather = unit.gather || layout.world > 1;
      } else {
        p.matrices = shape[0];
        p.rows = shape[1];
        p.cols = shape[2];
        p.whole_experts =
            RowNumel(plan_unit.params(placement.index)) == p.rows * p.cols;
        unit.gather = unit.gather || (!p.whole_experts && layout.world > 1);
        // Stored [in, out] per expert: fan_out is the last dimension.
        p.scale =
            static_cast<float>(kernels::MuonShapeScale(shape[2], shape[1]));
      }
      unit.params.push_back(p);
    }
    Merge(&unit.adamw_ranges);
  }
  return optimizer;
}

absl::Status MuonOptimizer::Prepare(OptimizerShards* shards, int u,
                                    const OptimizerStepContext& step) {
  const Unit& unit = units_[u];
  if (unit.params.empty()) return absl::OkStatus();
  const UnitLayout& layout = shards->layout(u);
  const ShardBuffers shard = shards->buffers(u);
  const float beta = static_cast<float>(muon_.momentum);
  auto failed = [&](const absl::Status& status) {
    return absl::Status(status.code(),
                        absl::StrCat(step.label, ": muon (unit ", u,
                                     "): ", status.message()));
  };
  // This rank's Nesterov updates, into the (zero) exp_avg_sq of its rows.
  for (const MuonParam& p : unit.params) {
    for (const OwnedRange& r : layout.params[p.placement].owned) {
      const absl::Status status = shards->MuonNesterov(
          shard.grads + r.shard_offset, shard.exp_avg + r.shard_offset,
          r.end - r.begin, beta, shard.exp_avg_sq + r.shard_offset);
      if (!status.ok()) return failed(status);
    }
  }
  // The whole unit's updates, gathered in fp32 with the unit's geometry:
  // rank r's shard at r * shard_numel (the other parameters' exp_avg_sq
  // travel along and are ignored).
  std::unique_ptr<OptimizerScratch> gathered;
  if (unit.gather) {
    SHARDD_ASSIGN_OR_RETURN(gathered, shards->Scratch(layout.gathered_numel));
    float* all = gathered->data();
    float* slot = all + int64_t{shards->gather_rank()} * layout.shard_numel;
    SHARDD_RETURN_IF_ERROR(shards->Copy(slot, shard.exp_avg_sq,
                                        layout.shard_numel));
    SHARDD_RETURN_IF_ERROR(shards->AllGather(
        slot, all, layout.shard_numel,
        absl::StrCat(step.label, " muon update all-gather (unit ", u, ")")));
  }
  for (const MuonParam& p : unit.params) {
    const ParamPlacement& placement = layout.params[p.placement];
    if (placement.owned.empty()) continue;  // Only padding here.
    const int64_t matrix = p.rows * p.cols;
    auto orthogonalise = [&](float* x) {
      return shards->Orthogonalise(x, p.rows, p.cols, muon_.ns_steps, p.scale);
    };
    // The matrices this rank holds a piece of, whole from the gathered
    // updates into `whole`; each piece copied back into exp_avg_sq.
    auto from_gathered = [&](int64_t matrices) -> absl::Status {
      SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerScratch> whole,
                              shards->Scratch(matrices * matrix));
      float* x = whole->data();
      for (const CopySegment& s : placement.gathered) {
        SHARDD_RETURN_IF_ERROR(
            shards->Copy(x + s.dst, gathered->data() + s.src, s.count));
      }
      int64_t done = -1;  // The last matrix orthogonalised.
      for (const OwnedRange& r : placement.owned) {
        for (int64_t e = r.begin / matrix; e * matrix < r.end; ++e) {
          if (e > done) SHARDD_RETURN_IF_ERROR(orthogonalise(x + e * matrix));
          done = std::max(done, e);
        }
        SHARDD_RETURN_IF_ERROR(shards->Copy(shard.exp_avg_sq + r.shard_offset,
                                            x + r.begin, r.end - r.begin));
      }
      return absl::OkStatus();
    };
    absl::Status status;
    if (p.role == MuonRole::kExperts && !p.whole_experts && unit.gather) {
      // Split by elements: an expert can straddle ranks.
      status = from_gathered(p.matrices);
    } else if (p.role == MuonRole::kExperts) {
      // Dim-0 shards of [E, in, out] hold whole experts (one rank: all).
      for (const OwnedRange& r : placement.owned) {
        for (int64_t e = r.begin; e < r.end && status.ok(); e += matrix) {
          status = orthogonalise(shard.exp_avg_sq + r.shard_offset +
                                 (e - r.begin));
        }
      }
    } else if (!unit.gather) {
      // One rank: it holds the whole matrix.
      status = orthogonalise(shard.exp_avg_sq + placement.owned[0].shard_offset);
    } else {
      status = from_gathered(1);
    }
    if (!status.ok()) return failed(status);
  }
  return absl::OkStatus();
}

absl::Status MuonOptimizer::Apply(OptimizerShards* shards, int u,
                                  const OptimizerStepContext& step) {
  const Unit& unit = units_[u];
  SHARDD_RETURN_IF_ERROR(
      ApplyAdamWRanges(shards, u, unit.adamw_ranges, adamw_, step));
  const UnitLayout& layout = shards->layout(u);
  const ShardBuffers shard = shards->buffers(u);
  const float beta = static_cast<float>(muon_.momentum);
  const double lr = muon_.lr * step.lr_factor;
  for (const MuonParam& p : unit.params) {
    for (const OwnedRange& r : layout.params[p.placement].owned) {
      const int64_t at = r.shard_offset, n = r.end - r.begin;
      SHARDD_RETURN_IF_ERROR(
          shards->MuonMomentum(shard.grads + at, shard.exp_avg + at, n, beta));
      SHARDD_RETURN_IF_ERROR(shards->MuonApply(
          u, at, n, shard.exp_avg_sq + at, lr, adamw_.weight_decay));
      SHARDD_RETURN_IF_ERROR(shards->Zero(shard.exp_avg_sq + at, n));
    }
  }
  return absl::OkStatus();
}

void MuonOptimizer::Discard(OptimizerShards* shards) {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    const UnitLayout& layout = shards->layout(u);
    const ShardBuffers shard = shards->buffers(u);
    for (const MuonParam& p : units_[u].params) {
      for (const OwnedRange& r : layout.params[p.placement].owned) {
        // Best effort: a device that fails here fails the next step too.
        shards->Zero(shard.exp_avg_sq + r.shard_offset, r.end - r.begin)
            .IgnoreError();
      }
    }
  }
}

}  // namespace shardd
