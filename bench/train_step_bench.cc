// Step time and tokens/s of sharded training (StepExecutor, W ranks as
// threads over loopback Gloo) against one unsharded rank (world 1: every
// collective is a local copy) training the same global batch.
//
// Model: tests/data/small_moe.json. Global batch 64 x seq 64 (4096 tokens
// per optimizer step, split over the W ranks), one micro-batch, fp32
// ("default" strategy, mixed precision off) and bf16 gathers (on).
// The kernels run on 1 thread (kernels::SetComputeThreads(1)), so W ranks
// use W compute threads plus W communication threads.
// Step time is the slowest rank's StepResult::seconds of each step; the
// table shows the median over kTimed steps after kWarmup. The worlds run
// round-robin kRounds times (1, 2, 4, 1, 2, 4, ...) so drift in machine load
// hits all of them; each round is a fresh executor.
//
// Then activation checkpointing: tests/data/small_qwen3_moe.json (attention)
// on 2 ranks, each policy's median step time against "none" in the same
// rounds, with the measured peak of activations (= the plan's).
//
// Run: bazel run -c opt //bench:train_step_bench

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/local_gloo_group.h"
#include "kernels/cpu/compute_pool.h"
#include "model/native_spec.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_executor.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {
namespace {

constexpr int64_t kGlobalBatch = 64;
constexpr int64_t kSeq = 64;
constexpr int kWarmup = 3;
constexpr int kTimed = 10;
constexpr int kRounds = 3;
constexpr absl::Duration kTimeout = absl::Seconds(60);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// tests/data/<name> in the runfiles tree (bazel run's working directory)
// or next to the binary.
std::string FindSpec(const std::string& name) {
  std::vector<std::string> candidates = {"tests/data/" + name};
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    candidates.push_back(std::string(exe, n) + ".runfiles/shardd/tests/data/" +
                         name);
  }
  for (const std::string& path : candidates) {
    std::string text = ReadFile(path);
    if (!text.empty()) return text;
  }
  return "";
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median step seconds of `world` ranks, or a negative number on failure.
// With `checkpointing` the plan models activations (and recomputes as it
// says); *peak_activations gets rank 0's measured peak.
double RunWorld(const v1::ModelSpec& model, int world, bool mixed,
                const std::string& checkpointing = "",
                int64_t* peak_activations = nullptr) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions plan_options;
  plan_options.mutable_mesh()->set_dp_shard(world);
  plan_options.set_mixed_precision(mixed);
  if (!checkpointing.empty()) {
    plan_options.set_micro_batch_size(
        static_cast<int32_t>(kGlobalBatch / world));
    plan_options.set_seq_len(kSeq);
    plan_options.set_activation_checkpointing(checkpointing);
  }
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, plan_options);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan: %s\n", plan.status().ToString().c_str());
    return -1;
  }
  absl::StatusOr<v1::StepProgram> program = CompileStepProgram(*plan);
  if (!program.ok()) {
    std::fprintf(stderr, "program: %s\n", program.status().ToString().c_str());
    return -1;
  }
  data::DataSourceOptions source_options;
  source_options.model_vocab_size = model.dims().vocab_size();
  source_options.seed = 3;
  auto source = data::CreateDataSource(source_options);
  if (!source.ok()) return -1;
  data::BatchSamplerOptions sampler_options;
  sampler_options.global_batch = kGlobalBatch;
  sampler_options.seq_len = kSeq;
  sampler_options.microbatches = 1;
  sampler_options.ranks = world;
  sampler_options.model_vocab_size = model.dims().vocab_size();
  auto sampler = data::BatchSampler::Create(*source, sampler_options);
  if (!sampler.ok()) {
    std::fprintf(stderr, "sampler: %s\n", sampler.status().ToString().c_str());
    return -1;
  }

  static int generation = 0;
  const std::string prefix = absl::StrCat("train-step-bench/", ++generation);
  absl::Mutex mu;
  // [step] slowest rank's seconds.
  std::vector<double> step_seconds(kWarmup + kTimed, 0.0);
  const bool ok = RunOnLocalGlooGroup(
      world, prefix, kTimeout,
      [&](int r, GlooCommunicator* comm) -> absl::Status {
        MemoryTracker tracker;
        StepExecutorOptions options;
        options.shard_rank = r;
        options.seed = 7;
        options.collective_timeout = kTimeout;
        options.adamw.lr = 1e-3;
        options.max_grad_norm = 1.0;
        auto executor = StepExecutor::Create(*plan, model, options, comm,
                                             nullptr, &tracker);
        if (!executor.ok()) return executor.status();
        for (int s = 0; s < kWarmup + kTimed; ++s) {
          v1::StepProgram step = *program;
          step.set_step(s);
          absl::StatusOr<data::MicroBatch> batch = sampler->Get(s, r, 0);
          if (!batch.ok()) return batch.status();
          std::vector<data::MicroBatch> batches;
          batches.push_back(*std::move(batch));
          absl::StatusOr<StepResult> result =
              (*executor)->Execute(step, batches);
          if (!result.ok()) return result.status();
          absl::MutexLock lock(&mu);
          step_seconds[s] = std::max(step_seconds[s], result->seconds);
          if (r == 0 && peak_activations != nullptr) {
            *peak_activations = result->peak_activation_bytes;
          }
        }
        return absl::OkStatus();
      });
  if (!ok) return -1;
  return Median(
      std::vector<double>(step_seconds.begin() + kWarmup, step_seconds.end()));
}

}  // namespace
}  // namespace shardd

