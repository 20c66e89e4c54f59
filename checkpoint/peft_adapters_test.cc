#include "checkpoint/peft_adapters.h"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/json_text.h"
#include "checkpoint/safetensors.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "testing/test_dir.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::shardd::StatusIs;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

v1::ModelSpec LoraSpec(const std::string& config,
                       std::initializer_list<const char*> targets, int rank = 4,
                       double alpha = 8) {
  absl::StatusOr<v1::ModelSpec> spec =
      ModelSpecFromHfConfig(ReadText("tests/data/" + config));
  EXPECT_TRUE(spec.ok()) << spec.status();
  v1::LoraConfig lora;
  lora.set_rank(rank);
  lora.set_alpha(alpha);
  for (const char* t : targets) lora.add_targets(t);
  const absl::Status applied = ApplyLora(lora, &*spec);
  EXPECT_TRUE(applied.ok()) << applied;
  return *spec;
}

// Commits a one-file checkpoint of every parameter of `spec` with distinct
// fp32 values per element (returned by name), recording the model.
absl::StatusOr<std::string> WriteCheckpoint(
    const v1::ModelSpec& spec, const std::string& root,
    std::map<std::string, std::vector<float>>* values) {
  std::vector<RankTensor> pieces;
  float next = 1.0f;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    std::vector<float>& v = (*values)[ref.fqn];
    v.resize(Numel(*ref.tensor));
    for (float& x : v) {
      x = next;
      next += 0.25f;  // Exact in fp32 while below 2^22.
    }
    std::vector<int64_t> shape(ref.tensor->shape().begin(),
                               ref.tensor->shape().end());
    pieces.push_back(
        {ref.fqn, "F32", shape, 0, static_cast<int64_t>(v.size()),
         absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                   v.size() * sizeof(float))});
  }
  SHARDD_ASSIGN_OR_RETURN(std::string tmp, BeginCheckpoint(root, 3));
  SHARDD_ASSIGN_OR_RETURN(RankFile file, WriteRankFile(tmp, 0, pieces));
  CheckpointIndex index;
  index.step = 3;
  index.saved_by = {"default", 1, {{"dp_shard", 1}}};
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(spec, &index.model_spec_json,
                                                   options)
           .ok()) {
    return absl::InternalError("printing the spec");
  }
  SHARDD_RETURN_IF_ERROR(AddRankFile(file, &index));
  return CommitCheckpoint(root, tmp, index);
}

std::vector<float> Floats(const SafetensorsReader& file,
                          const std::string& name) {
  const SafetensorsEntry* e = file.Find(name);
  EXPECT_NE(e, nullptr) << name;
  if (e == nullptr) return {};
  absl::StatusOr<std::vector<uint8_t>> bytes = file.ReadTensor(*e);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  std::vector<float> v(bytes->size() / 4);
  std::memcpy(v.data(), bytes->data(), bytes->size());
  return v;
}

class PeftAdaptersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = LoraSpec("tiny_qwen3_moe.json", {"q_proj", "o_proj", "experts"});
    dir_ = testing_util::FreshTestDir();
    SHARDD_ASSERT_OK_AND_ASSIGN(
        checkpoint_, WriteCheckpoint(spec_, dir_ + "/ckpt", &values_));
    out_ = dir_ + "/peft";
    SHARDD_ASSERT_OK(ExportPeftAdapters(checkpoint_, out_));
  }

  v1::ModelSpec spec_;
  std::string dir_;
  std::string checkpoint_;
  std::string out_;
  std::map<std::string, std::vector<float>> values_;
};

