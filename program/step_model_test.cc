#include "program/step_model.h"

#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "program/step_program.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

// Toy sizes, all over W = 4 shard ranks with fp32 master, bf16 gather and
// fp32 reduce, so per element: 2 bytes gathered, 4 bytes of unsharded
// gradient. R and L below are gathered element counts.
constexpr int kW = 4;
constexpr int64_t kRootShard = 25;    // R = 100 gathered elements.
constexpr int64_t kLayerShard = 250;  // L = 1000 gathered elements.
constexpr int64_t R = kRootShard * kW;
constexpr int64_t L = kLayerShard * kW;

// One fully trainable unit with a single unpadded parameter.
v1::FsdpUnit* AddUnit(v1::ShardingPlan* plan, const std::string& name,
                      v1::UnitKind kind, int layer_index, int64_t shard_numel) {
  v1::FsdpUnit* unit = plan->add_units();
  unit->set_name(name);
  unit->set_kind(kind);
  unit->set_layer_index(layer_index);
  unit->set_index(plan->units_size() - 1);
  unit->set_parent(-1);
  unit->set_numel(shard_numel * kW);
  unit->set_trainable_numel(shard_numel * kW);
  unit->set_shard_numel(shard_numel);
  unit->set_gathered_numel(shard_numel * kW);
  v1::ParamLayout* param = unit->add_params();
  param->set_name(name + ".weight");
  param->add_global_shape(shard_numel * kW);
  param->set_shard_dim(0);
  param->set_padded_dim0(shard_numel * kW);
  param->set_rows_per_rank(shard_numel);
  param->add_local_shape(shard_numel);
  param->set_local_numel(shard_numel);
  param->set_numel(shard_numel * kW);
  return unit;
}

void SetReshard(v1::FsdpUnit* unit, bool reshard) {
  unit->mutable_reshard_after_forward()->set_reshard(reshard);
}

// Explicit prefetch over `chain` (unit indices), NeMo style.
void SetPrefetch(v1::ShardingPlan* plan, const std::vector<int>& chain, int fwd,
                 int bwd) {
  const int n = static_cast<int>(chain.size());
  for (int k = 0; k < n; ++k) {
    v1::FsdpUnit* unit = plan->mutable_units(chain[k]);
    unit->clear_forward_prefetch();
    unit->clear_backward_prefetch();
    for (int j = k + 1; j <= k + fwd && j < n; ++j) {
      unit->add_forward_prefetch(chain[j]);
    }
    for (int j = k - 1; j >= k - bwd && j >= 0; --j) {
      unit->add_backward_prefetch(chain[j]);
    }
  }
  plan->mutable_step()->set_forward_prefetch_depth(fwd);
  plan->mutable_step()->set_backward_prefetch_depth(bwd);
}

// Units 0..2: layers (reshard true, true, false: the default heuristic),
// unit 3: root (never reshards). One micro-batch, one pass.
v1::ShardingPlan ToyPlan(int fwd, int bwd) {
  v1::ShardingPlan plan;
  plan.mutable_mesh()->set_dp_shard(kW);
  plan.mutable_mesh()->set_dp_replicate(1);
  plan.mutable_precision()->set_param_dtype(v1::FLOAT32);
  plan.mutable_precision()->set_compute_dtype(v1::BFLOAT16);
  plan.mutable_precision()->set_reduce_dtype(v1::FLOAT32);
  for (int i = 0; i < 3; ++i) {
    v1::FsdpUnit* layer = AddUnit(&plan, "model.layers." + std::to_string(i),
                                  v1::UNIT_LAYER, i, kLayerShard);
    layer->set_prefetch_target(true);
    SetReshard(layer, i < 2);
  }
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard), false);
  plan.mutable_step()->set_microbatches(1);
  plan.mutable_step()->set_passes(1);
  SetPrefetch(&plan, {0, 1, 2}, fwd, bwd);
  return plan;
}

