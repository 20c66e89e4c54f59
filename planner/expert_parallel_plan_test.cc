// Expert-parallel plans (docs/expert_parallel.md, issue 31 items 1 and 6):
// the mesh, the layout of expert units over EP blocks (every global element
// owned once, a gathered block equal to that block of the tensor), the
// memory and communication model, and the refusals.

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "layout/shard_layout.h"
#include "layout/shard_ranges.h"
#include "model/hf_config.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

v1::ModelSpec Config(const std::string& name) {
  const std::string json = ReadFile("tests/data/" + name);
  EXPECT_FALSE(json.empty()) << name;
  absl::StatusOr<v1::ModelSpec> model = ModelSpecFromHfConfig(json);
  EXPECT_TRUE(model.ok()) << name << ": " << model.status();
  return model.ok() ? *model : v1::ModelSpec();
}

v1::PlanOptions Options(int dp, int ep, int replicate = 1) {
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(dp);
  options.mutable_mesh()->set_dp_replicate(replicate);
  options.mutable_mesh()->set_ep(ep);
  return options;
}

class ExpertParallelPlanTest : public ::testing::Test {
 protected:
  absl::StatusOr<v1::ShardingPlan> Plan(const v1::ModelSpec& model,
                                        const v1::PlanOptions& options) {
    return ShardingPlanner(registry_.get()).Plan(model, options);
  }

  std::unique_ptr<StrategyRegistry> registry_ =
      StrategyRegistry::CreateWithBuiltins();
};

// Every global element of every parameter is owned by exactly one of the
// dp_shard ranks, and an expert-parallel rank owns only elements of its
// own block.
void ExpectPartition(const v1::ShardingPlan& plan) {
  const int dp = plan.mesh().dp_shard();
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      std::vector<int> owners(param.numel(), 0);
      const int blocks = EpBlocks(param);
      const int64_t block_numel = param.numel() / blocks;
      for (int r = 0; r < dp; ++r) {
        SHARDD_ASSERT_OK_AND_ASSIGN(
            std::vector<OwnedRange> runs,
            checkpoint::OwnedElementRanges(param, unit.shard_numel(), r));
        for (const OwnedRange& run : runs) {
          ASSERT_LE(run.end, param.numel()) << param.name();
          if (blocks > 1) {
            const int block = r / (dp / blocks);
            EXPECT_GE(run.begin, block * block_numel) << param.name() << r;
            EXPECT_LE(run.end, (block + 1) * block_numel) << param.name() << r;
          }
          for (int64_t i = run.begin; i < run.end; ++i) ++owners[i];
        }
      }
      for (int64_t i = 0; i < param.numel(); ++i) {
        ASSERT_EQ(owners[i], 1) << param.name() << " element " << i;
      }
    }
  }
}

// Simulates the all-gather of every unit on every rank: each rank's shard
// holds value(global index) at its owned runs; the gathered buffer of the
// unit's group copied out through ComputeUnitLayouts must give the
// parameter (one block of it under expert parallelism).
void ExpectGatherGivesBlocks(const v1::ShardingPlan& plan) {
  const int dp = plan.mesh().dp_shard();
  std::vector<std::vector<UnitLayout>> layouts(dp);
  for (int r = 0; r < dp; ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(layouts[r], ComputeUnitLayouts(plan, r));
  }
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const int64_t shard = unit.shard_numel();
    // Shards: value = global element index + 1, padding 0.
    std::vector<std::vector<double>> shards(dp,
                                            std::vector<double>(shard, 0));
    for (int r = 0; r < dp; ++r) {
      for (const ParamPlacement& p : layouts[r][u].params) {
        for (const OwnedRange& run : p.owned) {
          for (int64_t i = run.begin; i < run.end; ++i) {
            shards[r][run.shard_offset + i - run.begin] =
                static_cast<double>(i + 1);
          }
        }
      }
    }
    for (int r = 0; r < dp; ++r) {
      const UnitLayout& layout = layouts[r][u];
      ASSERT_EQ(layout.world * shard, unit.gathered_numel()) << unit.name();
      const int first = layout.block * layout.world;
      std::vector<double> gathered;
      for (int q = 0; q < layout.world; ++q) {
        gathered.insert(gathered.end(), shards[first + q].begin(),
                        shards[first + q].end());
      }
      for (const ParamPlacement& p : layout.params) {
        std::vector<double> param(p.numel, -1);
        for (const CopySegment& s : p.gathered) {
          for (int64_t i = 0; i < s.count; ++i) {
            param[s.dst + i] = gathered[s.src + i];
          }
        }
        const int64_t base = layout.block * p.numel;
        for (int64_t i = 0; i < p.numel; ++i) {
          ASSERT_EQ(param[i], static_cast<double>(base + i + 1))
              << unit.name() << " " << p.name << " rank " << r << " element "
              << i;
        }
      }
    }
  }
}

