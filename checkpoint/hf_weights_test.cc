#include "checkpoint/hf_weights.h"

#include <stdlib.h>

#include <cmath>
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
#include "checkpoint/hf_interop.h"
#include "checkpoint/safetensors.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "testing/test_dir.h"
#include "model/hf_config.h"
#include "model/model_util.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::shardd::StatusIs;

v1::ModelSpec SpecFromTestConfig(const std::string& name) {
  std::ifstream in(absl::StrCat("tests/data/", name));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(text.str());
  SHARDD_EXPECT_OK(spec.status());
  return *spec;
}

// A value per element that is exact in every dtype tested (a multiple of
// 1/64 below 8: 9 significant bits fit BF16's 8 + 1 only when small, so
// keep 7 bits), distinct per tensor and element so misplaced reads show.
float ValueOf(int tensor, int64_t i) {
  return static_cast<float>(((tensor * 131 + i * 7) % 255) - 127) / 32.0f;
}

void Store(const std::string& dtype, float v, uint8_t* out) {
  if (dtype == "F32") {
    std::memcpy(out, &v, 4);
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (dtype == "BF16") {
    const uint16_t h = static_cast<uint16_t>(bits >> 16);  // Exact values.
    std::memcpy(out, &h, 2);
    return;
  }
  // F16 of an exact value |v| in [2^-14, 2^15): rebias the exponent.
  uint16_t h = 0;
  if (v != 0.0f) {
    const uint32_t exp = ((bits >> 23) & 0xFF) - 112;
    h = static_cast<uint16_t>(((bits >> 16) & 0x8000) | (exp << 10) |
                              ((bits >> 13) & 0x3FF));
  }
  std::memcpy(out, &h, 2);
}

// The shardd parameters of `spec` with distinct values, as `dtype`.
std::vector<HostTensor> ShardTensors(const v1::ModelSpec& spec,
                                     const std::string& dtype,
                                     std::map<std::string, std::vector<float>>* values) {
  std::vector<HostTensor> out;
  int index = 0;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    HostTensor& t = out.emplace_back();
    t.name = ref.fqn;
    t.dtype = dtype;
    t.shape.assign(ref.tensor->shape().begin(), ref.tensor->shape().end());
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    std::vector<float>& v = (*values)[ref.fqn];
    v.resize(numel);
    const int64_t esize = SafetensorsDTypeBytes(dtype);
    t.bytes.resize(numel * esize);
    for (int64_t i = 0; i < numel; ++i) {
      v[i] = ValueOf(index, i);
      Store(dtype, v[i], t.bytes.data() + i * esize);
    }
    ++index;
  }
  return out;
}

struct Case {
  const char* config;
  HfMoeNaming naming;
  const char* dtype;
  int64_t max_shard_bytes;
};

class HfWeightsTest : public ::testing::TestWithParam<Case> {};

