#ifndef SHARDD_WORKER_MEMORY_CUDA_MEMORY_BACKEND_H_
#define SHARDD_WORKER_MEMORY_CUDA_MEMORY_BACKEND_H_

// cudaMalloc / cudaFree as a DeviceMemoryBackend, for DeviceAllocator on a
// GPU (CUDA builds only). Both calls synchronize the device, which is why
// DeviceAllocator caches what it gets from here.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/memory/device_allocator.h"

namespace shardd {

// The allocator's opaque stream handle for a CUDA stream.
inline DeviceStream ToDeviceStream(cudaStream_t stream) {
  return static_cast<DeviceStream>(stream);
}

class CudaMemoryBackend : public DeviceMemoryBackend {
 public:
  // Allocates on CUDA device `device`. Malloc and Free make it the calling
  // thread's current device (and leave it so).
  explicit CudaMemoryBackend(int device) : device_(device) {}

  // Errors: RESOURCE_EXHAUSTED when the device is out of memory;
  // FAILED_PRECONDITION when the device is unusable; other CUDA errors as
  // mapped by CudaStatus.
  absl::StatusOr<void*> Malloc(int64_t bytes) override;
  // Errors: CUDA errors as mapped by CudaStatus.
  absl::Status Free(void* ptr) override;
  std::string name() const override;

  int device() const { return device_; }

 private:
  const int device_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MEMORY_CUDA_MEMORY_BACKEND_H_
