#include "planner/strategy_registry.h"

#include <typeinfo>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "planner/default_strategy.h"
#include "planner/diffusion_gemma_strategy.h"
#include "planner/dtype_island_strategy.h"
#include "planner/megatron_fsdp_strategy.h"

namespace shardd {
namespace {

// Two objects with the same name are the same strategy; the type check
// catches a different implementation reusing a taken name.
bool SameStrategy(const ShardingStrategy& a, const ShardingStrategy& b) {
  return a.name() == b.name() && typeid(a) == typeid(b);
}

}  // namespace

StrategyRegistry::StrategyRegistry() {
  auto strategy = std::make_shared<const DefaultStrategy>();
  absl::MutexLock lock(&mu_);
  by_name_.emplace(strategy->name(), std::move(strategy));
}

std::unique_ptr<StrategyRegistry> StrategyRegistry::CreateWithBuiltins() {
  auto registry = std::make_unique<StrategyRegistry>();
  const std::pair<const char*, std::shared_ptr<const ShardingStrategy>>
      builtins[] = {
          {DiffusionGemmaStrategy::kArchitecture,
           std::make_shared<const DiffusionGemmaStrategy>()},
          {DtypeIslandStrategy::kArchitecture,
           std::make_shared<const DtypeIslandStrategy>()},
          {"", std::make_shared<const MegatronFsdpStrategy>()},
      };
  for (const auto& [architecture, strategy] : builtins) {
    absl::Status status = registry->Register(architecture, strategy);
    // Built-ins are distinct by construction; a failure is a programming
    // error, but keep serving the rest rather than crash.
    if (!status.ok()) {
      SHARDD_LOG(ERROR) << "built-in strategy " << strategy->name() << ": "
                        << status.ToString();
    }
  }
  return registry;
}

absl::Status StrategyRegistry::Register(
    absl::string_view architecture,
    std::shared_ptr<const ShardingStrategy> strategy) {
  if (strategy == nullptr) {
    return absl::InvalidArgumentError("strategy must not be null");
  }
  const std::string name = strategy->name();
  if (name.empty()) {
    return absl::InvalidArgumentError("strategy name must not be empty");
  }
  absl::MutexLock lock(&mu_);
  // Check everything before changing anything, so a refusal leaves the
  // registry as it was.
  auto named = by_name_.find(name);
  if (named != by_name_.end() && !SameStrategy(*named->second, *strategy)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "strategy name '", name,
        "' is already taken by a different strategy implementation"));
  }
  if (!architecture.empty()) {
    auto keyed = by_architecture_.find(std::string(architecture));
    if (keyed != by_architecture_.end() && keyed->second != name) {
      return absl::AlreadyExistsError(absl::StrCat(
          "architecture '", architecture, "' already has strategy '",
          keyed->second, "'; refusing to register '", name, "'"));
    }
    by_architecture_.emplace(std::string(architecture), name);
  }
  // Keep the first object of a name: earlier callers may hold it.
  if (named == by_name_.end()) by_name_.emplace(name, std::move(strategy));
  return absl::OkStatus();
}

std::shared_ptr<const ShardingStrategy> StrategyRegistry::ForArchitecture(
    absl::string_view architecture) const {
  absl::MutexLock lock(&mu_);
  auto keyed = by_architecture_.find(std::string(architecture));
  if (keyed != by_architecture_.end()) {
    auto named = by_name_.find(keyed->second);
    if (named != by_name_.end()) return named->second;
  }
  return by_name_.at(DefaultStrategy::kName);
}

absl::StatusOr<std::shared_ptr<const ShardingStrategy>>
StrategyRegistry::ByName(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto named = by_name_.find(std::string(name));
  if (named != by_name_.end()) return named->second;
  std::vector<std::string> names;
  for (const auto& [known, strategy] : by_name_) names.push_back(known);
  return absl::InvalidArgumentError(
      absl::StrCat("strategy: unknown strategy '", name,
                   "'; registered strategies: ", absl::StrJoin(names, ", ")));
}

std::vector<v1::StrategyInfo> StrategyRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::StrategyInfo> infos;
  infos.reserve(by_name_.size());
  // by_name_ is a sorted map, so the result is sorted by name.
  for (const auto& [name, strategy] : by_name_) {
    v1::StrategyInfo& info = infos.emplace_back();
    info.set_name(name);
    info.set_description(strategy->description());
    for (const auto& [architecture, target] : by_architecture_) {
      if (target == name) info.add_architectures(architecture);
    }
  }
  return infos;
}

}  // namespace shardd
