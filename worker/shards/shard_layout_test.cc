#include "layout/shard_layout.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "layout/param_init.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "testing/model_builder.h"
#include "worker/memory/memory_tracker.h"
#include "worker/shards/shard_store.h"

namespace shardd {
namespace {

constexpr uint64_t kSeed = 77;

// The shared tiny MoE (testing/model_builder.h): 2 layers, 3 experts (dim 0
// pads over 2 and 4 ranks), layer 0's router frozen, tied head.
v1::ModelSpec TinyModel() {
  testing_util::TinyMoeShape shape;
  shape.vocab = 11;
  shape.dim = 6;
  shape.experts = 3;
  shape.inter = 4;
  shape.mlp = 5;
  shape.freeze_router0 = true;
  return testing_util::TinyMoeSpec(shape);
}

v1::ShardingPlan PlanFor(const v1::ModelSpec& model, int world,
                         const std::string& strategy) {
  static auto* registry = StrategyRegistry::CreateWithBuiltins().release();
  ShardingPlanner planner(registry);
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(world);
  options.set_strategy(strategy);
  options.set_bucket_elements(50);  // Parameters straddling ranks.
  auto plan = planner.Plan(model, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : v1::ShardingPlan();
}

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

// A gradient value per parameter element, distinct across parameters.
float GradValue(int param, int64_t i) {
  return static_cast<float>(param * 1000 + i + 1);
}

struct Case {
  int world;
  std::string strategy;
};

class ShardLayoutTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardLayoutTest, AgreesWithShardStore) {
  const Case c = GetParam();
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, c.world, c.strategy);
  ASSERT_GT(plan.units_size(), 0);
  const int world = c.world;
  // Every rank's master shards, from ShardStore and from InitMasterShards.
  std::vector<std::vector<std::vector<float>>> masters(world);
  std::vector<std::vector<UnitLayout>> layouts(world);
  for (int r = 0; r < world; ++r) {
    MemoryTracker tracker;
    ShardStoreOptions options;
    options.shard_rank = r;
    options.seed = kSeed;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<ShardStore> store,
        ShardStore::Create(plan, model, options, &tracker));
    masters[r].resize(plan.units_size());
    std::vector<float*> ptrs;
    for (int u = 0; u < plan.units_size(); ++u) {
      masters[r][u].assign(plan.units(u).shard_numel(), -7.0f);
      ptrs.push_back(masters[r][u].data());
    }
    SHARDD_ASSERT_OK(InitMasterShards(plan, model, r, kSeed, ptrs));
    for (int u = 0; u < plan.units_size(); ++u) {
      const ShardStore::UnitShard shard = store->shard(u);
      ASSERT_EQ(shard.numel, static_cast<int64_t>(masters[r][u].size()));
      for (int64_t i = 0; i < shard.numel; ++i) {
        ASSERT_EQ(masters[r][u][i], shard.params[i])
            << "rank " << r << " unit " << u << " element " << i;
      }
    }
    SHARDD_ASSERT_OK_AND_ASSIGN(layouts[r], ComputeUnitLayouts(plan, r));
    ASSERT_EQ(static_cast<int>(layouts[r].size()), plan.units_size());
  }

  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const UnitLayout& layout = layouts[0][u];
    const int64_t shard = layout.shard_numel;
    ASSERT_EQ(layout.gathered_numel, shard * world) << unit.name();
    // The gathered buffer: the ranks' shards back to back.
    std::vector<float> gathered;
    for (int r = 0; r < world; ++r) {
      gathered.insert(gathered.end(), masters[r][u].begin(),
                      masters[r][u].end());
    }
    // Parameters reassemble from the gathered buffer.
    std::vector<char> covered(gathered.size(), 0);
    for (const ParamPlacement& p : layout.params) {
      const std::vector<float> whole = WholeParam(model, p.name);
      ASSERT_EQ(static_cast<int64_t>(whole.size()), p.numel) << p.name;
      std::vector<float> assembled(p.numel, -1.0f);
      for (const CopySegment& s : p.gathered) {
        for (int64_t i = 0; i < s.count; ++i) {
          assembled[s.dst + i] = gathered[s.src + i];
          ASSERT_EQ(covered[s.src + i], 0) << "overlap in " << p.name;
          covered[s.src + i] = 1;
        }
      }
      EXPECT_EQ(assembled, whole) << p.name;
      // What ShardStore views in place is contiguous here too.
      if (plan.flat_buckets() || unit.params_size() == 1 || world == 1) {
        EXPECT_TRUE(IsContiguous(p.gathered, p.numel)) << p.name;
      }
      EXPECT_EQ(p.frozen, p.grad.empty()) << p.name;
    }