// Every parameter read whole and in random pieces equals the values the
// Hugging Face checkpoint was written from (through ShardToHf's renaming,
// stacking and transposes), and every piece reads exactly its own bytes.
TEST_P(HfWeightsTest, ReadsEveryRangeExactlyFromItsBytes) {
  const Case& c = GetParam();
  const v1::ModelSpec spec = SpecFromTestConfig(c.config);
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::vector<HostTensor> hf,
      ShardToHf(ShardTensors(spec, c.dtype, &values), c.naming));
  const std::string dir = testing_util::FreshTestDir();
  SHARDD_ASSERT_OK(WriteHfTensors(dir, hf, c.max_shard_bytes));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                       HfWeights::Open(dir, spec));
  EXPECT_TRUE(weights->UnusedTensors().empty());
  const int64_t esize = SafetensorsDTypeBytes(c.dtype);
  std::mt19937_64 rng(5);
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    const std::vector<float>& want = values[ref.fqn];
    const int64_t numel = static_cast<int64_t>(want.size());
    for (int trial = 0; trial < 6; ++trial) {
      int64_t begin = 0, end = numel;
      if (trial > 0) {
        begin = static_cast<int64_t>(rng() % numel);
        end = begin + 1 + static_cast<int64_t>(rng() % (numel - begin));
      }
      std::vector<float> got(end - begin, std::nanf(""));
      const int64_t before = weights->data_bytes_read();
      SHARDD_ASSERT_OK(weights->Read(ref.fqn, *ref.tensor, begin, end, got.data()));
      EXPECT_EQ(weights->data_bytes_read() - before, (end - begin) * esize)
          << ref.fqn << " [" << begin << ", " << end << ")";
      for (int64_t i = begin; i < end; ++i) {
        ASSERT_EQ(got[i - begin], want[i])
            << ref.fqn << " element " << i << " of [" << begin << ", " << end
            << ")";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Namings, HfWeightsTest,
    ::testing::Values(
        Case{"tiny_mixtral.json", HfMoeNaming::kMixtral, "BF16", 0},
        Case{"tiny_qwen3_moe.json", HfMoeNaming::kQwen3Moe, "F32", 20000},
        Case{"tiny_qwen3_moe.json", HfMoeNaming::kQwen3Moe, "F16", 0},
        Case{"tiny_llama3.json", HfMoeNaming::kNone, "BF16", 30000}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name = absl::StrCat(info.param.config, "_", info.param.dtype,
                                       info.param.max_shard_bytes ? "_sharded" : "");
      for (char& ch : name) {
        if (ch == '.' || ch == '-') ch = '_';
      }
      return name;
    });

// GPT-OSS's fused experts: gate_up_proj [E, D, 2I] interleaves gate (even
// columns) and up (odd); shardd's halves are concatenated.
TEST(HfWeightsGptOssTest, DeinterleavesFusedExperts) {
  const std::string config = R"({
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "intermediate_size": 6, "num_local_experts": 3, "num_experts_per_tok": 2,
    "max_position_embeddings": 64, "rope_theta": 10000.0,
    "sliding_window": 4, "layer_types": ["sliding_attention"],
    "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"})";
  SHARDD_ASSERT_OK_AND_ASSIGN(const v1::ModelSpec spec, ModelSpecFromHfConfig(config));
  std::map<std::string, std::vector<float>> values;
  std::vector<HostTensor> tensors = ShardTensors(spec, "F32", &values);
  // HF names and the interleaved layout.
  std::vector<HostTensor> hf;
  for (HostTensor& t : tensors) {
    const std::string prefix = "model.layers.0.moe.";
    if (t.name.rfind(prefix, 0) != 0) {
      hf.push_back(std::move(t));
      continue;
    }
    std::string rest = t.name.substr(prefix.size());
    const bool interleave = rest == "experts.gate_and_up_projs" ||
                            rest == "experts.gate_up_proj_bias";
    if (rest == "experts.gate_and_up_projs") rest = "experts.gate_up_proj";
    if (rest == "experts.down_projs") rest = "experts.down_proj";
    if (rest.rfind("gate.", 0) == 0) rest = "router." + rest.substr(5);
    t.name = "model.layers.0.mlp." + rest;
    if (interleave) {
      const int64_t len = t.shape.back(), half = len / 2;
      std::vector<float> src(t.bytes.size() / 4), dst(src.size());
      std::memcpy(src.data(), t.bytes.data(), t.bytes.size());
      for (size_t row = 0; row < src.size() / len; ++row) {
        for (int64_t j = 0; j < half; ++j) {
          dst[row * len + 2 * j] = src[row * len + j];
          dst[row * len + 2 * j + 1] = src[row * len + half + j];
        }
      }
      std::memcpy(t.bytes.data(), dst.data(), t.bytes.size());
    }
    hf.push_back(std::move(t));
  }
  const std::string dir = testing_util::FreshTestDir();
  SHARDD_ASSERT_OK(WriteHfTensors(dir, hf));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                       HfWeights::Open(dir, spec));
  EXPECT_TRUE(weights->UnusedTensors().empty());
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    const std::vector<float>& want = values[ref.fqn];
    const int64_t n = static_cast<int64_t>(want.size());
    // Whole, and a range starting and ending inside rows.
    for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, n},
                              std::pair<int64_t, int64_t>{n / 3 + 1, n - 1}}) {
      if (begin >= end) continue;
      std::vector<float> got(end - begin);
      SHARDD_ASSERT_OK(weights->Read(ref.fqn, *ref.tensor, begin, end, got.data()));
      for (int64_t i = begin; i < end; ++i) {
        ASSERT_EQ(got[i - begin], want[i]) << ref.fqn << " element " << i;
      }
    }
  }
}