TEST_F(ExpertParallelPlanTest, ExpertUnitsAreBlocksOverEpShardRanks) {
  // Qwen3-MoE (128 experts here), Mixtral (8), GPT-OSS (biases [E, ...]),
  // DeepSeek-V3 (shared experts stay dense), DiffusionGemma.
  for (const char* config :
       {"tiny_qwen3_moe.json", "tiny_mixtral.json", "tiny_gpt_oss.json",
        "tiny_deepseek_v3.json", "tiny_diffusion_gemma.json"}) {
    SCOPED_TRACE(config);
    const v1::ModelSpec model = Config(config);
    int64_t experts = 0;
    for (const ParamRef& ref : ListParams(model)) {
      if (ref.fqn.find("moe.experts.") != std::string::npos) {
        experts = ref.tensor->shape(0);
        break;
      }
    }
    ASSERT_GE(experts, 4);
    for (const auto& [dp, ep] : std::vector<std::pair<int, int>>{
             {2, 2}, {4, 2}, {4, 4}, {8, 4}}) {
      SCOPED_TRACE(absl::StrCat("dp ", dp, " ep ", ep));
      SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                                  Plan(model, Options(dp, ep)));
      EXPECT_EQ(plan.mesh().ep(), ep);
      int expert_units = 0;
      for (const v1::FsdpUnit& unit : plan.units()) {
        if (unit.kind() != v1::UNIT_EXPERTS) {
          EXPECT_EQ(unit.ep(), 0) << unit.name();
          EXPECT_EQ(unit.gathered_numel(), unit.shard_numel() * dp);
          continue;
        }
        ++expert_units;
        EXPECT_EQ(unit.ep(), ep) << unit.name();
        EXPECT_EQ(unit.gathered_numel(), unit.shard_numel() * (dp / ep));
        for (const v1::ParamLayout& param : unit.params()) {
          EXPECT_EQ(param.ep_blocks(), ep) << param.name();
          EXPECT_EQ(param.valid_rows_size(), dp / ep) << param.name();
          EXPECT_EQ(param.global_shape(0), experts) << param.name();
        }
      }
      EXPECT_GT(expert_units, 0);
      ExpectPartition(plan);
      ExpectGatherGivesBlocks(plan);
    }
  }
}

TEST_F(ExpertParallelPlanTest, WithoutEpNothingChanges) {
  const v1::ModelSpec model = Config("tiny_qwen3_moe.json");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plain, Plan(model, Options(4, 0)));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan one, Plan(model, Options(4, 1)));
  EXPECT_EQ(plain.fingerprint(), one.fingerprint());
  EXPECT_EQ(one.mesh().ep(), 0);
  for (const v1::FsdpUnit& unit : one.units()) EXPECT_EQ(unit.ep(), 0);
  EXPECT_EQ(one.comm().all_to_alls(), 0);
  ExpectGatherGivesBlocks(one);
  // EP changes the layout, hence the fingerprint.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan two, Plan(model, Options(4, 2)));
  EXPECT_NE(two.fingerprint(), one.fingerprint());
}

TEST_F(ExpertParallelPlanTest, FewerExpertsThanRanksPerBlockSplitByElements) {
  // Mixtral's 8 experts at ep 8 over 16 ranks: one expert per block over 2
  // ranks, split by elements under "auto" (dim 0 would pad half).
  const v1::ModelSpec model = Config("tiny_mixtral.json");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                              Plan(model, Options(16, 8)));
  for (const v1::FsdpUnit& unit : plan.units()) {
    if (unit.kind() != v1::UNIT_EXPERTS) continue;
    for (const v1::ParamLayout& param : unit.params()) {
      EXPECT_TRUE(SplitByElements(param)) << param.name();
    }
  }
  ExpectPartition(plan);
  ExpectGatherGivesBlocks(plan);
}

