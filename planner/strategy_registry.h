#ifndef SHARDD_PLANNER_STRATEGY_REGISTRY_H_
#define SHARDD_PLANNER_STRATEGY_REGISTRY_H_

// Strategies keyed on the model's architecture class name (a bare name such
// as "DiffusionGemmaForBlockDiffusion"); any other name gets "default".
// Thread-safe.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "proto/coordinator.pb.h"
#include "planner/sharding_strategy.h"

namespace shardd {

class StrategyRegistry {
 public:
  // An empty registry except for "default", which is always present.
  StrategyRegistry();

  // A registry holding every built-in strategy: "default", "diffusion_gemma"
  // (DiffusionGemmaForBlockDiffusion), "deepseek_v4" (DeepseekV4ForCausalLM)
  // and "megatron_fsdp" (by name only).
  static std::unique_ptr<StrategyRegistry> CreateWithBuiltins();

  // Makes `strategy` reachable by its name and, when `architecture` is
  // non-empty, under that architecture key. Registering the same strategy
  // (same name, and same dynamic type) under the same key again is a no-op;
  // the object registered first stays. One strategy may serve several keys.
  // A refused call changes nothing.
  // Errors: INVALID_ARGUMENT (null strategy or empty name), ALREADY_EXISTS
  // (the key is taken by a strategy of another name, or the name by an
  // object of another type).
  absl::Status Register(absl::string_view architecture,
                        std::shared_ptr<const ShardingStrategy> strategy);

  // The strategy registered for `architecture`, else "default". Never null.
  std::shared_ptr<const ShardingStrategy> ForArchitecture(
      absl::string_view architecture) const;

  // Errors: INVALID_ARGUMENT listing the registered names.
  absl::StatusOr<std::shared_ptr<const ShardingStrategy>> ByName(
      absl::string_view name) const;

  // Every strategy with the architectures it serves, sorted by name.
  std::vector<v1::StrategyInfo> List() const;

 private:
  mutable absl::Mutex mu_;
  // Strategy name -> strategy.
  std::map<std::string, std::shared_ptr<const ShardingStrategy>> by_name_
      ABSL_GUARDED_BY(mu_);
  // Architecture class name -> strategy name.
  std::map<std::string, std::string> by_architecture_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardd

#endif  // SHARDD_PLANNER_STRATEGY_REGISTRY_H_