int64_t MaxLive(const v1::ShardingPlan& plan, const std::string& phase) {
  int64_t best = 0;
  for (const v1::TimelineEvent& e : plan.memory().timeline()) {
    if (e.phase() != phase) continue;
    best = std::max(best, e.live_param_bytes() + e.live_grad_bytes());
  }
  return best;
}

TEST(StepModelTest, PrefetchOneTwo) {
  v1::ShardingPlan plan = ToyPlan(1, 2);
  SHARDD_ASSERT_OK(ModelStep(/*include_timeline=*/true, &plan));
  const v1::MemoryReport& m = plan.memory();
  // Backward of layer 2: root (2R) + layers 2, 1, 0 gathered (6L, two of
  // them by backward prefetch), root gradient (4R, allocated when the head's
  // backward runs) + layer 2's gradient (4L).
  EXPECT_EQ(m.peak_param_bytes(), 2 * R + 6 * L);
  EXPECT_EQ(m.peak_grad_bytes(), 4 * R + 4 * L);
  EXPECT_EQ(m.peak_unsharded_bytes(), 6 * R + 10 * L);
  EXPECT_THAT(m.peak_where(), HasSubstr("backward"));
  EXPECT_THAT(m.peak_where(), HasSubstr("model.layers.2"));
  // Forward: root + the running layer + the one prefetched.
  EXPECT_EQ(MaxLive(plan, "forward"), 2 * R + 4 * L);

  // Persistent: 775 shard elements, all trainable.
  const int64_t shard = kRootShard + 3 * kLayerShard;
  EXPECT_EQ(m.sharded_param_bytes(), shard * 4);
  EXPECT_EQ(m.grad_bytes(), shard * 4);
  EXPECT_EQ(m.optimizer_bytes(), shard * 8);
  EXPECT_EQ(m.persistent_bytes(), shard * 16);
  EXPECT_EQ(m.peak_total_bytes(), shard * 16 + 6 * R + 10 * L);

  // Forward gathers all four units; backward re-gathers layers 1 and 0
  // (resharded after forward) through prefetch.
  const v1::CommReport& c = plan.comm();
  EXPECT_EQ(c.all_gathers(), 6);
  EXPECT_EQ(c.all_gather_bytes(), 2 * R + 5 * 2 * L);
  EXPECT_EQ(c.reduce_scatters(), 4);
  EXPECT_EQ(c.reduce_scatter_bytes(), 4 * R + 3 * 4 * L);
  EXPECT_EQ(c.all_reduces(), 0);

  // The timeline ends with everything freed, and the peak event matches.
  ASSERT_EQ(m.timeline_size(), m.timeline_events());
  const v1::TimelineEvent& last = m.timeline(m.timeline_size() - 1);
  EXPECT_EQ(last.phase(), "optimizer");
  EXPECT_EQ(last.live_param_bytes() + last.live_grad_bytes(), 0);
  const v1::TimelineEvent& peak = m.timeline(m.peak_event());
  EXPECT_EQ(peak.live_param_bytes() + peak.live_grad_bytes(),
            m.peak_unsharded_bytes());
  EXPECT_EQ(plan.units(peak.unit()).name(), "model.layers.2");
}

TEST(StepModelTest, NoPrefetchLowersPeak) {
  v1::ShardingPlan with = ToyPlan(1, 2);
  v1::ShardingPlan without = ToyPlan(0, 0);
  SHARDD_ASSERT_OK(ModelStep(false, &with));
  SHARDD_ASSERT_OK(ModelStep(false, &without));
  // Without prefetch only the running layer is gathered besides the root.
  EXPECT_EQ(without.memory().peak_unsharded_bytes(), 6 * R + 6 * L);
  EXPECT_EQ(with.memory().peak_unsharded_bytes() -
                without.memory().peak_unsharded_bytes(),
            4 * L);  // Two prefetched bf16 layers.
  // Same collectives, issued later.
  EXPECT_EQ(without.comm().all_gathers(), 6);
  EXPECT_EQ(without.comm().all_gather_bytes(), with.comm().all_gather_bytes());
  // Without include_timeline events are still counted.
  EXPECT_EQ(without.memory().timeline_size(), 0);
  EXPECT_GT(without.memory().timeline_events(), 0);
}

