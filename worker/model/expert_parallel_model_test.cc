// Expert parallelism in the model (docs/expert_parallel.md, step 3): ep
// ranks, each holding one block of every layer's experts and its own
// tokens, exchange the routed rows over Gloo (threads on loopback) and
// must compute what each rank computes alone with every expert: the same
// loss and non-expert gradients on every rank, and on the expert blocks
// the sum over the ranks' tokens of the single-rank gradients, within the
// fp32 bounds of testing/numerics.h (the experts' GEMMs run over other row
// groupings, and the block's gradient sums the ranks' tokens in another
// order).

#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "testing/map_param_source.h"
#include "testing/model_commands.h"
#include "testing/numerics.h"
#include "testing/random_params.h"
#include "program/pass_layout.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace {

using testing_util::MapParamSource;

constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr int64_t kBatch = 2;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool IsExpertTensor(const std::string& name) {
  return absl::StrContains(name, ".experts.");
}

struct RankResult {
  double loss = 0;
  std::map<std::string, std::vector<float>> grads;
};

// How a case runs: a standard next-token step, or DiffusionGemma's block
// diffusion (encode, self-conditioning decode, decode; the canvas's noise
// keyed by each rank's sequence keys).
struct Case {
  std::string config;
  int64_t seq = 8;
  bool diffusion = false;
};

MoeModelOptions OptionsFor(const Case& c) {
  MoeModelOptions o;
  if (c.diffusion) {
    o.passes = 3;
    o.no_grad_passes = 1;
  }
  return o;
}

// One step of micro-batch `tokens` on `model` reading `source`.
absl::StatusOr<RankResult> Step(MoeModel* model, const Case& c,
                                const std::vector<bool>& moe, int rank,
                                bool exchanged, MapParamSource* source,
                                const testing_util::TokenBatches& tokens) {
  model->ResetStep();
  SHARDD_RETURN_IF_ERROR(model->SetBatch(0, tokens.inputs[0].data(),
                                         tokens.targets[0].data(), kBatch,
                                         c.seq));
  std::vector<v1::Command> commands;
  if (c.diffusion) {
    const int64_t keys[kBatch] = {100 + 2 * rank, 101 + 2 * rank};
    SHARDD_RETURN_IF_ERROR(model->SetSequenceKeys(0, /*step=*/3, keys));
    commands = testing_util::ModelStepCommands(
        moe, PassLayout::For(kBlockDiffusionArchitecture, 3, 1), 1, exchanged);
  } else {
    commands = testing_util::ModelStepCommands(
        moe, PassLayout::For("", 1, 0), 1, exchanged);
  }
  for (const v1::Command& cmd : commands) {
    SHARDD_RETURN_IF_ERROR(model->Run(cmd, source));
  }
  RankResult out;
  out.loss = model->step_loss();
  out.grads = source->grads;
  return out;
}

