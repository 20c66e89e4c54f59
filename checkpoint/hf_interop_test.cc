#include "checkpoint/hf_interop.h"

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "testing/test_dir.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/file_util.h"
#include "checkpoint/safetensors.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kHidden = 6, kInter = 4, kExperts = 3, kVocab = 11;

HostTensor Random(const std::string& name, const std::string& dtype,
                  std::vector<int64_t> shape, std::mt19937_64* rng) {
  HostTensor t{name, dtype, std::move(shape), {}};
  int64_t numel = 1;
  for (int64_t d : t.shape) numel *= d;
  // Arbitrary bit patterns (NaNs, denormals): the copy must be bit exact.
  t.bytes.resize(numel * SafetensorsDTypeBytes(dtype));
  for (uint8_t& b : t.bytes) b = static_cast<uint8_t>((*rng)());
  return t;
}

// A small HF MoE checkpoint: 2 layers; with Qwen3 naming layer 0 is dense
// (gate_proj/up_proj/down_proj under mlp, as mlp_only_layers makes it).
std::vector<HostTensor> SyntheticHf(HfMoeNaming naming,
                                    const std::string& dtype) {
  std::mt19937_64 rng(naming == HfMoeNaming::kMixtral ? 7 : 11);
  const bool mixtral = naming == HfMoeNaming::kMixtral;
  const std::string moe = mixtral ? "block_sparse_moe" : "mlp";
  const char* proj[3] = {mixtral ? "w1" : "gate_proj",
                         mixtral ? "w3" : "up_proj",
                         mixtral ? "w2" : "down_proj"};
  std::vector<HostTensor> t;
  t.push_back(
      Random("model.embed_tokens.weight", dtype, {kVocab, kHidden}, &rng));
  t.push_back(Random("model.norm.weight", dtype, {kHidden}, &rng));
  t.push_back(Random("lm_head.weight", dtype, {kVocab, kHidden}, &rng));
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t.push_back(Random(p + "input_layernorm.weight", dtype, {kHidden}, &rng));
    t.push_back(
        Random(p + "self_attn.q_proj.weight", dtype, {8, kHidden}, &rng));
    if (!mixtral && l == 0) {
      t.push_back(
          Random(p + "mlp.gate_proj.weight", dtype, {5, kHidden}, &rng));
      t.push_back(Random(p + "mlp.up_proj.weight", dtype, {5, kHidden}, &rng));
      t.push_back(
          Random(p + "mlp.down_proj.weight", dtype, {kHidden, 5}, &rng));
      continue;
    }
    t.push_back(
        Random(p + moe + ".gate.weight", dtype, {kExperts, kHidden}, &rng));
    for (int e = 0; e < kExperts; ++e) {
      const std::string x = absl::StrCat(p, moe, ".experts.", e, ".");
      t.push_back(
          Random(x + proj[0] + ".weight", dtype, {kInter, kHidden}, &rng));
      t.push_back(
          Random(x + proj[1] + ".weight", dtype, {kInter, kHidden}, &rng));
      t.push_back(
          Random(x + proj[2] + ".weight", dtype, {kHidden, kInter}, &rng));
    }
  }
  std::sort(t.begin(), t.end(), [](const HostTensor& a, const HostTensor& b) {
    return a.name < b.name;
  });
  return t;
}

std::map<std::string, const HostTensor*> ByName(
    const std::vector<HostTensor>& tensors) {
  std::map<std::string, const HostTensor*> out;
  for (const HostTensor& t : tensors) out[t.name] = &t;
  return out;
}

void ExpectSameTensors(const std::vector<HostTensor>& a,
                       const std::vector<HostTensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].dtype, b[i].dtype) << a[i].name;
    EXPECT_EQ(a[i].shape, b[i].shape) << a[i].name;
    EXPECT_TRUE(a[i].bytes == b[i].bytes) << a[i].name << " differs";
  }
}

std::string FileBytes(const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(path, 1 << 24);
  EXPECT_THAT(s, IsOk());
  return s.ok() ? *s : "";
}

// Element (e, row, col) of a [E, rows, cols] tensor or (row, col) of a 2-D
// one, as raw bytes.
std::string At(const HostTensor& t, int64_t index) {
  const int64_t esize = SafetensorsDTypeBytes(t.dtype);
  return std::string(
      reinterpret_cast<const char*>(t.bytes.data()) + index * esize, esize);
}

