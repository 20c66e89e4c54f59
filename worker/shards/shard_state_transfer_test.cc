#include "worker/shards/shard_state_transfer.h"

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "layout/param_init.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "testing/model_builder.h"
#include "testing/staged_shard_state.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/shards/shard_store.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(20);

// The shared tiny MoE (testing/model_builder.h) with one layer.
v1::ModelSpec TinyModel() {
  testing_util::TinyMoeShape shape;
  shape.vocab = 11;
  shape.dim = 6;
  shape.experts = 3;
  shape.inter = 4;
  shape.mlp = 5;
  shape.layers = 1;
  return testing_util::TinyMoeSpec(shape);
}

v1::ShardingPlan PlanFor(const v1::ModelSpec& model, int dp_shard,
                         bool mixed = false, bool keep_compute_shard = false) {
  static auto* registry = StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(dp_shard);
  options.set_strategy("default");
  options.set_mixed_precision(mixed);
  options.set_keep_compute_shard(keep_compute_shard);
  options.set_bucket_elements(50);
  auto plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

std::unique_ptr<ShardStore> MakeStore(const v1::ShardingPlan& plan,
                                      const v1::ModelSpec& model,
                                      int shard_rank, uint64_t seed,
                                      MemoryTracker* tracker) {
  ShardStoreOptions options;
  options.shard_rank = shard_rank;
  options.seed = seed;
  options.collective_timeout = kTimeout;
  auto store = ShardStore::Create(plan, model, options, tracker);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// Fresh moments and gradients are zero: give them values that depend on
// `salt`, so a copy that skipped them would show.
void Scribble(ShardStore* store, float salt) {
  for (int u = 0; u < store->num_units(); ++u) {
    const ShardStore::UnitShard s = store->shard(u);
    for (int64_t i = 0; i < s.numel; ++i) {
      if (s.exp_avg != nullptr) s.exp_avg[i] = salt + 0.001f * i;
      if (s.exp_avg_sq != nullptr) s.exp_avg_sq[i] = salt * salt + 1e-5f * i;
      if (s.grads != nullptr) s.grads[i] = -salt;
    }
  }
}

bool Same(const float* a, const float* b, int64_t n) {
  if (a == nullptr || b == nullptr) return a == b;
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

// Bitwise comparison of two stores' masters and moments.
void ExpectSameState(const ShardStore& a, const ShardStore& b) {
  ASSERT_EQ(a.num_units(), b.num_units());
  for (int u = 0; u < a.num_units(); ++u) {
    const ShardStore::UnitShard x = a.shard(u);
    const ShardStore::UnitShard y = b.shard(u);
    ASSERT_EQ(x.numel, y.numel) << "unit " << u;
    EXPECT_TRUE(Same(x.params, y.params, x.numel)) << "unit " << u;
    EXPECT_TRUE(Same(x.exp_avg, y.exp_avg, x.numel)) << "unit " << u;
    EXPECT_TRUE(Same(x.exp_avg_sq, y.exp_avg_sq, x.numel)) << "unit " << u;
  }
}

void ExpectSameState(const ShardStore& a, const ShardStateSnapshot& b) {
  ASSERT_EQ(a.num_units(), static_cast<int>(b.units.size()));
  for (int u = 0; u < a.num_units(); ++u) {
    const ShardStore::UnitShard x = a.shard(u);
    const ShardStateSnapshot::Unit& y = b.units[u];
    ASSERT_EQ(x.numel, static_cast<int64_t>(y.params.size())) << "unit " << u;
    EXPECT_TRUE(Same(x.params, y.params.data(), x.numel)) << "unit " << u;
    EXPECT_TRUE(Same(x.exp_avg, y.exp_avg.data(), x.numel)) << "unit " << u;
    EXPECT_TRUE(Same(x.exp_avg_sq, y.exp_avg_sq.data(), x.numel))
        << "unit " << u;
  }
}

void ExpectZeroGrads(const ShardStore& store) {
  for (int u = 0; u < store.num_units(); ++u) {
    const ShardStore::UnitShard s = store.shard(u);
    for (int64_t i = 0; i < s.numel; ++i) {
      ASSERT_EQ(s.grads[i], 0.0f) << "unit " << u << " [" << i << "]";
    }
  }
}

ShardStateSnapshot Capture(const ShardState& state) {
  absl::StatusOr<ShardStateSnapshot> snapshot = CaptureShardState(state);
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  return snapshot.ok() ? *std::move(snapshot) : ShardStateSnapshot();
}

int64_t StateBytes(const v1::ShardingPlan& plan) {
  int64_t elements = 0;
  for (const v1::FsdpUnit& unit : plan.units()) elements += unit.shard_numel();
  return 3 * 4 * elements;  // Master + two moments, fp32.
}

TEST(CopyShardStateTest, CopiesMastersAndMomentsAndZeroesGradients) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 2);
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> from = MakeStore(plan, model, 1, 7, &tracker);
  std::unique_ptr<ShardStore> to = MakeStore(plan, model, 1, 8, &tracker);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  Scribble(from.get(), 1.5f);
  Scribble(to.get(), -2.5f);
  // Different seeds: the masters differ before the copy.
  EXPECT_FALSE(
      Same(from->shard(0).params, to->shard(0).params, from->shard(0).numel));
  SHARDD_ASSERT_OK(CopyShardState(*from, to.get()));
  ExpectSameState(*from, *to);
  ExpectZeroGrads(*to);
  // The source is left alone (its gradients too).
  EXPECT_EQ(from->shard(0).grads[0], -1.5f);
}

TEST(CopyShardStateTest, RefusesAnotherLayoutAndChangesNothing) {
  const v1::ModelSpec model = TinyModel();
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> to =
      MakeStore(PlanFor(model, 2), model, 0, 8, &tracker);
  std::unique_ptr<ShardStore> other =
      MakeStore(PlanFor(model, 4), model, 0, 9, &tracker);
  ASSERT_NE(to, nullptr);
  ASSERT_NE(other, nullptr);
  Scribble(to.get(), 3.0f);
  const ShardStateSnapshot before = Capture(*to);
  EXPECT_THAT(
      CopyShardState(*other, to.get()),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("unit ")));
  ExpectSameState(*to, before);
  EXPECT_EQ(to->shard(0).grads[0], -3.0f);  // Not even zeroed.
  EXPECT_THAT(CopyShardState(*other, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));

  // The same through a snapshot of the other layout.
  EXPECT_THAT(RestoreShardState(Capture(*other), to.get()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  ExpectSameState(*to, before);
}

TEST(CopyShardStateTest, SnapshotRoundTrip) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 2);
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> from = MakeStore(plan, model, 0, 7, &tracker);
  std::unique_ptr<ShardStore> to = MakeStore(plan, model, 0, 8, &tracker);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  Scribble(from.get(), 0.25f);
  Scribble(to.get(), 4.0f);
  const ShardStateSnapshot snapshot = Capture(*from);
  EXPECT_EQ(snapshot.bytes(), StateBytes(plan));
  from.reset();  // The snapshot stands alone.
  SHARDD_ASSERT_OK(RestoreShardState(snapshot, to.get()));
  ExpectSameState(*to, snapshot);
  ExpectZeroGrads(*to);
}