double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) *
            (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

void ExpectEpMatchesLocal(const Case& c, int ep, bool recompute_experts,
                          bool recompute_layers = false) {
  SCOPED_TRACE(absl::StrCat(c.config, " ep ", ep,
                            recompute_experts ? " recompute experts" : "",
                            recompute_layers ? " recompute layers" : ""));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const v1::ModelSpec spec,
      ModelSpecFromHfConfig(ReadFile("tests/data/" + c.config)));
  SHARDD_ASSERT_OK_AND_ASSIGN(const MoeArchitecture arch,
                              ReadMoeArchitecture(spec));
  const std::vector<bool> moe = arch.LayersWithExperts();
  const int64_t experts = arch.layers[0].has_moe ? arch.layers[0].experts
                                                 : arch.layers.back().experts;
  const auto values = testing_util::RandomParamValues(spec);
  std::vector<testing_util::TokenBatches> tokens;
  for (int r = 0; r < ep; ++r) {
    tokens.push_back(
        testing_util::RandomTokenBatches(1, kBatch * c.seq, arch.vocab, 7 + r));
  }
  std::vector<bool> recompute(arch.layers.size(), recompute_layers);
  std::vector<bool> recompute_e(arch.layers.size(), recompute_experts);

  // Each rank alone, every expert local.
  std::vector<RankResult> local(ep);
  for (int r = 0; r < ep; ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(auto model,
                                MoeModel::Create(spec, OptionsFor(c)));
    SHARDD_ASSERT_OK(model->SetRecompute(recompute, recompute_e));
    MapParamSource source;
    source.values = values;
    SHARDD_ASSERT_OK_AND_ASSIGN(
        local[r], Step(model.get(), c, moe, r, false, &source, tokens[r]));
  }

  // The ep ranks together, each with its block of the experts.
  std::vector<RankResult> parallel(ep);
  std::vector<absl::Status> statuses(ep);
  InMemoryKeyValueClient kv;
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      statuses[r] = [&]() -> absl::Status {
        KvGlooStore store(&kv, kTimeout);
        SHARDD_ASSIGN_OR_RETURN(
            std::unique_ptr<GlooCommunicator> comm,
            GlooCommunicator::Create(&store, "ep", r, ep,
                                     GlooCommunicator::kDefaultBindAddress,
                                     kTimeout));
        SHARDD_ASSIGN_OR_RETURN(
            ExpertExchange exchange,
            ExpertExchange::Create(comm.get(), experts, kTimeout));
        SHARDD_ASSIGN_OR_RETURN(auto model,
                                MoeModel::Create(spec, OptionsFor(c)));
        SHARDD_RETURN_IF_ERROR(model->SetRecompute(recompute, recompute_e));
        SHARDD_RETURN_IF_ERROR(model->SetExpertExchange(&exchange, 2.0));
        MapParamSource source;
        for (const auto& [name, v] : values) {
          if (!IsExpertTensor(name)) {
            source.values[name] = v;
            continue;
          }
          const size_t block = v.size() / ep;
          source.values[name].assign(v.begin() + r * block,
                                     v.begin() + (r + 1) * block);
        }
        SHARDD_ASSIGN_OR_RETURN(
            parallel[r],
            Step(model.get(), c, moe, r, true, &source, tokens[r]));
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ep; ++r) ASSERT_THAT(statuses[r], IsOk()) << r;

  const testing_util::StepTolerances tol = testing_util::MoeStepTolerances(
      spec.dims(), ep * kBatch * c.seq, ep);
  int expert_tensors = 0;
  for (int r = 0; r < ep; ++r) {
    testing_util::ExpectRelativelyNear(parallel[r].loss, local[r].loss,
                                       tol.loss);
    for (const auto& [name, want_full] : local[r].grads) {
      ASSERT_EQ(parallel[r].grads.count(name), 1u) << name;
      const std::vector<float>& got = parallel[r].grads.at(name);
      if (!IsExpertTensor(name)) {
        ASSERT_EQ(got.size(), want_full.size()) << name;
        EXPECT_LE(RelL2(got, want_full), tol.grad) << name << " rank " << r;
        continue;
      }
      // Block r of the sum over every rank's tokens.
      ++expert_tensors;
      const size_t block = want_full.size() / ep;
      ASSERT_EQ(got.size(), block) << name;
      std::vector<float> want(block, 0.0f);
      for (int q = 0; q < ep; ++q) {
        const std::vector<float>& g = local[q].grads.at(name);
        for (size_t i = 0; i < block; ++i) want[i] += g[r * block + i];
      }
      EXPECT_LE(RelL2(got, want), tol.grad) << name << " rank " << r;
    }
  }
  EXPECT_GT(expert_tensors, 0);
}

TEST(ExpertParallelModelTest, MatchesEveryRankAloneWithAllExperts) {
  // Qwen3-MoE (attention with q/k norms), Mixtral, GPT-OSS (expert and
  // router biases, clamped SwiGLU, the load-balancing loss), DeepSeek-V3
  // (latent attention, shared experts, the group-limited router).
  for (const char* config : {"tiny_qwen3_moe.json", "tiny_mixtral.json",
                             "tiny_gpt_oss.json", "tiny_deepseek_v3.json"}) {
    for (int ep : {2, 4}) ExpectEpMatchesLocal({config}, ep, false);
  }
}

TEST(ExpertParallelModelTest, RecomputedExpertsDispatchAgain) {
  ExpectEpMatchesLocal({"tiny_qwen3_moe_aux.json"}, 2, true);
}

// DiffusionGemma: the experts sit inside the Gemma layer's EXPERTS, after
// the dense MLP and the router; every pass of the block-diffusion step
// (the no-grad self-conditioning decode included) exchanges its rows.
TEST(ExpertParallelModelTest, DiffusionGemmaBlockDiffusionStep) {
  const Case gemma{"tiny_diffusion_gemma.json", /*seq=*/12, /*diffusion=*/true};
  for (int ep : {2, 4}) ExpectEpMatchesLocal(gemma, ep, false);
  ExpectEpMatchesLocal(gemma, 2, /*recompute_experts=*/true);
  ExpectEpMatchesLocal(gemma, 2, false, /*recompute_layers=*/true);
}

}  // namespace
}  // namespace shardd