// The released DiffusionGemma checkpoint's names and layouts, written here
// independently of ShardToHf: model.decoder.*, experts [E, 2I, D] and
// [E, D, I], router.per_expert_scale [E], plus tensors the text stack does
// not read (vision tower, embed_vision, the encoder's layer_scalar copies).
struct DiffusionGemmaHf {
  std::vector<HostTensor> tensors;
  std::map<std::string, std::vector<float>> want;  // By parameter.
  size_t ignored = 0;
};

HostTensor Hf(const std::string& name, const std::string& dtype,
              std::vector<int64_t> shape, const std::vector<float>& v) {
  HostTensor t{name, dtype, std::move(shape), {}};
  const int64_t esize = SafetensorsDTypeBytes(dtype);
  t.bytes.resize(v.size() * esize);
  for (size_t i = 0; i < v.size(); ++i) {
    Store(dtype, v[i], t.bytes.data() + i * esize);
  }
  return t;
}

DiffusionGemmaHf WriteDiffusionGemma(const v1::ModelSpec& spec,
                                     const std::string& dtype) {
  DiffusionGemmaHf out;
  int index = 0;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    const std::vector<int64_t> shape(ref.tensor->shape().begin(),
                                     ref.tensor->shape().end());
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    std::vector<float> v(numel);
    for (int64_t i = 0; i < numel; ++i) v[i] = ValueOf(index, i);
    ++index;
    std::vector<float>& want = out.want[ref.fqn];
    want = v;
    const std::string fqn = ref.fqn;
    const size_t moe = fqn.find(".moe.");
    if (moe == std::string::npos) {
      out.tensors.push_back(
          Hf("model.decoder." + fqn.substr(6), dtype, shape, v));
      continue;
    }
    const std::string layer = "model.decoder." + fqn.substr(6, moe - 6 + 1);
    const std::string rest = fqn.substr(moe + 5);
    if (rest == "gate.scale" || rest == "gate.proj.weight") {
      out.tensors.push_back(Hf(layer + "router." + rest.substr(5), dtype,
                               shape, v));
      continue;
    }
    // Experts: HF holds each expert's [R, C] as [C, R].
    const bool down = rest == "experts.down_projs";
    const int64_t e_count = shape[0], r_count = shape[1], c_count = shape[2];
    std::vector<float> hf(numel);
    for (int64_t e = 0; e < e_count; ++e) {
      for (int64_t r = 0; r < r_count; ++r) {
        for (int64_t c = 0; c < c_count; ++c) {
          hf[(e * c_count + c) * r_count + r] =
              v[(e * r_count + r) * c_count + c];
        }
      }
    }
    out.tensors.push_back(Hf(layer + (down ? "experts.down_proj"
                                           : "experts.gate_up_proj"),
                             dtype, {e_count, c_count, r_count}, hf));
    if (down) {
      // Scales other than 1 so the fold shows; the expected values are the
      // fp32 products the reader must compute.
      std::vector<float> scale(e_count);
      for (int64_t e = 0; e < e_count; ++e) scale[e] = 0.5f + 0.25f * e;
      for (int64_t i = 0; i < numel; ++i) {
        want[i] = v[i] * scale[i / (r_count * c_count)];
      }
      out.tensors.push_back(
          Hf(layer + "router.per_expert_scale", dtype, {e_count}, scale));
      // The encoder's copy of the layer's buffer.
      const std::string n = fqn.substr(13, moe - 13);  // Layer index.
      out.tensors.push_back(
          Hf("model.encoder.language_model.layers." + n + ".layer_scalar",
             dtype, {1}, {1.0f}));
      ++out.ignored;
    }
  }
  for (const char* name :
       {"model.encoder.vision_tower.encoder.layers.0.mlp.down_proj.linear."
        "weight",
        "model.encoder.vision_tower.patch_embedder.position_embedding_table",
        "model.encoder.embed_vision.embedding_projection.weight"}) {
    out.tensors.push_back(Hf(name, dtype, {2, 3}, std::vector<float>(6, 1.0f)));
    ++out.ignored;
  }
  return out;
}

