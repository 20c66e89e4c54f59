#ifndef SHARDD_WORKER_MODEL_DEVICE_PARAM_SOURCE_H_
#define SHARDD_WORKER_MODEL_DEVICE_PARAM_SOURCE_H_

// How the GPU model reads unsharded parameters and adds gradients: the
// device counterpart of ParamSource (worker/model/moe_model.h). The worker's
// DeviceShardStore implements it over its gathered buffers; tests implement
// it over plain device tensors. No CUDA headers: pointers are device
// addresses and the stream is an opaque cudaStream_t.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace shardd {

enum class DeviceDType { kFloat32, kBFloat16 };

// An unsharded parameter in device memory: numel elements of its global
// shape, row-major and contiguous, in the unit's compute dtype.
struct DeviceTensor {
  const void* data = nullptr;
  DeviceDType dtype = DeviceDType::kFloat32;
  int64_t numel = 0;
};

class DeviceParamSource {
 public:
  virtual ~DeviceParamSource() = default;
  // The parameter, valid until its unit reshards. Work on the model's
  // stream that reads it must be ordered after the unit's all-gather: the
  // source makes `stream` wait for it (an event, never a host wait) before
  // returning. Errors: NOT_FOUND (unknown name), FAILED_PRECONDITION (the
  // unit is not gathered).
  virtual absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                             void* stream) = 0;
  // The fp32 unsharded gradient of a trainable parameter (numel elements),
  // to be ADDED to by kernels on `stream`; valid until the unit's
  // reduce-scatter. Errors: NOT_FOUND, FAILED_PRECONDITION (gradient not
  // allocated, or the parameter is frozen).
  virtual absl::StatusOr<float*> Grad(const std::string& name,
                                      void* stream) = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_PARAM_SOURCE_H_