// With keep_compute_shard the bf16 shard copies follow the copied masters:
// a gather after the copy reads the source's values.
TEST(CopyShardStateTest, RefreshesComputeShards) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan =
      PlanFor(model, 1, /*mixed=*/true, /*keep_compute_shard=*/true);
  constexpr uint64_t kFromSeed = 7;
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> from =
      MakeStore(plan, model, 0, kFromSeed, &tracker);
  std::unique_ptr<ShardStore> to = MakeStore(plan, model, 0, 8, &tracker);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  SHARDD_ASSERT_OK(CopyShardState(*from, to.get()));
  InMemoryKeyValueClient kv;
  KvGlooStore kv_store(&kv, kTimeout);
  auto comm = GlooCommunicator::Create(&kv_store, "transfer-compute", 0, 1,
                                       "127.0.0.1", kTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  for (int u = 0; u < plan.units_size(); ++u) {
    SHARDD_ASSERT_OK(to->Unshard(u, comm->get()));
    for (const v1::ParamLayout& p : plan.units(u).params()) {
      std::vector<float> whole;
      for (const ParamRef& ref : ListParams(model)) {
        if (ref.fqn != p.name()) continue;
        whole.resize(Numel(*ref.tensor));
        InitParamRange(
            kFromSeed, p.name(),
            InitRuleFor(*ref.tensor, ref.path.back()->kind(), p.name()), 0,
            static_cast<int64_t>(whole.size()), whole.data());
      }
      ASSERT_EQ(static_cast<int64_t>(whole.size()), p.numel()) << p.name();
      auto view = to->ParamView(p.name());
      ASSERT_TRUE(view.ok()) << view.status();
      for (int64_t i = 0; i < p.numel(); ++i) {
        ASSERT_EQ((*view)[i], kernels::RoundToBf16(whole[i]))
            << p.name() << "[" << i << "]";
      }
    }
    SHARDD_ASSERT_OK(to->Reshard(u));
  }
}

