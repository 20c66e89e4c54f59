#ifndef SHARDD_TESTING_TINY_MODELS_H_
#define SHARDD_TESTING_TINY_MODELS_H_

// Small models from tests/data for executor-level tests (test-only; the
// target needs //tests/data:configs in its data).

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/hf_config.h"
#include "proto/model.pb.h"

namespace shardd {
namespace testing_util {

// tests/data/tiny_diffusion_gemma.json with a 30-token vocabulary and
// 4-row canvases, so that sequences of 10 tokens hold a canvas after a
// prompt. Test failures (ADD_FAILURE) when the file or the edits are off.
inline v1::ModelSpec TinyDiffusionGemmaSpec() {
  std::ifstream in("tests/data/tiny_diffusion_gemma.json");
  std::stringstream text;
  text << in.rdbuf();
  std::string json = text.str();
  for (const auto& [from, to] :
       std::vector<std::pair<std::string, std::string>>{
           {"\"vocab_size\": 97", "\"vocab_size\": 30"},
           {"\"canvas_length\": 8", "\"canvas_length\": 4"}}) {
    const size_t at = json.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) json.replace(at, from.size(), to);
  }
  absl::StatusOr<v1::ModelSpec> spec = ModelSpecFromHfConfig(json);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? *spec : v1::ModelSpec();
}

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_TINY_MODELS_H_