TEST_F(PeftAdaptersTest, WritesPeftNamesShapesAndLayouts) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<SafetensorsReader> file,
      SafetensorsReader::Open(out_ + "/adapter_model.safetensors"));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const SafetensorsEntry& e : file->tensors()) {
    EXPECT_EQ(e.dtype, "F32") << e.name;
    shapes[e.name] = e.shape;
  }
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const std::string p = "base_model.model.model.layers.";
  std::map<std::string, std::vector<int64_t>> want;
  for (int l = 0; l < 2; ++l) {
    const std::string a = absl::StrCat(p, l, ".self_attn.");
    const std::string x = absl::StrCat(p, l, ".mlp.experts.");
    want[a + "q_proj.lora_A.weight"] = {4, 64};
    want[a + "q_proj.lora_B.weight"] = {64, 4};
    want[a + "o_proj.lora_A.weight"] = {4, 64};
    want[a + "o_proj.lora_B.weight"] = {64, 4};
    // E = 8, D = 64, I = 32, R = 4.
    want[x + "base_layer.lora_A.weight"] = {32, 64};  // gate_up_proj.
    want[x + "base_layer.lora_B.weight"] = {64, 32};
    want[x + "lora_A.weight"] = {32, 32};  // down_proj.
    want[x + "lora_B.weight"] = {64, 32};
  }
  EXPECT_EQ(shapes, want);

  // Linears and every lora_A keep their bytes; an expert lora_B is
  // [out, R*E] with B[o, r*E + e] = shardd's B[e][o, r].
  const std::string s = "model.layers.1.";
  EXPECT_EQ(Floats(*file, p + "1.self_attn.q_proj.lora_B.weight"),
            values_.at(s + "self_attn.q_proj.lora_B.weight"));
  EXPECT_EQ(Floats(*file, p + "1.mlp.experts.base_layer.lora_A.weight"),
            values_.at(s + "moe.experts.gate_and_up_projs_lora_A"));
  EXPECT_EQ(Floats(*file, p + "1.mlp.experts.lora_A.weight"),
            values_.at(s + "moe.experts.down_projs_lora_A"));
  const std::vector<float> b = Floats(*file, p + "1.mlp.experts.lora_B.weight");
  const std::vector<float>& ours =
      values_.at(s + "moe.experts.down_projs_lora_B");
  const int64_t E = 8, O = 64, R = 4;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t r = 0; r < R; ++r) {
        ASSERT_EQ(b[o * R * E + r * E + e], ours[(e * O + o) * R + r])
            << e << " " << o << " " << r;
      }
    }
  }

  SHARDD_ASSERT_OK_AND_ASSIGN(
      const nlohmann::json config,
      ParseJsonStrict(ReadText(out_ + "/adapter_config.json"), "config",
                      absl::StatusCode::kDataLoss));
  EXPECT_EQ(config.at("peft_type"), "LORA");
  EXPECT_EQ(config.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(config.at("r"), 4);
  EXPECT_EQ(config.at("lora_alpha"), 8);
  EXPECT_EQ(config.at("lora_dropout"), 0.0);
  EXPECT_EQ(config.at("bias"), "none");
  EXPECT_EQ(config.at("use_rslora"), false);
  EXPECT_EQ(config.at("fan_in_fan_out"), false);
  EXPECT_TRUE(config.at("base_model_name_or_path").is_null());
  EXPECT_EQ(config.at("target_modules"),
            nlohmann::json::array({"o_proj", "q_proj"}));
  EXPECT_EQ(config.at("target_parameters"),
            nlohmann::json::array(
                {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"}));
  // Nothing left beside the output.
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 2);  // ckpt, peft.
}

TEST_F(PeftAdaptersTest, ReadsEveryAdapterBackBitForBit) {
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeftAdapters> adapters,
                              PeftAdapters::Open(out_, spec_));
  int adapters_seen = 0;
  for (const ParamRef& ref : ListParams(spec_)) {
    EXPECT_EQ(adapters->Provides(ref.fqn), IsLoraAdapter(ref.fqn)) << ref.fqn;
    if (!IsLoraAdapter(ref.fqn)) continue;
    ++adapters_seen;
    const std::vector<float>& want = values_.at(ref.fqn);
    const int64_t n = static_cast<int64_t>(want.size());
    std::vector<float> got(want.size());
    SHARDD_ASSERT_OK(adapters->Read(ref.fqn, *ref.tensor, 0, n, got.data()));
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
        << ref.fqn;
    // Ranges as ranks own them: odd splits inside and across experts.
    for (const auto& [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {3, n / 3 + 5}, {n / 3 + 5, n - 7}, {n - 7, n}, {n, n}}) {
      std::vector<float> part(static_cast<size_t>(hi - lo));
      SHARDD_ASSERT_OK(
          adapters->Read(ref.fqn, *ref.tensor, lo, hi, part.data()));
      EXPECT_TRUE(std::equal(part.begin(), part.end(), want.begin() + lo))
          << ref.fqn << " [" << lo << ", " << hi << ")";
    }
  }
  EXPECT_EQ(adapters_seen, 2 * (2 * 2 + 2 * 2));
  const ParamRef base = ListParams(spec_).front();
  float x;
  EXPECT_THAT(adapters->Read(base.fqn, *base.tensor, 0, 1, &x),
              StatusIs(absl::StatusCode::kNotFound));
  const std::string a = "model.layers.0.self_attn.q_proj.lora_A.weight";
  EXPECT_THAT(adapters->Read(a, v1::TensorSpec(), 255, 257, &x),
              StatusIs(absl::StatusCode::kOutOfRange));
}

TEST_F(PeftAdaptersTest, RefusesAConfigOfAnotherLora) {
  const v1::ModelSpec rank8 =
      LoraSpec("tiny_qwen3_moe.json", {"q_proj", "o_proj", "experts"}, 8);
  EXPECT_THAT(PeftAdapters::Open(out_, rank8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("adapter_config.json: r is 4, the job's "
                                 "--lora-rank is 8")));
  const v1::ModelSpec alpha16 =
      LoraSpec("tiny_qwen3_moe.json", {"q_proj", "o_proj", "experts"}, 4, 16);
  EXPECT_THAT(PeftAdapters::Open(out_, alpha16),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("lora_alpha is 8")));
  const v1::ModelSpec fewer =
      LoraSpec("tiny_qwen3_moe.json", {"q_proj", "experts"});
  EXPECT_THAT(PeftAdapters::Open(out_, fewer),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("target_modules is [o_proj, q_proj], the "
                                 "job's --lora-targets give [q_proj]")));
  const v1::ModelSpec no_experts =
      LoraSpec("tiny_qwen3_moe.json", {"q_proj", "o_proj"});
  EXPECT_THAT(PeftAdapters::Open(out_, no_experts),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("target_parameters")));

  const std::string config_path = out_ + "/adapter_config.json";
  const std::string config = ReadText(config_path);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      nlohmann::json j,
      ParseJsonStrict(config, "config", absl::StatusCode::kDataLoss));
  j["use_rslora"] = true;
  WriteText(config_path, j.dump());
  EXPECT_THAT(
      PeftAdapters::Open(out_, spec_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use_rslora")));
  WriteText(config_path, "[1]");
  EXPECT_THAT(PeftAdapters::Open(out_, spec_),
              StatusIs(absl::StatusCode::kDataLoss));
  std::filesystem::remove(config_path);
  EXPECT_THAT(PeftAdapters::Open(out_, spec_),
              StatusIs(absl::StatusCode::kNotFound));
}

// Rewrites adapter_model.safetensors with `edit` applied to its tensors.
void EditTensors(
    const std::string& dir,
    const std::function<void(std::vector<std::string>* names,
                             std::vector<std::vector<int64_t>>* shapes,
                             std::vector<std::vector<uint8_t>>* bytes)>& edit) {
  const std::string path = dir + "/adapter_model.safetensors";
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<uint8_t>> bytes;
  {
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> file =
        SafetensorsReader::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    for (const SafetensorsEntry& e : (*file)->tensors()) {
      names.push_back(e.name);
      shapes.push_back(e.shape);
      bytes.push_back(*(*file)->ReadTensor(e));
    }
  }
  edit(&names, &shapes, &bytes);
  std::vector<TensorView> views;
  for (size_t i = 0; i < names.size(); ++i) {
    views.push_back({names[i], "F32", shapes[i], bytes[i]});
  }
  ASSERT_TRUE(WriteSafetensors(path, views).ok());
}

TEST_F(PeftAdaptersTest, NamesAMissingOrMisshapenOrExtraTensor) {
  const std::string down_b =
      "base_model.model.model.layers.1.mlp.experts.lora_B.weight";
  EditTensors(out_, [&](auto* names, auto* shapes, auto* bytes) {
    for (size_t i = 0; i < names->size(); ++i) {
      if ((*names)[i] == down_b) (*shapes)[i] = {32, 64};
    }
  });
  EXPECT_THAT(PeftAdapters::Open(out_, spec_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("tensor \"", down_b,
                                              "\" has shape [32, 64], adapter "
                                              "\"model.layers.1.moe.experts."
                                              "down_projs_lora_B\" [8, 64, 4] "
                                              "needs [64, 32]"))));
  EditTensors(out_, [&](auto* names, auto* shapes, auto* bytes) {
    for (size_t i = 0; i < names->size(); ++i) {
      if ((*names)[i] == down_b) {
        names->erase(names->begin() + i);
        shapes->erase(shapes->begin() + i);
        bytes->erase(bytes->begin() + i);
        break;
      }
    }
  });
  EXPECT_THAT(PeftAdapters::Open(out_, spec_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("no tensor \"", down_b, "\""))));
  EditTensors(out_, [&](auto* names, auto* shapes, auto* bytes) {
    names->push_back(down_b);
    shapes->push_back({64, 32});
    bytes->push_back(std::vector<uint8_t>(64 * 32 * 4));
    names->push_back("base_model.model.lm_head.lora_A.weight");
    shapes->push_back({4, 64});
    bytes->push_back(std::vector<uint8_t>(4 * 64 * 4));
  });
  EXPECT_THAT(PeftAdapters::Open(out_, spec_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"base_model.model.lm_head.lora_A.weight\" "
                                 "is no adapter of the job's model")));
}

