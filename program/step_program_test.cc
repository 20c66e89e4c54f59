#include "program/step_program.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "program/pass_layout.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace {

using ::testing::Contains;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;
using v1::Command;

// All hand-built plans shard over W = 4 ranks with fp32 master, bf16 gather
// and fp32 reduce: per gathered element 2 bytes of parameters and 4 bytes
// of unsharded gradient.
constexpr int kW = 4;

v1::MixedPrecision Mixed() {
  v1::MixedPrecision p;
  p.set_param_dtype(v1::FLOAT32);
  p.set_compute_dtype(v1::BFLOAT16);
  p.set_reduce_dtype(v1::FLOAT32);
  return p;
}

v1::ShardingPlan EmptyPlan() {
  v1::ShardingPlan plan;
  plan.mutable_mesh()->set_dp_shard(kW);
  plan.mutable_mesh()->set_dp_replicate(1);
  *plan.mutable_precision() = Mixed();
  plan.set_fingerprint(0x5eed);
  plan.mutable_step()->set_microbatches(1);
  plan.mutable_step()->set_passes(1);
  return plan;
}

// A unit with one trainable dim-0 parameter `param` of shard_numel local
// elements (parent -1; callers nest it).
v1::FsdpUnit* AddUnit(v1::ShardingPlan* plan, const std::string& name,
                      v1::UnitKind kind, int layer, int64_t shard_numel,
                      const std::string& param) {
  v1::FsdpUnit* unit = plan->add_units();
  unit->set_name(name);
  unit->set_kind(kind);
  unit->set_layer_index(layer);
  unit->set_index(plan->units_size() - 1);
  unit->set_parent(-1);
  unit->set_numel(shard_numel * kW);
  unit->set_trainable_numel(shard_numel * kW);
  unit->set_shard_numel(shard_numel);
  unit->set_gathered_numel(shard_numel * kW);
  v1::ParamLayout* p = unit->add_params();
  p->set_name(param);
  p->set_shard_dim(0);
  p->set_local_numel(shard_numel);
  p->set_numel(shard_numel * kW);
  return unit;
}

void SetReshard(v1::FsdpUnit* unit, bool reshard) {
  unit->mutable_reshard_after_forward()->set_reshard(reshard);
}

// Sizes of the experts-own-unit plan below, in gathered elements.
constexpr int64_t kRootShard = 25;     // R = 100.
constexpr int64_t kAttnShard = 100;    // A = 400.
constexpr int64_t kExpertShard = 500;  // E = 2000.
constexpr int64_t R = kRootShard * kW;
constexpr int64_t A = kAttnShard * kW;
constexpr int64_t E = kExpertShard * kW;

// The diffusion_gemma layout of a root and two MoE layers:
//   u0 model.layers.0.moe.experts (nested in u1)   reshard true
//   u1 model.layers.0                              reshard true
//   u2 model.layers.1.moe.experts (nested in u3)   reshard false
//   u3 model.layers.1                              reshard false (last)
//   u4 <root>                                      never
// with the planner's default prefetch (forward 1, backward 2) over the
// layer units u1, u3.
v1::ShardingPlan ExpertsOwnUnitPlan() {
  v1::ShardingPlan plan = EmptyPlan();
  for (int l = 0; l < 2; ++l) {
    const std::string name = "model.layers." + std::to_string(l);
    v1::FsdpUnit* experts =
        AddUnit(&plan, name + ".moe.experts", v1::UNIT_EXPERTS, l, kExpertShard,
                name + ".moe.experts.gate_up_proj");
    experts->set_parent(plan.units_size());
    SetReshard(experts, l == 0);
    v1::FsdpUnit* layer = AddUnit(&plan, name, v1::UNIT_LAYER, l, kAttnShard,
                                  name + ".self_attn.q_proj.weight");
    layer->set_prefetch_target(true);
    SetReshard(layer, l == 0);
  }
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard,
                     "model.embed_tokens.weight"),
             false);
  plan.mutable_units(1)->add_forward_prefetch(3);
  plan.mutable_units(3)->add_backward_prefetch(1);
  plan.mutable_step()->set_forward_prefetch_depth(1);
  plan.mutable_step()->set_backward_prefetch_depth(2);
  return plan;
}

// How many of the program's commands are `op`.
int CountOps(const v1::StepProgram& program, Command::Op op) {
  int n = 0;
  for (const Command& c : program.commands()) n += c.op() == op;
  return n;
}

std::vector<std::string> Lines(const v1::StepProgram& program) {
  std::vector<std::string> lines;
  for (const Command& c : program.commands()) {
    lines.push_back(CommandToString(c));
  }
  return lines;
}

TEST(StepProgramTest, ExpertsOwnUnitSequence) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  EXPECT_EQ(program.plan_fingerprint(), 0x5eedu);
  EXPECT_EQ(program.microbatches(), 1);
  EXPECT_EQ(program.passes(), 1);
  EXPECT_EQ(program.no_grad_passes(), 0);
  EXPECT_FALSE(program.defer_grad_sync());
  // Derived from the rules in step_program.h.
  const std::vector<std::string> expected = {
      // Forward: the root first; layer 0 prefetches layer 1 (not its
      // experts, which gather lazily right before their forward).
      "UNSHARD u4",
      "FORWARD EMBED p0 m0",
      "UNSHARD u1",
      "UNSHARD u3 prefetch",
      "FORWARD LAYER l0 p0 m0",
      "UNSHARD u0",
      "FORWARD EXPERTS l0 p0 m0",
      "RESHARD u0",
      "RESHARD u1",
      // Layer 1 is already gathered by the prefetch; it keeps its
      // parameters (last layer), and so do its experts.
      "WAIT_UNSHARD u3",
      "FORWARD LAYER l1 p0 m0",
      "UNSHARD u2",
      "FORWARD EXPERTS l1 p0 m0",
      "FORWARD HEAD p0 m0",
      // Backward: the root's gradient first.
      "ALLOC_GRAD u4",
      "BACKWARD HEAD p0 m0",
      // Layer 1 prefetches layer 0, then its experts run backward and are
      // reduce-scattered before the layer's own gradient exists.
      "UNSHARD u1 prefetch",
      "ALLOC_GRAD u2",
      "BACKWARD EXPERTS l1 p0 m0",
      "REDUCE_SCATTER u2",
      "RESHARD u2",
      "ALLOC_GRAD u3",
      "BACKWARD LAYER l1 p0 m0",
      "REDUCE_SCATTER u3",
      "RESHARD u3",
      // Layer 0: its experts were resharded after forward.
      "UNSHARD u0",
      "ALLOC_GRAD u0",
      "BACKWARD EXPERTS l0 p0 m0",
      "REDUCE_SCATTER u0",
      "RESHARD u0",
      "ALLOC_GRAD u1",
      "WAIT_UNSHARD u1",
      "BACKWARD LAYER l0 p0 m0",
      "REDUCE_SCATTER u1",
      "RESHARD u1",
      "BACKWARD EMBED p0 m0",
      "REDUCE_SCATTER u4",
      "RESHARD u4",
      "OPTIMIZER_STEP",
  };
  EXPECT_THAT(Lines(program), ElementsAreArray(expected));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));
}

