// DeviceMoeModel::Create's checks that run before the device is touched,
// so they hold on machines without a GPU (and with one).

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
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
using ::testing::AllOf;
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
  EXPECT_EQ(backend_.mallocs(), 0);
}

// Device 4096 exists on no machine: a spec the GPU model computes gets past
// every spec check to the device's FAILED_PRECONDITION, with or without a
// GPU; one it refuses fails before, naming what it cannot compute.
class DeviceMoeModelHfSpecTest : public DeviceMoeModelCreateTest {
 protected:
  static std::string ReadConfig(const std::string& file) {
    std::ifstream in("tests/data/" + file);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_FALSE(ss.str().empty()) << file;
    return ss.str();
  }
  absl::Status CreateFromConfig(const std::string& file,
                                const MoeModelOptions& shape = {}) {
    return CreateFromJson(ReadConfig(file), shape);
  }
  absl::Status CreateFromJson(const std::string& json,
                              const MoeModelOptions& shape = {}) {
    absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(json);
    if (!spec.ok()) return spec.status();
    DeviceMoeModelOptions options;
    options.model = shape;
    options.device = 4096;
    return DeviceMoeModel::Create(*spec, options, &allocator_).status();
  }
};

TEST_F(DeviceMoeModelHfSpecTest, ComputesGptOssAndTheLoadBalancingLoss) {
  // Attention biases, sinks, the top-k-then-softmax router with its bias,
  // clamped SwiGLU experts with biases.
  EXPECT_THAT(
      CreateFromConfig("tiny_gpt_oss.json"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  EXPECT_THAT(
      CreateFromConfig("tiny_gpt_oss_aux.json"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  EXPECT_THAT(
      CreateFromConfig("tiny_mixtral_aux.json"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  v1::ModelSpec aux = OneLayerModel(4, 2);
  aux.mutable_dims()->set_router_aux_loss_coef(0.01);
  DeviceMoeModelOptions options;
  options.device = 4096;
  EXPECT_THAT(
      DeviceMoeModel::Create(aux, options, &allocator_).status(),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelHfSpecTest, AcceptsDeepSeekV3) {
  // Latent attention, the sigmoid group-limited router, shared experts and
  // dense first layers pass every spec check; only the device is missing.
  EXPECT_THAT(
      CreateFromConfig("tiny_deepseek_v3.json"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelHfSpecTest, AcceptsDiffusionGemmaStepsTheGpuComputes) {
  // The causal pass and the block-diffusion step pass every spec check;
  // only the device is missing.
  EXPECT_THAT(
      CreateFromConfig("tiny_diffusion_gemma.json"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  MoeModelOptions diffusion;
  diffusion.passes = 3;
  diffusion.no_grad_passes = 1;
  EXPECT_THAT(
      CreateFromConfig("tiny_diffusion_gemma.json", diffusion),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  // Any other step shape is refused by name, as on the CPU.
  MoeModelOptions two;
  two.passes = 2;
  two.no_grad_passes = 1;
  EXPECT_THAT(CreateFromConfig("tiny_diffusion_gemma.json", two),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block-diffusion step")));
  // A response of negative length names the field.
  diffusion.diffusion.response_length = -1;
  EXPECT_THAT(CreateFromConfig("tiny_diffusion_gemma.json", diffusion),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("train.diffusion.response_length")));
  EXPECT_EQ(backend_.mallocs(), 0);
}

TEST_F(DeviceMoeModelHfSpecTest, TakesHeadDimsUpTo512) {
  // The released 26B model's full layers have global_head_dim 512: accepted
  // (only the device is missing); wider heads are refused by name.
  const std::string json = ReadConfig("diffusion_gemma_26b.json");
  EXPECT_THAT(
      CreateFromJson(json),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("device")));
  const std::string wider = absl::StrReplaceAll(
      json, {{"\"global_head_dim\": 512", "\"global_head_dim\": 640"}});
  ASSERT_NE(wider, json);
  EXPECT_THAT(CreateFromJson(wider),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("self_attn"), HasSubstr("640"),
                             HasSubstr("512"))));
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
