// Packed rows (MoeModel::SetRowSegments, docs/sft_data.md): a row holding
// several examples computes what each example computes alone: every
// target's cross-entropy (so the loss, the token-weighted mean) and every
// parameter gradient (the sum over the examples), for standard attention
// (Llama, Qwen3-MoE with q/k norms, GPT-OSS with sinks and a sliding
// window), DeepSeek-V3's latent attention and DiffusionGemma's causal pass
// (sliding and full layers, two RoPEs), within the fp32 bounds of
// testing/numerics.h (other block boundaries in the attention's online
// softmax, another summation order). RoPE positions restart at each
// example as transformers' position_ids do; RoPE being relative, what the
// values depend on is the attention staying inside the example (dropping
// key_begin fails this test; not restarting the positions does not).

#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "testing/map_param_source.h"
#include "testing/model_commands.h"
#include "testing/numerics.h"
#include "testing/random_params.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using testing_util::MapParamSource;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Result {
  double loss_sum = 0;  // Sum of the counted targets' cross-entropy.
  int64_t counted = 0;
  std::map<std::string, std::vector<float>> grads;  // Of the loss sum.
};

// One forward and backward of `rows` rows of `seq` tokens.
absl::StatusOr<Result> Run(const v1::ModelSpec& spec,
                           const std::map<std::string, std::vector<float>>& w,
                           const std::vector<int32_t>& inputs,
                           const std::vector<int32_t>& targets, int64_t rows,
                           int64_t seq, const std::vector<int32_t>* segments) {
  SHARDD_ASSIGN_OR_RETURN(auto model, MoeModel::Create(spec, {}));
  SHARDD_ASSIGN_OR_RETURN(const MoeArchitecture arch,
                          ReadMoeArchitecture(spec));
  MapParamSource source;
  source.values = w;
  model->ResetStep();
  SHARDD_RETURN_IF_ERROR(
      model->SetBatch(0, inputs.data(), targets.data(), rows, seq));
  if (segments != nullptr) {
    SHARDD_RETURN_IF_ERROR(model->SetRowSegments(0, segments->data()));
  }
  for (const v1::Command& c : testing_util::ModelStepCommands(
           arch.LayersWithExperts(), 1, 0, 1)) {
    SHARDD_RETURN_IF_ERROR(model->Run(c, &source));
  }
  Result r;
  for (int32_t t : targets) r.counted += t >= 0;
  // The step's loss is the mean over the counted targets, and so is the
  // gradient: scale both to sums.
  r.loss_sum = model->step_loss() * r.counted;
  for (auto& [name, g] : source.grads) {
    for (float& x : g) x *= static_cast<float>(r.counted);
    r.grads[name] = g;
  }
  return r;
}

double RelL2(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

void ExpectPackedEqualsAlone(const std::string& config) {
  SCOPED_TRACE(config);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadFile("tests/data/" + config)));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const auto w = testing_util::RandomParamValues(spec);
  // Two rows of 24: [5, 12, 4 tokens, 3 padding] and [9, 15].
  const std::vector<std::vector<int>> layout = {{5, 12, 4}, {9, 15}};
  constexpr int64_t kSeq = 24;
  std::mt19937 gen(17);
  std::vector<int32_t> inputs, targets, segments;
  std::vector<std::vector<int32_t>> ex_inputs, ex_targets;
  for (const std::vector<int>& row : layout) {
    int start = 0;
    for (int n : row) {
      std::vector<int32_t> in(n), tg(n);
      for (int j = 0; j < n; ++j) {
        in[j] = static_cast<int32_t>(gen() % arch.vocab);
        // Some targets ignored, and never one across the example's end.
        tg[j] = j + 1 < n && gen() % 4 != 0
                    ? static_cast<int32_t>(gen() % arch.vocab)
                    : -1;
      }
      inputs.insert(inputs.end(), in.begin(), in.end());
      targets.insert(targets.end(), tg.begin(), tg.end());
      segments.insert(segments.end(), n, start);
      ex_inputs.push_back(in);
      ex_targets.push_back(tg);
      start += n;
    }
    for (int j = start; j < kSeq; ++j) {
      inputs.push_back(0);
      targets.push_back(-1);
      segments.push_back(start);
    }
  }
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const Result packed,
      Run(spec, w, inputs, targets, 2, kSeq, &segments));
  double loss_sum = 0;
  int64_t counted = 0;
  std::map<std::string, std::vector<double>> grads;
  for (size_t e = 0; e < ex_inputs.size(); ++e) {
    const int64_t n = ex_inputs[e].size();
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const Result alone,
        Run(spec, w, ex_inputs[e], ex_targets[e], 1, n, nullptr));
    loss_sum += alone.loss_sum;
    counted += alone.counted;
    for (const auto& [name, g] : alone.grads) {
      std::vector<double>& sum = grads[name];
      sum.resize(g.size(), 0.0);
      for (size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
  }
  ASSERT_EQ(packed.counted, counted);
  const testing_util::StepTolerances tol =
      testing_util::MoeStepTolerances(spec.dims(), 2 * kSeq, 1);
  testing_util::ExpectRelativelyNear(packed.loss_sum, loss_sum, tol.loss);
  for (const auto& [name, want] : grads) {
    ASSERT_EQ(packed.grads.count(name), 1u) << name;
    EXPECT_LE(RelL2(packed.grads.at(name), want), tol.grad) << name;
  }
}

TEST(PackedRowsTest, EachExampleComputesWhatItComputesAlone) {
  for (const char* config :
       {"tiny_llama3.json", "tiny_qwen3_moe.json", "tiny_gpt_oss.json",
        "tiny_deepseek_v3.json", "tiny_diffusion_gemma.json"}) {
    ExpectPackedEqualsAlone(config);
  }
}

TEST(PackedRowsTest, BadSegmentsAreRefusedByIndex) {
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadFile("tests/data/tiny_qwen3_moe.json")));
  SHARDD_ASSERT_OK_AND_ASSIGN(auto model, MoeModel::Create(spec, {}));
  const std::vector<int32_t> tokens(8, 1);
  EXPECT_THAT(model->SetRowSegments(0, tokens.data()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  SHARDD_ASSERT_OK(model->SetBatch(0, tokens.data(), tokens.data(), 2, 4));
  // Row 1 (index 4) must start at 0; index 2 may not point back to 1.
  EXPECT_THAT(model->SetRowSegments(0, std::vector<int32_t>{0, 0, 1, 1,
                                                            1, 1, 1, 1}
                                           .data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("segment_starts[2]: 1 at row position 2")));
  EXPECT_THAT(model->SetRowSegments(0, std::vector<int32_t>{0, 0, 2, 2,
                                                            1, 1, 1, 1}
                                           .data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("segment_starts[4]")));
  SHARDD_EXPECT_OK(model->SetRowSegments(
      0, std::vector<int32_t>{0, 0, 2, 2, 0, 1, 1, 3}.data()));
}

}  // namespace
}  // namespace shardd
