#ifndef SHARDD_TESTING_MAP_PARAM_SOURCE_H_
#define SHARDD_TESTING_MAP_PARAM_SOURCE_H_

// A ParamSource over whole tensors in maps: the unsharded reference the
// model and executor tests compare against.

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/model/moe_model.h"

namespace shardd {
namespace testing_util {

class MapParamSource : public ParamSource {
 public:
  // NOT_FOUND for a name without a value.
  absl::StatusOr<const float*> Param(const std::string& name) override {
    auto it = values.find(name);
    if (it == values.end()) return absl::NotFoundError(name);
    return it->second.data();
  }
  // Adds `g` (as many elements as the value) into grads[name]. NOT_FOUND
  // for a name without a value.
  absl::Status AccumulateGrad(const std::string& name,
                              const float* g) override {
    auto it = values.find(name);
    if (it == values.end()) {
      return absl::NotFoundError(absl::StrCat("gradient of ", name));
    }
    std::vector<float>& v = grads[name];
    v.resize(it->second.size(), 0.0f);
    for (size_t i = 0; i < v.size(); ++i) v[i] += g[i];
    return absl::OkStatus();
  }

  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<float>> grads;
};

}  // namespace testing_util
}  // namespace shardd

#endif  // SHARDD_TESTING_MAP_PARAM_SOURCE_H_