class HfWeightsDiffusionGemmaTest
    : public ::testing::TestWithParam<std::pair<const char*, int64_t>> {};

// Every range of every parameter equals the released tensors' values
// (renamed, transposed, down_projs times per_expert_scale), reading exactly
// its own bytes plus, for down_projs, one scale element per expert touched.
TEST_P(HfWeightsDiffusionGemmaTest, ReadsTheReleasedNamesAndFoldsTheScale) {
  const std::string dtype = GetParam().first;
  const v1::ModelSpec spec = SpecFromTestConfig("tiny_diffusion_gemma.json");
  const DiffusionGemmaHf hf = WriteDiffusionGemma(spec, dtype);
  const std::string dir = testing_util::FreshTestDir();
  SHARDD_ASSERT_OK(WriteHfTensors(dir, hf.tensors, GetParam().second));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                              HfWeights::Open(dir, spec));
  EXPECT_TRUE(weights->UnusedTensors().empty())
      << weights->UnusedTensors().front();
  EXPECT_EQ(weights->IgnoredTensors().size(), hf.ignored);
  const int64_t esize = SafetensorsDTypeBytes(dtype);
  std::mt19937_64 rng(17);
  int scaled = 0;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    const std::vector<float>& want = hf.want.at(ref.fqn);
    const int64_t numel = static_cast<int64_t>(want.size());
    const bool down = ref.fqn.find("down_projs") != std::string::npos;
    scaled += down;
    const int64_t per_expert = down ? numel / ref.tensor->shape(0) : 0;
    for (int trial = 0; trial < 8; ++trial) {
      int64_t begin = 0, end = numel;
      if (trial > 0) {
        begin = static_cast<int64_t>(rng() % numel);
        end = begin + 1 + static_cast<int64_t>(rng() % (numel - begin));
      }
      std::vector<float> got(end - begin, std::nanf(""));
      const int64_t before = weights->data_bytes_read();
      SHARDD_ASSERT_OK(
          weights->Read(ref.fqn, *ref.tensor, begin, end, got.data()));
      const int64_t scale_bytes =
          down ? ((end - 1) / per_expert - begin / per_expert + 1) * esize : 0;
      EXPECT_EQ(weights->data_bytes_read() - before,
                (end - begin) * esize + scale_bytes)
          << ref.fqn << " [" << begin << ", " << end << ")";
      for (int64_t i = begin; i < end; ++i) {
        ASSERT_EQ(got[i - begin], want[i])
            << ref.fqn << " element " << i << " of [" << begin << ", " << end
            << ")";
      }
    }
  }
  EXPECT_EQ(scaled, 3);
}

INSTANTIATE_TEST_SUITE_P(
    DTypes, HfWeightsDiffusionGemmaTest,
    ::testing::Values(std::make_pair("BF16", int64_t{0}),
                      std::make_pair("F32", int64_t{40000})),
    [](const auto& info) {
      return absl::StrCat(info.param.first,
                          info.param.second ? "_sharded" : "");
    });