int main() {
  if (!shardd::kernels::SetComputeThreads(1).ok()) return 1;
  const std::string json = shardd::FindSpec("small_moe.json");
  absl::StatusOr<shardd::v1::ModelSpec> model =
      shardd::ModelSpecFromNativeJson(json);
  if (!model.ok()) {
    std::fprintf(stderr, "tests/data/small_moe.json: %s\n",
                 model.status().ToString().c_str());
    return 1;
  }
  const int worlds[] = {1, 2, 4};
  for (bool mixed : {false, true}) {
    // [world index][round]
    std::vector<std::vector<double>> medians(3);
    for (int round = 0; round < shardd::kRounds; ++round) {
      for (int w = 0; w < 3; ++w) {
        const double t = shardd::RunWorld(*model, worlds[w], mixed);
        if (t < 0) return 1;
        medians[w].push_back(t);
      }
    }
    std::printf(
        "\n%s gathers; per-round medians in ms in brackets\n"
        "| W | rows per rank | median step ms | tokens/s | tokens/s ratio to "
        "W=1 |\n|---|---|---|---|---|\n",
        mixed ? "bf16" : "fp32");
    const double base = shardd::Median(medians[0]);
    for (int w = 0; w < 3; ++w) {
      const double t = shardd::Median(medians[w]);
      std::string rounds;
      for (double m : medians[w])
        absl::StrAppend(&rounds, " ", absl::StrFormat("%.1f", m * 1e3));
      std::printf("| %d | %lld | %.2f [%s ] | %.0f | %.2f |\n", worlds[w],
                  static_cast<long long>(shardd::kGlobalBatch / worlds[w]),
                  t * 1e3, rounds.c_str(),
                  shardd::kGlobalBatch * shardd::kSeq / t, base / t);
    }
    std::fflush(stdout);
  }

  absl::StatusOr<shardd::v1::ModelSpec> attention =
      shardd::ModelSpecFromJson(shardd::FindSpec("small_qwen3_moe.json"));
  if (!attention.ok()) {
    std::fprintf(stderr, "tests/data/small_qwen3_moe.json: %s\n",
                 attention.status().ToString().c_str());
    return 1;
  }
  const char* policies[] = {"none", "experts", "every:2", "all"};
  std::vector<std::vector<double>> medians(4);
  std::vector<int64_t> peaks(4, 0);
  for (int round = 0; round < shardd::kRounds; ++round) {
    for (int p = 0; p < 4; ++p) {
      const double t = shardd::RunWorld(*attention, 2, /*mixed=*/false,
                                        policies[p], &peaks[p]);
      if (t < 0) return 1;
      medians[p].push_back(t);
    }
  }
  std::printf(
      "\nsmall_qwen3_moe, 2 ranks, fp32, %lld sequences x %lld tokens per "
      "rank\n| activation_checkpointing | median step ms | step time ratio "
      "to none | peak activations per rank | ratio to none |\n"
      "|---|---|---|---|---|\n",
      static_cast<long long>(shardd::kGlobalBatch / 2),
      static_cast<long long>(shardd::kSeq));
  const double base = shardd::Median(medians[0]);
  for (int p = 0; p < 4; ++p) {
    const double t = shardd::Median(medians[p]);
    std::printf("| %s | %.2f | %.2f | %.2f MiB | %.2f |\n", policies[p],
                t * 1e3, t / base, peaks[p] / 1048576.0,
                static_cast<double>(peaks[p]) / peaks[0]);
  }
  return 0;
}