TEST(StepModelTest, ReshardTrueVersusFalse) {
  v1::ShardingPlan keep = ToyPlan(0, 0);
  v1::ShardingPlan free = ToyPlan(0, 0);
  for (int i = 0; i < 3; ++i) {
    SetReshard(keep.mutable_units(i), false);
    SetReshard(free.mutable_units(i), true);
  }
  SHARDD_ASSERT_OK(ModelStep(false, &keep));
  SHARDD_ASSERT_OK(ModelStep(false, &free));
  // Keeping: all layers stay gathered into backward; no re-gather.
  EXPECT_EQ(keep.comm().all_gathers(), 4);
  EXPECT_EQ(keep.comm().all_gather_bytes(), 2 * R + 3 * 2 * L);
  EXPECT_EQ(keep.memory().peak_unsharded_bytes(), 6 * R + 10 * L);
  // Freeing every layer (the last too): backward re-gathers all three.
  EXPECT_EQ(free.comm().all_gathers(), 7);
  EXPECT_EQ(free.comm().all_gather_bytes(), 2 * R + 6 * 2 * L);
  EXPECT_EQ(free.memory().peak_unsharded_bytes(), 6 * R + 6 * L);
  EXPECT_EQ(keep.comm().reduce_scatters(), free.comm().reduce_scatters());
}

TEST(StepModelTest, ReshardToSmallerGroupKeepsASlice) {
  v1::ShardingPlan plan = ToyPlan(0, 0);
  for (int i = 0; i < 3; ++i) {
    plan.mutable_units(i)->mutable_reshard_after_forward()->set_group_size(2);
  }
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  // After forward each layer keeps 2L/2 = L bytes. Backward of layer 2:
  // root 2R + layer 2 gathered 2L + slices of layers 0, 1 (2L) + grads
  // 4R + 4L.
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(), 6 * R + 8 * L);
  EXPECT_EQ(MaxLive(plan, "forward"), 2 * R + 4 * L);  // 2L + slices 2 * L.
  // Re-gathers from the slices still move the whole buffer.
  EXPECT_EQ(plan.comm().all_gathers(), 7);
  EXPECT_EQ(plan.comm().all_gather_bytes(), 2 * R + 6 * 2 * L);
}

TEST(StepModelTest, GroupSizeMustDivideShardGroup) {
  v1::ShardingPlan plan = ToyPlan(0, 0);
  plan.mutable_units(1)->mutable_reshard_after_forward()->set_group_size(3);
  EXPECT_THAT(ModelStep(false, &plan),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("units[1].reshard_after_forward.group_size")));
}

TEST(StepModelTest, PassesRegatherResharededUnits) {
  v1::ShardingPlan plan = ToyPlan(0, 0);
  plan.mutable_step()->set_passes(3);
  plan.mutable_step()->set_no_grad_passes(1);
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  // Forward: pass 0 gathers root and layers 0..2; passes 1 and 2 re-gather
  // layers 0 and 1 (layer 2 and root stay). Backward of pass 2: layers 1, 0
  // re-gathered; backward of pass 1: layers 2 (resharded after its pass-2
  // backward), 1, 0. The no-grad pass 0 has no backward.
  EXPECT_EQ(plan.comm().all_gathers(), 4 + 2 + 2 + 2 + 3);
  EXPECT_EQ(plan.comm().all_gather_bytes(), 2 * R + 12 * 2 * L);
  // One reduce-scatter per layer per grad pass, the root once.
  EXPECT_EQ(plan.comm().reduce_scatters(), 3 + 3 + 1);
  EXPECT_EQ(plan.comm().reduce_scatter_bytes(), 4 * R + 6 * 4 * L);
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(), 6 * R + 6 * L);

  // Every pass with gradients: one more backward walk.
  v1::ShardingPlan all_grad = ToyPlan(0, 0);
  all_grad.mutable_step()->set_passes(3);
  SHARDD_ASSERT_OK(ModelStep(false, &all_grad));
  EXPECT_EQ(all_grad.comm().all_gathers(), 4 + 2 + 2 + 2 + 3 + 3);
  EXPECT_EQ(all_grad.comm().reduce_scatters(), 3 * 3 + 1);
  // Forward events carry their pass index.
  int max_pass = -1;
  for (const v1::TimelineEvent& e : plan.memory().timeline()) {
    if (e.phase() == "forward") max_pass = std::max(max_pass, e.pass());
    if (e.phase() == "backward") {
      EXPECT_EQ(e.pass(), -1);
    }
  }
  EXPECT_EQ(max_pass, 2);
}

