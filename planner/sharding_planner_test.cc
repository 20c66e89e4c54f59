#include "planner/sharding_planner.h"

#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"
#include "model/hf_config.h"
#include "planner/strategy_registry.h"
#include "program/step_program.h"
#include "absl/strings/str_cat.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// ---- A toy MoE model -------------------------------------------------------
// Hidden D = 8, vocab V = 32, E experts of intermediate I = 4, 3 layers.
// Per layer (walk order):
//   input_layernorm.weight [D]                        8
//   self_attn.q_proj.weight [D, D]                   64
//   self_attn.o_proj.weight [D, D]                   64
//   moe.router.weight [E, D]                         8E
//   moe.experts.gate_and_up_projs [E, D, 2I]        64E
//   moe.experts.down_projs [E, I, D]                32E
// Root: model.embed_tokens.weight [V, D] (256), model.norm.weight [D] (8),
// lm_head.weight tied to the embedding.
constexpr int64_t kD = 8;
constexpr int64_t kV = 32;
constexpr int64_t kI = 4;
constexpr int kLayers = 3;

v1::TensorSpec Tensor(const std::string& name, std::vector<int64_t> shape,
                      v1::DType dtype = v1::BFLOAT16) {
  v1::TensorSpec t;
  t.set_name(name);
  for (int64_t d : shape) t.add_shape(d);
  t.set_dtype(dtype);
  return t;
}

v1::ModuleSpec* Child(v1::ModuleSpec* parent, const std::string& name,
                      v1::ModuleKind kind) {
  v1::ModuleSpec* m = parent->add_children();
  m->set_name(name);
  m->set_kind(kind);
  return m;
}