// A Hugging Face checkpoint held as tensors, written and opened for a spec:
// what the error tests edit before opening.
class HfCheckpointFixture : public ::testing::Test {
 protected:
  absl::Status OpenWith(const std::vector<HostTensor>& tensors) {
    std::filesystem::remove_all(dir_);
    SHARDD_RETURN_IF_ERROR(WriteHfTensors(dir_, tensors));
    return HfWeights::Open(dir_, spec_).status();
  }
  std::vector<HostTensor> Without(const std::string& name) {
    std::vector<HostTensor> out;
    for (const HostTensor& t : hf_) {
      if (t.name != name) out.push_back(t);
    }
    EXPECT_EQ(out.size() + 1, hf_.size()) << name;
    return out;
  }
  HostTensor* Tensor(const std::string& name) {
    for (HostTensor& t : hf_) {
      if (t.name == name) return &t;
    }
    ADD_FAILURE() << "no " << name;
    return &hf_[0];
  }

  v1::ModelSpec spec_;
  std::vector<HostTensor> hf_;
  std::string dir_;
};

class HfWeightsDiffusionGemmaErrorTest : public HfCheckpointFixture {
 protected:
  void SetUp() override {
    spec_ = SpecFromTestConfig("tiny_diffusion_gemma.json");
    hf_ = WriteDiffusionGemma(spec_, "F32").tensors;
    dir_ = testing_util::FreshTestDir();
  }
};

TEST_F(HfWeightsDiffusionGemmaErrorTest, MissingTensorsNameThemAndTheParameter) {
  const std::string scale = "model.decoder.layers.1.router.per_expert_scale";
  EXPECT_THAT(OpenWith(Without(scale)),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(scale),
                             HasSubstr("model.layers.1.moe.experts.down_projs"),
                             HasSubstr(dir_))));
  EXPECT_THAT(
      OpenWith(Without("model.decoder.layers.2.self_attn.k_norm.weight")),
      StatusIs(absl::StatusCode::kNotFound,
               HasSubstr("model.decoder.layers.2.self_attn.k_norm.weight")));
}

TEST_F(HfWeightsDiffusionGemmaErrorTest, WrongShapesNameTensorFileAndBothShapes) {
  // (tiny_diffusion_gemma has D = 2I = 64, so both gate/up layouts agree.)
  HostTensor* gu = Tensor("model.decoder.layers.0.experts.gate_up_proj");
  gu->shape = {8, 128, 32};
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("experts.gate_up_proj"),
                             HasSubstr("model.safetensors"),
                             HasSubstr("[8, 128, 32]"), HasSubstr("[8, 64, 64]"),
                             HasSubstr("each expert transposed"))));
  SetUp();
  HostTensor* dn = Tensor("model.decoder.layers.0.experts.down_proj");
  dn->shape = {8, 32, 64};  // [E, I, D] for [E, D, I].
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("experts.down_proj"),
                             HasSubstr("model.safetensors"),
                             HasSubstr("[8, 32, 64]"),
                             HasSubstr("[8, 64, 32]"))));
  SetUp();
  HostTensor* scale = Tensor("model.decoder.layers.2.router.per_expert_scale");
  scale->shape = {4};
  scale->bytes.resize(16);
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("router.per_expert_scale"),
                             HasSubstr("model.safetensors"), HasSubstr("[4]"),
                             HasSubstr("[8]"))));
}

// An unexpected tensor is still reported; only the known ones are ignored.
TEST_F(HfWeightsDiffusionGemmaErrorTest, UnusedListsOnlyTheUnexpected) {
  HostTensor extra = *Tensor("model.decoder.norm.weight");
  extra.name = "model.encoder.language_model.norm.weight";
  hf_.push_back(extra);
  SHARDD_ASSERT_OK(WriteHfTensors(dir_, hf_));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                              HfWeights::Open(dir_, spec_));
  EXPECT_EQ(weights->UnusedTensors(),
            std::vector<std::string>{"model.encoder.language_model.norm.weight"});
  EXPECT_EQ(weights->IgnoredTensors().size(), 6u);
}

