#include "kernels/cuda/cuda_status.h"

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

// Runs without a GPU: only the error-name tables of the libraries are used.
TEST(CudaStatusTest, MapsCudaErrors) {
  EXPECT_THAT(CudaStatus(cudaSuccess, "x"), IsOk());
  EXPECT_THAT(CudaStatus(cudaErrorMemoryAllocation, "alloc gathered"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("alloc gathered: CUDA error 2")));
  EXPECT_THAT(CudaStatus(cudaErrorNoDevice, "probe"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("cudaErrorNoDevice")));
  EXPECT_THAT(CudaStatus(cudaErrorInvalidValue, "memcpy"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaStatus(cudaErrorLaunchFailure, "kernel"),
              StatusIs(absl::StatusCode::kInternal));
}

TEST(CudaStatusTest, MapsCublasErrors) {
  EXPECT_THAT(CublasStatus(CUBLAS_STATUS_SUCCESS, "x"), IsOk());
  EXPECT_THAT(CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "gemm"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("CUBLAS_STATUS_ALLOC_FAILED")));
  EXPECT_THAT(CublasStatus(CUBLAS_STATUS_INVALID_VALUE, "gemm"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CublasStatus(CUBLAS_STATUS_EXECUTION_FAILED, "gemm"),
              StatusIs(absl::StatusCode::kInternal));
}

TEST(CudaStatusTest, MapsNcclErrors) {
  EXPECT_THAT(NcclStatus(ncclSuccess, "x"), IsOk());
  EXPECT_THAT(NcclStatus(ncclRemoteError, "all-gather"),
              StatusIs(absl::StatusCode::kAborted,
                       HasSubstr("all-gather: NCCL error")));
  EXPECT_THAT(NcclStatus(ncclInvalidArgument, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NcclStatus(ncclInProgress, "init"),
              StatusIs(absl::StatusCode::kUnavailable));
}

// Runs with and without a GPU: the answer must match what the driver says.
TEST(CudaStatusTest, CheckCudaDeviceMatchesTheDriver) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  cudaGetLastError();
  if (error != cudaSuccess || count == 0) {
    EXPECT_THAT(CheckCudaDevice(0),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("CUDA device")));
    return;
  }
  EXPECT_THAT(CheckCudaDevice(0), IsOk());
  EXPECT_THAT(CheckCudaDevice(count - 1), IsOk());
  EXPECT_THAT(CheckCudaDevice(count),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("does not exist")));
  EXPECT_THAT(CheckCudaDevice(-1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace shardd
