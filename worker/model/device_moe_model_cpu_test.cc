// DeviceMoeModel::Create's checks that run before the device is touched,
// so they hold on machines without a GPU (and with one).

#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "testing/model_builder.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/device_moe_model.h"

namespace shardd {
namespace {

using ::shardd::testing_util::AddChild;
using ::shardd::testing_util::AddParam;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 11, kDim = 8, kInter = 4;

// One MoE layer with `experts` experts and top_k `top_k`.
v1::ModelSpec OneLayerModel(int64_t experts, int top_k) {
  v1::ModelSpec spec;
  spec.set_architecture("ShardMoEForCausalLM");
  spec.set_dtype(v1::FLOAT32);
  spec.mutable_dims()->set_top_k(top_k);
  spec.mutable_dims()->set_activation(v1::SWIGLU);
  v1::ModuleSpec* root = spec.mutable_root();
  root->set_kind(v1::MODULE_MODEL);
  v1::ModuleSpec* model = AddChild(root, "model", v1::MODULE_GENERIC);
  AddParam(AddChild(model, "embed_tokens", v1::MODULE_EMBEDDING), "weight",
           {kVocab, kDim});
  v1::ModuleSpec* layers = AddChild(model, "layers", v1::MODULE_LAYER_LIST);
  v1::ModuleSpec* layer = AddChild(layers, "0", v1::MODULE_DECODER_LAYER);
  AddParam(AddChild(layer, "input_layernorm", v1::MODULE_NORM), "weight",
           {kDim});
  v1::ModuleSpec* moe = AddChild(layer, "moe", v1::MODULE_MOE);
  AddParam(AddChild(moe, "gate", v1::MODULE_ROUTER), "weight", {experts, kDim});
  v1::ModuleSpec* ex = AddChild(moe, "experts", v1::MODULE_GROUPED_EXPERTS);
  AddParam(ex, "gate_and_up_projs", {experts, kDim, 2 * kInter});
  AddParam(ex, "down_projs", {experts, kInter, kDim});
  AddParam(AddChild(model, "norm", v1::MODULE_NORM), "weight", {kDim});
  AddParam(AddChild(root, "lm_head", v1::MODULE_LM_HEAD), "weight",
           {kVocab, kDim});
  return spec;
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
  EXPECT_THAT(
      DeviceMoeModel::Create(spec, {}, &allocator_).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no attention")));

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