// `fp32_sinks` adds self_attn.sinks [D] in fp32 (a dtype island).
v1::ModelSpec ToyMoe(int64_t experts,
                     const std::string& arch = "ToyMoeForCausalLM",
                     bool fp32_sinks = false) {
  v1::ModelSpec spec;
  spec.set_architecture(arch);
  spec.set_dtype(v1::BFLOAT16);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = Child(root, "model", v1::MODULE_GENERIC);
  *Child(model, "embed_tokens", v1::MODULE_EMBEDDING)->add_params() =
      Tensor("weight", {kV, kD});
  v1::ModuleSpec* layers = Child(model, "layers", v1::MODULE_LAYER_LIST);
  for (int i = 0; i < kLayers; ++i) {
    v1::ModuleSpec* layer =
        Child(layers, std::to_string(i), v1::MODULE_DECODER_LAYER);
    *Child(layer, "input_layernorm", v1::MODULE_NORM)->add_params() =
        Tensor("weight", {kD});
    v1::ModuleSpec* attn = Child(layer, "self_attn", v1::MODULE_ATTENTION);
    *Child(attn, "q_proj", v1::MODULE_GENERIC)->add_params() =
        Tensor("weight", {kD, kD});
    *Child(attn, "o_proj", v1::MODULE_GENERIC)->add_params() =
        Tensor("weight", {kD, kD});
    if (fp32_sinks) *attn->add_params() = Tensor("sinks", {kD}, v1::FLOAT32);
    v1::ModuleSpec* moe = Child(layer, "moe", v1::MODULE_MOE);
    *Child(moe, "router", v1::MODULE_ROUTER)->add_params() =
        Tensor("weight", {experts, kD});
    v1::ModuleSpec* ex = Child(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
    *ex->add_params() = Tensor("gate_and_up_projs", {experts, kD, 2 * kI});
    *ex->add_params() = Tensor("down_projs", {experts, kI, kD});
  }
  *Child(model, "norm", v1::MODULE_NORM)->add_params() = Tensor("weight", {kD});
  v1::TensorSpec head = Tensor("weight", {kV, kD});
  head.set_tied_to("model.embed_tokens.weight");
  *Child(root, "lm_head", v1::MODULE_LM_HEAD)->add_params() = head;
  return spec;
}

v1::PlanOptions Options(int dp_shard) {
  v1::PlanOptions options;
  options.mutable_mesh()->set_dp_shard(dp_shard);
  return options;
}

class PlannerTest : public ::testing::Test {
 protected:
  absl::StatusOr<v1::ShardingPlan> Plan(const v1::ModelSpec& model,
                                        const v1::PlanOptions& options) {
    return planner_.Plan(model, options);
  }

  std::unique_ptr<StrategyRegistry> registry_ =
      StrategyRegistry::CreateWithBuiltins();
  ShardingPlanner planner_{registry_.get()};
};

std::vector<std::string> UnitNames(const v1::ShardingPlan& plan) {
  std::vector<std::string> names;
  for (const v1::FsdpUnit& unit : plan.units()) names.push_back(unit.name());
  return names;
}

std::vector<int> Ints(const google::protobuf::RepeatedField<int32_t>& v) {
  return std::vector<int>(v.begin(), v.end());
}

TEST_F(PlannerTest, DefaultStrategyLayoutAndSizes) {
  const int64_t e = 4;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                              Plan(ToyMoe(e), Options(4)));
  EXPECT_EQ(plan.strategy(), "default");
  EXPECT_EQ(plan.architecture(), "ToyMoeForCausalLM");
  EXPECT_EQ(plan.world_size(), 4);
  EXPECT_EQ(plan.mesh().dp_replicate(), 1);
  EXPECT_FALSE(plan.flat_buckets());
  // Tied head counted once: 264 + 3 * (136 + 104E).
  const int64_t layer = 8 + 64 + 64 + 8 * e + 96 * e;
  EXPECT_EQ(plan.total_params(), 256 + 8 + kLayers * layer);
  ASSERT_THAT(UnitNames(plan), ElementsAre("model.layers.0", "model.layers.1",
                                           "model.layers.2", "<root>"));
  for (int i = 0; i < 4; ++i) {
    const v1::FsdpUnit& unit = plan.units(i);
    EXPECT_EQ(unit.index(), i);
    EXPECT_EQ(unit.parent(), -1);
    EXPECT_EQ(unit.kind(), i < 3 ? v1::UNIT_LAYER : v1::UNIT_ROOT);
    EXPECT_EQ(unit.layer_index(), i < 3 ? i : -1);
    // Every dim 0 here is a multiple of 4: no padding.
    const int64_t numel = i < 3 ? layer : 256 + 8;
    EXPECT_EQ(unit.numel(), numel);
    EXPECT_EQ(unit.shard_numel(), numel / 4);
    EXPECT_EQ(unit.gathered_numel(), numel);
  }
  // Embedding [32, 8] over 4 ranks: 8 rows each; the norm follows it in
  // each rank's chunk.
  const v1::ParamLayout& embed = plan.units(3).params(0);
  EXPECT_EQ(embed.name(), "model.embed_tokens.weight");
  EXPECT_THAT(embed.global_shape(), ElementsAre(32, 8));
  EXPECT_EQ(embed.padded_dim0(), 32);
  EXPECT_THAT(embed.local_shape(), ElementsAre(8, 8));
  EXPECT_THAT(embed.valid_rows(), ElementsAre(8, 8, 8, 8));
  EXPECT_EQ(plan.units(3).params(1).shard_offset(), 64);

  // Step defaults.
  EXPECT_EQ(plan.step().microbatches(), 1);
  EXPECT_EQ(plan.step().passes(), 1);
  EXPECT_EQ(plan.step().no_grad_passes(), 0);
  EXPECT_FALSE(plan.step().defer_grad_sync());
  EXPECT_EQ(plan.step().forward_prefetch_depth(), 1);
  EXPECT_EQ(plan.step().backward_prefetch_depth(), 2);

  // Persistent memory: fp32 master shards, fp32 grads, 2 fp32 Adam moments.
  const int64_t shard = (kLayers * layer + 264) / 4;
  EXPECT_EQ(plan.memory().sharded_param_bytes(), shard * 4);
  EXPECT_EQ(plan.memory().grad_bytes(), shard * 4);
  EXPECT_EQ(plan.memory().optimizer_bytes(), shard * 8);
  // Peak (see step_model_test): root + 3 bf16 layers + fp32 grads of root
  // and one layer.
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(),
            2 * 264 + 3 * 2 * layer + 4 * 264 + 4 * layer);
  EXPECT_GT(plan.memory().timeline_events(), 0);
  EXPECT_THAT(plan.memory().timeline(), IsEmpty());
}

