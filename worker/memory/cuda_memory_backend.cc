#include "worker/memory/cuda_memory_backend.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace shardd {
namespace {

// Makes `device` current for the calling thread. The previous device is not
// restored: on a thread that never chose one, "restoring" device 0 would
// create a CUDA context on a GPU this rank may not use.
absl::Status MakeDeviceCurrent(int device) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    cudaGetLastError();
    current = -1;
  }
  if (current == device) return absl::OkStatus();
  const cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) cudaGetLastError();
  return CudaStatus(error, absl::StrCat("cudaSetDevice(", device, ")"));
}

}  // namespace

absl::StatusOr<void*> CudaMemoryBackend::Malloc(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes must be positive, got ", bytes));
  }
  const absl::Status device = MakeDeviceCurrent(device_);
  if (!device.ok()) return device;
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, static_cast<size_t>(bytes));
  if (error != cudaSuccess) {
    // An out-of-memory error is not sticky; clear it so later calls on
    // this thread do not report it again.
    cudaGetLastError();
    return CudaStatus(
        error, absl::StrCat(name(), ": cudaMalloc of ", bytes, " bytes"));
  }
  return ptr;
}

absl::Status CudaMemoryBackend::Free(void* ptr) {
  const absl::Status device = MakeDeviceCurrent(device_);
  if (!device.ok()) return device;
  return CudaStatus(cudaFree(ptr), absl::StrCat(name(), ": cudaFree"));
}

std::string CudaMemoryBackend::name() const {
  return absl::StrCat("cuda device ", device_);
}

}  // namespace shardd