// A store whose state is not host memory (a GPU store) takes the same
// paths through its copies: captured, restored and copied to and from
// another such store, with the host store's results.
TEST(CopyShardStateTest, StateOutsideHostMemoryGoesThroughItsCopies) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 2, /*mixed=*/true,
                                        /*keep_compute_shard=*/true);
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> from = MakeStore(plan, model, 1, 7, &tracker);
  std::unique_ptr<ShardStore> to = MakeStore(plan, model, 1, 8, &tracker);
  ASSERT_NE(from, nullptr);
  ASSERT_NE(to, nullptr);
  Scribble(from.get(), 0.5f);
  Scribble(to.get(), 2.0f);
  testing_util::StagedShardState device_from(from.get());
  testing_util::StagedShardState device_to(to.get());

  // Device to device: staged through host memory.
  SHARDD_ASSERT_OK(CopyShardState(device_from, &device_to));
  EXPECT_GT(device_from.copies_to_host(), 0);
  EXPECT_GT(device_to.copies_from_host(), 0);
  EXPECT_EQ(device_to.resets(), plan.units_size());
  SHARDD_ASSERT_OK(device_to.Flush());
  ExpectSameState(*to, *from);
  ExpectZeroGrads(*to);

  // Capture from and restore into a device store.
  const ShardStateSnapshot snapshot = Capture(device_from);
  ExpectSameState(*from, snapshot);
  Scribble(to.get(), 3.0f);
  testing_util::StagedShardState device_again(to.get());
  SHARDD_ASSERT_OK(RestoreShardState(snapshot, &device_again));
  SHARDD_ASSERT_OK(device_again.Flush());
  ExpectSameState(*to, *from);

  // Another layout is refused before anything is written.
  std::unique_ptr<ShardStore> other =
      MakeStore(PlanFor(model, 4), model, 0, 9, &tracker);
  ASSERT_NE(other, nullptr);
  testing_util::StagedShardState device_other(other.get());
  EXPECT_THAT(CopyShardState(device_from, &device_other),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(device_other.copies_from_host(), 0);
}