TEST_F(PlannerTest, ReshardHeuristicAndPrefetchLists) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                              Plan(ToyMoe(4), Options(4)));
  // Every layer but the last reshards; the root never does.
  for (int i = 0; i < 4; ++i) {
    const v1::ReshardPolicy& p = plan.units(i).reshard_after_forward();
    ASSERT_EQ(p.policy_case(), v1::ReshardPolicy::kReshard) << i;
    EXPECT_EQ(p.reshard(), i < 2) << i;
  }
  EXPECT_THAT(Ints(plan.units(0).forward_prefetch()), ElementsAre(1));
  EXPECT_THAT(Ints(plan.units(1).forward_prefetch()), ElementsAre(2));
  EXPECT_THAT(Ints(plan.units(2).forward_prefetch()), IsEmpty());
  EXPECT_THAT(Ints(plan.units(0).backward_prefetch()), IsEmpty());
  EXPECT_THAT(Ints(plan.units(1).backward_prefetch()), ElementsAre(0));
  EXPECT_THAT(Ints(plan.units(2).backward_prefetch()), ElementsAre(1, 0));
  EXPECT_THAT(Ints(plan.units(3).forward_prefetch()), IsEmpty());
  EXPECT_THAT(Ints(plan.units(3).backward_prefetch()), IsEmpty());

  // Depths are configurable.
  v1::PlanOptions options = Options(4);
  options.set_forward_prefetch_depth(2);
  options.set_backward_prefetch_depth(0);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan deep, Plan(ToyMoe(4), options));
  EXPECT_THAT(Ints(deep.units(0).forward_prefetch()), ElementsAre(1, 2));
  EXPECT_THAT(Ints(deep.units(2).backward_prefetch()), IsEmpty());
}

TEST_F(PlannerTest, DiffusionGemmaStrategyNestsExperts) {
  v1::PlanOptions options = Options(4);
  options.set_strategy("diffusion_gemma");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(ToyMoe(4), options));
  EXPECT_EQ(plan.strategy(), "diffusion_gemma");
  ASSERT_THAT(
      UnitNames(plan),
      ElementsAre("model.layers.0.moe.experts", "model.layers.0",
                  "model.layers.1.moe.experts", "model.layers.1",
                  "model.layers.2.moe.experts", "model.layers.2", "<root>"));
  for (int i = 0; i < 6; i += 2) {
    const v1::FsdpUnit& experts = plan.units(i);
    EXPECT_EQ(experts.kind(), v1::UNIT_EXPERTS);
    EXPECT_EQ(experts.parent(), i + 1);
    EXPECT_FALSE(experts.prefetch_target());
    EXPECT_THAT(Ints(experts.forward_prefetch()), IsEmpty());
    // Experts inherit their layer's policy: true, true, false.
    EXPECT_EQ(experts.reshard_after_forward().reshard(), i < 4);
    EXPECT_EQ(plan.units(i + 1).reshard_after_forward().reshard(), i < 4);
  }
  // Prefetch chains link only the layer units.
  EXPECT_THAT(Ints(plan.units(1).forward_prefetch()), ElementsAre(3));
  EXPECT_THAT(Ints(plan.units(3).forward_prefetch()), ElementsAre(5));
  EXPECT_THAT(Ints(plan.units(5).backward_prefetch()), ElementsAre(3, 1));
  EXPECT_FALSE(plan.units(6).reshard_after_forward().reshard());

  // The architecture picks the strategy too, and with it the three passes.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ShardingPlan by_arch,
      Plan(ToyMoe(4, "DiffusionGemmaForBlockDiffusion"), Options(4)));
  EXPECT_EQ(by_arch.strategy(), "diffusion_gemma");
  EXPECT_EQ(by_arch.step().passes(), 3);
  EXPECT_EQ(by_arch.step().no_grad_passes(), 1);
  v1::PlanOptions two = Options(4);
  two.set_passes(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ShardingPlan two_passes,
      Plan(ToyMoe(4, "DiffusionGemmaForBlockDiffusion"), two));
  EXPECT_EQ(two_passes.step().passes(), 2);
  EXPECT_EQ(two_passes.step().no_grad_passes(), 0);
}