TEST(StepModelTest, MicrobatchesWithoutDeferral) {
  v1::ShardingPlan one = ToyPlan(1, 2);
  v1::ShardingPlan two = ToyPlan(1, 2);
  two.mutable_step()->set_microbatches(2);
  SHARDD_ASSERT_OK(ModelStep(false, &one));
  SHARDD_ASSERT_OK(ModelStep(false, &two));
  // Every micro-batch repeats the whole schedule.
  EXPECT_EQ(two.comm().all_gathers(), 2 * 6);
  EXPECT_EQ(two.comm().reduce_scatters(), 2 * 4);
  EXPECT_EQ(two.comm().all_gather_bytes(), 2 * one.comm().all_gather_bytes());
  EXPECT_EQ(two.memory().peak_unsharded_bytes(), 6 * R + 10 * L);
}

TEST(StepModelTest, DeferredSyncKeepsEverythingUnsharded) {
  v1::ShardingPlan plan = ToyPlan(1, 2);
  plan.mutable_step()->set_microbatches(2);
  plan.mutable_step()->set_defer_grad_sync(true);
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  // Micro-batch 0: forward gathers 4 units, backward prefetches layers 1, 0;
  // nothing is reduce-scattered or resharded. Micro-batch 1: the forward
  // finds everything gathered (0 all-gathers) but reshards layers 0 and 1
  // after forward by policy, so backward prefetches them again.
  EXPECT_EQ(plan.comm().all_gathers(), 4 + 2 + 0 + 2);
  EXPECT_EQ(plan.comm().reduce_scatters(), 4);  // Final micro-batch only.
  EXPECT_EQ(plan.comm().reduce_scatter_bytes(), 4 * R + 3 * 4 * L);
  // The cost: at the end of micro-batch 0's backward every parameter is
  // gathered in bf16 and every gradient unsharded in fp32, i.e.
  // (2 + 4) bytes times all gathered elements, against 6R + 10L without.
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(), 6 * (R + 3 * L));
  EXPECT_EQ(plan.memory().peak_param_bytes(), 2 * (R + 3 * L));
  EXPECT_EQ(plan.memory().peak_grad_bytes(), 4 * (R + 3 * L));
  EXPECT_THAT(plan.memory().peak_where(), HasSubstr("backward, micro-batch 0"));
  EXPECT_THAT(plan.memory().peak_where(), HasSubstr("model.layers.0"));
  // After the final micro-batch everything is synced and resharded.
  const v1::TimelineEvent& last =
      plan.memory().timeline(plan.memory().timeline_size() - 1);
  EXPECT_EQ(last.live_param_bytes(), 0);
  EXPECT_EQ(last.live_grad_bytes(), 0);
}