TEST_F(PeftAdaptersTest, NeverOverwritesAnOutputDirectory) {
  EXPECT_THAT(ExportPeftAdapters(checkpoint_, out_),
              StatusIs(absl::StatusCode::kAlreadyExists));
  std::filesystem::create_directories(dir_ + "/empty");
  SHARDD_EXPECT_OK(ExportPeftAdapters(checkpoint_, dir_ + "/empty/"));
  EXPECT_TRUE(
      std::filesystem::exists(dir_ + "/empty/adapter_model.safetensors"));
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 3);  // ckpt, peft, empty: no temporary left.
}

TEST(PeftAdaptersExportTest, DenseMlpsOfAnMoeModelAreTargetParameters) {
  // Qwen3-MoE with a dense layer 0: PEFT would read target_modules
  // "gate_proj" as the experts' (see peft_adapters.h).
  absl::StatusOr<v1::ModelSpec> spec =
      ModelSpecFromHfConfig(absl::StrReplaceAll(
          ReadText("tests/data/tiny_qwen3_moe.json"),
          {{"\"mlp_only_layers\": []", "\"mlp_only_layers\": [0]"}}));
  ASSERT_TRUE(spec.ok()) << spec.status();
  v1::LoraConfig lora;
  lora.set_rank(2);
  lora.set_alpha(3.5);
  for (const char* t : {"gate_proj", "down_proj", "k_proj", "gate"}) {
    lora.add_targets(t);
  }
  SHARDD_ASSERT_OK(ApplyLora(lora, &*spec));
  const std::string dir = testing_util::FreshTestDir();
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string checkpoint,
                              WriteCheckpoint(*spec, dir + "/ckpt", &values));
  SHARDD_ASSERT_OK(ExportPeftAdapters(checkpoint, dir + "/peft"));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const nlohmann::json config,
      ParseJsonStrict(ReadText(dir + "/peft/adapter_config.json"), "config",
                      absl::StatusCode::kDataLoss));
  EXPECT_EQ(config.at("lora_alpha"), 3.5);
  EXPECT_EQ(config.at("target_modules"), nlohmann::json::array({"k_proj"}));
  EXPECT_EQ(config.at("target_parameters"),
            nlohmann::json::array({"mlp.down_proj.weight", "mlp.gate.weight",
                                   "mlp.gate_proj.weight"}));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<SafetensorsReader> file,
      SafetensorsReader::Open(dir + "/peft/adapter_model.safetensors"));
  std::vector<std::string> names;
  for (const SafetensorsEntry& e : file->tensors()) {
    if (absl::StrContains(e.name, "lora_A")) names.push_back(e.name);
  }
  const std::string p = "base_model.model.model.layers.";
  EXPECT_THAT(names,
              UnorderedElementsAre(p + "0.self_attn.k_proj.lora_A.weight",
                                   p + "1.self_attn.k_proj.lora_A.weight",
                                   p + "0.mlp.gate_proj.lora_A.weight",
                                   p + "0.mlp.down_proj.lora_A.weight",
                                   p + "1.mlp.gate.lora_A.weight"));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeftAdapters> adapters,
                              PeftAdapters::Open(dir + "/peft", *spec));
  EXPECT_TRUE(adapters->Provides("model.layers.1.moe.gate.lora_B.weight"));
}