TEST_F(PlannerTest, ReshardOverrides) {
  v1::PlanOptions options = Options(4);
  options.set_strategy("diffusion_gemma");
  options.mutable_reshard_after_forward()->set_reshard(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan all, Plan(ToyMoe(4), options));
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(all.units(i).reshard_after_forward().reshard()) << i;
  }
  EXPECT_FALSE(all.units(6).reshard_after_forward().reshard());  // Root.

  // false: nothing to prefetch (NeMo prefetches only when not false).
  options.mutable_reshard_after_forward()->set_reshard(false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan none, Plan(ToyMoe(4), options));
  for (const v1::FsdpUnit& unit : none.units()) {
    EXPECT_FALSE(unit.reshard_after_forward().reshard()) << unit.name();
    EXPECT_THAT(Ints(unit.forward_prefetch()), IsEmpty()) << unit.name();
    EXPECT_THAT(Ints(unit.backward_prefetch()), IsEmpty()) << unit.name();
  }
  EXPECT_EQ(none.step().forward_prefetch_depth(), 0);
  EXPECT_EQ(none.step().backward_prefetch_depth(), 0);
  // Nothing resharded: each unit is gathered exactly once.
  EXPECT_EQ(none.comm().all_gathers(), 7);

  // A smaller group: every layer and its experts, the root stays false.
  options.mutable_reshard_after_forward()->set_group_size(2);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan group, Plan(ToyMoe(4), options));
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(group.units(i).reshard_after_forward().group_size(), 2) << i;
  }
  EXPECT_FALSE(group.units(6).reshard_after_forward().reshard());
  EXPECT_THAT(Ints(group.units(1).forward_prefetch()), ElementsAre(3));
}

TEST_F(PlannerTest, MixedPrecision) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan,
                              Plan(ToyMoe(4), Options(4)));
  EXPECT_EQ(plan.precision().param_dtype(), v1::FLOAT32);
  EXPECT_EQ(plan.precision().compute_dtype(), v1::BFLOAT16);
  EXPECT_EQ(plan.precision().reduce_dtype(), v1::FLOAT32);
  for (const v1::FsdpUnit& unit : plan.units()) {
    EXPECT_EQ(unit.precision().param_dtype(), v1::FLOAT32);
    EXPECT_EQ(unit.precision().compute_dtype(), v1::BFLOAT16);
    EXPECT_EQ(unit.precision().reduce_dtype(), v1::FLOAT32);
    // The sharded (master) copy is fp32.
    for (const v1::ParamLayout& p : unit.params()) {
      EXPECT_EQ(p.dtype(), v1::FLOAT32) << p.name();
    }
  }

  // Off: everything in the parameters' own bf16; the master shards halve.
  v1::PlanOptions off = Options(4);
  off.set_mixed_precision(false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plain, Plan(ToyMoe(4), off));
  EXPECT_EQ(plain.precision().compute_dtype(), v1::BFLOAT16);
  for (const v1::FsdpUnit& unit : plain.units()) {
    EXPECT_EQ(unit.precision().param_dtype(), v1::BFLOAT16);
    EXPECT_EQ(unit.precision().reduce_dtype(), v1::BFLOAT16);
    EXPECT_EQ(unit.params(0).dtype(), v1::BFLOAT16);
  }
  EXPECT_EQ(plain.memory().sharded_param_bytes() * 2,
            plan.memory().sharded_param_bytes());

  // fp32 islands (deepseek_v4) keep fp32 for all three.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ShardingPlan islands,
      Plan(ToyMoe(4, "DeepseekV4ForCausalLM", /*fp32_sinks=*/true),
           Options(4)));
  EXPECT_EQ(islands.strategy(), "deepseek_v4");
  int seen = 0;
  for (const v1::FsdpUnit& unit : islands.units()) {
    if (unit.kind() != v1::UNIT_DTYPE_ISLAND) continue;
    ++seen;
    EXPECT_EQ(unit.precision().param_dtype(), v1::FLOAT32);
    EXPECT_EQ(unit.precision().compute_dtype(), v1::FLOAT32);
    EXPECT_EQ(unit.precision().reduce_dtype(), v1::FLOAT32);
    const v1::FsdpUnit& parent = islands.units(unit.parent());
    EXPECT_EQ(parent.precision().compute_dtype(), v1::BFLOAT16);
    EXPECT_EQ(unit.reshard_after_forward().reshard(),
              parent.reshard_after_forward().reshard());
  }
  EXPECT_EQ(seen, kLayers);
}