// The stacked layout: gate_and_up[e][d][i] = gate_e[i][d],
// gate_and_up[e][d][I + i] = up_e[i][d], down[e][i][d] = down_e[d][i].
void ExpectStacked(const std::vector<HostTensor>& hf,
                   const std::vector<HostTensor>& shardd,
                   const std::string& hf_moe, const char* const proj[3],
                   int layer) {
  auto h = ByName(hf);
  auto s = ByName(shardd);
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const HostTensor* gu = s.at(p + "moe.experts.gate_and_up_projs");
  const HostTensor* dn = s.at(p + "moe.experts.down_projs");
  EXPECT_EQ(gu->shape, std::vector<int64_t>({kExperts, kHidden, 2 * kInter}));
  EXPECT_EQ(dn->shape, std::vector<int64_t>({kExperts, kInter, kHidden}));
  EXPECT_TRUE(s.at(p + "moe.gate.weight")->bytes ==
              h.at(p + hf_moe + ".gate.weight")->bytes);
  for (int64_t e = 0; e < kExperts; ++e) {
    const std::string x = absl::StrCat(p, hf_moe, ".experts.", e, ".");
    const HostTensor* gate = h.at(x + proj[0] + ".weight");
    const HostTensor* up = h.at(x + proj[1] + ".weight");
    const HostTensor* down = h.at(x + proj[2] + ".weight");
    for (int64_t d = 0; d < kHidden; ++d) {
      for (int64_t i = 0; i < kInter; ++i) {
        const int64_t row = (e * kHidden + d) * 2 * kInter;
        ASSERT_EQ(At(*gu, row + i), At(*gate, i * kHidden + d));
        ASSERT_EQ(At(*gu, row + kInter + i), At(*up, i * kHidden + d));
        ASSERT_EQ(At(*dn, (e * kInter + i) * kHidden + d),
                  At(*down, d * kInter + i));
      }
    }
  }
}

TEST(HfInteropTest, Qwen3Bf16RoundTripIsBitExact) {
  const std::vector<HostTensor> hf =
      SyntheticHf(HfMoeNaming::kQwen3Moe, "BF16");
  const std::string in = testing_util::FreshTestDir("in");
  SHARDD_ASSERT_OK(WriteHfTensors(in, hf));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> read, ReadHfTensors(in));
  ExpectSameTensors(read, hf);

  HfMoeNaming naming = HfMoeNaming::kNone;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> shardd,
                              HfToShardd(read, &naming));
  EXPECT_EQ(naming, HfMoeNaming::kQwen3Moe);
  const char* proj[3] = {"gate_proj", "up_proj", "down_proj"};
  ExpectStacked(hf, shardd, "mlp", proj, 1);
  auto s = ByName(shardd);
  EXPECT_EQ(s.count("model.layers.0.mlp.gate_proj.weight"), 1u);  // Dense.
  EXPECT_EQ(s.count("model.layers.1.mlp.experts.0.up_proj.weight"), 0u);
  EXPECT_EQ(shardd.size(), hf.size() - 3 * kExperts + 2);

  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back,
                              ShardToHf(shardd, HfMoeNaming::kQwen3Moe));
  ExpectSameTensors(back, hf);
  const std::string out = testing_util::FreshTestDir("out");
  SHARDD_ASSERT_OK(WriteHfTensors(out, back));
  // Same tensors, same order, same metadata: the very same file.
  EXPECT_EQ(FileBytes(out + "/model.safetensors"),
            FileBytes(in + "/model.safetensors"));
}