TEST(PeftAdaptersExportTest, NeedsALoraModelOfASupportedArchitecture) {
  const std::string dir = testing_util::FreshTestDir();
  absl::StatusOr<v1::ModelSpec> plain =
      ModelSpecFromHfConfig(ReadText("tests/data/tiny_qwen3_moe.json"));
  ASSERT_TRUE(plain.ok());
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string checkpoint,
                              WriteCheckpoint(*plain, dir + "/a", &values));
  EXPECT_THAT(ExportPeftAdapters(checkpoint, dir + "/out"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("no LoRA adapters")));
  SHARDD_ASSERT_OK_AND_ASSIGN(const bool plain_has_lora,
                              CheckpointHasLora(checkpoint));
  EXPECT_FALSE(plain_has_lora);
  EXPECT_THAT(PeftAdapters::Open(dir, *plain),
              StatusIs(absl::StatusCode::kInvalidArgument));

  const v1::ModelSpec gpt_oss =
      LoraSpec("tiny_gpt_oss.json", {"q_proj", "experts"});
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string gpt_checkpoint,
                              WriteCheckpoint(gpt_oss, dir + "/b", &values));
  SHARDD_ASSERT_OK_AND_ASSIGN(const bool gpt_has_lora,
                              CheckpointHasLora(gpt_checkpoint));
  EXPECT_TRUE(gpt_has_lora);
  EXPECT_THAT(ExportPeftAdapters(gpt_checkpoint, dir + "/out"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("GptOssForCausalLM")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/out"));
}

TEST(PeftAdaptersExportTest, LlamaAndMixtral) {
  for (const char* config : {"tiny_llama3.json", "tiny_mixtral.json"}) {
    const bool moe = std::string(config) == "tiny_mixtral.json";
    const v1::ModelSpec spec =
        moe ? LoraSpec(config, {"v_proj", "experts"})
            : LoraSpec(config, {"v_proj", "gate_proj", "up_proj"});
    const std::string dir = testing_util::FreshTestDir(config);
    std::map<std::string, std::vector<float>> values;
    SHARDD_ASSERT_OK_AND_ASSIGN(const std::string checkpoint,
                                WriteCheckpoint(spec, dir + "/ckpt", &values));
    SHARDD_ASSERT_OK(ExportPeftAdapters(checkpoint, dir + "/peft"));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const nlohmann::json j,
        ParseJsonStrict(ReadText(dir + "/peft/adapter_config.json"), "config",
                        absl::StatusCode::kDataLoss));
    // Llama has no v4 -> v5 conversion: its MLP names stay target_modules.
    EXPECT_EQ(j.at("target_modules"),
              moe ? nlohmann::json::array({"v_proj"})
                  : nlohmann::json::array({"gate_proj", "up_proj", "v_proj"}))
        << config;
    SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeftAdapters> adapters,
                                PeftAdapters::Open(dir + "/peft", spec));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<SafetensorsReader> file,
        SafetensorsReader::Open(dir + "/peft/adapter_model.safetensors"));
    if (moe) {
      // transformers 5 names Mixtral's MoE mlp (its files block_sparse_moe).
      EXPECT_NE(file->Find("base_model.model.model.layers.0.mlp.experts."
                           "base_layer.lora_B.weight"),
                nullptr);
    }
    for (const ParamRef& ref : ListParams(spec)) {
      if (!IsLoraAdapter(ref.fqn)) continue;
      const std::vector<float>& want = values.at(ref.fqn);
      std::vector<float> got(want.size());
      SHARDD_ASSERT_OK(adapters->Read(ref.fqn, *ref.tensor, 0,
                                      static_cast<int64_t>(got.size()),
                                      got.data()));
      EXPECT_EQ(got, want) << ref.fqn;
    }
  }
}