TEST(StepProgramTest, EvalProgramSequence) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileEvalProgram(plan));
  EXPECT_TRUE(program.eval());
  EXPECT_EQ(program.plan_fingerprint(), 0x5eedu);
  // The training forward above, without a graph, then everything still
  // gathered (layer 1, its experts, the root) resharded; no gradient.
  const std::vector<std::string> expected = {
      "UNSHARD u4",
      "FORWARD EMBED p0 m0 no_grad",
      "UNSHARD u1",
      "UNSHARD u3 prefetch",
      "FORWARD LAYER l0 p0 m0 no_grad",
      "UNSHARD u0",
      "FORWARD EXPERTS l0 p0 m0 no_grad",
      "RESHARD u0",
      "RESHARD u1",
      "WAIT_UNSHARD u3",
      "FORWARD LAYER l1 p0 m0 no_grad",
      "UNSHARD u2",
      "FORWARD EXPERTS l1 p0 m0 no_grad",
      "FORWARD HEAD p0 m0 no_grad",
      "RESHARD u2",
      "RESHARD u3",
      "RESHARD u4",
  };
  EXPECT_THAT(Lines(program), ElementsAreArray(expected));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));
  // Its peak is the training forward's: root, layers 0 and 1, experts 0.
  v1::MemoryReport memory;
  v1::CommReport comm;
  SHARDD_ASSERT_OK(ReplayStepProgram(plan, program, /*include_timeline=*/true,
                                     &memory, &comm));
  EXPECT_EQ(memory.peak_unsharded_bytes(), 2 * R + 4 * A + 2 * E);
  EXPECT_EQ(memory.peak_grad_bytes(), 0);
  EXPECT_EQ(comm.all_gathers(), 5);
  EXPECT_EQ(comm.reduce_scatters(), 0);
  const v1::TimelineEvent& end = memory.timeline(memory.timeline_size() - 1);
  EXPECT_EQ(end.live_param_bytes(), 0);
}

TEST(StepProgramValidatorTest, EvalProgramRules) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram eval,
                              CompileEvalProgram(plan));
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram train,
                              CompileStepProgram(plan));
  // A training program marked eval: its first forward builds a graph.
  v1::StepProgram marked = train;
  marked.set_eval(true);
  EXPECT_THAT(ValidateStepProgram(plan, marked),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("eval program builds no graph")));
  // ... and with graph-free forwards, its first ALLOC_GRAD is refused.
  for (v1::Command& c : *marked.mutable_commands()) c.set_requires_grad(false);
  EXPECT_THAT(ValidateStepProgram(plan, marked),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ALLOC_GRAD u4): an eval program computes "
                                 "no gradients")));
  // An eval program run as a training step lacks its backward.
  v1::StepProgram unmarked = eval;
  unmarked.set_eval(false);
  EXPECT_THAT(ValidateStepProgram(plan, unmarked),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A forward that builds a graph.
  v1::StepProgram graph = eval;
  graph.mutable_commands(1)->set_requires_grad(true);
  EXPECT_THAT(
      ValidateStepProgram(plan, graph),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("commands[1] (FORWARD EMBED p0 m0): requires_grad")));
  // A unit left gathered at the end.
  v1::StepProgram open = eval;
  open.mutable_commands()->RemoveLast();
  EXPECT_THAT(ValidateStepProgram(plan, open),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unit 4 (<root>) still gathered")));
  // A slice kept by a partial reshard counts as gathered.
  v1::StepProgram slice = eval;
  for (v1::Command& c : *slice.mutable_commands()) {
    if (c.op() == Command::RESHARD && c.unit() == 4) c.set_group_size(2);
  }
  EXPECT_THAT(ValidateStepProgram(plan, slice),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("still gathered")));
  // An optimizer step appended.
  v1::StepProgram stepped = eval;
  stepped.add_commands()->set_op(Command::OPTIMIZER_STEP);
  EXPECT_THAT(ValidateStepProgram(plan, stepped),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no optimizer step")));
}

TEST(StepProgramTest, ExpertsOwnUnitReplay) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  v1::MemoryReport memory;
  v1::CommReport comm;
  SHARDD_ASSERT_OK(ReplayStepProgram(plan, program, /*include_timeline=*/true,
                                     &memory, &comm));
  // Walking the sequence above: the peak is at ALLOC_GRAD u2 (backward of
  // layer 1's experts): root 2R + 4R, layers 1 and 0 (prefetched) 4A,
  // experts 1 2E + 4E. Layer 1's own gradient later is 6R + 8A < that.
  EXPECT_EQ(memory.peak_unsharded_bytes(), 6 * R + 4 * A + 6 * E);
  EXPECT_EQ(memory.peak_param_bytes(), 2 * R + 4 * A + 2 * E);
  EXPECT_EQ(memory.peak_grad_bytes(), 4 * R + 4 * E);
  EXPECT_THAT(memory.peak_where(), HasSubstr("model.layers.1.moe.experts"));
  EXPECT_THAT(memory.peak_where(), HasSubstr("command 17"));
  const v1::TimelineEvent& peak = memory.timeline(memory.peak_event());
  EXPECT_EQ(peak.command(), 17);
  EXPECT_EQ(peak.op(), "grad");
  EXPECT_EQ(peak.phase(), "backward");
  // Forward: root, layer 0, prefetched layer 1 and experts 0.
  int64_t forward_max = 0;
  for (const v1::TimelineEvent& e : memory.timeline()) {
    if (e.phase() == "forward") {
      forward_max =
          std::max(forward_max, e.live_param_bytes() + e.live_grad_bytes());
    }
  }
  EXPECT_EQ(forward_max, 2 * R + 4 * A + 2 * E);
  // One event per UNSHARD, RESHARD, ALLOC_GRAD and REDUCE_SCATTER (7 + 7
  // + 5 + 5 in the sequence) and the optimizer step.
  EXPECT_EQ(memory.timeline_events(), 7 + 7 + 5 + 5 + 1);
  EXPECT_EQ(memory.timeline_size(), memory.timeline_events());
  // Collectives: u4, u1, u3, u0, u2 in forward, u1, u0 again in backward.
  EXPECT_EQ(comm.all_gathers(), 7);
  EXPECT_EQ(comm.all_gather_bytes(), 2 * R + 3 * 2 * A + 3 * 2 * E);
  EXPECT_EQ(comm.reduce_scatters(), 5);
  EXPECT_EQ(comm.reduce_scatter_bytes(), 4 * R + 2 * 4 * A + 2 * 4 * E);
  EXPECT_EQ(comm.all_reduces(), 0);
  // Persistent: 25 + 2 * (100 + 500) shard elements, all trainable.
  const int64_t shard = kRootShard + 2 * (kAttnShard + kExpertShard);
  EXPECT_EQ(memory.persistent_bytes(), shard * (4 + 4 + 8));
  EXPECT_EQ(memory.peak_total_bytes(),
            memory.persistent_bytes() + memory.peak_unsharded_bytes());
}

// One layer whose experts are folded into the layer unit (a parameter
// named "...experts..."), with an fp32 island in the layer and one in the
// root; two micro-batches with deferred gradient sync:
//   u0 model.layers.0.<fp32> (island in u1)  reshard true (inherited)
//   u1 model.layers.0                        reshard true
//   u2 <root>.<fp32> (island in u3)          reshard false (inherited)
//   u3 <root>
v1::ShardingPlan FoldedIslandPlan() {
  v1::ShardingPlan plan = EmptyPlan();
  v1::FsdpUnit* island = AddUnit(&plan, "model.layers.0.<fp32>",
                                 v1::UNIT_DTYPE_ISLAND, 0, 8, "sinks");
  island->set_parent(1);
  SetReshard(island, true);
  v1::FsdpUnit* layer = AddUnit(&plan, "model.layers.0", v1::UNIT_LAYER, 0,
                                kAttnShard, "model.layers.0.mlp.experts.w");
  layer->set_prefetch_target(true);
  SetReshard(layer, true);
  v1::FsdpUnit* root_island =
      AddUnit(&plan, "<root>.<fp32>", v1::UNIT_DTYPE_ISLAND, -1, 4, "hc_head");
  root_island->set_parent(3);
  SetReshard(root_island, false);
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard,
                     "model.embed_tokens.weight"),
             false);
  plan.mutable_step()->set_microbatches(2);
  plan.mutable_step()->set_defer_grad_sync(true);
  return plan;
}

TEST(StepProgramTest, FoldedExpertsIslandsAndDeferredSyncSequence) {
  const v1::ShardingPlan plan = FoldedIslandPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  EXPECT_TRUE(program.defer_grad_sync());
  EXPECT_EQ(program.microbatches(), 2);
  const std::vector<std::string> expected = {
      // Micro-batch 0 (deferred): each root is followed by its island.
      "UNSHARD u3",
      "UNSHARD u2",
      "FORWARD EMBED p0 m0",
      "UNSHARD u1",
      "UNSHARD u0",
      "FORWARD LAYER l0 p0 m0",
      "FORWARD EXPERTS l0 p0 m0",
      "RESHARD u0",
      "RESHARD u1",
      "FORWARD HEAD p0 m0",
      "ALLOC_GRAD u3",
      "ALLOC_GRAD u2",
      "BACKWARD HEAD p0 m0",
      "UNSHARD u1",
      "UNSHARD u0",
      // The experts live in the layer unit: its gradient (and the
      // island's) exists before the experts' backward writes it.
      "ALLOC_GRAD u0",
      "ALLOC_GRAD u1",
      "BACKWARD EXPERTS l0 p0 m0",
      "BACKWARD LAYER l0 p0 m0",
      // Deferred: no reduce-scatter, no reshard.
      "BACKWARD EMBED p0 m0",
      // Micro-batch 1 (final, syncs): nothing to gather for forward, but
      // the layer's policy still reshards it after forward.
      "FORWARD EMBED p0 m1",
      "FORWARD LAYER l0 p0 m1",
      "FORWARD EXPERTS l0 p0 m1",
      "RESHARD u0",
      "RESHARD u1",
      "FORWARD HEAD p0 m1",
      // Gradients are still allocated from micro-batch 0.
      "BACKWARD HEAD p0 m1",
      "UNSHARD u1",
      "UNSHARD u0",
      "BACKWARD EXPERTS l0 p0 m1",
      "BACKWARD LAYER l0 p0 m1",
      "REDUCE_SCATTER u0",
      "RESHARD u0",
      "REDUCE_SCATTER u1",
      "RESHARD u1",
      "BACKWARD EMBED p0 m1",
      "REDUCE_SCATTER u2",
      "RESHARD u2",
      "REDUCE_SCATTER u3",
      "RESHARD u3",
      "OPTIMIZER_STEP",
  };
  EXPECT_THAT(Lines(program), ElementsAreArray(expected));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));

  // The island gathers and reduces in fp32: 4 bytes per element. Peak at
  // ALLOC_GRAD u1 of micro-batch 0: root 2R + 4R, root island 4*16 + 4*16,
  // layer 2A + 4A, layer island 4*32 + 4*32.
  v1::ShardingPlan fp32 = plan;
  v1::MixedPrecision full;
  full.set_param_dtype(v1::FLOAT32);
  full.set_compute_dtype(v1::FLOAT32);
  full.set_reduce_dtype(v1::FLOAT32);
  *fp32.mutable_units(0)->mutable_precision() = full;
  *fp32.mutable_units(2)->mutable_precision() = full;
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram same, CompileStepProgram(fp32));
  EXPECT_THAT(Lines(same), ElementsAreArray(expected));
  v1::MemoryReport memory;
  v1::CommReport comm;
  SHARDD_ASSERT_OK(ReplayStepProgram(fp32, same, false, &memory, &comm));
  EXPECT_EQ(memory.peak_unsharded_bytes(), 6 * R + 8 * 16 + 6 * A + 8 * 32);
  EXPECT_THAT(memory.peak_where(), HasSubstr("backward, micro-batch 0"));
  // 6 gathers in micro-batch 0, 2 in micro-batch 1; 4 reduce-scatters.
  EXPECT_EQ(comm.all_gathers(), 8);
  EXPECT_EQ(comm.reduce_scatters(), 4);
}

TEST(StepProgramTest, PassesAndNoGradPasses) {
  // Dense toy: two layers (reshard true), root; 3 passes, the first
  // without gradients; no prefetch.
  v1::ShardingPlan plan = EmptyPlan();
  for (int l = 0; l < 2; ++l) {
    v1::FsdpUnit* layer = AddUnit(&plan, "model.layers." + std::to_string(l),
                                  v1::UNIT_LAYER, l, kAttnShard, "w");
    SetReshard(layer, true);
  }
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard, "e"),
             false);
  plan.mutable_step()->set_passes(3);
  plan.mutable_step()->set_no_grad_passes(1);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  std::vector<std::string> computations;
  for (const std::string& line : Lines(program)) {
    if (line.rfind("FORWARD", 0) == 0 || line.rfind("BACKWARD", 0) == 0) {
      computations.push_back(line);
    }
  }
  EXPECT_THAT(computations, ElementsAreArray(std::vector<std::string>{
                                "FORWARD EMBED p0 m0 no_grad",
                                "FORWARD LAYER l0 p0 m0 no_grad",
                                "FORWARD LAYER l1 p0 m0 no_grad",
                                "FORWARD HEAD p0 m0 no_grad",
                                "FORWARD EMBED p1 m0",
                                "FORWARD LAYER l0 p1 m0",
                                "FORWARD LAYER l1 p1 m0",
                                "FORWARD HEAD p1 m0",
                                "FORWARD EMBED p2 m0",
                                "FORWARD LAYER l0 p2 m0",
                                "FORWARD LAYER l1 p2 m0",
                                "FORWARD HEAD p2 m0",
                                "BACKWARD HEAD p2 m0",
                                "BACKWARD LAYER l1 p2 m0",
                                "BACKWARD LAYER l0 p2 m0",
                                "BACKWARD EMBED p2 m0",
                                "BACKWARD HEAD p1 m0",
                                "BACKWARD LAYER l1 p1 m0",
                                "BACKWARD LAYER l0 p1 m0",
                                "BACKWARD EMBED p1 m0",
                            }));
  // Each layer is gathered in each of the 3 forward and 2 backward passes,
  // the root once; each layer reduce-scatters after each grad pass, the
  // root once.
  EXPECT_EQ(CountOps(program, Command::UNSHARD), 2 * (3 + 2) + 1);
  EXPECT_EQ(CountOps(program, Command::REDUCE_SCATTER), 2 * 2 + 1);
}

// DiffusionGemma's 3-pass step: encode (gradients), self-conditioning
// decode (no graph), decode (gradients); the decode's backward runs first,
// then the encode's, which takes the encoder K/V gradients.
v1::ShardingPlan BlockDiffusionToyPlan() {
  v1::ShardingPlan plan = EmptyPlan();
  plan.set_architecture(kBlockDiffusionArchitecture);
  for (int l = 0; l < 2; ++l) {
    v1::FsdpUnit* layer = AddUnit(&plan, "model.layers." + std::to_string(l),
                                  v1::UNIT_LAYER, l, kAttnShard, "w");
    SetReshard(layer, true);
  }
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard, "e"),
             false);
  plan.mutable_step()->set_passes(3);
  plan.mutable_step()->set_no_grad_passes(1);
  return plan;
}

TEST(StepProgramTest, BlockDiffusionPassLayout) {
  const v1::ShardingPlan plan = BlockDiffusionToyPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));
  std::vector<std::string> computations;
  for (const std::string& line : Lines(program)) {
    if (line.rfind("FORWARD", 0) == 0 || line.rfind("BACKWARD", 0) == 0) {
      computations.push_back(line);
    }
  }
  EXPECT_THAT(computations, ElementsAreArray(std::vector<std::string>{
                                "FORWARD EMBED p0 m0",
                                "FORWARD LAYER l0 p0 m0",
                                "FORWARD LAYER l1 p0 m0",
                                "FORWARD HEAD p0 m0",
                                "FORWARD EMBED p1 m0 no_grad",
                                "FORWARD LAYER l0 p1 m0 no_grad",
                                "FORWARD LAYER l1 p1 m0 no_grad",
                                "FORWARD HEAD p1 m0 no_grad",
                                "FORWARD EMBED p2 m0",
                                "FORWARD LAYER l0 p2 m0",
                                "FORWARD LAYER l1 p2 m0",
                                "FORWARD HEAD p2 m0",
                                "BACKWARD HEAD p2 m0",
                                "BACKWARD LAYER l1 p2 m0",
                                "BACKWARD LAYER l0 p2 m0",
                                "BACKWARD EMBED p2 m0",
                                "BACKWARD HEAD p0 m0",
                                "BACKWARD LAYER l1 p0 m0",
                                "BACKWARD LAYER l0 p0 m0",
                                "BACKWARD EMBED p0 m0",
                            }));
  // The same gathers and reduce-scatters as any 3-pass step with two grad
  // passes: only which pass builds no graph moves.
  EXPECT_EQ(CountOps(program, Command::UNSHARD), 2 * (3 + 2) + 1);
  EXPECT_EQ(CountOps(program, Command::REDUCE_SCATTER), 2 * 2 + 1);
}

TEST(StepProgramTest, BlockDiffusionRefusesTheNoGradFirstLayout) {
  // The old layout (pass 0 without gradients) compiled for another
  // architecture does not run on a DiffusionGemma plan, and vice versa.
  v1::ShardingPlan plan = BlockDiffusionToyPlan();
  v1::ShardingPlan other = plan;
  other.set_architecture("ShardMoEForCausalLM");
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram no_grad_first,
                              CompileStepProgram(other));
  EXPECT_THAT(ValidateStepProgram(plan, no_grad_first),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("requires_grad must be true in pass 0 "
                                 "(block diffusion")));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram diffusion,
                              CompileStepProgram(plan));
  EXPECT_THAT(ValidateStepProgram(other, diffusion),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("requires_grad must be false in pass 0")));
}

TEST(StepProgramTest, CommandToString) {
  Command c;
  EXPECT_EQ(CommandToString(c), "OP_UNSPECIFIED");
  c.set_op(Command::RESHARD);
  c.set_unit(7);
  c.set_group_size(2);
  EXPECT_EQ(CommandToString(c), "RESHARD u7 group 2");
  c.Clear();
  c.set_op(Command::BACKWARD);
  c.set_part(Command::EXPERTS);
  c.set_layer(3);
  c.set_pass(1);
  c.set_microbatch(2);
  EXPECT_EQ(CommandToString(c), "BACKWARD EXPERTS l3 p1 m2");
  c.set_op(static_cast<Command::Op>(99));
  EXPECT_EQ(CommandToString(c), "OP(99)");
}

// ---- The validator ----------------------------------------------------------

Command Unit(Command::Op op, int unit) {
  Command c;
  c.set_op(op);
  c.set_unit(unit);
  return c;
}

// Index of the first command printing as `line`.
int Find(const v1::StepProgram& program, const std::string& line) {
  for (int i = 0; i < program.commands_size(); ++i) {
    if (CommandToString(program.commands(i)) == line) return i;
  }
  ADD_FAILURE() << "no command " << line;
  return 0;
}

void Insert(v1::StepProgram* program, int at, const Command& c) {
  program->add_commands();
  for (int i = program->commands_size() - 1; i > at; --i) {
    program->mutable_commands()->SwapElements(i, i - 1);
  }
  *program->mutable_commands(at) = c;
}

void Erase(v1::StepProgram* program, int at) {
  for (int i = at; i + 1 < program->commands_size(); ++i) {
    program->mutable_commands()->SwapElements(i, i + 1);
  }
  program->mutable_commands()->RemoveLast();
}