TEST(HfInteropTest, MixtralF32ShardedRoundTripIsBitExact) {
  const std::vector<HostTensor> hf = SyntheticHf(HfMoeNaming::kMixtral, "F32");
  const std::string in = testing_util::FreshTestDir("in");
  SHARDD_ASSERT_OK(WriteHfTensors(in, hf, /*max_shard_bytes=*/600));
  EXPECT_TRUE(std::filesystem::exists(in + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(in + "/model.safetensors"));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> read, ReadHfTensors(in));
  ExpectSameTensors(read, hf);

  HfMoeNaming naming = HfMoeNaming::kNone;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> shardd,
                              HfToShardd(read, &naming));
  EXPECT_EQ(naming, HfMoeNaming::kMixtral);
  const char* proj[3] = {"w1", "w3", "w2"};
  ExpectStacked(hf, shardd, "block_sparse_moe", proj, 0);
  ExpectStacked(hf, shardd, "block_sparse_moe", proj, 1);

  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back,
                              ShardToHf(shardd, HfMoeNaming::kMixtral));
  ExpectSameTensors(back, hf);
  const std::string out = testing_util::FreshTestDir("out");
  SHARDD_ASSERT_OK(WriteHfTensors(out, back, 600));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::vector<HostTensor> reread,
      ReadHfTensors(out + "/model.safetensors.index.json"));
  ExpectSameTensors(reread, hf);
  EXPECT_EQ(FileBytes(out + "/model.safetensors.index.json"),
            FileBytes(in + "/model.safetensors.index.json"));
}

TEST(HfInteropTest, EveryElementSizeTransposesExactly) {
  for (const char* dtype : {"U8", "F16", "F32", "F64"}) {
    const std::vector<HostTensor> hf =
        SyntheticHf(HfMoeNaming::kMixtral, dtype);
    SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> shardd, HfToShardd(hf));
    const char* proj[3] = {"w1", "w3", "w2"};
    ExpectStacked(hf, shardd, "block_sparse_moe", proj, 1);
    SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back,
                                ShardToHf(shardd, HfMoeNaming::kMixtral));
    ExpectSameTensors(back, hf);
  }
}

TEST(HfInteropTest, ThroughAShardedCheckpointAndBack) {
  const std::vector<HostTensor> hf =
      SyntheticHf(HfMoeNaming::kQwen3Moe, "BF16");
  const std::string in = testing_util::FreshTestDir("in");
  SHARDD_ASSERT_OK(WriteHfTensors(in, hf, 500));
  const std::string root = testing_util::FreshTestDir("ckpt");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string path,
                              ImportHfToCheckpoint(in, root, 0));
  EXPECT_EQ(path, root + "/step-00000000");

  // A rank of a 2-way dim-0 layout reads only its expert rows: rows
  // [2, 3) (expert 2) of gate_and_up_projs [3, 6, 8].
  SHARDD_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::Open(path));
  const TensorRecord* gu =
      reader->FindTensor("model.layers.1.moe.experts.gate_and_up_projs");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->dtype, "BF16");
  std::vector<uint16_t> expert2(kHidden * 2 * kInter);
  SHARDD_ASSERT_OK(reader->ReadElements(
      "model.layers.1.moe.experts.gate_and_up_projs", 2 * kHidden * 2 * kInter,
      3 * kHidden * 2 * kInter, expert2.data()));
  EXPECT_EQ(reader->data_bytes_read(), kHidden * 2 * kInter * 2);
  auto h = ByName(hf);
  const HostTensor* up2 = h.at("model.layers.1.mlp.experts.2.up_proj.weight");
  for (int64_t d = 0; d < kHidden; ++d) {
    for (int64_t i = 0; i < kInter; ++i) {
      uint16_t want;
      memcpy(&want, up2->bytes.data() + 2 * (i * kHidden + d), 2);
      ASSERT_EQ(expert2[d * 2 * kInter + kInter + i], want);
    }
  }

  const std::string out = testing_util::FreshTestDir("out");
  SHARDD_ASSERT_OK(
      ExportCheckpointToHf(path, HfMoeNaming::kQwen3Moe, out, 500));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back, ReadHfTensors(out));
  ExpectSameTensors(back, hf);
  for (const auto& entry : std::filesystem::directory_iterator(in)) {
    const std::string name = entry.path().filename().string();
    EXPECT_EQ(FileBytes(out + "/" + name), FileBytes(in + "/" + name)) << name;
  }
}

std::vector<HostTensor> Without(std::vector<HostTensor> t,
                                const std::string& name) {
  t.erase(std::remove_if(t.begin(), t.end(),
                         [&](const HostTensor& x) { return x.name == name; }),
          t.end());
  return t;
}