// DiffusionGemma: every layer adapter under both of transformers' module
// trees (decoder and encoder copies), target_modules a regex without the
// vision tower, the experts' down_proj B divided by the base's
// per_expert_scale on export (1 in a base shardd exported) and multiplied
// back on import.
TEST(PeftAdaptersExportTest, DiffusionGemmaWritesBothModuleTrees) {
  const v1::ModelSpec spec = LoraSpec("tiny_diffusion_gemma.json",
                                      {"q_proj", "gate_proj", "experts"});
  const std::string dir = testing_util::FreshTestDir();
  std::map<std::string, std::vector<float>> values;
  SHARDD_ASSERT_OK_AND_ASSIGN(const std::string checkpoint,
                              WriteCheckpoint(spec, dir + "/ckpt", &values));
  EXPECT_THAT(ExportPeftAdapters(checkpoint, dir + "/peft"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--base")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/peft"));
  // A base: the model without adapters, as shardd exports it.
  std::map<std::string, std::vector<float>> base_values;
  v1::ModelSpec plain = WithoutLoraAdapters(spec);
  plain.set_hf_config_json(ReadText("tests/data/tiny_diffusion_gemma.json"));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const std::string base_checkpoint,
      WriteCheckpoint(plain, dir + "/base_ckpt", &base_values));
  SHARDD_ASSERT_OK(ExportHfModel(base_checkpoint, dir + "/base", 0));
  SHARDD_ASSERT_OK(ExportPeftAdapters(checkpoint, dir + "/peft", dir + "/base"));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      const nlohmann::json j,
      ParseJsonStrict(ReadText(dir + "/peft/adapter_config.json"), "config",
                      absl::StatusCode::kDataLoss));
  EXPECT_EQ(j.at("target_modules"),
            "model\\.(decoder|encoder\\.language_model)\\.layers\\.\\d+\\."
            "(mlp\\.gate_proj|self_attn\\.q_proj)|"
            "model\\.decoder\\.self_conditioning\\.gate_proj");
  EXPECT_TRUE(j.at("task_type").is_null());
  EXPECT_EQ(j.at("target_parameters"),
            nlohmann::json::array({"experts.down_proj", "experts.gate_up_proj"}));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<SafetensorsReader> file,
      SafetensorsReader::Open(dir + "/peft/adapter_model.safetensors"));
  const std::string dec = "base_model.model.model.decoder.layers.1.";
  const std::string enc = "base_model.model.model.encoder.language_model.layers.1.";
  for (const std::string key :
       {"self_attn.q_proj.lora_A.weight", "mlp.gate_proj.lora_B.weight",
        "experts.base_layer.lora_A.weight", "experts.lora_B.weight"}) {
    EXPECT_EQ(Floats(*file, dec + key), Floats(*file, enc + key)) << key;
    EXPECT_FALSE(Floats(*file, dec + key).empty()) << key;
  }
  EXPECT_NE(file->Find("base_model.model.model.decoder.self_conditioning."
                       "gate_proj.lora_A.weight"),
            nullptr);
  // 3 layers x (q_proj, mlp.gate_proj, 2 expert tensors) x 2 trees + the
  // self-conditioning's, A and B each.
  EXPECT_EQ(file->tensors().size(), 2u * (3 * 4 * 2 + 1));

  // Back: bit for bit with the base's scales (1); twice B with scales 2.
  auto ones = [](const std::string&) -> absl::StatusOr<std::vector<float>> {
    return std::vector<float>(8, 1.0f);
  };
  auto twos = [](const std::string&) -> absl::StatusOr<std::vector<float>> {
    return std::vector<float>(8, 2.0f);
  };
  EXPECT_THAT(PeftAdapters::Open(dir + "/peft", spec),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("per-expert scales")));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeftAdapters> same,
                              PeftAdapters::Open(dir + "/peft", spec, ones));
  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeftAdapters> doubled,
                              PeftAdapters::Open(dir + "/peft", spec, twos));
  int seen = 0;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!IsLoraAdapter(ref.fqn)) continue;
    ++seen;
    const std::vector<float>& want = values.at(ref.fqn);
    std::vector<float> got(want.size()), got2(want.size());
    const int64_t n = static_cast<int64_t>(want.size());
    SHARDD_ASSERT_OK(same->Read(ref.fqn, *ref.tensor, 0, n, got.data()));
    SHARDD_ASSERT_OK(doubled->Read(ref.fqn, *ref.tensor, 0, n, got2.data()));
    EXPECT_EQ(got, want) << ref.fqn;
    const bool scaled = ref.fqn == absl::StrCat(ref.fqn.substr(0, ref.fqn.rfind('.')),
                                                ".down_projs_lora_B");
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got2[i], scaled ? 2.0f * want[i] : want[i]) << ref.fqn << i;
    }
  }
  EXPECT_EQ(seen, 2 * (3 * 4 + 1));

  // The encoder's copy must hold the decoder's values.
  const std::string path = dir + "/peft/adapter_model.safetensors";
  std::vector<TensorView> views;
  std::vector<std::vector<float>> keep;
  for (const SafetensorsEntry& e : file->tensors()) {
    keep.push_back(Floats(*file, e.name));
    if (e.name == enc + "self_attn.q_proj.lora_A.weight") keep.back()[0] += 1;
  }
  int i = 0;
  for (const SafetensorsEntry& e : file->tensors()) {
    views.push_back({e.name, "F32", e.shape,
                     absl::Span<const uint8_t>(
                         reinterpret_cast<const uint8_t*>(keep[i].data()),
                         keep[i].size() * 4)});
    ++i;
  }
  file.reset();
  SHARDD_ASSERT_OK(WriteSafetensors(path, views, {}).status());
  EXPECT_THAT(PeftAdapters::Open(dir + "/peft", spec, ones),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("differs from")));
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd
