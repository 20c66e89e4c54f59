#include "worker/shards/shard_store.h"

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "layout/param_init.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "testing/model_builder.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 1234;

// The shared tiny MoE (testing/model_builder.h): 2 layers, 3 experts so dim
// 0 pads over 2 and 4 ranks, tied head.
v1::ModelSpec TinyModel() {
  testing_util::TinyMoeShape shape;
  shape.vocab = 11;
  shape.dim = 6;
  shape.experts = 3;
  shape.inter = 4;
  shape.mlp = 5;
  return testing_util::TinyMoeSpec(shape);
}

v1::ShardingPlan PlanFor(const v1::ModelSpec& model, int world,
                         const std::string& strategy, bool mixed,
                         bool keep_compute_shard = false) {
  static auto* registry = StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(world);
  options.set_strategy(strategy);
  options.set_mixed_precision(mixed);
  options.set_keep_compute_shard(keep_compute_shard);
  options.set_bucket_elements(50);  // Several buckets, params straddling ranks.
  auto plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

// The whole parameter as an unsharded process initialises it.
std::vector<float> WholeParam(const v1::ModelSpec& model,
                              const std::string& name) {
  for (const ParamRef& ref : ListParams(model)) {
    if (ref.fqn != name) continue;
    std::vector<float> out(Numel(*ref.tensor));
    InitParamRange(kSeed, name,
                   InitRuleFor(*ref.tensor, ref.path.back()->kind(), name), 0,
                   static_cast<int64_t>(out.size()), out.data());
    return out;
  }
  return {};
}

// Runs fn(rank, store, comm) on `world` threads, each with its own store and
// Gloo communicator rendezvousing through one in-memory KV store.
template <typename Fn>
void RunRanks(const v1::ShardingPlan& plan, const v1::ModelSpec& model,
              std::vector<MemoryTracker>* trackers, Fn fn) {
  const int world = plan.mesh().dp_shard();
  InMemoryKeyValueClient kv;
  std::vector<std::thread> threads;
  static int generation = 0;
  const std::string prefix = absl::StrCat("shard-store-test/", ++generation);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      KvGlooStore store(&kv, absl::Seconds(20));
      auto comm = GlooCommunicator::Create(&store, prefix, r, world,
                                           "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(comm.ok()) << comm.status();
      ShardStoreOptions options;
      options.shard_rank = r;
      options.seed = kSeed;
      options.collective_timeout = absl::Seconds(20);
      auto shards = ShardStore::Create(plan, model, options, &(*trackers)[r]);
      ASSERT_TRUE(shards.ok()) << shards.status();
      fn(r, shards->get(), comm->get());
    });
  }
  for (auto& t : threads) t.join();
}

struct Case {
  int world;
  std::string strategy;
  bool mixed;
  bool keep_compute_shard = false;
};

class ShardStoreTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardStoreTest, UnshardRebuildsEveryParameterAndGradsAverage) {
  const Case c = GetParam();
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan =
      PlanFor(model, c.world, c.strategy, c.mixed, c.keep_compute_shard);
  std::vector<MemoryTracker> trackers(c.world);
  RunRanks(
      plan, model, &trackers,
      [&](int rank, ShardStore* store, Communicator* comm) {
        // Master shards, plus their bf16 copies with keep_compute_shard.
        EXPECT_EQ(trackers[rank]
                      .Snapshot()
                      .live[static_cast<int>(MemoryKind::kShardParams)],
                  plan.memory().sharded_param_bytes() +
                      plan.memory().compute_shard_bytes());
        for (int u = 0; u < plan.units_size(); ++u) {
          const v1::FsdpUnit& unit = plan.units(u);
          SHARDD_ASSERT_OK(store->Unshard(u, comm));
          EXPECT_THAT(store->Unshard(u, comm),
                      StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("already gathered")));
          const int64_t gathered_bytes =
              unit.gathered_numel() *
              DTypeBytes(unit.precision().compute_dtype());
          EXPECT_EQ(trackers[rank].Snapshot().live_unsharded, gathered_bytes);
          for (const v1::ParamLayout& p : unit.params()) {
            const std::vector<float> whole = WholeParam(model, p.name());
            ASSERT_EQ(static_cast<int64_t>(whole.size()), p.numel());
            auto view = store->ParamView(p.name());
            ASSERT_TRUE(view.ok()) << view.status();
            for (int64_t i = 0; i < p.numel(); ++i) {
              const float expected =
                  c.mixed ? kernels::RoundToBf16(whole[i]) : whole[i];
              ASSERT_EQ((*view)[i], expected) << p.name() << "[" << i << "]";
            }
          }
          // Gradients: rank r contributes (r + 1) * g; the reduce-scatter
          // averages, so each rank's shard holds mean(r + 1) * g = (W + 1) / 2
          // * g for the rows it owns.
          SHARDD_ASSERT_OK(store->AllocGrad(u));
          for (const v1::ParamLayout& p : unit.params()) {
            std::vector<float> g(p.numel());
            for (int64_t i = 0; i < p.numel(); ++i) {
              g[i] = static_cast<float>((rank + 1) * (i % 7 + 1)) / 8.0f;
            }
            SHARDD_ASSERT_OK(store->AccumulateGrad(p.name(), g.data()));
          }
          SHARDD_ASSERT_OK(store->ReduceScatter(u, comm, nullptr));
          SHARDD_ASSERT_OK(store->Reshard(u));
          EXPECT_EQ(trackers[rank].Snapshot().live_unsharded, 0);
          EXPECT_EQ(trackers[rank]
                        .Snapshot()
                        .live[static_cast<int>(MemoryKind::kWorkspace)],
                    0);
        }
        // The master slice this rank owns is the unsharded initial value.
        for (const v1::FsdpUnit& unit : plan.units()) {
          for (const v1::ParamLayout& p : unit.params()) {
            std::vector<float> mine(p.numel(), -1.0f);
            SHARDD_ASSERT_OK(store->CopyOwnedParamSlice(p.name(), mine.data()));
            const std::vector<float> whole = WholeParam(model, p.name());
            for (int64_t i = 0; i < p.numel(); ++i) {
              if (mine[i] != -1.0f) {
                ASSERT_EQ(mine[i], whole[i]) << p.name();
              }
            }
          }
        }
      });
  for (const MemoryTracker& t : trackers) {
    EXPECT_EQ(t.over_frees(), 0);
    EXPECT_EQ(t.Snapshot().live_unsharded, 0);
  }
}

TEST_P(ShardStoreTest, ShardedGradientsSumToTheAverage) {
  const Case c = GetParam();
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, c.world, c.strategy, c.mixed);
  std::vector<MemoryTracker> trackers(c.world);
  std::vector<double> totals(c.world, 0.0);
  double expected_total = 0.0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& p : unit.params()) {
      for (int64_t i = 0; i < p.numel(); ++i)
        expected_total += (i % 7 + 1) / 8.0;
    }
  }
  expected_total *= (c.world + 1) / 2.0;
  RunRanks(plan, model, &trackers,
           [&](int rank, ShardStore* store, Communicator* comm) {
             for (int u = 0; u < plan.units_size(); ++u) {
               SHARDD_ASSERT_OK(store->AllocGrad(u));
               for (const v1::ParamLayout& p : plan.units(u).params()) {
                 std::vector<float> g(p.numel());
                 for (int64_t i = 0; i < p.numel(); ++i) {
                   g[i] = static_cast<float>((rank + 1) * (i % 7 + 1)) / 8.0f;
                 }
                 SHARDD_ASSERT_OK(store->AccumulateGrad(p.name(), g.data()));
               }
               SHARDD_ASSERT_OK(store->ReduceScatter(u, comm, nullptr));
               const ShardStore::UnitShard s = store->shard(u);
               for (int64_t i = 0; i < s.numel; ++i) totals[rank] += s.grads[i];
             }
           });
  double total = 0.0;
  for (double t : totals) total += t;
  // Every element of every parameter lands on exactly one rank (padding
  // holds zeros), averaged over the W contributions (r + 1) * g.
  EXPECT_NEAR(total, expected_total, 1e-3 * expected_total);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ShardStoreTest,
    ::testing::Values(
        Case{1, "default", false}, Case{2, "default", false},
        Case{4, "default", true}, Case{3, "diffusion_gemma", false},
        Case{2, "megatron_fsdp", false}, Case{3, "megatron_fsdp", true},
        Case{4, "default", true, true}, Case{3, "megatron_fsdp", true, true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.strategy, "_w", info.param.world,
                          info.param.mixed ? "_bf16" : "_fp32",
                          info.param.keep_compute_shard ? "_keep" : "");
    });