TEST(HfInteropTest, ImportRejectsInconsistentExperts) {
  const std::vector<HostTensor> hf = SyntheticHf(HfMoeNaming::kQwen3Moe, "F32");
  EXPECT_THAT(
      HfToShardd(Without(hf, "model.layers.1.mlp.experts.1.up_proj.weight")),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("\"model.layers.1.mlp.experts.1.up_proj.weight\" is "
                         "missing")));
  // Experts 0 and 2 only: numbering has a hole.
  std::vector<HostTensor> hole = hf;
  for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
    hole = Without(hole,
                   absl::StrCat("model.layers.1.mlp.experts.1.", p, ".weight"));
  }
  EXPECT_THAT(HfToShardd(hole),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("experts.1.gate_proj.weight\" is missing")));
  std::vector<HostTensor> shape = hf;
  for (HostTensor& t : shape) {
    if (t.name == "model.layers.1.mlp.experts.2.down_proj.weight") {
      t.shape = {kInter, kHidden};
    }
  }
  EXPECT_THAT(HfToShardd(shape),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("experts.2.down_proj.weight\": F32 [4, 6], "
                                 "expected F32 [6, 4]")));
  std::vector<HostTensor> bias = hf;
  bias.push_back({"model.layers.1.mlp.experts.0.up_proj.bias",
                  "F32",
                  {4},
                  std::vector<uint8_t>(16)});
  EXPECT_THAT(HfToShardd(bias),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unsupported per-expert tensor")));
  std::vector<HostTensor> mixed = hf;
  mixed.push_back({"model.layers.1.block_sparse_moe.gate.weight",
                   "F32",
                   {kExperts, kHidden},
                   std::vector<uint8_t>(kExperts * kHidden * 4)});
  EXPECT_THAT(HfToShardd(mixed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("uses Mixtral naming but")));
  std::vector<HostTensor> clash = hf;
  clash.push_back(
      {"model.layers.1.moe.gate.weight", "F32", {1}, std::vector<uint8_t>(4)});
  EXPECT_THAT(HfToShardd(clash),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("two tensors have this name")));
}

TEST(HfInteropTest, ExportRejectsWhatHfCannotHold) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::vector<HostTensor> shardd,
      HfToShardd(SyntheticHf(HfMoeNaming::kMixtral, "BF16")));
  EXPECT_THAT(ShardToHf(shardd, HfMoeNaming::kNone),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("need an HF naming")));
  EXPECT_THAT(
      ShardToHf(Without(shardd, "model.layers.0.moe.experts.down_projs"),
                HfMoeNaming::kMixtral),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("model.layers.0.moe.experts.down_projs is missing")));
  std::vector<HostTensor> bias = shardd;
  bias.push_back({"model.layers.0.moe.experts.down_proj_bias",
                  "BF16",
                  {kExperts, kHidden},
                  std::vector<uint8_t>(kExperts * kHidden * 2)});
  EXPECT_THAT(ShardToHf(bias, HfMoeNaming::kMixtral),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("has no Hugging Face counterpart")));
  std::vector<HostTensor> shape = shardd;
  for (HostTensor& t : shape) {
    if (t.name == "model.layers.1.moe.experts.down_projs") {
      t.shape = {kExperts, kHidden, kInter};
    }
  }
  EXPECT_THAT(ShardToHf(shape, HfMoeNaming::kMixtral),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("[E, D, 2I] and [E, I, D]")));
}

TEST(HfInteropTest, ReadRejectsBadCheckpoints) {
  EXPECT_THAT(ReadHfTensors(testing_util::FreshTestDir("empty")),
              StatusIs(absl::StatusCode::kNotFound));
  const std::string dir = testing_util::FreshTestDir("bad");
  const std::vector<HostTensor> hf = SyntheticHf(HfMoeNaming::kMixtral, "F32");
  SHARDD_ASSERT_OK(WriteHfTensors(dir, hf, 600));
  const std::string index = dir + "/model.safetensors.index.json";
  SHARDD_ASSERT_OK(WriteStringToFile(
      index, R"({"weight_map": {"lm_head.weight": "../model.safetensors"}})"));
  EXPECT_THAT(ReadHfTensors(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("plain name")));
  std::string first_shard;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("model-00001-of-", 0) == 0) first_shard = name;
  }
  ASSERT_FALSE(first_shard.empty());
  // The index misses the file's real tensors.
  SHARDD_ASSERT_OK(WriteStringToFile(
      index,
      absl::StrCat(R"({"weight_map": {"nope": ")", first_shard, R"("}})")));
  EXPECT_THAT(ReadHfTensors(dir),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("is not listed for this file")));
  SHARDD_ASSERT_OK(WriteStringToFile(index, R"({"metadata": {}})"));
  EXPECT_THAT(ReadHfTensors(dir),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("weight_map")));
}

