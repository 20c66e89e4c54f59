#include "worker/exec/optimizer_registry.h"

#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/exec/adamw_optimizer.h"
#include "worker/exec/muon_optimizer.h"

namespace shardd {
namespace {

using Factory = std::function<absl::StatusOr<std::unique_ptr<Optimizer>>(
    const OptimizerOptions&, const kernels::AdamWConfig&,
    const v1::ShardingPlan&, const v1::ModelSpec&, const OptimizerShards&)>;

struct Entry {
  const char* name;
  Factory create;
};

const Entry kEntries[] = {
    {kAdamWOptimizer,
     [](const OptimizerOptions&, const kernels::AdamWConfig& adamw,
        const v1::ShardingPlan&, const v1::ModelSpec&,
        const OptimizerShards&) -> absl::StatusOr<std::unique_ptr<Optimizer>> {
       return std::make_unique<AdamWOptimizer>(adamw);
     }},
    {kMuonOptimizer,
     [](const OptimizerOptions& options, const kernels::AdamWConfig& adamw,
        const v1::ShardingPlan& plan, const v1::ModelSpec& model,
        const OptimizerShards& store) -> absl::StatusOr<std::unique_ptr<Optimizer>> {
       SHARDD_ASSIGN_OR_RETURN(
           std::unique_ptr<MuonOptimizer> muon,
           MuonOptimizer::Create(options.muon, adamw, plan, model, store));
       return std::unique_ptr<Optimizer>(std::move(muon));
     }},
};

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> CreateOptimizer(
    const OptimizerOptions& options, const kernels::AdamWConfig& adamw,
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const OptimizerShards& store) {
  SHARDD_RETURN_IF_ERROR(ValidateOptimizerOptions(options, "train."));
  for (const Entry& entry : kEntries) {
    if (options.name == entry.name) {
      return entry.create(options, adamw, plan, model, store);
    }
  }
  // Unreachable while kEntries covers OptimizerNames() (optimizer_test).
  return absl::InvalidArgumentError(
      absl::StrCat("train.optimizer: no optimizer \"", options.name, "\""));
}

}  // namespace shardd
