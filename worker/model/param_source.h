#ifndef SHARDD_WORKER_MODEL_PARAM_SOURCE_H_
#define SHARDD_WORKER_MODEL_PARAM_SOURCE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardd {

// Where the CPU model reads parameters and adds gradients: the worker's
// ShardStore, or a plain map in tests and the unsharded reference.
class ParamSource {
 public:
  virtual ~ParamSource() = default;
  // The unsharded fp32 values of a parameter (numel of its global shape).
  virtual absl::StatusOr<const float*> Param(const std::string& name) = 0;
  // grad[name] += values.
  virtual absl::Status AccumulateGrad(const std::string& name,
                                      const float* values) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_PARAM_SOURCE_H_
