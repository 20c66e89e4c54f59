#include "checkpoint/hf_export.h"

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/hf_weights.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "testing/test_dir.h"
#include "model/model_util.h"
#include "model/native_spec.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::shardd::StatusIs;
using ::testing::HasSubstr;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Commits a one-file checkpoint of `spec`'s parameters with random fp32
// values (returned by name), recording the model when `record_model`.
absl::StatusOr<std::string> WriteCheckpoint(
    const v1::ModelSpec& spec, const std::string& root, bool record_model,
    std::map<std::string, std::vector<float>>* values) {
  std::mt19937 gen(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<RankTensor> pieces;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    std::vector<float>& v = (*values)[ref.fqn];
    v.resize(Numel(*ref.tensor));
    for (float& x : v) x = normal(gen);
    std::vector<int64_t> shape(ref.tensor->shape().begin(),
                               ref.tensor->shape().end());
    pieces.push_back({ref.fqn, "F32", shape, 0,
                      static_cast<int64_t>(v.size()),
                      absl::Span<const uint8_t>(
                          reinterpret_cast<const uint8_t*>(v.data()),
                          v.size() * sizeof(float))});
  }
  SHARDD_ASSIGN_OR_RETURN(std::string tmp, BeginCheckpoint(root, 5));
  SHARDD_ASSIGN_OR_RETURN(RankFile file, WriteRankFile(tmp, 0, pieces));
  CheckpointIndex index;
  index.step = 5;
  index.saved_by = {"default", 1, {{"dp_shard", 1}}};
  if (record_model) {
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    if (!google::protobuf::util::MessageToJsonString(
             spec, &index.model_spec_json, options)
             .ok()) {
      return absl::InternalError("printing the spec");
    }
  }
  SHARDD_RETURN_IF_ERROR(AddRankFile(file, &index));
  return CommitCheckpoint(root, tmp, index);
}

class HfExportTest : public ::testing::TestWithParam<const char*> {};

// Export, then read back as `train --model OUT --init-from OUT` does: the
// same model and every parameter bit for bit.
TEST_P(HfExportTest, InitFromReadsTheExportBackBitForBit) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::ModelSpec spec,
      ModelSpecFromJson(ReadText(absl::StrCat("tests/data/", GetParam()))));
  const std::string dir = testing_util::FreshTestDir();
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string checkpoint,
      WriteCheckpoint(spec, dir + "/ckpt", /*record_model=*/true, &values));
  const std::string out = dir + "/hf";
  // Small shards for one config: the index path too.
  const int64_t shard_bytes =
      std::string(GetParam()) == "tiny_mixtral.json" ? 100000 : 0;
  SHARDD_ASSERT_OK(ExportHfModel(checkpoint, out, shard_bytes));
  EXPECT_EQ(std::filesystem::exists(out + "/model.safetensors.index.json"),
            shard_bytes > 0);

  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::ModelSpec again,
                              ModelSpecFromJson(ReadText(out + "/config.json")));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(spec, again));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                              HfWeights::Open(out, again));
  EXPECT_TRUE(weights->UnusedTensors().empty());
  for (const ParamRef& ref : ListParams(again)) {
    if (!ref.tensor->tied_to().empty()) continue;
    const std::vector<float>& want = values[ref.fqn];
    std::vector<float> got(want.size());
    SHARDD_ASSERT_OK(weights->Read(ref.fqn, *ref.tensor, 0,
                                   static_cast<int64_t>(got.size()),
                                   got.data()));
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
        << ref.fqn;
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, HfExportTest,
                         ::testing::Values("tiny_llama3.json",
                                           "tiny_mixtral.json",
                                           "tiny_qwen3_moe.json",
                                           "tiny_gpt_oss.json",
                                           "tiny_diffusion_gemma.json"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string name = i.param;
                           for (char& c : name) {
                             if (c == '.') c = '_';
                           }
                           return name;
                         });