    // Gradients: scatter each parameter's gradient into the unsharded
    // buffer, then take each rank's chunk into its sharded gradient; it must
    // sit where the rank's master holds the same elements.
    std::vector<float> buffer(layout.grad_chunk_numel * world, 0.0f);
    for (const ParamPlacement& p : layout.params) {
      for (const CopySegment& s : p.grad) {
        for (int64_t i = 0; i < s.count; ++i) {
          buffer[s.dst + i] += GradValue(p.index, s.src + i);
        }
      }
    }
    for (int r = 0; r < world; ++r) {
      const UnitLayout& mine = layouts[r][u];
      EXPECT_EQ(mine.grad_chunk_numel, layout.grad_chunk_numel);
      std::vector<float> sharded(shard, 0.0f);
      for (const CopySegment& s : mine.shard_grad) {
        for (int64_t i = 0; i < s.count; ++i) {
          sharded[s.dst + i] += buffer[r * mine.grad_chunk_numel + s.src + i];
        }
      }
      std::vector<float> expected(shard, 0.0f);
      std::vector<std::pair<int64_t, int64_t>> trainable;
      for (const ParamPlacement& p : mine.params) {
        if (p.frozen) continue;
        for (const CopySegment& s : p.gathered) {
          const int64_t begin = std::max(s.src, r * shard);
          const int64_t end = std::min(s.src + s.count, (r + 1) * shard);
          for (int64_t g = begin; g < end; ++g) {
            expected[g - r * shard] = GradValue(p.index, s.dst + (g - s.src));
          }
          if (begin < end) {
            trainable.emplace_back(begin - r * shard, end - r * shard);
          }
        }
      }
      EXPECT_EQ(sharded, expected) << unit.name() << " rank " << r;
      // Trainable ranges: exactly the trainable elements, merged.
      std::vector<char> in_range(shard, 0), want(shard, 0);
      for (const auto& range : mine.trainable_ranges) {
        ASSERT_LE(range.first, range.second);
        for (int64_t i = range.first; i < range.second; ++i) in_range[i] = 1;
      }
      for (const auto& range : trainable) {
        for (int64_t i = range.first; i < range.second; ++i) want[i] = 1;
      }
      EXPECT_EQ(in_range, want) << unit.name() << " rank " << r;
      for (size_t k = 1; k < mine.trainable_ranges.size(); ++k) {
        EXPECT_LT(mine.trainable_ranges[k - 1].second,
                  mine.trainable_ranges[k].first);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ShardLayoutTest,
    ::testing::Values(Case{1, "default"}, Case{2, "default"},
                      Case{4, "default"}, Case{3, "diffusion_gemma"},
                      Case{2, "megatron_fsdp"}, Case{3, "megatron_fsdp"}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return absl::StrCat(info.param.strategy, "_w", info.param.world);
    });

TEST(ShardLayoutTest, RejectsARankOutsideTheMesh) {
  const v1::ModelSpec model = TinyModel();
  const v1::ShardingPlan plan = PlanFor(model, 2, "default");
  EXPECT_THAT(ComputeUnitLayouts(plan, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("shard_rank")));
  EXPECT_THAT(ComputeUnitLayouts(plan, -1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float*> none;
  EXPECT_THAT(InitMasterShards(plan, model, 0, kSeed, none),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("shards")));
}

}  // namespace
}  // namespace shardd
