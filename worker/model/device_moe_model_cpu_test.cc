// DeviceMoeModel::Create's checks that run before the device is touched,
// so they hold on machines without a GPU (and with one).

#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "testing/model_builder.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/device_moe_model.h"

namespace shardd {
namespace {

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 11, kDim = 8, kInter = 4;

// One MoE layer (no dense MLP) with `experts` experts and top_k `top_k`,
// untied head: the shared tiny MoE (testing/model_builder.h).
v1::ModelSpec OneLayerModel(int64_t experts, int top_k) {
  testing_util::TinyMoeShape shape;
  shape.vocab = kVocab;
  shape.dim = kDim;
  shape.experts = experts;
  shape.inter = kInter;
  shape.layers = 1;
  shape.top_k = top_k;
  shape.tied = false;
  shape.moe_layers = {true};
  shape.mlp_layers = {false};
  return testing_util::TinyMoeSpec(shape);
}

class DeviceMoeModelCreateTest : public ::testing::Test {
 protected:
  // Host memory: Create must fail before asking the allocator for anything.
  HostMemoryBackend backend_;
  DeviceAllocator allocator_{&backend_, nullptr};
};

TEST_F(DeviceMoeModelCreateTest, RefusesWhatTheCpuModelRefuses) {
  v1::ModelSpec spec = OneLayerModel(4, 2);
  v1::ModuleSpec* layer0 = spec.mutable_root()
                               ->mutable_children(0)
                               ->mutable_children(1)
                               ->mutable_children(0);
  AddParam(AddChild(layer0, "self_attn", v1::MODULE_ATTENTION), "q_proj",
           {kDim, kDim});
  EXPECT_THAT(DeviceMoeModel::Create(spec, {}, &allocator_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("self_attn.q_proj")));
  // A whole attention layer passes the spec checks; only the device (none
  // here) can refuse it.
  testing_util::TinyMoeShape attention;
  attention.vocab = kVocab;
  attention.dim = kDim;
  attention.layers = 1;
  attention.attention = true;
  EXPECT_THAT(DeviceMoeModel::Create(testing_util::TinyMoeSpec(attention), {},
                                     &allocator_)
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  DeviceMoeModelOptions bad_shape;
  bad_shape.model.passes = 2;
  bad_shape.model.no_grad_passes = 2;
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(4, 2), bad_shape, &allocator_)
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("no_grad_passes")));
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(4, 5), {}, &allocator_).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dims.top_k")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelCreateTest, RefusesWhatOnlyTheGpuKernelsCannotRun) {
  // The CPU path computes these; the CUDA router holds at most 1024
  // experts and top-32 per token.
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(1025, 2), {}, &allocator_).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("at most 1024 experts")));
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(64, 33), {}, &allocator_).status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("dims.top_k: the GPU router")));
  // The load-balancing loss is computed on the CPU workers only so far.
  v1::ModelSpec aux = OneLayerModel(4, 2);
  aux.mutable_dims()->set_router_aux_loss_coef(0.01);
  EXPECT_THAT(DeviceMoeModel::Create(aux, {}, &allocator_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dims.router_aux_loss_coef")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelCreateTest, RefusesDiffusionGemmaByName) {
  // The CPU model computes its causal pass (gemma_layer.h); the GPU not yet.
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(R"({
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "text_config": {"vocab_size": 11, "hidden_size": 8,
      "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 4, "global_head_dim": 8,
      "intermediate_size": 8, "moe_intermediate_size": 4, "num_experts": 4,
      "top_k_experts": 2, "sliding_window": 4, "dtype": "float32",
      "layer_types": ["sliding_attention", "full_attention"]}})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(DeviceMoeModel::Create(*spec, {}, &allocator_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("DiffusionGemma")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelCreateTest, NullAllocatorAndBadDevice) {
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(4, 2), {}, nullptr).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allocator")));
  // Without a GPU, or with one: device 4096 does not exist either way.
  DeviceMoeModelOptions options;
  options.device = 4096;
  EXPECT_THAT(DeviceMoeModel::Create(OneLayerModel(4, 2), options, &allocator_)
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  options.device = -1;
  EXPECT_THAT(
      DeviceMoeModel::Create(OneLayerModel(4, 2), options, &allocator_)
          .status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

}  // namespace
}  // namespace shardd