TEST(StepProgramValidatorTest, RejectsBrokenPrograms) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram good,
                              CompileStepProgram(plan));
  struct Case {
    std::string name;
    std::function<void(v1::StepProgram*)> mutate;
    std::string index;  // "commands[N]" naming the offending command.
    std::string rule;
  };
  const int embed = Find(good, "FORWARD EMBED p0 m0");
  const int prefetch = Find(good, "UNSHARD u3 prefetch");
  const int wait = Find(good, "WAIT_UNSHARD u3");
  const int alloc_root = Find(good, "ALLOC_GRAD u4");
  const int last = good.commands_size() - 1;
  const std::vector<Case> cases = {
      {"op unset",
       [](v1::StepProgram* p) { p->mutable_commands(0)->clear_op(); },
       "commands[0]", "op must be set"},
      {"unit out of range",
       [](v1::StepProgram* p) { p->mutable_commands(0)->set_unit(5); },
       "commands[0]", "out of range"},
      {"unshard a gathered unit",
       [](v1::StepProgram* p) { Insert(p, 1, Unit(Command::UNSHARD, 4)); },
       "commands[1]", "already gathered"},
      {"wait without prefetch",
       [](v1::StepProgram* p) { Insert(p, 1, Unit(Command::WAIT_UNSHARD, 4)); },
       "commands[1]", "pending prefetched UNSHARD"},
      {"reshard a sharded unit",
       [](v1::StepProgram* p) { Insert(p, 0, Unit(Command::RESHARD, 1)); },
       "commands[0]", "needs a gathered unit"},
      {"reshard a pending unit",
       [&](v1::StepProgram* p) {
         Insert(p, prefetch + 1, Unit(Command::RESHARD, 3));
       },
       absl::StrCat("commands[", prefetch + 1, "]"), "WAIT_UNSHARD it first"},
      {"reshard to a group that does not divide dp_shard",
       [](v1::StepProgram* p) {
         Command c = Unit(Command::RESHARD, 4);
         c.set_group_size(3);
         Insert(p, 1, c);
       },
       "commands[1]", "group_size"},
      {"forward before the unshard", [](v1::StepProgram* p) { Erase(p, 0); },
       "commands[0]", "needs unit 4 (<root>) gathered"},
      {"forward of a prefetched unit without wait",
       [&](v1::StepProgram* p) { Erase(p, wait); },
       absl::StrCat("commands[", wait, "]"), "WAIT_UNSHARD first"},
      {"backward without its gradient",
       [&](v1::StepProgram* p) { Erase(p, alloc_root); },
       absl::StrCat("commands[", alloc_root, "]"),
       "ALLOC_GRAD before BACKWARD"},
      {"gradient allocated twice",
       [&](v1::StepProgram* p) {
         Insert(p, alloc_root + 1, Unit(Command::ALLOC_GRAD, 4));
       },
       absl::StrCat("commands[", alloc_root + 1, "]"), "already allocated"},
      {"reduce-scatter without gradient",
       [](v1::StepProgram* p) {
         Insert(p, 1, Unit(Command::REDUCE_SCATTER, 4));
       },
       "commands[1]", "needs an allocated unsharded gradient"},
      {"computation out of order",
       [&](v1::StepProgram* p) { p->mutable_commands(embed)->set_pass(1); },
       absl::StrCat("commands[", embed, "]"),
       "out of order: the next computation of the step is FORWARD EMBED p0 "
       "m0"},
      {"experts of the wrong layer",
       [&](v1::StepProgram* p) {
         p->mutable_commands(Find(*p, "FORWARD EXPERTS l0 p0 m0"))
             ->set_layer(1);
       },
       absl::StrCat("commands[", Find(good, "FORWARD EXPERTS l0 p0 m0"), "]"),
       "out of order"},
      {"forward without requires_grad in a grad pass",
       [&](v1::StepProgram* p) {
         p->mutable_commands(embed)->set_requires_grad(false);
       },
       absl::StrCat("commands[", embed, "]"), "requires_grad"},
      {"optimizer step first",
       [](v1::StepProgram* p) {
         Command c;
         c.set_op(Command::OPTIMIZER_STEP);
         Insert(p, 0, c);
       },
       "commands[0]", "out of order"},
      {"optimizer step with a gathered unit",
       [&](v1::StepProgram* p) { Erase(p, last - 1); },
       absl::StrCat("commands[", last - 1, "]"),
       "unit 4 (<root>) is still gathered"},
      {"optimizer step with an unsharded gradient",
       [&](v1::StepProgram* p) { Erase(p, last - 2); },
       absl::StrCat("commands[", last - 1, "]"),
       "still holds an unsharded gradient"},
      {"command after the optimizer step",
       [](v1::StepProgram* p) {
         *p->add_commands() = Unit(Command::UNSHARD, 0);
       },
       absl::StrCat("commands[", last + 1, "]"), "nothing may follow"},
      {"program ends early", [&](v1::StepProgram* p) { Erase(p, last); },
       absl::StrCat("commands[", last, "]"), "ends early"},
  };
  for (const Case& c : cases) {
    v1::StepProgram program = good;
    c.mutate(&program);
    const absl::Status status = ValidateStepProgram(plan, program);
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr(c.index)))
        << c.name;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.rule)) << c.name;
    // The replay validates the same way.
    v1::MemoryReport memory;
    v1::CommReport comm;
    EXPECT_EQ(ReplayStepProgram(plan, program, false, &memory, &comm), status)
        << c.name;
  }
}

// The same plan under expert parallelism 2: each experts unit is one block
// of 2 ranks (ep_shard 2 of dp_shard 4). With `recompute`, the activation
// model recomputes the experts of both layers.
v1::ShardingPlan ExpertParallelPlan(bool recompute) {
  v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  plan.mutable_mesh()->set_ep(2);
  for (int u : {0, 2}) {
    v1::FsdpUnit* experts = plan.mutable_units(u);
    experts->set_ep(2);
    experts->set_gathered_numel(kExpertShard * kW / 2);
  }
  if (recompute) {
    for (int l = 0; l < 2; ++l) {
      v1::LayerActivations* layer = plan.mutable_activations()->add_layers();
      layer->set_layer(l);
      layer->set_recompute_experts(true);
    }
  }
  return plan;
}

TEST(StepProgramTest, ExpertParallelLayersDispatchAndCombine) {
  const v1::ShardingPlan plan = ExpertParallelPlan(/*recompute=*/false);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  const std::vector<std::string> expected = {
      "UNSHARD u4",
      "FORWARD EMBED p0 m0",
      "UNSHARD u1",
      "UNSHARD u3 prefetch",
      "FORWARD LAYER l0 p0 m0",
      // The experts' gather runs under the dispatch of their rows; they go
      // before the outputs come back.
      "UNSHARD u0 prefetch",
      "FORWARD DISPATCH l0 p0 m0",
      "WAIT_UNSHARD u0",
      "FORWARD EXPERTS l0 p0 m0",
      "RESHARD u0",
      "FORWARD COMBINE l0 p0 m0",
      "RESHARD u1",
      "WAIT_UNSHARD u3",
      "FORWARD LAYER l1 p0 m0",
      "UNSHARD u2 prefetch",
      "FORWARD DISPATCH l1 p0 m0",
      "WAIT_UNSHARD u2",
      "FORWARD EXPERTS l1 p0 m0",
      "FORWARD COMBINE l1 p0 m0",
      "FORWARD HEAD p0 m0",
      "ALLOC_GRAD u4",
      "BACKWARD HEAD p0 m0",
      "UNSHARD u1 prefetch",
      // Layer 1's experts stayed gathered: the output gradients go out, the
      // experts run backward, and their reduce-scatter runs under the
      // return of the input gradients.
      "BACKWARD COMBINE l1 p0 m0",
      "ALLOC_GRAD u2",
      "BACKWARD EXPERTS l1 p0 m0",
      "REDUCE_SCATTER u2",
      "RESHARD u2",
      "BACKWARD DISPATCH l1 p0 m0",
      "ALLOC_GRAD u3",
      "BACKWARD LAYER l1 p0 m0",
      "REDUCE_SCATTER u3",
      "RESHARD u3",
      // Layer 0's experts gather under the output gradients' exchange.
      "UNSHARD u0 prefetch",
      "BACKWARD COMBINE l0 p0 m0",
      "ALLOC_GRAD u0",
      "WAIT_UNSHARD u0",
      "BACKWARD EXPERTS l0 p0 m0",
      "REDUCE_SCATTER u0",
      "RESHARD u0",
      "BACKWARD DISPATCH l0 p0 m0",
      "ALLOC_GRAD u1",
      "WAIT_UNSHARD u1",
      "BACKWARD LAYER l0 p0 m0",
      "REDUCE_SCATTER u1",
      "RESHARD u1",
      "BACKWARD EMBED p0 m0",
      "REDUCE_SCATTER u4",
      "RESHARD u4",
      "OPTIMIZER_STEP",
  };
  EXPECT_THAT(Lines(program), ElementsAreArray(expected));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));

  // The eval program exchanges too.
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram eval, CompileEvalProgram(plan));
  EXPECT_GT(Find(eval, "FORWARD EXPERTS l1 p0 m0 no_grad"),
            Find(eval, "FORWARD DISPATCH l1 p0 m0 no_grad"));
  EXPECT_GT(Find(eval, "FORWARD COMBINE l1 p0 m0 no_grad"),
            Find(eval, "FORWARD EXPERTS l1 p0 m0 no_grad"));
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, eval));

  // Recomputed experts run their forward again in BACKWARD COMBINE, so it
  // needs them gathered and their gradient allocated.
  const v1::ShardingPlan recompute = ExpertParallelPlan(/*recompute=*/true);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram rp,
                              CompileStepProgram(recompute));
  SHARDD_EXPECT_OK(ValidateStepProgram(recompute, rp));
  const int combine = Find(rp, "BACKWARD COMBINE l0 p0 m0");
  ASSERT_GE(combine, 2);
  EXPECT_EQ(Lines(rp)[combine - 2], "UNSHARD u0");
  EXPECT_EQ(Lines(rp)[combine - 1], "ALLOC_GRAD u0");
  // The non-recomputing program's order fails that plan's validation.
  EXPECT_THAT(ValidateStepProgram(recompute, program),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("(BACKWARD COMBINE l1 p0 m0): writes the "
                                 "gradient of unit 2")));
}