TEST(StepModelTest, HsdpAllReducesOncePerReduceScatter) {
  v1::ShardingPlan plan = ToyPlan(1, 2);
  plan.mutable_mesh()->set_dp_replicate(2);
  SHARDD_ASSERT_OK(ModelStep(false, &plan));
  EXPECT_EQ(plan.comm().all_reduces(), 4);
  // The sharded gradients: every shard element in fp32.
  EXPECT_EQ(plan.comm().all_reduce_bytes(), (kRootShard + 3 * kLayerShard) * 4);

  v1::ShardingPlan deferred = ToyPlan(1, 2);
  deferred.mutable_mesh()->set_dp_replicate(2);
  deferred.mutable_step()->set_microbatches(3);
  deferred.mutable_step()->set_defer_grad_sync(true);
  SHARDD_ASSERT_OK(ModelStep(false, &deferred));
  EXPECT_EQ(deferred.comm().all_reduces(), 4);
  EXPECT_EQ(deferred.comm().reduce_scatters(), 4);

  v1::ShardingPlan every = ToyPlan(1, 2);
  every.mutable_mesh()->set_dp_replicate(2);
  every.mutable_step()->set_microbatches(3);
  SHARDD_ASSERT_OK(ModelStep(false, &every));
  EXPECT_EQ(every.comm().all_reduces(), 3 * 4);
}

// Layers of A (attention etc.) + E (grouped experts) gathered elements.
constexpr int64_t kAttnShard = 100;    // A = 400.
constexpr int64_t kExpertShard = 500;  // E = 2000.
constexpr int64_t A = kAttnShard * kW;
constexpr int64_t E = kExpertShard * kW;

TEST(StepModelTest, ExpertsAsOwnUnitLowerThePeak) {
  // Folded: each layer unit holds A + E.
  v1::ShardingPlan folded;
  {
    folded.mutable_mesh()->set_dp_shard(kW);
    *folded.mutable_precision() = ToyPlan(0, 0).precision();
    for (int i = 0; i < 3; ++i) {
      v1::FsdpUnit* layer =
          AddUnit(&folded, "model.layers." + std::to_string(i), v1::UNIT_LAYER,
                  i, kAttnShard + kExpertShard);
      layer->set_prefetch_target(true);
      SetReshard(layer, i < 2);
    }
    SetReshard(AddUnit(&folded, "<root>", v1::UNIT_ROOT, -1, kRootShard),
               false);
    folded.mutable_step()->set_microbatches(1);
    folded.mutable_step()->set_passes(1);
    SetPrefetch(&folded, {0, 1, 2}, 1, 2);
  }
  // Own unit: [experts 0, layer 0, experts 1, layer 1, experts 2, layer 2,
  // root]; experts nested in their layer, not prefetch targets, inheriting
  // the layer's policy.
  v1::ShardingPlan own;
  {
    own.mutable_mesh()->set_dp_shard(kW);
    *own.mutable_precision() = folded.precision();
    for (int i = 0; i < 3; ++i) {
      const std::string name = "model.layers." + std::to_string(i);
      v1::FsdpUnit* experts = AddUnit(&own, name + ".moe.experts",
                                      v1::UNIT_EXPERTS, i, kExpertShard);
      experts->set_parent(own.units_size());
      SetReshard(experts, i < 2);
      v1::FsdpUnit* layer = AddUnit(&own, name, v1::UNIT_LAYER, i, kAttnShard);
      layer->set_prefetch_target(true);
      SetReshard(layer, i < 2);
    }
    SetReshard(AddUnit(&own, "<root>", v1::UNIT_ROOT, -1, kRootShard), false);
    own.mutable_step()->set_microbatches(1);
    own.mutable_step()->set_passes(1);
    SetPrefetch(&own, {1, 3, 5}, 1, 2);
  }
  SHARDD_ASSERT_OK(ModelStep(true, &folded));
  SHARDD_ASSERT_OK(ModelStep(true, &own));

  // Folded: the toy-plan peak with L = A + E.
  EXPECT_EQ(folded.memory().peak_unsharded_bytes(), 6 * R + 10 * (A + E));
  // Own unit, backward of layer 2: layers 2, 1, 0 gathered without their
  // experts (6A), experts 2 gathered (2E) with its gradient (4E); the
  // experts are reduce-scattered before the layer's own gradient (4A) is
  // allocated. With E > A that is 6A + 6E (against 10A later).
  EXPECT_EQ(own.memory().peak_unsharded_bytes(), 6 * R + 6 * A + 6 * E);
  EXPECT_THAT(own.memory().peak_where(), HasSubstr("moe.experts"));
  // Saving: 4(A + E): two prefetched expert stacks (4E) and the layer's
  // gradient no longer overlapping the experts' (4A). 9600 bytes here,
  // 39% of the folded peak.
  EXPECT_EQ(folded.memory().peak_unsharded_bytes() -
                own.memory().peak_unsharded_bytes(),
            4 * (A + E));
  EXPECT_EQ(4 * (A + E), 9600);

  // Forward: 2R + 4(A + E) folded vs 2R + 4A + 2E (one expert stack).
  EXPECT_EQ(MaxLive(folded, "forward"), 2 * R + 4 * (A + E));
  EXPECT_EQ(MaxLive(own, "forward"), 2 * R + 4 * A + 2 * E);

  // Same bytes moved, more (smaller) collectives: the experts gather lazily.
  EXPECT_EQ(own.comm().all_gather_bytes(), folded.comm().all_gather_bytes());
  EXPECT_EQ(own.comm().all_gathers(), 11);
  EXPECT_EQ(folded.comm().all_gathers(), 6);
  EXPECT_EQ(own.comm().reduce_scatter_bytes(),
            folded.comm().reduce_scatter_bytes());
  EXPECT_EQ(own.comm().reduce_scatters(), 7);
}