// DiffusionGemma: renamed under model.decoder., experts transposed per
// expert, per_expert_scale written as 1.0 in the tensors' dtype (BF16 here),
// the encoder's layer_scalar copy, lm_head dropped; a moe tensor without a
// Hugging Face counterpart is refused by name.
TEST(ShardToHfDiffusionGemmaTest, NamesLayoutsAndUnitScale) {
  auto bf16 = [](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    HostTensor t{name, "BF16", shape, std::vector<uint8_t>(2 * n)};
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t v = static_cast<uint16_t>(i + 1);
      std::memcpy(t.bytes.data() + 2 * i, &v, 2);
    }
    return t;
  };
  std::vector<HostTensor> shardd = {
      bf16("model.layers.3.moe.experts.down_projs", {2, 3, 4}),
      bf16("model.layers.3.moe.gate.proj.weight", {2, 4}),
      bf16("model.layers.3.layer_scalar", {1}),
      bf16("model.norm.weight", {4}),
      bf16("lm_head.weight", {5, 4})};
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::vector<HostTensor> hf,
      ShardToHf(shardd, HfMoeNaming::kDiffusionGemma));
  std::vector<std::string> names;
  for (const HostTensor& t : hf) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model.decoder.layers.3.experts.down_proj",
                       "model.decoder.layers.3.layer_scalar",
                       "model.decoder.layers.3.router.per_expert_scale",
                       "model.decoder.layers.3.router.proj.weight",
                       "model.decoder.norm.weight",
                       "model.encoder.language_model.layers.3.layer_scalar"}));
  const HostTensor& down = hf[0];
  EXPECT_EQ(down.shape, (std::vector<int64_t>{2, 4, 3}));
  // Expert 1, HF [d=2][i=1] is shardd [i=1][d=2]: element 12 + 1 * 4 + 2.
  uint16_t v;
  std::memcpy(&v, down.bytes.data() + 2 * (12 + 2 * 3 + 1), 2);
  EXPECT_EQ(v, 12 + 1 * 4 + 2 + 1);
  EXPECT_EQ(hf[2].shape, std::vector<int64_t>{2});
  EXPECT_EQ(hf[2].bytes, (std::vector<uint8_t>{0x80, 0x3F, 0x80, 0x3F}));

  std::vector<HostTensor> bad = {
      bf16("model.layers.0.moe.experts.down_proj_bias", {2, 4})};
  EXPECT_THAT(ShardToHf(bad, HfMoeNaming::kDiffusionGemma).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.layers.0.moe.experts.down_proj_bias")));
}

// A GPT-OSS checkpoint of 2 MoE layers: fused experts with interleaved
// gate/up columns, biases, router weight and bias.
std::vector<HostTensor> SyntheticGptOss(const std::string& dtype) {
  std::mt19937_64 rng(13);
  std::vector<HostTensor> t;
  t.push_back(
      Random("model.embed_tokens.weight", dtype, {kVocab, kHidden}, &rng));
  t.push_back(Random("model.norm.weight", dtype, {kHidden}, &rng));
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t.push_back(Random(p + "self_attn.sinks", dtype, {2}, &rng));
    t.push_back(
        Random(p + "mlp.router.weight", dtype, {kExperts, kHidden}, &rng));
    t.push_back(Random(p + "mlp.router.bias", dtype, {kExperts}, &rng));
    const std::string x = p + "mlp.experts.";
    t.push_back(Random(x + "gate_up_proj", dtype,
                       {kExperts, kHidden, 2 * kInter}, &rng));
    t.push_back(
        Random(x + "gate_up_proj_bias", dtype, {kExperts, 2 * kInter}, &rng));
    t.push_back(
        Random(x + "down_proj", dtype, {kExperts, kInter, kHidden}, &rng));
    t.push_back(Random(x + "down_proj_bias", dtype, {kExperts, kHidden}, &rng));
  }
  std::sort(t.begin(), t.end(), [](const HostTensor& a, const HostTensor& b) {
    return a.name < b.name;
  });
  return t;
}