TEST(StepProgramValidatorTest, ExpertParallelOrder) {
  const v1::ShardingPlan plan = ExpertParallelPlan(/*recompute=*/false);
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram good,
                              CompileStepProgram(plan));
  const int dispatch = Find(good, "FORWARD DISPATCH l0 p0 m0");
  const int combine = Find(good, "FORWARD COMBINE l0 p0 m0");
  const int b_dispatch = Find(good, "BACKWARD DISPATCH l1 p0 m0");
  {
    // No DISPATCH: EXPERTS is not the next computation.
    v1::StepProgram p = good;
    Erase(&p, dispatch);
    EXPECT_THAT(ValidateStepProgram(plan, p),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the next computation of the step is "
                                   "FORWARD DISPATCH l0 p0 m0")));
  }
  {
    v1::StepProgram p = good;
    Erase(&p, combine);
    EXPECT_THAT(ValidateStepProgram(plan, p),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("FORWARD COMBINE l0 p0 m0")));
  }
  {
    v1::StepProgram p = good;
    Erase(&p, b_dispatch);
    EXPECT_THAT(ValidateStepProgram(plan, p),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("BACKWARD DISPATCH l1 p0 m0")));
  }
  // A plan without expert parallelism takes no DISPATCH.
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram plain,
                              CompileStepProgram(ExpertsOwnUnitPlan()));
  EXPECT_THAT(Lines(plain), Not(Contains("FORWARD DISPATCH l0 p0 m0")));
  EXPECT_THAT(ValidateStepProgram(ExpertsOwnUnitPlan(), good),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("(FORWARD DISPATCH l0 p0 m0): out of order: "
                                 "the next computation of the step is "
                                 "FORWARD EXPERTS l0 p0 m0")));
}

TEST(StepProgramValidatorTest, AllocGradNeedsTrainableParameters) {
  v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  // Freeze the experts of layer 1: no gradient buffer, no reduce-scatter.
  plan.mutable_units(2)->mutable_params(0)->set_frozen(true);
  plan.mutable_units(2)->set_trainable_numel(0);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  for (const Command& c : program.commands()) {
    if (c.op() == Command::ALLOC_GRAD || c.op() == Command::REDUCE_SCATTER) {
      EXPECT_NE(c.unit(), 2) << CommandToString(c);
    }
  }
  SHARDD_EXPECT_OK(ValidateStepProgram(plan, program));
  const int backward = Find(program, "BACKWARD EXPERTS l1 p0 m0");
  Insert(&program, backward, Unit(Command::ALLOC_GRAD, 2));
  EXPECT_THAT(ValidateStepProgram(plan, program),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("commands[", backward,
                                              "] (ALLOC_GRAD u2): ALLOC_GRAD "
                                              "of a unit without trainable"))));
}

TEST(StepProgramValidatorTest, ExpertsOnlyForLayersWithExperts) {
  v1::ShardingPlan plan = EmptyPlan();
  SetReshard(AddUnit(&plan, "model.layers.0", v1::UNIT_LAYER, 0, 10,
                     "model.layers.0.mlp.down_proj.weight"),
             true);
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  const int layer = Find(program, "FORWARD LAYER l0 p0 m0");
  Command experts = program.commands(layer);
  experts.set_part(Command::EXPERTS);
  Insert(&program, layer + 1, experts);
  EXPECT_THAT(ValidateStepProgram(plan, program),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat(
                           "commands[", layer + 1,
                           "] (FORWARD EXPERTS l0 p0 m0): out of order: the "
                           "next computation of the step is FORWARD HEAD"))));
}

TEST(StepProgramValidatorTest, Header) {
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram good,
                              CompileStepProgram(plan));
  v1::StepProgram stale = good;
  stale.set_plan_fingerprint(1);
  EXPECT_THAT(ValidateStepProgram(plan, stale),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("program.plan_fingerprint")));
  v1::StepProgram bad = good;
  bad.set_microbatches(0);
  EXPECT_THAT(ValidateStepProgram(plan, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("program.microbatches")));
  bad = good;
  bad.set_passes(kMaxPasses + 1);
  EXPECT_THAT(ValidateStepProgram(plan, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("program.passes")));
  bad = good;
  bad.set_no_grad_passes(1);
  EXPECT_THAT(ValidateStepProgram(plan, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("program.no_grad_passes")));
  // A header promising two micro-batches for a one-micro-batch program.
  bad = good;
  bad.set_microbatches(2);
  EXPECT_THAT(
      ValidateStepProgram(plan, bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of order")));
  v1::MemoryReport memory;
  EXPECT_THAT(ReplayStepProgram(plan, good, false, &memory, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StepProgramTest, CompileRejectsInconsistentPlans) {
  v1::ShardingPlan experts_on_top = ExpertsOwnUnitPlan();
  experts_on_top.mutable_units(0)->set_parent(-1);
  EXPECT_THAT(CompileStepProgram(experts_on_top),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("units[0].parent")));
  v1::ShardingPlan order = ExpertsOwnUnitPlan();
  order.mutable_units(1)->set_layer_index(5);
  EXPECT_THAT(CompileStepProgram(order),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("units[3].layer_index")));
  v1::ShardingPlan no_layer = ExpertsOwnUnitPlan();
  no_layer.mutable_units(3)->set_layer_index(-1);
  EXPECT_THAT(CompileStepProgram(no_layer),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("units[3].layer_index")));
  v1::ShardingPlan step = ExpertsOwnUnitPlan();
  step.mutable_step()->set_passes(0);
  EXPECT_THAT(
      CompileStepProgram(step),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step.passes")));
}

TEST(StepProgramTest, ReplayMeasuresTheProgramItIsGiven) {
  // A valid but different schedule: gather every unit up front (forward
  // and backward), free everything at the end. The replay follows the
  // program, not the compiler's schedule.
  const v1::ShardingPlan plan = ExpertsOwnUnitPlan();
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::StepProgram compiled,
                              CompileStepProgram(plan));
  v1::StepProgram program = compiled;
  program.clear_commands();
  for (int u = 0; u < 5; ++u)
    *program.add_commands() = Unit(Command::UNSHARD, u);
  for (int u = 0; u < 5; ++u) {
    *program.add_commands() = Unit(Command::ALLOC_GRAD, u);
  }
  for (const Command& c : compiled.commands()) {
    if (c.op() == Command::FORWARD || c.op() == Command::BACKWARD) {
      *program.add_commands() = c;
    }
  }
  for (int u = 0; u < 5; ++u) {
    *program.add_commands() = Unit(Command::REDUCE_SCATTER, u);
    *program.add_commands() = Unit(Command::RESHARD, u);
  }
  Command step;
  step.set_op(Command::OPTIMIZER_STEP);
  *program.add_commands() = step;
  v1::MemoryReport memory;
  v1::CommReport comm;
  SHARDD_ASSERT_OK(ReplayStepProgram(plan, program, false, &memory, &comm));
  // Everything at once: 6 bytes per gathered element.
  EXPECT_EQ(memory.peak_unsharded_bytes(), 6 * (R + 2 * A + 2 * E));
  EXPECT_EQ(comm.all_gathers(), 5);
  EXPECT_EQ(comm.reduce_scatters(), 5);
}