TEST_F(ExpertParallelPlanTest, HsdpReplicatesTheArrangement) {
  const v1::ModelSpec model = Config("tiny_qwen3_moe.json");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                              Plan(model, Options(4, 2, /*replicate=*/2)));
  EXPECT_EQ(plan.world_size(), 8);
  ExpectPartition(plan);
  EXPECT_GT(plan.comm().all_reduces(), 0);
}

// The model's activations and communication with EP, derived here from the
// config: per MoE layer and micro-batch 2 exchanges forward and 2 backward
// of T * top_k rows of the hidden size in fp32; the expert units gather one
// block over dp / ep ranks.
TEST_F(ExpertParallelPlanTest, CommunicationModel) {
  const v1::ModelSpec model = Config("tiny_qwen3_moe.json");
  const int64_t d = model.dims().hidden_size();
  const int64_t k = model.dims().top_k();
  int layers = 0;
  for (const ParamRef& ref : ListParams(model)) {
    if (ref.fqn.find("moe.experts.gate_and_up_projs") != std::string::npos) {
      ++layers;
    }
  }
  ASSERT_GT(layers, 0);
  constexpr int kBatch = 2, kSeq = 16, kMicro = 3;
  for (const char* checkpointing : {"none", "experts"}) {
    SCOPED_TRACE(checkpointing);
    v1::PlanOptions options = Options(4, 2);
    options.set_micro_batch_size(kBatch);
    options.set_seq_len(kSeq);
    options.set_microbatches(kMicro);
    options.set_activation_checkpointing(checkpointing);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan ep, Plan(model, options));
    // Recomputed experts dispatch and combine again in backward. Rows of
    // D + 2, D (forward), D, D + 1 (backward) floats.
    const bool again = std::string(checkpointing) != "none";
    const int per_layer = again ? 6 : 4;
    const int64_t floats = (4 * d + 3) + (again ? 2 * d + 2 : 0);
    const int64_t rows = kBatch * kSeq * k;
    EXPECT_EQ(ep.comm().all_to_alls(), kMicro * layers * per_layer);
    EXPECT_EQ(ep.comm().all_to_all_bytes(),
              int64_t{kMicro} * layers * rows * floats * 4);
    for (const v1::LayerActivations& l : ep.activations().layers()) {
      EXPECT_EQ(l.routed_rows(), rows);
      EXPECT_EQ(l.dispatch_bytes(), 2 * rows * d * 4);
    }

    options.mutable_mesh()->set_ep(1);
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plain, Plan(model, options));
    EXPECT_EQ(plain.comm().all_to_alls(), 0);
    EXPECT_EQ(plain.comm().all_to_all_bytes(), 0);
    EXPECT_LT(ep.comm().all_gather_bytes(), plain.comm().all_gather_bytes());
    EXPECT_LT(ep.comm().reduce_scatter_bytes(),
              plain.comm().reduce_scatter_bytes());
    // The experts are units of their own under EP: more, smaller gathers.
    EXPECT_GT(ep.comm().all_gathers(), plain.comm().all_gathers());
  }
}

// Balanced routing sends each rank's experts T * top_k rows in all; the
// capacity factor scales what the plan reserves for them.
TEST_F(ExpertParallelPlanTest, CapacityFactorScalesTheExpertsBytes) {
  const v1::ModelSpec model = Config("tiny_mixtral.json");
  v1::PlanOptions options = Options(4, 4);
  options.set_micro_batch_size(1);
  options.set_seq_len(32);
  options.set_ep_capacity_factor(1.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan one, Plan(model, options));
  options.set_ep_capacity_factor(3.0);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan three, Plan(model, options));
  EXPECT_EQ(three.activations().ep_capacity_factor(), 3.0);
  options.clear_ep_capacity_factor();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan dflt, Plan(model, options));
  EXPECT_EQ(dflt.activations().ep_capacity_factor(), 2.0);
  // Given, the workers enforce it; the default is an assumption only.
  EXPECT_TRUE(three.activations().ep_capacity_enforced());
  EXPECT_FALSE(dflt.activations().ep_capacity_enforced());
  ASSERT_EQ(one.activations().layers_size(),
            three.activations().layers_size());
  for (int l = 0; l < one.activations().layers_size(); ++l) {
    const v1::LayerActivations& a = one.activations().layers(l);
    const v1::LayerActivations& b = three.activations().layers(l);
    EXPECT_GT(b.experts_saved_bytes(), a.experts_saved_bytes());
    EXPECT_EQ(b.experts_backward_bytes(), 3 * a.experts_backward_bytes());
  }
  EXPECT_GT(three.memory().peak_activation_bytes(),
            one.memory().peak_activation_bytes());
  EXPECT_NE(three.fingerprint(), one.fingerprint());
}