std::vector<HostTensor> Replaced(std::vector<HostTensor> tensors,
                                 HostTensor t) {
  for (HostTensor& x : tensors) {
    if (x.name == t.name) x = t;
  }
  return tensors;
}

TEST(HfInteropTest, GptOssRoundTripIsBitExact) {
  const std::vector<HostTensor> hf = SyntheticGptOss("BF16");
  HfMoeNaming naming = HfMoeNaming::kNone;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> shardd,
                              HfToShardd(hf, &naming));
  EXPECT_EQ(naming, HfMoeNaming::kGptOss);
  std::vector<std::string> names;
  for (const HostTensor& t : shardd) names.push_back(t.name);
  EXPECT_EQ(
      names,
      (std::vector<std::string>{
          "model.embed_tokens.weight",
          "model.layers.0.moe.experts.down_proj_bias",
          "model.layers.0.moe.experts.down_projs",
          "model.layers.0.moe.experts.gate_and_up_projs",
          "model.layers.0.moe.experts.gate_up_proj_bias",
          "model.layers.0.moe.gate.bias", "model.layers.0.moe.gate.weight",
          "model.layers.0.self_attn.sinks",
          "model.layers.1.moe.experts.down_proj_bias",
          "model.layers.1.moe.experts.down_projs",
          "model.layers.1.moe.experts.gate_and_up_projs",
          "model.layers.1.moe.experts.gate_up_proj_bias",
          "model.layers.1.moe.gate.bias", "model.layers.1.moe.gate.weight",
          "model.layers.1.self_attn.sinks", "model.norm.weight"}));
  // De-interleaved: shardd column j < I is HF column 2j (gate), column
  // I + j is 2j + 1 (up); rows of the weight and the bias alike.
  auto h = ByName(hf);
  auto s = ByName(shardd);
  for (const char* kind : {"gate_up_proj", "gate_up_proj_bias"}) {
    const HostTensor* from =
        h.at(absl::StrCat("model.layers.1.mlp.experts.", kind));
    const HostTensor* to = s.at(absl::StrCat(
        "model.layers.1.moe.experts.",
        std::string(kind) == "gate_up_proj" ? "gate_and_up_projs" : kind));
    EXPECT_EQ(to->shape, from->shape);
    const int64_t rows =
        static_cast<int64_t>(from->bytes.size()) / (2 * kInter * 2);
    ASSERT_GT(rows, 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < kInter; ++j) {
        const int64_t row = r * 2 * kInter;
        ASSERT_EQ(At(*to, row + j), At(*from, row + 2 * j)) << kind;
        ASSERT_EQ(At(*to, row + kInter + j), At(*from, row + 2 * j + 1))
            << kind;
      }
    }
  }
  EXPECT_TRUE(s.at("model.layers.1.moe.experts.down_projs")->bytes ==
              h.at("model.layers.1.mlp.experts.down_proj")->bytes);
  EXPECT_TRUE(s.at("model.layers.0.moe.gate.bias")->bytes ==
              h.at("model.layers.0.mlp.router.bias")->bytes);

  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back,
                              ShardToHf(shardd, HfMoeNaming::kGptOss));
  ExpectSameTensors(back, hf);
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> again, HfToShardd(back));
  ExpectSameTensors(again, shardd);
}

TEST(HfInteropTest, GptOssThroughACheckpointAndBack) {
  const std::vector<HostTensor> hf = SyntheticGptOss("F32");
  const std::string in = testing_util::FreshTestDir("in");
  SHARDD_ASSERT_OK(WriteHfTensors(in, hf));
  const std::string root = testing_util::FreshTestDir("ckpt");
  SHARDD_ASSERT_OK_AND_ASSIGN(std::string path,
                              ImportHfToCheckpoint(in, root, 0));
  const std::string out = testing_util::FreshTestDir("out");
  SHARDD_ASSERT_OK(ExportCheckpointToHf(path, HfMoeNaming::kGptOss, out));
  EXPECT_EQ(FileBytes(out + "/model.safetensors"),
            FileBytes(in + "/model.safetensors"));
}