// ---- Properties over random small plans -------------------------------------

enum class Family { kDefault, kExpertsUnit, kIslands, kBuckets };
enum class Policy { kRandom, kAllFree, kAllKeep };

int Uniform(std::mt19937* rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(*rng);
}

struct Shape {
  int roots = 0;
  int root_nested = 0;
  int non_root = 0;
  int trainable_roots = 0;
  int trainable_non_root = 0;  // Including root islands (per-pass).
};

// A unit with random sizes, sometimes with a frozen parameter, sometimes
// entirely frozen; flat-range layout for buckets.
v1::FsdpUnit* AddRandomUnit(v1::ShardingPlan* plan, int w,
                            const std::string& name, v1::UnitKind kind,
                            int layer, const std::string& param, bool flat,
                            std::mt19937* rng) {
  v1::FsdpUnit* unit = plan->add_units();
  unit->set_name(name);
  unit->set_kind(kind);
  unit->set_layer_index(layer);
  unit->set_index(plan->units_size() - 1);
  unit->set_parent(-1);
  const int64_t trainable = Uniform(rng, 0, 6) == 0 ? 0 : Uniform(rng, 1, 40);
  const int64_t frozen =
      trainable == 0 || Uniform(rng, 0, 3) == 0 ? Uniform(rng, 1, 10) : 0;
  const int64_t shard = trainable + frozen;
  unit->set_shard_numel(shard);
  unit->set_gathered_numel(shard * w);
  unit->set_numel(shard * w);
  unit->set_trainable_numel(trainable * w);
  if (trainable > 0) {
    v1::ParamLayout* p = unit->add_params();
    p->set_name(param);
    p->set_shard_dim(flat ? -1 : 0);
    p->set_local_numel(flat ? 0 : trainable);
    p->set_numel(trainable * w);
  }
  if (frozen > 0) {
    v1::ParamLayout* f = unit->add_params();
    f->set_name(name + ".frozen");
    f->set_shard_dim(flat ? -1 : 0);
    f->set_local_numel(flat ? 0 : frozen);
    f->set_numel(frozen * w);
    f->set_frozen(true);
  }
  return unit;
}

// Planner-like plans: layers in order (nested units before their layer),
// roots last, nested units inheriting the layer's policy, prefetch chains
// over the layer units.
v1::ShardingPlan RandomPlan(std::mt19937* rng, Family family, Policy policy,
                            Shape* shape) {
  v1::ShardingPlan plan;
  const int ws[] = {1, 2, 4, 8};
  const int w = ws[Uniform(rng, 0, 3)];
  plan.mutable_mesh()->set_dp_shard(w);
  plan.mutable_mesh()->set_dp_replicate(Uniform(rng, 1, 2));
  *plan.mutable_precision() = Mixed();
  plan.set_fingerprint(static_cast<uint64_t>((*rng)()));
  const bool flat = family == Family::kBuckets;
  auto trainable = [&](int u) { return plan.units(u).trainable_numel() > 0; };
  const int layers = Uniform(rng, 0, 3);
  for (int l = 0; l < layers; ++l) {
    const std::string name = "model.layers." + std::to_string(l);
    const bool moe = Uniform(rng, 0, 1) == 1;
    v1::ReshardPolicy reshard;
    const int choice = policy == Policy::kAllFree   ? 0
                       : policy == Policy::kAllKeep ? 1
                                                    : Uniform(rng, 0, 2);
    if (choice == 2 && w >= 4) {
      reshard.set_group_size(2);
    } else {
      reshard.set_reshard(choice != 1);
    }
    std::vector<int> nested;
    if (family == Family::kExpertsUnit && moe) {
      nested.push_back(plan.units_size());
      AddRandomUnit(&plan, w, name + ".moe.experts", v1::UNIT_EXPERTS, l,
                    name + ".moe.experts.gate_up_proj", false, rng);
    }
    if (family == Family::kIslands) {
      for (int k = Uniform(rng, 0, 2); k > 0; --k) {
        nested.push_back(plan.units_size());
        v1::FsdpUnit* island = AddRandomUnit(
            &plan, w, name + ".island" + std::to_string(k),
            v1::UNIT_DTYPE_ISLAND, l, name + ".sinks", false, rng);
        island->mutable_precision()->set_param_dtype(v1::FLOAT32);
        island->mutable_precision()->set_compute_dtype(v1::FLOAT32);
        island->mutable_precision()->set_reduce_dtype(v1::FLOAT32);
      }
    }
    const int buckets = flat ? Uniform(rng, 1, 3) : 1;
    for (int b = 0; b < buckets; ++b) {
      const std::string param = moe && family != Family::kExpertsUnit
                                    ? name + ".mlp.experts.w"
                                    : name + ".self_attn.w";
      v1::FsdpUnit* unit = AddRandomUnit(
          &plan, w, flat ? name + "#" + std::to_string(b) : name,
          flat ? v1::UNIT_FLAT_BUCKET : v1::UNIT_LAYER, l, param, flat, rng);
      unit->set_prefetch_target(true);
      *unit->mutable_reshard_after_forward() = reshard;
    }
    for (int n : nested) {
      plan.mutable_units(n)->set_parent(plan.units_size() - 1);
      *plan.mutable_units(n)->mutable_reshard_after_forward() = reshard;
    }
  }
  const int roots = flat ? Uniform(rng, 1, 2) : Uniform(rng, 0, 3) == 0 ? 0 : 1;
  for (int r = 0; r < roots; ++r) {
    int island = -1;
    if (family == Family::kIslands && Uniform(rng, 0, 1) == 1) {
      island = plan.units_size();
      AddRandomUnit(&plan, w, "<root>.<fp32>", v1::UNIT_DTYPE_ISLAND, -1,
                    "model.hc_head", false, rng)
          ->mutable_reshard_after_forward()
          ->set_reshard(false);
    }
    AddRandomUnit(&plan, w, flat ? "<root>#" + std::to_string(r) : "<root>",
                  flat ? v1::UNIT_FLAT_BUCKET : v1::UNIT_ROOT, -1,
                  "model.embed_tokens.weight", flat, rng)
        ->mutable_reshard_after_forward()
        ->set_reshard(false);
    if (island >= 0) {
      plan.mutable_units(island)->set_parent(plan.units_size() - 1);
    }
  }
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    const bool root = unit.parent() < 0 && unit.layer_index() < 0;
    const bool root_nested =
        unit.parent() >= 0 && plan.units(unit.parent()).layer_index() < 0;
    shape->roots += root;
    shape->root_nested += root_nested;
    shape->non_root += !root && !root_nested;
    shape->trainable_roots += root && trainable(u);
    shape->trainable_non_root += !root && trainable(u);
  }
  std::vector<int> chain;
  for (int i = 0; i < plan.units_size(); ++i) {
    if (plan.units(i).prefetch_target()) chain.push_back(i);
  }
  const int fwd = Uniform(rng, 0, 2);
  const int bwd = Uniform(rng, 0, 2);
  const int c = static_cast<int>(chain.size());
  for (int k = 0; k < c; ++k) {
    v1::FsdpUnit* unit = plan.mutable_units(chain[k]);
    for (int j = k + 1; j <= k + fwd && j < c; ++j) {
      unit->add_forward_prefetch(chain[j]);
    }
    for (int j = k - 1; j >= k - bwd && j >= 0; --j) {
      unit->add_backward_prefetch(chain[j]);
    }
  }
  v1::StepShape* step = plan.mutable_step();
  step->set_microbatches(Uniform(rng, 1, 3));
  step->set_passes(Uniform(rng, 1, 3));
  step->set_no_grad_passes(Uniform(rng, 0, std::min(2, step->passes() - 1)));
  step->set_defer_grad_sync(Uniform(rng, 0, 1) == 1);
  step->set_forward_prefetch_depth(fwd);
  step->set_backward_prefetch_depth(bwd);
  return plan;
}