TEST_F(PlannerTest, FingerprintIsStableAndTracksTheLayout) {
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan a, Plan(ToyMoe(4), Options(4)));
  // A separate registry and planner give the same fingerprint.
  std::unique_ptr<StrategyRegistry> other =
      StrategyRegistry::CreateWithBuiltins();
  ShardingPlanner other_planner(other.get());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan b,
                              other_planner.Plan(ToyMoe(4), Options(4)));
  EXPECT_NE(a.fingerprint(), 0u);
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  // The step shape is not layout.
  v1::PlanOptions more = Options(4);
  more.set_microbatches(4);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan c, Plan(ToyMoe(4), more));
  EXPECT_EQ(a.fingerprint(), c.fingerprint());
  // Another shard group, strategy or model changes it.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan d, Plan(ToyMoe(4), Options(2)));
  EXPECT_NE(a.fingerprint(), d.fingerprint());
  v1::PlanOptions dg = Options(4);
  dg.set_strategy("diffusion_gemma");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan e, Plan(ToyMoe(4), dg));
  EXPECT_NE(a.fingerprint(), e.fingerprint());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan f, Plan(ToyMoe(8), Options(4)));
  EXPECT_NE(a.fingerprint(), f.fingerprint());
}

TEST_F(PlannerTest, FewerExpertsThanRanksArePaddedOnDimZeroWhenForced) {
  // 8 experts over 16 ranks with shard_placement dim0: one expert row per
  // rank on ranks 0..7, ranks 8..15 hold only padding.
  v1::PlanOptions options = Options(16);
  options.set_strategy("diffusion_gemma");
  options.set_shard_placement("dim0");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(ToyMoe(8), options));
  EXPECT_EQ(plan.shard_placement(), "dim0");
  const v1::FsdpUnit& experts = plan.units(0);
  ASSERT_EQ(experts.kind(), v1::UNIT_EXPERTS);
  const v1::ParamLayout& gate_up = experts.params(0);
  EXPECT_EQ(gate_up.name(), "model.layers.0.moe.experts.gate_and_up_projs");
  EXPECT_EQ(gate_up.padded_dim0(), 16);
  EXPECT_EQ(gate_up.rows_per_rank(), 1);
  EXPECT_THAT(gate_up.local_shape(), ElementsAre(1, kD, 2 * kI));
  EXPECT_EQ(gate_up.local_numel(), kD * 2 * kI);
  std::vector<int64_t> rows(gate_up.valid_rows().begin(),
                            gate_up.valid_rows().end());
  EXPECT_EQ(rows, std::vector<int64_t>(
                      {1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0}));
  // The unit's gathered buffer is twice the experts' size.
  EXPECT_EQ(experts.numel(), 8 * (64 + 32));
  EXPECT_EQ(experts.gathered_numel(), 2 * experts.numel());
  EXPECT_GT(plan.memory().peak_unsharded_bytes(), 0);
}

TEST_F(PlannerTest, FewerExpertsThanRanksAreSplitByElementsByDefault) {
  v1::PlanOptions options = Options(16);
  options.set_strategy("diffusion_gemma");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(ToyMoe(8), options));
  EXPECT_EQ(plan.shard_placement(), "auto");
  const v1::FsdpUnit& experts = plan.units(0);
  const v1::ParamLayout& gate_up = experts.params(0);
  EXPECT_EQ(gate_up.row_numel(), 1);
  EXPECT_EQ(gate_up.rows_per_rank(), 8 * kD * 2 * kI / 16);
  // Even: the unit is its elements over 16 ranks, no padding.
  EXPECT_EQ(experts.numel(), 8 * (64 + 32));
  EXPECT_EQ(experts.gathered_numel(), experts.numel());
  // The layout is part of the fingerprint.
  options.set_shard_placement("dim0");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan dim0, Plan(ToyMoe(8), options));
  EXPECT_NE(dim0.fingerprint(), plan.fingerprint());
  options.set_shard_placement("rows");
  EXPECT_THAT(Plan(ToyMoe(8), options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard_placement")));
}

TEST_F(PlannerTest, MegatronFlatBuckets) {
  v1::PlanOptions options = Options(4);
  options.set_strategy("megatron_fsdp");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(ToyMoe(4), options));
  EXPECT_TRUE(plan.flat_buckets());
  EXPECT_EQ(plan.bucket_elements(), 40'000'000);
  int root_buckets = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    EXPECT_EQ(unit.kind(), v1::UNIT_FLAT_BUCKET);
    for (const v1::ParamLayout& p : unit.params()) EXPECT_EQ(p.shard_dim(), -1);
    // Root buckets and the last layer's keep their parameters.
    const bool keep = unit.layer_index() < 0 || unit.layer_index() == 2;
    EXPECT_EQ(unit.reshard_after_forward().reshard(), !keep) << unit.name();
    if (unit.layer_index() < 0) ++root_buckets;
  }
  EXPECT_GT(root_buckets, 0);
  EXPECT_GT(plan.memory().peak_unsharded_bytes(), 0);
  EXPECT_EQ(plan.comm().reduce_scatters(), plan.units_size());
}

