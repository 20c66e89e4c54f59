#ifndef SHARDD_TESTING_RANDOM_PARAMS_H_
#define SHARDD_TESTING_RANDOM_PARAMS_H_

// Random values for every (untied) parameter of a model spec, for the model
// tests: norm weights near 1, DiffusionGemma's layer_scalar exactly 1, the
// rest uniform. Drawn in ListParams order from one seeded stream, so a spec
// and options always give the same values. And random token micro-batches
// for the same tests.

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "model/model_util.h"
#include "proto/model.pb.h"

namespace shardd {
namespace testing_util {

struct RandomParamOptions {
  uint32_t seed = 7;
  // Values uniform in [-range, range).
  float range = 0.5f;
  // Norm weights are 1 + norm_spread * (a value drawn as above).
  float norm_spread = 0.2f;
  // Round every value to bf16, so a bf16 run and its fp32 reference read the
  // same values.
  bool round_to_bf16 = false;
};

inline std::map<std::string, std::vector<float>> RandomParamValues(
    const v1::ModelSpec& spec,
    const RandomParamOptions& options = RandomParamOptions()) {
  std::mt19937 gen(options.seed);
  std::uniform_real_distribution<float> uni(-options.range, options.range);
  std::map<std::string, std::vector<float>> out;
  for (const ParamRef& ref : ListParams(spec)) {
    if (!ref.tensor->tied_to().empty()) continue;
    std::vector<float>& v = out[ref.fqn];
    v.resize(Numel(*ref.tensor));
    const bool norm = ref.fqn.find("norm") != std::string::npos;
    const bool scalar = ref.fqn.find("layer_scalar") != std::string::npos;
    for (float& x : v) {
      x = scalar ? 1.0f : norm ? 1.0f + options.norm_spread * uni(gen) : uni(gen);
      if (options.round_to_bf16) x = kernels::RoundToBf16(x);
    }
  }
  return out;
}

// Micro-batches of `tokens` token ids each, uniform over [0, vocab), and
// their targets, uniform too but every 5th (index % 5 == 3) ignored (-1);
// one stream seeded with `seed`, each micro-batch's inputs then targets.
struct TokenBatches {
  std::vector<std::vector<int32_t>> inputs, targets;
};

inline TokenBatches RandomTokenBatches(int microbatches, int64_t tokens,
                                       int64_t vocab, uint32_t seed) {
  TokenBatches b;
  std::mt19937 gen(seed);
  for (int m = 0; m < microbatches; ++m) {
    std::vector<int32_t> in(tokens), tg(tokens);
    for (int32_t& x : in) x = static_cast<int32_t>(gen() % vocab);
    for (int64_t i = 0; i < tokens; ++i) {
      tg[i] = i % 5 == 3 ? -1 : static_cast<int32_t>(gen() % vocab);
    }
    b.inputs.push_back(std::move(in));
    b.targets.push_back(std::move(tg));
  }
  return b;
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_RANDOM_PARAMS_H_