TEST(StepProgramPropertyTest, RandomPlansCompileValidateAndBalance) {
  std::mt19937 rng(20240611);
  int checked_gathers = 0;
  for (int i = 0; i < 1200; ++i) {
    const Family family = static_cast<Family>(i % 4);
    const Policy policy = static_cast<Policy>((i / 4) % 3);
    Shape shape;
    const v1::ShardingPlan plan = RandomPlan(&rng, family, policy, &shape);
    const v1::StepShape& step = plan.step();
    SCOPED_TRACE(absl::StrCat("plan ", i, ": ", plan.ShortDebugString()));
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                                CompileStepProgram(plan));
    SHARDD_ASSERT_OK(ValidateStepProgram(plan, program));
    v1::MemoryReport memory;
    v1::CommReport comm;
    SHARDD_ASSERT_OK(ReplayStepProgram(plan, program, true, &memory, &comm));

    // Streaming (ModelStep's path) and the materialized program agree.
    v1::MemoryReport streamed_memory;
    v1::CommReport streamed_comm;
    SHARDD_ASSERT_OK(
        ReplayCompiledStep(plan, true, &streamed_memory, &streamed_comm));
    EXPECT_EQ(streamed_memory.SerializeAsString(), memory.SerializeAsString());
    EXPECT_EQ(streamed_comm.SerializeAsString(), comm.SerializeAsString());

    // The eval program of the same plan: valid, forward only, no deeper
    // than the training step, and it ends with nothing gathered.
    SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram eval, CompileEvalProgram(plan));
    SHARDD_ASSERT_OK(ValidateStepProgram(plan, eval));
    v1::MemoryReport eval_memory;
    v1::CommReport eval_comm;
    SHARDD_ASSERT_OK(
        ReplayStepProgram(plan, eval, true, &eval_memory, &eval_comm));
    EXPECT_LE(eval_memory.peak_unsharded_bytes(),
              memory.peak_unsharded_bytes());
    EXPECT_EQ(eval_memory.peak_grad_bytes(), 0);
    EXPECT_EQ(eval_comm.reduce_scatters(), 0);
    EXPECT_EQ(CountOps(eval, Command::FORWARD),
              CountOps(program, Command::FORWARD));
    EXPECT_EQ(CountOps(eval, Command::BACKWARD), 0);
    for (const Command& c : eval.commands()) ASSERT_FALSE(c.requires_grad());
    if (eval_memory.timeline_size() > 0) {
      const v1::TimelineEvent& last =
          eval_memory.timeline(eval_memory.timeline_size() - 1);
      EXPECT_EQ(last.live_param_bytes(), 0);
    }

    // Everything gathered is resharded and every gradient reduce-scattered.
    ASSERT_GT(memory.timeline_size(), 0);
    const v1::TimelineEvent& end = memory.timeline(memory.timeline_size() - 1);
    EXPECT_EQ(end.phase(), "optimizer");
    EXPECT_EQ(end.live_param_bytes(), 0);
    EXPECT_EQ(end.live_grad_bytes(), 0);
    for (const v1::TimelineEvent& e : memory.timeline()) {
      ASSERT_GE(e.live_param_bytes(), 0);
      ASSERT_GE(e.live_grad_bytes(), 0);
      ASSERT_LE(e.live_param_bytes() + e.live_grad_bytes(),
                memory.peak_unsharded_bytes());
      // Events point at the command that changed memory.
      ASSERT_LT(e.command(), program.commands_size());
    }

    // Reduce-scatters: per syncing micro-batch, every trainable non-root
    // unit once per grad pass (per-forward-call post-backward), every
    // trainable root once.
    const int grad_passes = step.passes() - step.no_grad_passes();
    const int syncing = step.defer_grad_sync() ? 1 : step.microbatches();
    EXPECT_EQ(comm.reduce_scatters(),
              syncing * (grad_passes * shape.trainable_non_root +
                         shape.trainable_roots));
    EXPECT_EQ(comm.all_reduces(),
              plan.mesh().dp_replicate() > 1 ? comm.reduce_scatters() : 0);

    // All-gathers, without deferral: roots once per micro-batch; root
    // islands (kept after forward) once per grad pass; layer units and
    // their nested units once per grad pass when kept after forward, and
    // once per forward pass plus once per grad pass when freed.
    if (!step.defer_grad_sync() && policy != Policy::kRandom) {
      const int per_layer_unit = policy == Policy::kAllFree
                                     ? step.passes() + grad_passes
                                     : grad_passes;
      EXPECT_EQ(
          comm.all_gathers(),
          step.microbatches() * (shape.roots + grad_passes * shape.root_nested +
                                 per_layer_unit * shape.non_root));
      ++checked_gathers;
    }
  }
  EXPECT_GT(checked_gathers, 200);
}

}  // namespace
}  // namespace shardd