TEST(ShardStoreFrozenTest, GradientBufferHoldsOnlyTrainableParameters) {
  v1::ModelSpec model = TinyModel();
  // Freeze layer 0's router: model.layers.0.moe.gate.weight.
  model.mutable_root()
      ->mutable_children(0)
      ->mutable_children(1)
      ->mutable_children(0)
      ->mutable_children(1)
      ->mutable_children(0)
      ->mutable_params(0)
      ->set_frozen(true);
  const v1::ShardingPlan plan = PlanFor(model, 2, "default", false);
  int unit = -1;
  for (int u = 0; u < plan.units_size(); ++u) {
    if (plan.units(u).name() == "model.layers.0") unit = u;
  }
  ASSERT_GE(unit, 0);
  int64_t trainable_local = 0;
  double expected_total = 0.0;
  for (const v1::ParamLayout& p : plan.units(unit).params()) {
    if (p.name() == "model.layers.0.moe.gate.weight") {
      ASSERT_TRUE(p.frozen());
      continue;
    }
    trainable_local += p.local_numel();
    for (int64_t i = 0; i < p.numel(); ++i) expected_total += (i % 7 + 1) / 8.0;
  }
  expected_total *= 1.5;  // Mean of rank factors 1 and 2.
  std::vector<MemoryTracker> trackers(2);
  std::vector<double> totals(2, 0.0);
  RunRanks(plan, model, &trackers,
           [&](int rank, ShardStore* store, Communicator* comm) {
             SHARDD_ASSERT_OK(store->AllocGrad(unit));
             // Two ranks' chunks of the trainable shards only: the same
             // bytes the plan's step model counts for this unit.
             EXPECT_EQ(trackers[rank].Snapshot().live_unsharded,
                       trainable_local * 2 * 4);
             for (const v1::ParamLayout& p : plan.units(unit).params()) {
               std::vector<float> g(p.numel());
               for (int64_t i = 0; i < p.numel(); ++i) {
                 g[i] = static_cast<float>((rank + 1) * (i % 7 + 1)) / 8.0f;
               }
               absl::Status s = store->AccumulateGrad(p.name(), g.data());
               if (p.frozen()) {
                 EXPECT_THAT(s, StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("frozen")));
               } else {
                 SHARDD_EXPECT_OK(s);
               }
             }
             SHARDD_ASSERT_OK(store->ReduceScatter(unit, comm, nullptr));
             const ShardStore::UnitShard shard = store->shard(unit);
             for (const v1::ParamLayout& p : plan.units(unit).params()) {
               for (int64_t i = 0; i < p.local_numel(); ++i) {
                 const float g = shard.grads[p.shard_offset() + i];
                 if (p.frozen()) {
                   ASSERT_EQ(g, 0.0f) << p.name();
                 }
                 totals[rank] += g;
               }
             }
           });
  EXPECT_NEAR(totals[0] + totals[1], expected_total, 1e-3 * expected_total);
}