TEST(StepModelTest, FrozenParametersHaveNoGradientsOrOptimizerState) {
  v1::ShardingPlan plan = ToyPlan(0, 0);
  // The root gets a second, frozen parameter of 15 local elements.
  v1::FsdpUnit* root = plan.mutable_units(3);
  v1::ParamLayout* frozen = root->add_params();
  frozen->set_name("<root>.frozen");
  frozen->add_global_shape(15 * kW);
  frozen->set_shard_dim(0);
  frozen->set_local_numel(15);
  frozen->set_shard_offset(kRootShard);
  frozen->set_frozen(true);
  root->set_shard_numel(kRootShard + 15);
  root->set_gathered_numel((kRootShard + 15) * kW);
  root->set_numel((kRootShard + 15) * kW);
  SHARDD_ASSERT_OK(ModelStep(false, &plan));
  const int64_t shard = kRootShard + 15 + 3 * kLayerShard;
  const int64_t trainable = kRootShard + 3 * kLayerShard;
  EXPECT_EQ(plan.memory().sharded_param_bytes(), shard * 4);
  EXPECT_EQ(plan.memory().grad_bytes(), trainable * 4);
  EXPECT_EQ(plan.memory().optimizer_bytes(), trainable * 8);
  // Root gathers R + 60 elements but reduce-scatters only R.
  EXPECT_EQ(plan.comm().reduce_scatter_bytes(), 4 * R + 3 * 4 * L);
  // Forward gathers the root (with its frozen part) and 3 layers, backward
  // re-gathers layers 1 and 0.
  EXPECT_EQ(plan.comm().all_gather_bytes(),
            2 * (R + 15 * kW) + 2 * 3 * L + 2 * 2 * L);
}