// DiffusionGemma under the released names: the folded down weights with
// per_expert_scale = 1, the encoder's layer_scalar copies, no lm_head, and
// every parameter's bytes where Hugging Face keeps them.
TEST(HfExportDiffusionGemmaTest, WritesTheReleasedNamesWithUnitScales) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::ModelSpec spec,
      ModelSpecFromJson(ReadText("tests/data/tiny_diffusion_gemma.json")));
  const std::string dir = testing_util::FreshTestDir();
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string checkpoint,
      WriteCheckpoint(spec, dir + "/ckpt", /*record_model=*/true, &values));
  SHARDD_ASSERT_OK(ExportHfModel(checkpoint, dir + "/hf"));
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<HostTensor> hf,
                              ReadHfTensors(dir + "/hf"));
  std::map<std::string, const HostTensor*> by_name;
  for (const HostTensor& t : hf) by_name[t.name] = &t;
  auto floats = [&](const std::string& name) {
    const HostTensor* t = by_name.at(name);
    EXPECT_EQ(t->dtype, "F32") << name;
    std::vector<float> v(t->bytes.size() / 4);
    std::memcpy(v.data(), t->bytes.data(), t->bytes.size());
    return v;
  };
  EXPECT_EQ(by_name.count("lm_head.weight"), 0u);
  EXPECT_EQ(by_name.count("model.embed_tokens.weight"), 0u);
  EXPECT_EQ(floats("model.decoder.embed_tokens.weight"),
            values.at("model.embed_tokens.weight"));
  EXPECT_EQ(floats("model.decoder.self_conditioning.pre_norm.weight"),
            values.at("model.self_conditioning.pre_norm.weight"));
  for (int layer = 0; layer < 3; ++layer) {
    const std::string hf_layer = absl::StrCat("model.decoder.layers.", layer, ".");
    const std::string ours = absl::StrCat("model.layers.", layer, ".");
    EXPECT_EQ(floats(hf_layer + "router.per_expert_scale"),
              std::vector<float>(8, 1.0f));
    EXPECT_EQ(floats(hf_layer + "router.proj.weight"),
              values.at(ours + "moe.gate.proj.weight"));
    EXPECT_EQ(floats(absl::StrCat("model.encoder.language_model.layers.",
                                  layer, ".layer_scalar")),
              values.at(ours + "layer_scalar"));
    // down_proj [E, D, I] holds down_projs [E, I, D] transposed per expert.
    const HostTensor* down = by_name.at(hf_layer + "experts.down_proj");
    EXPECT_EQ(down->shape, (std::vector<int64_t>{8, 64, 32}));
    const std::vector<float> d = floats(hf_layer + "experts.down_proj");
    const std::vector<float>& want = values.at(ours + "moe.experts.down_projs");
    EXPECT_EQ(d[(3 * 64 + 5) * 32 + 7], want[(3 * 32 + 7) * 64 + 5]);
    EXPECT_EQ(by_name.at(hf_layer + "experts.gate_up_proj")->shape,
              (std::vector<int64_t>{8, 64, 64}));
  }
  // Full-attention layer 2 has no v_proj.
  EXPECT_EQ(by_name.count("model.decoder.layers.2.self_attn.v_proj.weight"), 0u);
  EXPECT_EQ(by_name.count("model.decoder.layers.1.self_attn.v_proj.weight"), 1u);
}

TEST(HfExportErrorTest, NeedsARecordedModelWithItsConfig) {
  const std::string dir = testing_util::FreshTestDir();
  SHARDD_ASSERT_OK_AND_ASSIGN(
      v1::ModelSpec spec,
      ModelSpecFromJson(ReadText("tests/data/tiny_mixtral.json")));
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string unrecorded,
      WriteCheckpoint(spec, dir + "/a", /*record_model=*/false, &values));
  EXPECT_THAT(ExportHfModel(unrecorded, dir + "/out"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("consolidate --hf")));
  spec.clear_hf_config_json();  // As a native spec gives it.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string native,
      WriteCheckpoint(spec, dir + "/b", /*record_model=*/true, &values));
  EXPECT_THAT(ExportHfModel(native, dir + "/out"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("native spec")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
