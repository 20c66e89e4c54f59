#include "worker/exec/muon_optimizer.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/muon.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "testing/model_builder.h"
#include "testing/shard_state.h"
#include "worker/exec/host_optimizer_shards.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/exec/optimizer_registry.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {
namespace {

using ::shardd::testing_util::TrainingStateMaps;
using ::testing::HasSubstr;

constexpr char kRouter0[] = "model.layers.0.moe.gate.weight";

// Attention (q 16x16, k/v 8x16, o 16x16), a dense MLP (12x16, 16x12) and 4
// experts ([4, 16, 16] and [4, 8, 16]) per layer; layer 0's router frozen.
// Over 3 ranks dim 0 of 16 pads to 18: rows 6, 6, 4; 4 experts pad to 6:
// 2, 2 and none.
v1::ModelSpec Model() {
  testing_util::TinyMoeShape shape;
  shape.attention = true;
  shape.heads = 4;
  shape.kv_heads = 2;
  shape.head_dim = 4;
  shape.qk_norm = true;
  shape.freeze_router0 = true;
  return testing_util::TinyMoeSpec(shape);
}

v1::ShardingPlan Plan(const v1::ModelSpec& model, const std::string& strategy,
                      int dp) {
  static StrategyRegistry* registry =
      StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.set_strategy(strategy);
  options.mutable_mesh()->set_dp_shard(dp);
  options.set_bucket_elements(700);
  absl::StatusOr<v1::ShardingPlan> plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

kernels::AdamWConfig AdamW() {
  kernels::AdamWConfig adamw;
  adamw.lr = 1e-2;
  adamw.weight_decay = 0.1;
  adamw.beta2 = 0.95;
  return adamw;
}

OptimizerOptions Muon() {
  OptimizerOptions options;
  options.name = kMuonOptimizer;
  options.muon.lr = 0.02;
  return options;
}

// A gradient that depends only on (parameter, element, step), so every
// layout holds the same global values.
float GradOf(const std::string& name, int64_t i, int step) {
  uint64_t h = std::hash<std::string>{}(name) ^
               (static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(step) << 56);
  h += 0x9E3779B97F4A7C15ull;
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  h ^= h >> 31;
  return static_cast<float>(h >> 40) / static_cast<float>(1 << 24) * 2 - 1;
}

void SetGrads(ShardStore* store, int step) {
  for (int u = 0; u < store->num_units(); ++u) {
    const ShardStore::UnitShard shard = store->shard(u);
    for (const ParamPlacement& p : store->layout(u).params) {
      if (p.frozen) continue;
      for (const OwnedRange& r : p.owned) {
        for (int64_t i = r.begin; i < r.end; ++i) {
          shard.grads[r.shard_offset + (i - r.begin)] = GradOf(p.name, i, step);
        }
      }
    }
  }
}

OptimizerStepContext Context(int step) {
  OptimizerStepContext c;
  c.step = step;
  c.lr = AdamW().lr;
  c.lr_factor = 1.0;
  c.label = "test";
  return c;
}

// Runs `steps` Muon steps on every rank of a dp-rank plan with the same
// global gradients and returns the state after each.
std::vector<TrainingStateMaps> RunMuon(const v1::ModelSpec& model, int dp,
                                       int steps, double lr_factor = 1.0) {
  const v1::ShardingPlan plan = Plan(model, "default", dp);
  std::vector<TrainingStateMaps> states(steps);
  static std::atomic<int> generation{0};
  const std::string prefix =
      absl::StrCat("muon-optimizer-test/", generation.fetch_add(1));
  InMemoryKeyValueClient kv;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < dp; ++rank) {
    threads.emplace_back([&, rank] {
      KvGlooStore kv_store(&kv, absl::Seconds(20));
      auto group = GlooCommunicator::Create(&kv_store, prefix, rank, dp,
                                            "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(group.ok()) << group.status();
      MemoryTracker tracker;
      ShardStoreOptions store_options;
      store_options.shard_rank = rank;
      store_options.seed = 7;
      auto store = ShardStore::Create(plan, model, store_options, &tracker);
      ASSERT_TRUE(store.ok()) << store.status();
      HostOptimizerShards shards(store->get(), &tracker, group->get(),
                                 absl::Seconds(20), RunCollectiveHere());
      auto optimizer = CreateOptimizer(Muon(), AdamW(), plan, model, shards);
      ASSERT_TRUE(optimizer.ok()) << optimizer.status();
      for (int s = 1; s <= steps; ++s) {
        SetGrads(store->get(), s);
        OptimizerStepContext c = Context(s);
        c.lr_factor = lr_factor;
        c.lr = AdamW().lr * lr_factor;
        for (int u = 0; u < (*store)->num_units(); ++u) {
          ASSERT_THAT((*optimizer)->Prepare(&shards, u, c), IsOk());
        }
        for (int u = 0; u < (*store)->num_units(); ++u) {
          ASSERT_THAT((*optimizer)->Apply(&shards, u, c), IsOk());
        }
        absl::MutexLock lock(&mu);
        testing_util::CollectOwnedState(plan, **store, &states[s - 1]);
      }
      // Workspace is freed after each unit.
      EXPECT_EQ(
          tracker.Snapshot().live[static_cast<int>(MemoryKind::kWorkspace)], 0);
    });
  }
  for (std::thread& t : threads) t.join();
  return states;
}

TEST(MuonRoleTest, HiddenMatricesAndExpertsAreMuonsTheRestAdamW) {
  std::map<std::string, MuonRole> roles;
  ForEachParam(Model(),
               [&roles](const ParamRef& p) { roles[p.fqn] = MuonRoleOf(p); });
  const std::string l = "model.layers.1.";
  EXPECT_EQ(roles.at(l + "self_attn.q_proj.weight"), MuonRole::kMatrix);
  EXPECT_EQ(roles.at(l + "self_attn.k_proj.weight"), MuonRole::kMatrix);
  EXPECT_EQ(roles.at(l + "self_attn.o_proj.weight"), MuonRole::kMatrix);
  EXPECT_EQ(roles.at(l + "mlp.down_proj.weight"), MuonRole::kMatrix);
  EXPECT_EQ(roles.at(l + "moe.experts.gate_and_up_projs"), MuonRole::kExperts);
  EXPECT_EQ(roles.at(l + "moe.experts.down_projs"), MuonRole::kExperts);
  EXPECT_EQ(roles.at(l + "moe.gate.weight"), MuonRole::kAdamW);
  EXPECT_EQ(roles.at(l + "input_layernorm.weight"), MuonRole::kAdamW);
  EXPECT_EQ(roles.at(l + "self_attn.q_norm.weight"), MuonRole::kAdamW);
  EXPECT_EQ(roles.at("model.embed_tokens.weight"), MuonRole::kAdamW);
  EXPECT_EQ(roles.at(kRouter0), MuonRole::kAdamW);  // Frozen.
  for (const auto& [name, role] : roles) {
    if (name.find("lm_head") != std::string::npos) {
      EXPECT_EQ(role, MuonRole::kAdamW) << name;
    }
  }
}

// dp 1 against the published algorithm, step by step, with the kernels: a
// Muon matrix and an expert of a stacked tensor.
class MuonOptimizerScheduleTest : public ::testing::TestWithParam<double> {};

// lr_factor: the schedule's factor this step, which scales Muon's lr too.
TEST_P(MuonOptimizerScheduleTest, OneRankIsThePublishedUpdate) {
  const double factor = GetParam();
  const v1::ModelSpec model = Model();
  const std::vector<TrainingStateMaps> states = RunMuon(model, 1, 2, factor);
  const v1::ShardingPlan plan = Plan(model, "default", 1);
  MemoryTracker tracker;
  ShardStoreOptions store_options;
  store_options.seed = 7;
  auto store = ShardStore::Create(plan, model, store_options, &tracker);
  ASSERT_TRUE(store.ok());
  TrainingStateMaps init;
  testing_util::CollectOwnedState(plan, **store, &init);
  struct Case {
    std::string name;
    int64_t offset, rows, cols;
    double scale;
  };
  const std::string l = "model.layers.0.";
  // q_proj [16, 16]; expert 1 of gate_and_up [4, 16, 16] (in 16, out 16);
  // expert 3 of down_projs [4, 8, 16]: stored [in 8, out 16], so the scale
  // is sqrt(16 / 8).
  const std::vector<Case> cases = {
      {l + "self_attn.q_proj.weight", 0, 16, 16, 1.0},
      {l + "moe.experts.gate_and_up_projs", 256, 16, 16, 1.0},
      {l + "moe.experts.down_projs", 3 * 128, 8, 16, std::sqrt(2.0)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t n = c.rows * c.cols;
    std::vector<float> p(init.params.at(c.name).begin() + c.offset,
                         init.params.at(c.name).begin() + c.offset + n);
    std::vector<float> m(n, 0.0f), g(n), u(n);
    std::vector<float> ws(kernels::NewtonSchulzWorkspace(c.rows, c.cols));
    for (int s = 1; s <= 2; ++s) {
      for (int64_t i = 0; i < n; ++i) g[i] = GradOf(c.name, c.offset + i, s);
      kernels::MuonNesterovUpdate(g.data(), m.data(), n, 0.95f, u.data());
      kernels::MuonMomentumStep(g.data(), m.data(), n, 0.95f);
      ASSERT_THAT(kernels::NewtonSchulz(u.data(), c.rows, c.cols, 5, ws.data()),
                  IsOk());
      for (float& v : u) v *= static_cast<float>(c.scale);
      kernels::MuonApply(p.data(), u.data(), n, 0.02 * factor, 0.1);
      const TrainingStateMaps& got = states[s - 1];
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got.params.at(c.name)[c.offset + i], p[i]) << s << " " << i;
        ASSERT_EQ(got.exp_avg.at(c.name)[c.offset + i], m[i]) << s << " " << i;
        ASSERT_EQ(got.exp_avg_sq.at(c.name)[c.offset + i], 0.0f);
      }
    }
  }
  // The frozen router did not move.
  EXPECT_EQ(states[1].params.at(kRouter0), init.params.at(kRouter0));
}

INSTANTIATE_TEST_SUITE_P(LrFactors, MuonOptimizerScheduleTest,
                         ::testing::Values(1.0, 0.25));

// Sharded Muon is the one-rank Muon bit for bit: the gathered matrix is the
// same bits and Newton-Schulz runs the same GEMM calls on it, whatever
// rank runs it (3 ranks: uneven rows, one rank without experts).
TEST(MuonOptimizerTest, ShardedEqualsOneRankBitwise) {
  const v1::ModelSpec model = Model();
  const std::vector<TrainingStateMaps> one = RunMuon(model, 1, 2);
  for (int dp : {2, 3, 4}) {
    const std::vector<TrainingStateMaps> run = RunMuon(model, dp, 2);
    for (int s = 0; s < 2; ++s) {
      SCOPED_TRACE(absl::StrCat("dp ", dp, " step ", s + 1));
      EXPECT_EQ(run[s].params, one[s].params);
      EXPECT_EQ(run[s].exp_avg, one[s].exp_avg);
      EXPECT_EQ(run[s].exp_avg_sq, one[s].exp_avg_sq);
    }
  }
}

TEST(MuonOptimizerTest, FlatRangesAreRefused) {
  const v1::ModelSpec model = Model();
  const v1::ShardingPlan plan = Plan(model, "megatron_fsdp", 2);
  MemoryTracker tracker;
  ShardStoreOptions store_options;
  auto store = ShardStore::Create(plan, model, store_options, &tracker);
  ASSERT_TRUE(store.ok());
  const HostOptimizerShards shards(store->get(), &tracker, nullptr,
                                   absl::Seconds(20), RunCollectiveHere());
  EXPECT_THAT(CreateOptimizer(Muon(), AdamW(), plan, model, shards),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is a flat range (strategy megatron_fsdp)")));
  OptimizerOptions adamw;
  EXPECT_THAT(CreateOptimizer(adamw, AdamW(), plan, model, shards), IsOk());
}

TEST(MuonOptimizerTest, AFailedGatherCommitsNothing) {
  const v1::ModelSpec model = Model();
  const v1::ShardingPlan plan = Plan(model, "default", 2);
  MemoryTracker tracker;
  ShardStoreOptions store_options;
  store_options.seed = 7;
  auto store = ShardStore::Create(plan, model, store_options, &tracker);
  ASSERT_TRUE(store.ok());
  TrainingStateMaps before, after;
  testing_util::CollectOwnedState(plan, **store, &before);
  SetGrads(store->get(), 1);
  // A one-rank group stands in for rank 0's (the runner never calls it).
  InMemoryKeyValueClient kv;
  KvGlooStore kv_store(&kv, absl::Seconds(20));
  auto group = GlooCommunicator::Create(&kv_store, "fail", 0, 1, "127.0.0.1",
                                        absl::Seconds(20));
  ASSERT_TRUE(group.ok()) << group.status();
  HostOptimizerShards shards(
      store->get(), &tracker, group->get(), absl::Seconds(20),
      [](const std::string& what, std::function<absl::Status()>) {
        return absl::DeadlineExceededError(what);
      });
  auto optimizer = CreateOptimizer(Muon(), AdamW(), plan, model, shards);
  ASSERT_TRUE(optimizer.ok());
  const OptimizerStepContext c = Context(1);
  absl::Status status;
  for (int u = 0; u < (*store)->num_units() && status.ok(); ++u) {
    status = (*optimizer)->Prepare(&shards, u, c);
  }
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kDeadlineExceeded,
                               HasSubstr("muon update all-gather")));
  (*optimizer)->Discard(&shards);
  testing_util::CollectOwnedState(plan, **store, &after);
  EXPECT_EQ(after.params, before.params);
  EXPECT_EQ(after.exp_avg, before.exp_avg);
  EXPECT_EQ(after.exp_avg_sq, before.exp_avg_sq);
  EXPECT_EQ(tracker.Snapshot().live[static_cast<int>(MemoryKind::kWorkspace)],
            0);
}