TEST(HfWeightsF16Test, ConvertsEveryClassOfValue) {
  // 1, the smallest subnormal, the largest subnormal, the smallest normal
  // (negative), the largest finite, -0, +inf.
  const uint16_t bits[] = {0x3C00, 0x0001, 0x03FF, 0x8400,
                           0x7BFF, 0x8000, 0x7C00};
  const float want[] = {1.0f,
                        std::ldexp(1.0f, -24),
                        std::ldexp(1023.0f, -24),
                        -std::ldexp(1.0f, -14),
                        65504.0f,
                        -0.0f,
                        INFINITY};
  const std::string dir = testing_util::FreshTestDir();
  HostTensor t{"model.norm.weight", "F16", {7}, {}};
  t.bytes.resize(14);
  std::memcpy(t.bytes.data(), bits, 14);
  SHARDD_ASSERT_OK(WriteHfTensors(dir, {t}));
  v1::ModelSpec spec;
  v1::ModuleSpec* model = spec.mutable_root()->add_children();
  model->set_name("model");
  v1::ModuleSpec* norm = model->add_children();
  norm->set_name("norm");
  v1::TensorSpec* w = norm->add_params();
  w->set_name("weight");
  w->add_shape(7);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HfWeights> weights,
                       HfWeights::Open(dir, spec));
  float got[7];
  SHARDD_ASSERT_OK(weights->Read("model.norm.weight", *w, 0, 7, got));
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
        << i << ": " << got[i] << " vs " << want[i];
  }
}

class HfWeightsErrorTest : public HfCheckpointFixture {
 protected:
  void SetUp() override {
    spec_ = SpecFromTestConfig("tiny_mixtral.json");
    std::map<std::string, std::vector<float>> values;
    absl::StatusOr<std::vector<HostTensor>> hf =
        ShardToHf(ShardTensors(spec_, "BF16", &values), HfMoeNaming::kMixtral);
    SHARDD_ASSERT_OK(hf.status());
    hf_ = *hf;
    dir_ = testing_util::FreshTestDir();
  }
};

TEST_F(HfWeightsErrorTest, MissingTensorNamesItAndTheCheckpoint) {
  std::vector<HostTensor> without;
  for (const HostTensor& t : hf_) {
    if (t.name != "model.layers.1.self_attn.k_proj.weight") without.push_back(t);
  }
  EXPECT_THAT(OpenWith(without),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("model.layers.1.self_attn.k_proj.weight"),
                             HasSubstr(dir_))));
  without.clear();
  for (const HostTensor& t : hf_) {
    if (t.name != "model.layers.0.block_sparse_moe.experts.5.w3.weight") {
      without.push_back(t);
    }
  }
  EXPECT_THAT(OpenWith(without),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr("experts.5.w3.weight"),
                             HasSubstr("expert 5 of 8"))));
}

TEST_F(HfWeightsErrorTest, WrongShapeNamesTensorFileAndBothShapes) {
  HostTensor* t = Tensor("model.layers.0.block_sparse_moe.experts.2.w2.weight");
  t->shape = {48, 64};  // [I, D] instead of [D, I].
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("experts.2.w2.weight"),
                             HasSubstr("model.safetensors"),
                             HasSubstr("[48, 64]"), HasSubstr("[64, 48]"))));
  SetUp();
  t = Tensor("model.norm.weight");
  t->shape = {32};
  t->bytes.resize(64);
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.norm.weight"), HasSubstr("[32]"),
                             HasSubstr("[64]"))));
}

TEST_F(HfWeightsErrorTest, WrongDTypeAndExtraExperts) {
  HostTensor* t = Tensor("model.embed_tokens.weight");
  t->dtype = "I16";
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.embed_tokens.weight"),
                             HasSubstr("I16"), HasSubstr("F32, BF16 or F16"))));
  SetUp();
  HostTensor extra = *Tensor("model.layers.1.block_sparse_moe.experts.0.w1.weight");
  extra.name = "model.layers.1.block_sparse_moe.experts.8.w1.weight";
  hf_.push_back(extra);
  EXPECT_THAT(OpenWith(hf_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("experts.8.w1.weight"),
                             HasSubstr("more experts"))));
}

TEST(HfWeightsOpenTest, NoCheckpoint) {
  EXPECT_THAT(HfWeights::Open(testing_util::FreshTestDir(), v1::ModelSpec()).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("model.safetensors")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