// Megatron-FSDP: a layer computes with all of its flat buckets, so they are
// gathered together, and its backward writes all of their gradients.
TEST(StepModelTest, AllBucketsOfALayerAreLiveTogether) {
  constexpr int64_t kBucketShard = 250;  // B = 1000 gathered elements.
  constexpr int64_t B = kBucketShard * kW;
  v1::ShardingPlan plan;
  plan.mutable_mesh()->set_dp_shard(kW);
  *plan.mutable_precision() = ToyPlan(0, 0).precision();
  for (int l = 0; l < 2; ++l) {
    for (int b = 0; b < 2; ++b) {
      v1::FsdpUnit* bucket = AddUnit(
          &plan, "model.layers." + std::to_string(l) + "#" + std::to_string(b),
          v1::UNIT_FLAT_BUCKET, l, kBucketShard);
      bucket->set_prefetch_target(true);
      SetReshard(bucket, l == 0);
    }
  }
  SetReshard(AddUnit(&plan, "<root>#0", v1::UNIT_FLAT_BUCKET, -1, kRootShard),
             false);
  plan.mutable_step()->set_microbatches(1);
  plan.mutable_step()->set_passes(1);
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  // Backward of layer 1: root 2R + 4R, both buckets gathered (4B) with
  // both gradients (8B). (Replaying bucket by bucket, as the model did
  // before it replayed the step program, freed one bucket's gradient before
  // allocating the next: 6R + 8B, an underestimate.)
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(), 6 * R + 12 * B);
  EXPECT_EQ(plan.memory().peak_grad_bytes(), 4 * R + 8 * B);
  EXPECT_THAT(plan.memory().peak_where(), HasSubstr("model.layers.1#0"));
  EXPECT_EQ(MaxLive(plan, "forward"), 2 * R + 4 * B);
  // Forward gathers everything once; backward re-gathers layer 0.
  EXPECT_EQ(plan.comm().all_gathers(), 5 + 2);
  EXPECT_EQ(plan.comm().reduce_scatters(), 5);
}

// A dtype island is part of its layer's computation: its gradient exists
// from before the layer's backward until the layer's post-backward.
TEST(StepModelTest, IslandGradientOverlapsItsLayer) {
  constexpr int64_t kIslandShard = 8;  // I = 32 gathered fp32 elements.
  constexpr int64_t I = kIslandShard * kW;
  v1::ShardingPlan plan;
  plan.mutable_mesh()->set_dp_shard(kW);
  *plan.mutable_precision() = ToyPlan(0, 0).precision();
  v1::FsdpUnit* island = AddUnit(&plan, "model.layers.0.<fp32>",
                                 v1::UNIT_DTYPE_ISLAND, 0, kIslandShard);
  island->set_parent(1);
  island->mutable_precision()->set_param_dtype(v1::FLOAT32);
  island->mutable_precision()->set_compute_dtype(v1::FLOAT32);
  island->mutable_precision()->set_reduce_dtype(v1::FLOAT32);
  SetReshard(island, true);
  SetReshard(AddUnit(&plan, "model.layers.0", v1::UNIT_LAYER, 0, kLayerShard),
             true);
  SetReshard(AddUnit(&plan, "<root>", v1::UNIT_ROOT, -1, kRootShard), false);
  plan.mutable_step()->set_microbatches(1);
  plan.mutable_step()->set_passes(1);
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  // Backward of layer 0: root 6R, layer 2L + 4L, island 4I + 4I (fp32).
  // (The model before the step program reduce-scattered the island before
  // the layer's gradient existed: 6R + 6L.)
  EXPECT_EQ(plan.memory().peak_unsharded_bytes(), 6 * R + 6 * L + 8 * I);
  EXPECT_THAT(plan.memory().peak_where(),
              HasSubstr("model.layers.0, after grad"));
  // Forward: root, layer and island together.
  EXPECT_EQ(MaxLive(plan, "forward"), 2 * R + 2 * L + 4 * I);
  EXPECT_EQ(plan.comm().all_gathers(), 3 + 2);
  EXPECT_EQ(plan.comm().reduce_scatters(), 3);
}