TEST(OptimizerRegistryTest, EveryNameCreatesAndUnknownOnesAreListed) {
  const v1::ModelSpec model = Model();
  const v1::ShardingPlan plan = Plan(model, "default", 1);
  MemoryTracker tracker;
  auto store = ShardStore::Create(plan, model, ShardStoreOptions(), &tracker);
  ASSERT_TRUE(store.ok());
  const HostOptimizerShards shards(store->get(), &tracker, nullptr,
                                   absl::Seconds(20), RunCollectiveHere());
  for (const std::string& name : OptimizerNames()) {
    OptimizerOptions options = Muon();
    options.name = name;
    auto created = CreateOptimizer(options, AdamW(), plan, model, shards);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ((*created)->name(), name);
  }
  OptimizerOptions sgd;
  sgd.name = "sgd";
  EXPECT_THAT(CreateOptimizer(sgd, AdamW(), plan, model, shards),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.optimizer: must be one of adamw, "
                                 "muon, got \"sgd\"")));
  OptimizerOptions bad = Muon();
  bad.muon.ns_steps = 0;
  EXPECT_THAT(CreateOptimizer(bad, AdamW(), plan, model, shards),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.muon_ns_steps: must be in [1, 100]")));
  bad = Muon();
  bad.muon.momentum = 1.0;
  EXPECT_THAT(CreateOptimizer(bad, AdamW(), plan, model, shards),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.muon_momentum")));
}

}  // namespace
}  // namespace shardd