TEST_F(PlannerTest, HsdpAndTimeline) {
  v1::PlanOptions options = Options(4);
  options.mutable_mesh()->set_dp_replicate(2);
  options.set_include_timeline(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(ToyMoe(4), options));
  EXPECT_EQ(plan.world_size(), 8);
  EXPECT_EQ(plan.comm().all_reduces(), plan.comm().reduce_scatters());
  EXPECT_EQ(plan.comm().all_reduce_bytes(), plan.memory().grad_bytes());
  EXPECT_EQ(plan.memory().timeline_size(), plan.memory().timeline_events());
}

TEST_F(PlannerTest, BadOptions) {
  struct Case {
    const char* what;
    void (*mutate)(v1::PlanOptions*);
    const char* field;
  };
  const Case cases[] = {
      {"dp_shard 0",
       [](v1::PlanOptions* o) { o->mutable_mesh()->set_dp_shard(0); },
       "options.mesh.dp_shard: must be between 1 and 65536, got 0"},
      {"dp_shard 1e9",
       [](v1::PlanOptions* o) { o->mutable_mesh()->set_dp_shard(1000000000); },
       "options.mesh.dp_shard"},
      {"world 2^20",
       [](v1::PlanOptions* o) {
         o->mutable_mesh()->set_dp_shard(1024);
         o->mutable_mesh()->set_dp_replicate(1024);
       },
       "options.mesh: world size"},
      {"dp_replicate -1",
       [](v1::PlanOptions* o) { o->mutable_mesh()->set_dp_replicate(-1); },
       "options.mesh.dp_replicate"},
      {"tp 2", [](v1::PlanOptions* o) { o->mutable_mesh()->set_tp(2); },
       "options.mesh.tp"},
      {"cp 4", [](v1::PlanOptions* o) { o->mutable_mesh()->set_cp(4); },
       "options.mesh.cp"},
      {"unknown strategy",
       [](v1::PlanOptions* o) { o->set_strategy("zero_infinity"); },
       "options.strategy: unknown strategy 'zero_infinity'"},
      {"group 3",
       [](v1::PlanOptions* o) {
         o->mutable_reshard_after_forward()->set_group_size(3);
       },
       "options.reshard_after_forward.group_size"},
      {"group 0",
       [](v1::PlanOptions* o) {
         o->mutable_reshard_after_forward()->set_group_size(0);
       },
       "options.reshard_after_forward.group_size"},
      {"microbatches -1", [](v1::PlanOptions* o) { o->set_microbatches(-1); },
       "options.microbatches"},
      {"passes 17", [](v1::PlanOptions* o) { o->set_passes(17); },
       "options.passes"},
      {"no_grad_passes", [](v1::PlanOptions* o) { o->set_no_grad_passes(1); },
       "options.no_grad_passes"},
      {"fwd depth",
       [](v1::PlanOptions* o) { o->set_forward_prefetch_depth(-1); },
       "options.forward_prefetch_depth"},
      {"bwd depth",
       [](v1::PlanOptions* o) { o->set_backward_prefetch_depth(1000); },
       "options.backward_prefetch_depth"},
      {"buckets", [](v1::PlanOptions* o) { o->set_bucket_elements(-5); },
       "options.bucket_elements"},
  };
  for (const Case& c : cases) {
    v1::PlanOptions options = Options(4);
    c.mutate(&options);
    EXPECT_THAT(
        Plan(ToyMoe(4), options),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.field)))
        << c.what;
  }
  // The unknown-strategy message lists the registered ones.
  v1::PlanOptions unknown = Options(4);
  unknown.set_strategy("nope");
  EXPECT_THAT(Plan(ToyMoe(4), unknown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("diffusion_gemma")));
  // No mesh at all is 1x1.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan single,
                              Plan(ToyMoe(4), v1::PlanOptions()));
  EXPECT_EQ(single.world_size(), 1);
  EXPECT_EQ(single.mesh().dp_shard(), 1);
  // A bad model is refused before planning.
  v1::ModelSpec bad = ToyMoe(4);
  bad.clear_architecture();
  EXPECT_THAT(
      Plan(bad, Options(4)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("architecture")));
  // So is a registry-less planner, without crashing.
  ShardingPlanner no_registry(nullptr);
  EXPECT_FALSE(no_registry.Plan(ToyMoe(4), Options(4)).ok());
}