// LoRA (model/lora.h): adapted units lay their trainable adapters out
// first, and with trim_frozen_state the store holds gradients and AdamW
// moments for them only: the bytes the plan counts.
TEST(ShardStoreLoraTest, TrimmedStateHoldsTheAdaptersOnly) {
  v1::ModelSpec model = TinyModel();
  v1::LoraConfig lora;
  lora.set_rank(2);
  lora.set_alpha(4);
  lora.add_targets("experts");
  SHARDD_ASSERT_OK(ApplyLora(lora, &model));
  const v1::ShardingPlan plan = PlanFor(model, 2, "default", false);
  for (bool trim : {false, true}) {
    MemoryTracker tracker;
    ShardStoreOptions options;
    options.shard_rank = 1;
    options.seed = kSeed;
    options.trim_frozen_state = trim;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<ShardStore> store,
        ShardStore::Create(plan, model, options, &tracker));
    int64_t held = 0, shard = 0;
    for (int u = 0; u < plan.units_size(); ++u) {
      int64_t trainable = 0;
      for (const v1::ParamLayout& p : plan.units(u).params()) {
        if (!p.frozen()) {
          // Trainable first: every adapter inside the prefix.
          EXPECT_EQ(p.shard_offset(), trainable) << p.name();
          trainable += p.local_numel();
        }
      }
      const ShardStore::UnitShard s = store->shard(u);
      EXPECT_EQ(s.state_numel, trim ? trainable : s.numel) << u;
      held += s.state_numel;
      shard += s.numel;
    }
    const MemorySnapshot snap = tracker.Snapshot();
    const int kOpt = static_cast<int>(MemoryKind::kOptimizerState);
    const int kGrads = static_cast<int>(MemoryKind::kShardGrads);
    EXPECT_EQ(snap.live[kOpt], 2 * 4 * held);
    EXPECT_EQ(snap.live[kGrads], 4 * held);
    if (trim) {
      EXPECT_EQ(snap.live[kOpt], plan.memory().optimizer_bytes());
      EXPECT_LT(held, shard);  // The frozen base holds none.
    }
    // A frozen parameter's moments are not held once trimmed.
    std::vector<float> out(6 * 11);
    const absl::Status frozen = store->CopyOwnedParamSlice(
        "model.embed_tokens.weight", out.data(), ShardBuffer::kExpAvg);
    if (trim) {
      EXPECT_THAT(frozen, StatusIs(absl::StatusCode::kFailedPrecondition,
                                   HasSubstr("not held")));
    } else {
      SHARDD_EXPECT_OK(frozen);
    }
  }
}

