#ifndef SHARDD_KERNELS_CUDA_CUDA_STATUS_H_
#define SHARDD_KERNELS_CUDA_CUDA_STATUS_H_

// CUDA, cuBLAS and NCCL error codes as absl::Status, so device code reports
// failures through the same channel as the rest of shardd. The .cu launchers
// return the library's own error type; host wrappers convert it here.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardd {

// OK for cudaSuccess. cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED,
// cudaErrorNoDevice / cudaErrorInsufficientDriver -> FAILED_PRECONDITION,
// cudaErrorInvalidValue and friends -> INVALID_ARGUMENT, everything else ->
// INTERNAL. The message starts with `what` and names the CUDA error.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// CUBLAS_STATUS_ALLOC_FAILED -> RESOURCE_EXHAUSTED,
// CUBLAS_STATUS_INVALID_VALUE / NOT_SUPPORTED -> INVALID_ARGUMENT,
// CUBLAS_STATUS_NOT_INITIALIZED -> FAILED_PRECONDITION, others -> INTERNAL.
absl::Status CublasStatus(cublasStatus_t status, absl::string_view what);

// ncclInvalidArgument / ncclInvalidUsage -> INVALID_ARGUMENT,
// ncclRemoteError / ncclSystemError -> ABORTED (a peer or the network
// failed), ncclInProgress -> UNAVAILABLE (not finished yet), others ->
// INTERNAL.
absl::Status NcclStatus(ncclResult_t result, absl::string_view what);

// OK when CUDA device `device` is visible and the driver answers. Errors:
// FAILED_PRECONDITION (no driver, or no device visible), INVALID_ARGUMENT
// (`device` is negative or not below the number of visible devices), each
// saying which. Creates no context on the device.
absl::Status CheckCudaDevice(int device);

}  // namespace shardd

#define SHARDD_CUDA_RETURN_IF_ERROR(expr, what)                \
  do {                                                         \
    const cudaError_t shardd_cuda_error_ = (expr);             \
    if (shardd_cuda_error_ != cudaSuccess) {                   \
      return ::shardd::CudaStatus(shardd_cuda_error_, (what)); \
    }                                                          \
  } while (false)

#endif  // SHARDD_KERNELS_CUDA_CUDA_STATUS_H_