// Issue 31 item 1: DiffusionGemma-26B over 8 ranks with --ep 8 gathers at
// least 5x fewer bytes per step, and the plan says whether 80 GiB fits.
TEST_F(ExpertParallelPlanTest, DiffusionGemma26bGathersFiveTimesLess) {
  const v1::ModelSpec model = Config("diffusion_gemma_26b.json");
  v1::PlanOptions options = Options(8, 1);
  options.set_micro_batch_size(1);
  options.set_seq_len(4096);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plain, Plan(model, options));
  options.mutable_mesh()->set_ep(8);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan ep, Plan(model, options));
  EXPECT_GE(plain.comm().all_gather_bytes(), 5 * ep.comm().all_gather_bytes());
  EXPECT_GE(plain.comm().reduce_scatter_bytes(),
            5 * ep.comm().reduce_scatter_bytes());
  EXPECT_GT(ep.comm().all_to_all_bytes(), 0);
  // Every rank holds one whole block of experts: nothing to gather over.
  for (const v1::FsdpUnit& unit : ep.units()) {
    if (unit.kind() == v1::UNIT_EXPERTS) {
      EXPECT_EQ(unit.gathered_numel(), unit.shard_numel()) << unit.name();
    }
  }
  // The sharded state per rank is the same: 1/8 of everything either way.
  EXPECT_EQ(ep.memory().persistent_bytes(), plain.memory().persistent_bytes());
}

TEST_F(ExpertParallelPlanTest, RefusedWithTheFlagAndWhatIsAllowed) {
  const v1::ModelSpec moe = Config("tiny_mixtral.json");  // 8 experts
  struct Case {
    const char* what;
    v1::ModelSpec model;
    v1::PlanOptions options;
    std::vector<std::string> says;
  };
  std::vector<Case> cases;
  cases.push_back({"ep not dividing dp", moe, Options(4, 3),
                   {"options.mesh.ep (--ep)", "must divide",
                    "options.mesh.dp_shard (4"}});
  cases.push_back({"ep not dividing the experts", Config("tiny_mixtral.json"),
                   Options(16, 16),
                   {"options.mesh.ep (--ep)", "16 does not divide the 8",
                    "divisors of the expert count"}});
  cases.push_back({"negative ep", moe, Options(4, -2),
                   {"options.mesh.ep (--ep)", "between 1 and"}});
  cases.push_back({"a dense model", Config("tiny_llama3.json"), Options(2, 2),
                   {"options.mesh.ep (--ep)", "no routed (grouped) experts"}});
  v1::PlanOptions megatron = Options(2, 2);
  megatron.set_strategy("megatron_fsdp");
  cases.push_back({"flat buckets", moe, megatron,
                   {"options.mesh.ep (--ep)", "'megatron_fsdp'", "flat buckets",
                    "'default' and 'diffusion_gemma'"}});
  v1::PlanOptions islands = Options(2, 2);
  islands.set_strategy("deepseek_v4");
  cases.push_back({"experts kept in the layer unit", moe, islands,
                   {"options.mesh.ep (--ep)", "'deepseek_v4'",
                    "cannot place experts by block"}});
  v1::PlanOptions factor = Options(4, 2);
  factor.set_ep_capacity_factor(2.5);
  cases.push_back({"capacity above ep", moe, factor,
                   {"options.ep_capacity_factor", "between 1", "got 2.5"}});
  v1::PlanOptions no_ep = Options(4, 1);
  no_ep.set_ep_capacity_factor(1.5);
  cases.push_back({"capacity without ep", moe, no_ep,
                   {"options.ep_capacity_factor", "mesh.ep > 1"}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<v1::ShardingPlan> plan = Plan(c.model, c.options);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.says) {
      EXPECT_THAT(plan.status().message(), HasSubstr(part));
    }
  }
}

}  // namespace
}  // namespace shardd