// The timeline is the replay of the compiled program: every event names
// the command that changed memory.
TEST(StepModelTest, TimelineEventsNameProgramCommands) {
  v1::ShardingPlan plan = ToyPlan(1, 2);
  plan.mutable_step()->set_microbatches(2);
  plan.mutable_step()->set_passes(2);
  SHARDD_ASSERT_OK(ModelStep(true, &plan));
  SHARDD_ASSERT_OK_AND_ASSIGN(v1::StepProgram program,
                              CompileStepProgram(plan));
  int memory_commands = 0;
  for (const v1::Command& c : program.commands()) {
    memory_commands += c.op() == v1::Command::UNSHARD ||
                       c.op() == v1::Command::RESHARD ||
                       c.op() == v1::Command::ALLOC_GRAD ||
                       c.op() == v1::Command::REDUCE_SCATTER;
  }
  // Plus the optimizer step.
  ASSERT_EQ(plan.memory().timeline_size(), memory_commands + 1);
  for (const v1::TimelineEvent& e : plan.memory().timeline()) {
    ASSERT_GE(e.command(), 0);
    ASSERT_LT(e.command(), program.commands_size());
    const v1::Command& c = program.commands(e.command());
    if (e.op() == "step") {
      EXPECT_EQ(c.op(), v1::Command::OPTIMIZER_STEP);
      continue;
    }
    EXPECT_EQ(c.unit(), e.unit()) << e.ShortDebugString();
    const v1::Command::Op op = e.op() == "unshard" || e.op() == "prefetch"
                                   ? v1::Command::UNSHARD
                               : e.op() == "reshard" ? v1::Command::RESHARD
                               : e.op() == "grad"    ? v1::Command::ALLOC_GRAD
                                                  : v1::Command::REDUCE_SCATTER;
    EXPECT_EQ(c.op(), op) << e.ShortDebugString();
    EXPECT_EQ(c.prefetch(), e.op() == "prefetch") << e.ShortDebugString();
  }
}

TEST(StepModelTest, BadStepShapes) {
  struct Case {
    void (*mutate)(v1::ShardingPlan*);
    const char* field;
  };
  const Case cases[] = {
      {[](v1::ShardingPlan* p) { p->mutable_step()->set_microbatches(0); },
       "step.microbatches"},
      {[](v1::ShardingPlan* p) {
         p->mutable_step()->set_microbatches(kMaxMicrobatches + 1);
       },
       "step.microbatches"},
      {[](v1::ShardingPlan* p) { p->mutable_step()->set_passes(0); },
       "step.passes"},
      {[](v1::ShardingPlan* p) { p->mutable_step()->set_no_grad_passes(1); },
       "step.no_grad_passes"},
      {[](v1::ShardingPlan* p) { p->mutable_step()->set_no_grad_passes(-1); },
       "step.no_grad_passes"},
      {[](v1::ShardingPlan* p) {
         p->mutable_step()->set_forward_prefetch_depth(-1);
       },
       "step.forward_prefetch_depth"},
      {[](v1::ShardingPlan* p) {
         p->mutable_step()->set_backward_prefetch_depth(-2);
       },
       "step.backward_prefetch_depth"},
      {[](v1::ShardingPlan* p) { p->mutable_mesh()->set_dp_shard(0); },
       "mesh.dp_shard"},
      {[](v1::ShardingPlan* p) { p->mutable_units(3)->set_parent(0); },
       "units[3].parent"},
      {[](v1::ShardingPlan* p) { p->mutable_units(1)->set_parent(1); },
       "units[1].parent"},
      {[](v1::ShardingPlan* p) {
         p->mutable_units(0)->add_forward_prefetch(9);
       },
       "units[0].forward_prefetch"},
      {[](v1::ShardingPlan* p) { p->mutable_units(2)->set_gathered_numel(7); },
       "units[2].gathered_numel"},
      {[](v1::ShardingPlan* p) { p->clear_precision(); }, "units[0].precision"},
  };
  for (const Case& c : cases) {
    v1::ShardingPlan plan = ToyPlan(1, 2);
    c.mutate(&plan);
    EXPECT_THAT(
        ModelStep(false, &plan),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.field)))
        << c.field;
  }
  EXPECT_THAT(ModelStep(false, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan")));
}

}  // namespace
}  // namespace shardd