// Reshard to a smaller group (FSDP2's reshard_after_forward=int): after
// Reshard(u, 2) on 4 ranks each rank keeps half of the gathered buffer, and
// Unshard re-gathers it over its pair of ranks only.
class ShardStoreSliceTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardStoreSliceTest, ReshardToSliceAndRegatherOverTheSliceGroup) {
  const Case c = GetParam();
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, c.world, c.strategy, c.mixed);
  constexpr int kGroup = 2;
  InMemoryKeyValueClient kv;
  static int generation = 0;
  const std::string prefix = absl::StrCat("slice-test/", ++generation);
  std::vector<MemoryTracker> trackers(c.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.world; ++r) {
    threads.emplace_back([&, r] {
      KvGlooStore kv_store(&kv, absl::Seconds(20));
      auto comm =
          GlooCommunicator::Create(&kv_store, prefix + "/all", r, c.world,
                                   "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(comm.ok()) << comm.status();
      auto pair = GlooCommunicator::Create(
          &kv_store, absl::StrCat(prefix, "/q", r / kGroup), r % kGroup, kGroup,
          "127.0.0.1", absl::Seconds(20));
      ASSERT_TRUE(pair.ok()) << pair.status();
      ShardStoreOptions options;
      options.shard_rank = r;
      options.seed = kSeed;
      options.collective_timeout = absl::Seconds(20);
      auto store = ShardStore::Create(plan, model, options, &trackers[r]);
      ASSERT_TRUE(store.ok()) << store.status();
      const SliceGroups slices = {{kGroup, pair->get()}};
      for (int u = 0; u < plan.units_size(); ++u) {
        const v1::FsdpUnit& unit = plan.units(u);
        const int64_t gathered_bytes =
            unit.gathered_numel() *
            DTypeBytes(unit.precision().compute_dtype());
        SHARDD_ASSERT_OK((*store)->Unshard(u, comm->get()));
        EXPECT_THAT((*store)->Reshard(u, 3),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr("group_size")));
        SHARDD_ASSERT_OK((*store)->Reshard(u, kGroup));
        EXPECT_EQ((*store)->slice_group_size(u), kGroup);
        EXPECT_FALSE((*store)->gathered(u));
        EXPECT_EQ(trackers[r].Snapshot().live_unsharded,
                  gathered_bytes / kGroup);
        // Without its slice group the unit cannot be re-gathered.
        EXPECT_THAT((*store)->Unshard(u, comm->get()),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr("slice group of 2")));
        SHARDD_ASSERT_OK((*store)->Unshard(u, comm->get(), &slices));
        EXPECT_EQ((*store)->slice_group_size(u), 0);
        // The consumed slice stays until DropSlice.
        EXPECT_EQ(trackers[r].Snapshot().live_unsharded,
                  gathered_bytes + gathered_bytes / kGroup);
        (*store)->DropSlice(u);
        EXPECT_EQ(trackers[r].Snapshot().live_unsharded, gathered_bytes);
        for (const v1::ParamLayout& p : unit.params()) {
          const std::vector<float> whole = WholeParam(model, p.name());
          auto view = (*store)->ParamView(p.name());
          ASSERT_TRUE(view.ok()) << view.status();
          for (int64_t i = 0; i < p.numel(); ++i) {
            const float expected =
                c.mixed ? kernels::RoundToBf16(whole[i]) : whole[i];
            ASSERT_EQ((*view)[i], expected) << p.name() << "[" << i << "]";
          }
        }
        SHARDD_ASSERT_OK((*store)->Reshard(u));
        EXPECT_EQ(trackers[r].Snapshot().live_unsharded, 0);
      }
      // Only the pair's all-gathers moved the re-gathers.
      EXPECT_EQ((*pair)->stats().all_gather.calls, plan.units_size());
      EXPECT_EQ((*comm)->stats().all_gather.calls, plan.units_size());
    });
  }
  for (std::thread& t : threads) t.join();
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardStoreSliceTest,
                         ::testing::Values(Case{4, "default", true},
                                           Case{4, "diffusion_gemma", false},
                                           Case{4, "megatron_fsdp", false}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat(
                               info.param.strategy, "_w", info.param.world,
                               info.param.mixed ? "_bf16" : "_fp32");
                         });

TEST(ShardStoreErrorsTest, StateErrorsAndUnknownNames) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 1, "default", false);
  MemoryTracker tracker;
  ShardStoreOptions options;
  options.shard_rank = 1;
  EXPECT_THAT(
      ShardStore::Create(plan, model, options, &tracker).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_rank")));
  options.shard_rank = 0;
  auto store = ShardStore::Create(plan, model, options, &tracker);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_THAT((*store)->Reshard(0),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT((*store)->ReduceScatter(0, nullptr, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT((*store)->Unshard(99, nullptr),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*store)->ParamView("model.nope").status(),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT((*store)->ParamView("model.norm.weight").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not gathered")));
  float g[6] = {};
  EXPECT_THAT(
      (*store)->AccumulateGrad("model.norm.weight", g),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("ALLOC_GRAD")));
}

}  // namespace
}  // namespace shardd