// ---- DiffusionGemma 26B on 8 ranks: experts as their own unit -------------

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Hand-derived sizes from the released config (H 2816, 16 heads; sliding
// layers: head_dim 256, 8 KV heads, q/k/v/o; full layers (5, 11, ..., 29):
// head_dim 512, 2 KV heads, no v_proj; dense MLP 2112; 128 experts of 704;
// vocab 262144, tied head; the root holds the self-conditioning block:
// pre_norm and a gated MLP of 2112). Gathered element counts over W = 8, all
// dims are multiples of 8 except layer_scalar [1], padded to 8.
struct DgSizes {
  static constexpr int64_t H = 2816;
  static constexpr int64_t kExperts = 128 * H * 2 * 704 + 128 * 704 * H;
  static constexpr int64_t kMlp = 3 * H * 2112;
  static constexpr int64_t kRouter = H + 128 * H;  // Frozen scale + proj.
  static constexpr int64_t kNorms = 7 * H;
  static constexpr int64_t kScalarPadded = 8;  // layer_scalar, frozen.
  static constexpr int64_t kSlidingAttn =
      H * 16 * 256 + 2 * H * 8 * 256 + 16 * 256 * H + 2 * 256;
  static constexpr int64_t kFullAttn =
      H * 16 * 512 + H * 2 * 512 + 16 * 512 * H + 2 * 512;
  static constexpr int64_t kRoot = 262144 * H + H + H + 3 * H * 2112;

  static bool Full(int i) { return i % 6 == 5; }
  // Layer without experts: gathered, and its trainable part.
  static int64_t Rest(int i) {
    return (Full(i) ? kFullAttn : kSlidingAttn) + kMlp + kRouter + kNorms +
           kScalarPadded;
  }
  static int64_t RestTrainable(int i) {
    return Rest(i) - kRouter - kScalarPadded;
  }
};

// The step of the plan (prefetch 1/2, every layer but 29 resharded, three
// passes, one without gradients) peaks in backward: the root's bf16 params
// and fp32 gradient are live throughout, layer i is being differentiated
// with layers i-1 and i-2 prefetched. bf16 params: 2 bytes per gathered
// element, fp32 grads: 4 bytes per trainable gathered element.
//   default:          2R + 4R + max_i [2(L_i + L_{i-1} + L_{i-2}) + 4 L_i^t]
//                     with L = rest + experts (the layer unit holds both);
//   diffusion_gemma:  2R + 4R + max_i [2(A_i + A_{i-1} + A_{i-2})
//                                      + max(2E + 4E, 4 A_i^t)]
//                     with A = rest: the expert unit of layer i is gathered
//                     and its gradient reduce-scattered before the layer's
//                     own gradient exists, and prefetch carries no experts.
int64_t ExpectedPeak(bool experts_own_unit) {
  using S = DgSizes;
  const int64_t e = S::kExperts;
  int64_t best = 0;
  for (int i = 0; i < 30; ++i) {
    int64_t params = 0;
    for (int j = i - 2; j <= i; ++j) {
      if (j >= 0) params += 2 * (S::Rest(j) + (experts_own_unit ? 0 : e));
    }
    const int64_t grads = experts_own_unit
                              ? std::max(2 * e + 4 * e, 4 * S::RestTrainable(i))
                              : 4 * (S::RestTrainable(i) + e);
    best = std::max(best, params + grads);
  }
  return 2 * S::kRoot + 4 * S::kRoot + best;
}

TEST_F(PlannerTest, DiffusionGemma26bExpertsOwnUnitLowerThePeak) {
  const std::string json = ReadFile("tests/data/diffusion_gemma_26b.json");
  ASSERT_FALSE(json.empty()) << "tests/data/diffusion_gemma_26b.json";
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec model, ModelSpecFromHfConfig(json));

  v1::PlanOptions options = Options(8);  // Prefetch on by default (1/2).
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan own, Plan(model, options));
  options.set_strategy("default");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan folded, Plan(model, options));
  ASSERT_EQ(own.strategy(), "diffusion_gemma");
  ASSERT_EQ(own.step().passes(), 3);
  ASSERT_EQ(own.step().no_grad_passes(), 1);
  ASSERT_EQ(own.units_size(), 61);
  ASSERT_EQ(folded.units_size(), 31);

  // The plan's units have the hand-derived sizes.
  using S = DgSizes;
  EXPECT_EQ(own.units(0).name(), "model.layers.0.moe.experts");
  EXPECT_EQ(own.units(0).gathered_numel(), S::kExperts);
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(own.units(2 * i + 1).gathered_numel(), S::Rest(i)) << i;
    EXPECT_EQ(folded.units(i).gathered_numel(), S::Rest(i) + S::kExperts) << i;
  }
  EXPECT_EQ(own.units(60).gathered_numel(), S::kRoot);

  const int64_t own_peak = own.memory().peak_unsharded_bytes();
  const int64_t folded_peak = folded.memory().peak_unsharded_bytes();
  EXPECT_EQ(own_peak, ExpectedPeak(true));
  EXPECT_EQ(folded_peak, ExpectedPeak(false));
  // The peak sits at full-attention layer 29 (the widest rest): the saving
  // is 4 (A^t_29 + E): two prefetched bf16 expert stacks, and the layer's
  // fp32 gradient no longer overlapping the experts'.
  EXPECT_EQ(folded_peak - own_peak, 4 * (S::RestTrainable(29) + S::kExperts));
  const double ratio = static_cast<double>(own_peak) / folded_peak;
  EXPECT_NEAR(ratio, 0.740, 0.001);
  EXPECT_THAT(own.memory().peak_where(), HasSubstr("backward"));
  EXPECT_THAT(folded.memory().peak_where(), HasSubstr("backward"));
  // The replay runs the block-diffusion schedule: encode (gradients),
  // self-conditioning decode (no graph), decode (gradients); the peak is
  // in the first backward, the decode's, and the encode's follows it.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(own));
  std::vector<std::string> order;
  for (const v1::Command& c : program.commands()) {
    if (c.part() != v1::Command::EMBED) continue;
    order.push_back(absl::StrCat(
        c.op() == v1::Command::FORWARD ? "F" : "B", c.pass(),
        c.op() == v1::Command::FORWARD && !c.requires_grad() ? "-" : ""));
  }
  EXPECT_THAT(order, ElementsAre("F0", "F1-", "F2", "B2", "B0"));
  EXPECT_THAT(own.memory().peak_where(), HasSubstr("pass 2"));
  EXPECT_THAT(folded.memory().peak_where(), HasSubstr("pass 2"));
  std::cout << "DiffusionGemma 26B, dp_shard 8, prefetch 1/2, 3 passes:\n"
            << "  default          peak_unsharded_bytes " << folded_peak << " ("
            << folded.memory().peak_where() << ")\n"
            << "  diffusion_gemma  peak_unsharded_bytes " << own_peak << " ("
            << own.memory().peak_where() << ")\n"
            << "  ratio " << ratio << ", saved " << folded_peak - own_peak
            << " bytes\n";

  // Same bytes moved either way: the split only changes when.
  EXPECT_EQ(own.comm().all_gather_bytes(), folded.comm().all_gather_bytes());
  EXPECT_EQ(own.comm().reduce_scatter_bytes(),
            folded.comm().reduce_scatter_bytes());
}

TEST_F(PlannerTest, DiffusionGemma26bDeferredSyncScalesWithTotalParams) {
  const std::string json = ReadFile("tests/data/diffusion_gemma_26b.json");
  ASSERT_FALSE(json.empty());
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ModelSpec model, ModelSpecFromHfConfig(json));
  v1::PlanOptions options = Options(8);
  options.set_microbatches(2);
  options.set_defer_grad_sync(true);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::ShardingPlan plan, Plan(model, options));
  // At the end of micro-batch 0's backward every unit is gathered (bf16)
  // and holds its accumulated fp32 gradient.
  int64_t gathered = 0;
  int64_t trainable_gathered = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    gathered += unit.gathered_numel();
    for (const v1::ParamLayout& p : unit.params()) {
      if (!p.frozen()) trainable_gathered += p.local_numel() * 8;
    }
  }
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(),
            2 * gathered + 4 * trainable_gathered);
  EXPECT_GT(plan.memory().peak_unsharded_bytes(), 6 * 25'000'000'000LL);
  EXPECT_THAT(plan.memory().peak_where(), HasSubstr("micro-batch 0"));
}

}  // namespace
}  // namespace shardd
