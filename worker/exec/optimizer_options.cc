#include "worker/exec/optimizer_options.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardd {

std::vector<std::string> OptimizerNames() {
  return {kAdamWOptimizer, kMuonOptimizer};
}

absl::Status ValidateOptimizerOptions(const OptimizerOptions& options,
                                      const std::string& prefix) {
  const std::vector<std::string> names = OptimizerNames();
  bool known = false;
  for (const std::string& name : names) known = known || name == options.name;
  if (!known) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "optimizer: must be one of ", absl::StrJoin(names, ", "),
        ", got \"", options.name, "\""));
  }
  if (options.name != kMuonOptimizer) return absl::OkStatus();
  const kernels::MuonConfig& m = options.muon;
  if (!std::isfinite(m.lr) || m.lr <= 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "muon_lr: must be finite and > 0, got ", m.lr));
  }
  if (!std::isfinite(m.momentum) || m.momentum < 0.0 || m.momentum >= 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "muon_momentum: must be in [0, 1), got ", m.momentum));
  }
  if (m.ns_steps < 1 || m.ns_steps > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "muon_ns_steps: must be in [1, 100], got ", m.ns_steps));
  }
  return absl::OkStatus();
}

}  // namespace shardd
