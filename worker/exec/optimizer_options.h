#ifndef SHARDD_WORKER_EXEC_OPTIMIZER_OPTIONS_H_
#define SHARDD_WORKER_EXEC_OPTIMIZER_OPTIONS_H_

// Which optimizer a job's step applies (TrainConfig.optimizer) and Muon's
// hyper-parameters. AdamW's own are StepExecutorOptions::adamw; the
// registry that builds an optimizer from these is optimizer_registry.h.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/muon.h"

namespace shardd {

inline constexpr char kAdamWOptimizer[] = "adamw";
inline constexpr char kMuonOptimizer[] = "muon";

struct OptimizerOptions {
  // kAdamWOptimizer (every trainable parameter) or kMuonOptimizer (Muon for
  // the hidden 2-D weight matrices and each expert's matrix, AdamW for the
  // rest: muon_optimizer.h).
  std::string name = kAdamWOptimizer;
  // Muon's lr is the peak: the job's learning-rate schedule multiplies it
  // by the same factor as AdamW's. Its weight decay is AdamW's.
  kernels::MuonConfig muon;
};

// The names the registry knows, in the order error messages list them.
std::vector<std::string> OptimizerNames();

// INVALID_ARGUMENT naming `prefix` + the field and its allowed values: an
// unknown name (listing the known ones), and for muon a muon_lr not finite
// or <= 0, a muon_momentum outside [0, 1), muon_ns_steps outside [1, 100].
// `prefix` is how the caller's users spell the fields ("train.").
absl::Status ValidateOptimizerOptions(const OptimizerOptions& options,
                                      const std::string& prefix);

// Whether a store holds gradients and moments only up to each unit's last
// trainable element (ShardStoreOptions::trim_frozen_state): for LoRA jobs,
// whose frozen base then costs no optimizer memory, under AdamW (Muon uses
// exp_avg_sq as whole-shard scratch, so it keeps them all). Both backends
// follow this one rule.
inline bool TrimsFrozenState(bool lora, const OptimizerOptions& options) {
  return lora && options.name == kAdamWOptimizer;
}

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_OPTIMIZER_OPTIONS_H_