// Runs fn(rank, comm) on `world` threads over one Gloo group.
void RunGroup(int world, const std::string& prefix,
              const std::function<void(int, Communicator*)>& fn) {
  InMemoryKeyValueClient kv;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      KvGlooStore store(&kv, kTimeout);
      auto comm = GlooCommunicator::Create(&store, prefix, r, world,
                                           "127.0.0.1", kTimeout);
      ASSERT_TRUE(comm.ok()) << comm.status();
      fn(r, comm->get());
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(BroadcastShardStateTest, EveryReplicaEndsWithTheRootsState) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 2);
  constexpr int kReplicas = 3;
  constexpr int kRoot = 1;
  std::vector<MemoryTracker> trackers(kReplicas);
  std::vector<std::unique_ptr<ShardStore>> stores(kReplicas);
  for (int r = 0; r < kReplicas; ++r) {
    stores[r] = MakeStore(plan, model, 1, 100 + r, &trackers[r]);
    ASSERT_NE(stores[r], nullptr);
    Scribble(stores[r].get(), 1.0f + r);
  }
  const ShardStateSnapshot root_before = Capture(*stores[kRoot]);
  std::vector<int64_t> steps = {10, 11, 12};
  std::vector<absl::StatusOr<int64_t>> received(kReplicas, int64_t{-1});
  RunGroup(kReplicas, "transfer-broadcast", [&](int r, Communicator* comm) {
    received[r] =
        BroadcastShardState(stores[r].get(), &steps[r], comm, kRoot, kTimeout);
  });
  for (int r = 0; r < kReplicas; ++r) {
    ASSERT_TRUE(received[r].ok())
        << "rank " << r << ": " << received[r].status();
    EXPECT_EQ(*received[r], r == kRoot ? 0 : StateBytes(plan)) << "rank " << r;
    EXPECT_EQ(steps[r], 11) << "rank " << r;
    ExpectSameState(*stores[r], root_before);
    if (r != kRoot) ExpectZeroGrads(*stores[r]);
  }
  // The root's gradients are its own business.
  EXPECT_EQ(stores[kRoot]->shard(0).grads[0], -2.0f);
}

TEST(BroadcastShardStateTest, RefusesBadArgumentsAndAnotherLayout) {
  const v1::ModelSpec model = TinyModel();
  MemoryTracker tracker;
  std::unique_ptr<ShardStore> store =
      MakeStore(PlanFor(model, 2), model, 0, 1, &tracker);
  ASSERT_NE(store, nullptr);
  int64_t steps = 0;
  RunGroup(1, "transfer-args", [&](int, Communicator* comm) {
    EXPECT_THAT(
        BroadcastShardState(store.get(), &steps, comm, 1, kTimeout).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("root 1")));
    EXPECT_THAT(
        BroadcastShardState(nullptr, &steps, comm, 0, kTimeout).status(),
        StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(
        BroadcastShardState(store.get(), nullptr, comm, 0, kTimeout).status(),
        StatusIs(absl::StatusCode::kInvalidArgument));
    // A group of one: nothing to receive.
    SHARDD_ASSERT_OK_AND_ASSIGN(
        int64_t received,
        BroadcastShardState(store.get(), &steps, comm, 0, kTimeout));
    EXPECT_EQ(received, 0);
  });

  // Rank 1 holds a shard of another plan: every rank refuses, nothing moves.
  std::vector<MemoryTracker> trackers(2);
  std::vector<std::unique_ptr<ShardStore>> stores(2);
  stores[0] = MakeStore(PlanFor(model, 2), model, 0, 5, &trackers[0]);
  stores[1] = MakeStore(PlanFor(model, 4), model, 0, 6, &trackers[1]);
  ASSERT_NE(stores[0], nullptr);
  ASSERT_NE(stores[1], nullptr);
  const ShardStateSnapshot before = Capture(*stores[1]);
  std::vector<int64_t> rank_steps = {3, 4};
  std::vector<absl::Status> results(2);
  RunGroup(2, "transfer-mismatch", [&](int r, Communicator* comm) {
    results[r] =
        BroadcastShardState(stores[r].get(), &rank_steps[r], comm, 0, kTimeout)
            .status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(results[r], StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("different plans")))
        << "rank " << r;
  }
  EXPECT_EQ(rank_steps[1], 4);
  ExpectSameState(*stores[1], before);
}

}  // namespace
}  // namespace shardd
