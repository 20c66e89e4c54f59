#include "kernels/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace shardd {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(
      what, ": CUDA error ", static_cast<int>(error), " (",
      cudaGetErrorName(error), ": ", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(
      what, ": cuBLAS error ", static_cast<int>(status), " (",
      cublasGetStatusName(status), ": ", cublasGetStatusString(status), ")");
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::InvalidArgumentError(message);
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclStatus(ncclResult_t result, absl::string_view what) {
  if (result == ncclSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": NCCL error ", static_cast<int>(result), " (",
                   ncclGetErrorString(result), ")");
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::AbortedError(message);
    case ncclInProgress:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CheckCudaDevice(int device) {
  int device_count = 0;
  const cudaError_t error = cudaGetDeviceCount(&device_count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // Clear it: the next CUDA call must not see it.
    const absl::Status status =
        CudaStatus(error, "no usable CUDA device: cudaGetDeviceCount");
    // No driver or no device is a precondition of this machine, whatever
    // the CUDA error says.
    return absl::FailedPreconditionError(status.message());
  }
  if (device_count == 0) {
    return absl::FailedPreconditionError("no CUDA device is visible");
  }
  if (device < 0 || device >= device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist: ", device_count,
                     " visible, ordinals 0 to ", device_count - 1));
  }
  return absl::OkStatus();
}

}  // namespace shardd