TEST(HfInteropTest, GptOssImportRejectsMisshapenAndForeignTensors) {
  const std::vector<HostTensor> hf = SyntheticGptOss("BF16");
  EXPECT_THAT(
      HfToShardd(Replaced(
          hf, {"model.layers.1.mlp.experts.down_proj",
               "BF16",
               {kExperts, kHidden, kInter},
               std::vector<uint8_t>(kExperts * kHidden * kInter * 2)})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("\"model.layers.1.mlp.experts.down_proj\": BF16 "
                         "[3, 6, 4], expected BF16 [3, 4, 6] like "
                         "\"model.layers.1.mlp.experts.gate_up_proj\" "
                         "[3, 6, 8]")));
  EXPECT_THAT(
      HfToShardd(Replaced(hf, {"model.layers.0.mlp.experts.down_proj_bias",
                               "BF16",
                               {kExperts, kInter},
                               std::vector<uint8_t>(kExperts * kInter * 2)})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("down_proj_bias\": BF16 [3, 4], expected BF16 "
                         "[3, 6]")));
  EXPECT_THAT(
      HfToShardd(
          Replaced(hf, {"model.layers.0.mlp.experts.gate_up_proj",
                        "BF16",
                        {kExperts, kHidden, 7},
                        std::vector<uint8_t>(kExperts * kHidden * 7 * 2)})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("\"model.layers.0.mlp.experts.gate_up_proj\": BF16 "
                         "[3, 6, 7] must be [E, D, 2I] with an even last "
                         "dim")));
  EXPECT_THAT(HfToShardd(Without(hf, "model.layers.0.mlp.experts.down_proj")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"model.layers.0.mlp.experts.down_proj\" "
                                 "is missing")));
  std::vector<HostTensor> mxfp4 = hf;
  mxfp4.push_back({"model.layers.0.mlp.experts.gate_up_proj_blocks",
                   "U8",
                   {4},
                   std::vector<uint8_t>(4)});
  EXPECT_THAT(HfToShardd(mxfp4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gate_up_proj_blocks\": unsupported "
                                 "per-expert tensor; GPT-OSS")));
  std::vector<HostTensor> mixed = hf;
  mixed.push_back({"model.layers.1.mlp.gate.weight",
                   "BF16",
                   {kExperts, kHidden},
                   std::vector<uint8_t>(kExperts * kHidden * 2)});
  EXPECT_THAT(HfToShardd(mixed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("uses Qwen3-MoE naming but")));
}

// shardd's DiffusionGemma tensors (each name as the model's tree has it).
std::vector<HostTensor> SyntheticDiffusionGemmaShardd(
    const std::string& dtype) {
  std::mt19937_64 rng(17);
  std::vector<HostTensor> t;
  t.push_back(
      Random("model.embed_tokens.weight", dtype, {kVocab, kHidden}, &rng));
  t.push_back(Random("model.norm.weight", dtype, {kHidden}, &rng));
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t.push_back(Random(p + "layer_scalar", dtype, {1}, &rng));
    t.push_back(Random(p + "mlp.gate_proj.weight", dtype, {5, kHidden}, &rng));
    t.push_back(Random(p + "moe.gate.scale", dtype, {kHidden}, &rng));
    t.push_back(
        Random(p + "moe.gate.proj.weight", dtype, {kExperts, kHidden}, &rng));
    t.push_back(Random(p + "moe.experts.gate_and_up_projs", dtype,
                       {kExperts, kHidden, 2 * kInter}, &rng));
    t.push_back(Random(p + "moe.experts.down_projs", dtype,
                       {kExperts, kInter, kHidden}, &rng));
  }
  std::sort(t.begin(), t.end(), [](const HostTensor& a, const HostTensor& b) {
    return a.name < b.name;
  });
  return t;
}

TEST(HfInteropTest, DiffusionGemmaRoundTripIsBitExact) {
  const std::vector<HostTensor> shardd = SyntheticDiffusionGemmaShardd("BF16");
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<HostTensor> hf,
                              ShardToHf(shardd, HfMoeNaming::kDiffusionGemma));
  HfMoeNaming naming = HfMoeNaming::kNone;
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> back,
                              HfToShardd(hf, &naming));
  EXPECT_EQ(naming, HfMoeNaming::kDiffusionGemma);
  ExpectSameTensors(back, shardd);

  // HF -> shardd -> HF: the same bytes; the vision tower is dropped.
  std::vector<HostTensor> with_vision = hf;
  with_vision.push_back({"model.encoder.vision_tower.patch.weight",
                         "BF16",
                         {2},
                         std::vector<uint8_t>(4, 7)});
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> imported,
                              HfToShardd(with_vision));
  ExpectSameTensors(imported, shardd);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::vector<HostTensor> exported,
      ShardToHf(imported, HfMoeNaming::kDiffusionGemma));
  ExpectSameTensors(exported, hf);
}

