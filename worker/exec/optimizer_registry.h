#ifndef SHARDD_WORKER_EXEC_OPTIMIZER_REGISTRY_H_
#define SHARDD_WORKER_EXEC_OPTIMIZER_REGISTRY_H_

// Builds the Optimizer (optimizer.h) a job names: "adamw"
// (adamw_optimizer.h) or "muon" (muon_optimizer.h). A new optimizer adds an
// entry here and its name to OptimizerNames(); the backends only see the
// interface.

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/cpu/adamw.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/exec/optimizer.h"
#include "worker/exec/optimizer_options.h"
#include "worker/exec/optimizer_shards.h"

namespace shardd {

// Errors: INVALID_ARGUMENT naming train.optimizer and the known names for
// an unknown one, and the optimizer's own (bad hyper-parameters, a plan it
// cannot serve: see MuonOptimizer::Create).
absl::StatusOr<std::unique_ptr<Optimizer>> CreateOptimizer(
    const OptimizerOptions& options, const kernels::AdamWConfig& adamw,
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const OptimizerShards& store);

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_OPTIMIZER_REGISTRY_H_
