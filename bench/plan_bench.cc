// Planning DeepSeek-V3 (671B, 61 layers, 256 routed experts) for 8, 256 and
// 2048 shard ranks, timeline off. Target: under 50 ms at 2048 ranks, where
// the plan holds about 2M per-rank valid_rows entries. The baseline for
// ratios is parsing the same config.json into the module tree.
//
//   bazel run -c opt //bench:plan_bench
//
// The config is read from tests/data/deepseek_v3.json in the runfiles tree;
// SHARDD_DEEPSEEK_V3_CONFIG overrides the path.

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "benchmark/benchmark.h"
#include "model/hf_config.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Candidate paths: the override, the runfiles tree (bazel run's working
// directory), and the runfiles next to the binary.
std::string FindConfig() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("SHARDD_DEEPSEEK_V3_CONFIG")) {
    candidates.push_back(env);
  }
  candidates.push_back("tests/data/deepseek_v3.json");
  if (const char* runfiles = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(std::string(runfiles) +
                         "/shardd/tests/data/deepseek_v3.json");
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    candidates.push_back(std::string(exe, n) +
                         ".runfiles/shardd/tests/data/deepseek_v3.json");
  }
  for (const std::string& path : candidates) {
    std::string text = ReadFile(path);
    if (!text.empty()) return text;
  }
  return "";
}

const v1::ModelSpec* DeepseekV3() {
  static const v1::ModelSpec* spec = [] {
    const std::string json = FindConfig();
    absl::StatusOr<v1::ModelSpec> parsed = ModelSpecFromHfConfig(json);
    if (!parsed.ok()) return static_cast<v1::ModelSpec*>(nullptr);
    return new v1::ModelSpec(*std::move(parsed));
  }();
  return spec;
}

// DeepSeek-V3, or null after marking the benchmark skipped.
const v1::ModelSpec* DeepseekV3OrSkip(benchmark::State& state) {
  const v1::ModelSpec* model = DeepseekV3();
  if (model == nullptr) {
    state.SkipWithError("cannot read or parse tests/data/deepseek_v3.json");
  }
  return model;
}

// Options sharding over state.range(0) ranks.
v1::PlanOptions OverRanks(const benchmark::State& state) {
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(static_cast<int>(state.range(0)));
  return options;
}

void PlanDeepseekV3(benchmark::State& state, const char* strategy,
                    bool exclude_free) {
  const v1::ModelSpec* model = DeepseekV3OrSkip(state);
  if (model == nullptr) return;
  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  ShardingPlanner planner(registry.get());
  v1::PlanOptions options = OverRanks(state);
  options.set_strategy(strategy);
  int64_t units = 0;
  int64_t rank_entries = 0;
  for (auto _ : state) {
    absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(*model, options);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      return;
    }
    units = plan->units_size();
    benchmark::DoNotOptimize(plan->memory().peak_unsharded_bytes());
    if (rank_entries == 0) {
      for (const v1::FsdpUnit& unit : plan->units()) {
        for (const v1::ParamLayout& p : unit.params()) {
          rank_entries += p.valid_rows_size();
        }
      }
    }
    if (exclude_free) {
      // Free the plan outside the timed region (1M+ small messages).
      state.PauseTiming();
      plan = absl::StatusOr<v1::ShardingPlan>();
      state.ResumeTiming();
    }
  }
  state.counters["units"] = static_cast<double>(units);
  state.counters["rank_entries"] = static_cast<double>(rank_entries);
}

// What a job start sends each worker (LoadPlanRequest, serialized): the
// whole plan with the model, or (the default) the plan's options with the
// model for the worker to derive the plan; the time is one worker's
// derivation (planning the model) and its fingerprint check. Counters: the
// request's bytes either way and the coordinator's egress over the world.
void LoadPlanEgress(benchmark::State& state) {
  const v1::ModelSpec* model = DeepseekV3OrSkip(state);
  if (model == nullptr) return;
  std::unique_ptr<StrategyRegistry> registry =
      StrategyRegistry::CreateWithBuiltins();
  ShardingPlanner planner(registry.get());
  const v1::PlanOptions options = OverRanks(state);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(*model, options);
  if (!plan.ok()) {
    state.SkipWithError(std::string(plan.status().message()).c_str());
    return;
  }
  v1::LoadPlanRequest full;
  *full.mutable_plan() = *plan;
  *full.mutable_model() = *model;
  full.mutable_train()->set_steps(1000);
  v1::LoadPlanRequest derived;
  *derived.mutable_plan_options() = options;
  derived.set_plan_fingerprint(plan->fingerprint());
  *derived.mutable_model() = *model;
  derived.mutable_train()->set_steps(1000);
  for (auto _ : state) {
    absl::StatusOr<v1::ShardingPlan> mine =
        planner.Plan(derived.model(), derived.plan_options());
    if (!mine.ok() || mine->fingerprint() != derived.plan_fingerprint()) {
      state.SkipWithError("the derived plan differs");
      return;
    }
  }
  const double world = static_cast<double>(state.range(0));
  const double full_bytes = static_cast<double>(full.ByteSizeLong());
  const double derived_bytes = static_cast<double>(derived.ByteSizeLong());
  state.counters["full_B"] = full_bytes;
  state.counters["derived_B"] = derived_bytes;
  state.counters["egress_full_MB"] = full_bytes * world / 1e6;
  state.counters["egress_derived_MB"] = derived_bytes * world / 1e6;
}
BENCHMARK(LoadPlanEgress)
    ->Arg(8)
    ->Arg(256)
    ->Arg(2048)
    ->Arg(8192)
    ->Unit(benchmark::kMillisecond);

// Baseline for the ratios in docs/performance.md: turning the config.json
// into the module tree, the step every plan request makes before planning.
void ParseDeepseekV3Config(benchmark::State& state) {
  const std::string json = FindConfig();
  for (auto _ : state) {
    absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(json);
    if (!spec.ok()) {
      state.SkipWithError("cannot read or parse tests/data/deepseek_v3.json");
      return;
    }
    benchmark::DoNotOptimize(spec->root().children_size());
  }
}
BENCHMARK(ParseDeepseekV3Config)->Unit(benchmark::kMillisecond);

// The plan's lifetime (build and free) ...
BENCHMARK_CAPTURE(PlanDeepseekV3, default, "default", false)
    ->Arg(8)
    ->Arg(256)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(PlanDeepseekV3, megatron_fsdp, "megatron_fsdp", false)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
// ... and Plan() alone.
BENCHMARK_CAPTURE(PlanDeepseekV3, default_plan_only, "default", true)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(PlanDeepseekV3, megatron_fsdp_plan_only, "megatron_fsdp",
                  true)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace shardd