// Scales other than 1 are folded as --init-from folds them: expert e's
// down_proj times per_expert_scale[e] in fp32, stored as F32.
TEST(HfInteropTest, DiffusionGemmaFoldsPerExpertScale) {
  const std::vector<float> scale = {2.0f, 0.5f, -3.0f};
  HostTensor scale_t{"model.decoder.layers.0.router.per_expert_scale",
                     "F32",
                     {kExperts},
                     std::vector<uint8_t>(kExperts * 4)};
  std::memcpy(scale_t.bytes.data(), scale.data(), kExperts * 4);
  // BF16 down_proj [E, D, I]: element k is bf16(k + 1), exact.
  HostTensor down{"model.decoder.layers.0.experts.down_proj",
                  "BF16",
                  {kExperts, kHidden, kInter},
                  {}};
  const int64_t n = kExperts * kHidden * kInter;
  for (int64_t k = 0; k < n; ++k) {
    const float f = static_cast<float>(k + 1);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    down.bytes.push_back(static_cast<uint8_t>(bits >> 16));
    down.bytes.push_back(static_cast<uint8_t>(bits >> 24));
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<HostTensor> shardd,
                              HfToShardd({down, scale_t}));
  ASSERT_EQ(shardd.size(), 1u);
  const HostTensor& folded = shardd[0];
  EXPECT_EQ(folded.name, "model.layers.0.moe.experts.down_projs");
  EXPECT_EQ(folded.dtype, "F32");
  ASSERT_EQ(folded.shape, (std::vector<int64_t>{kExperts, kInter, kHidden}));
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int64_t i = 0; i < kInter; ++i) {
      for (int64_t d = 0; d < kHidden; ++d) {
        float got;
        std::memcpy(&got,
                    folded.bytes.data() + 4 * ((e * kInter + i) * kHidden + d),
                    4);
        const float hf_value =
            static_cast<float>((e * kHidden + d) * kInter + i + 1);
        ASSERT_EQ(got, hf_value * scale[e]) << e << " " << i << " " << d;
      }
    }
  }
}

TEST(HfInteropTest, DiffusionGemmaImportRejectsMisshapenAndForeignTensors) {
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::vector<HostTensor> hf,
                              ShardToHf(SyntheticDiffusionGemmaShardd("F32"),
                                        HfMoeNaming::kDiffusionGemma));
  EXPECT_THAT(
      HfToShardd(Replaced(
          hf, {"model.decoder.layers.1.experts.down_proj",
               "F32",
               {kExperts, kInter, kHidden},
               std::vector<uint8_t>(kExperts * kInter * kHidden * 4)})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("\"model.decoder.layers.1.experts.down_proj\": F32 "
                         "[3, 4, 6], expected F32 [3, 6, 4] like "
                         "\"model.decoder.layers.1.experts.gate_up_proj\" "
                         "[3, 8, 6]")));
  EXPECT_THAT(
      HfToShardd(Replaced(hf, {"model.decoder.layers.0.router.per_expert_scale",
                               "F32",
                               {kExperts + 1},
                               std::vector<uint8_t>((kExperts + 1) * 4)})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("per_expert_scale\": F32 [4], expected [3]")));
  EXPECT_THAT(
      HfToShardd(Without(hf, "model.decoder.layers.0.router.per_expert_scale")),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("\"model.decoder.layers.0.router.per_expert_scale\" "
                         "is missing")));
  std::vector<HostTensor> extra = hf;
  extra.push_back({"model.decoder.layers.0.router.bias",
                   "F32",
                   {kExperts},
                   std::vector<uint8_t>(kExperts * 4)});
  EXPECT_THAT(HfToShardd(extra),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"model.decoder.layers.0.router.bias\": has "
                                 "no counterpart")));
  std::vector<HostTensor> mixed = hf;
  mixed.push_back({"model.layers.0.mlp.router.weight",
                   "F32",
                   {1},
                   std::vector<uint8_t>(4)});
  EXPECT_THAT(HfToShardd(mixed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"model.layers.0.mlp.router.weight\": not "
                                 "under model.decoder.")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
