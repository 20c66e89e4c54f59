#ifndef SHARDD_TESTING_RANDOM_PARAMS_H_
#define SHARDD_TESTING_RANDOM_PARAMS_H_

// Random values for every (untied) parameter of a model spec, for the model
// tests: norm weights near 1, DiffusionGemma's layer_scalar exactly 1, the
// rest uniform. Drawn in ListParams order from one seeded stream, so a spec
// and options always give the same values.

#include <cstdint>
#include <map>
#include <random>
#include <string>
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

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_RANDOM_PARAMS_H_
