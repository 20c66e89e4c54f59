#ifndef SHARDD_WORKER_SHARDS_DEVICE_LORA_PARAMS_H_
#define SHARDD_WORKER_SHARDS_DEVICE_LORA_PARAMS_H_

// LoRA on the GPU (docs/lora.md): a DeviceParamSource over another that
// shows each adapted weight W merged with its adapters, W + s B A, and
// turns the gradient the model adds to W into the adapters' (the host
// store's LoraView / AccumulateGrad, shard_store.h). One lives for one
// FORWARD or BACKWARD command: the merged weights are made on first read
// (in fp32, with device_lora_merge.h's GEMMs, then in the unit's compute
// dtype) and freed with it, and Finish splits the gradients gathered in
// fp32 scratch into the adapters' gradients (added). Everything is
// stream-ordered on the model's stream; nothing waits for the device.
//
// Not run on a GPU yet (written 2026-12-07; cuda_backend_test's LoRA case
// and device_parity's lora row check it when a GPU is lent).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/lora.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/device_param_source.h"

namespace shardd {

class DeviceLoraParams final : public DeviceParamSource {
 public:
  // `targets` by base name, `inner`, `allocator` and the handle outlive
  // this; `stream` is the model's (the handle is bound to it).
  DeviceLoraParams(const absl::flat_hash_map<std::string, LoraTarget>* targets,
                   DeviceParamSource* inner, DeviceAllocator* allocator,
                   cublasHandle_t cublas, cudaStream_t stream)
      : targets_(targets),
        inner_(inner),
        allocator_(allocator),
        cublas_(cublas),
        stream_(stream) {}

  // An adapted weight merged (its dtype the inner source's), anything
  // else the inner source's. Errors: the inner source's; INTERNAL when the
  // weight's elements do not hold its LoRA geometry; cuBLAS errors.
  absl::StatusOr<DeviceTensor> Param(const std::string& name,
                                     void* stream) override;
  // An adapted weight: a zeroed fp32 scratch that Finish splits; anything
  // else the inner source's.
  absl::StatusOr<float*> Grad(const std::string& name, void* stream) override;
  // Adds each scratch's split, s B^T G and s G A^T, to the adapters'
  // gradients. Errors: the inner source's (the adapters' gradients need
  // their unit's ALLOC_GRAD), cuBLAS errors.
  absl::Status Finish();

 private:
  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes);
  // The tensor in fp32 (a cast into a temporary for bf16).
  absl::StatusOr<const float*> Fp32Of(const std::string& name);

  const absl::flat_hash_map<std::string, LoraTarget>* targets_;
  DeviceParamSource* inner_;
  DeviceAllocator* allocator_;
  cublasHandle_t cublas_;
  cudaStream_t stream_;
  std::map<std::string, DeviceTensor> merged_;   // By base name.
  std::map<std::string, const float*> fp32_;     // Adapters, by name.
  std::map<std::string, DeviceBuffer> scratch_;  // Bases' fp32 gradients.
  // Freed (stream-ordered) with this.
  std::vector<DeviceBuffer> temps_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_DEVICE_LORA_PARAMS_H_
