// DeviceAllocator over cudaMalloc. Skips without a GPU, except the check
// that a missing GPU is reported cleanly.

#include "worker/memory/cuda_memory_backend.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/gpu.h"
#include "worker/memory/device_allocator.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {
namespace {

using ::shardd::testing_util::GpuCount;

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(CudaMemoryBackendTest, WithoutGpuMallocFailsCleanly) {
  std::string reason;
  if (GpuCount(&reason) > 0) GTEST_SKIP() << "a GPU is present";
  CudaMemoryBackend backend(0);
  EXPECT_THAT(backend.Malloc(1024),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  DeviceAllocator allocator(&backend, nullptr);
  EXPECT_THAT(allocator.Allocate(1024, MemoryKind::kWorkspace, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(allocator.stats().reserved_bytes, 0);
}

TEST(CudaMemoryBackendTest, StepLoopMallocsOnlyInTheFirstStep) {
  std::string reason;
  if (GpuCount(&reason) == 0) GTEST_SKIP() << "no GPU: " << reason;
  CudaMemoryBackend backend(0);
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
            cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking),
            cudaSuccess);
  const std::vector<int64_t> sizes = {3 * kMiB + 100, 64 * kMiB, 4096,
                                      700 * 1024};
  int64_t first_step_mallocs = -1;
  for (int step = 0; step < 5; ++step) {
    std::vector<DeviceBuffer> buffers;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const DeviceStream stream = ToDeviceStream(i % 2 == 0 ? compute : comm);
      SHARDD_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer buffer,
          DeviceBuffer::Allocate(&allocator, sizes[i],
                                 MemoryKind::kGatheredParams, stream));
      // The memory is real device memory of the right size.
      ASSERT_EQ(cudaMemsetAsync(buffer.data(), step + 1, sizes[i],
                                static_cast<cudaStream_t>(stream)),
                cudaSuccess);
      unsigned char last = 0;
      ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&last, buffer.as<unsigned char>() + sizes[i] - 1, 1,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(last, step + 1);
      buffers.push_back(std::move(buffer));
    }
    buffers.clear();
    const DeviceAllocatorStats stats = allocator.stats();
    if (step == 0) {
      first_step_mallocs = stats.backend_mallocs;
    } else {
      EXPECT_EQ(stats.backend_mallocs, first_step_mallocs) << "step " << step;
    }
    EXPECT_EQ(stats.backend_frees, 0);
    EXPECT_EQ(stats.live_bytes, 0);
  }
  const MemorySnapshot snapshot = tracker.Snapshot();
  EXPECT_EQ(snapshot.live[static_cast<int>(MemoryKind::kCached)],
            allocator.stats().reserved_bytes);
  SHARDD_ASSERT_OK(allocator.EmptyCache());
  EXPECT_EQ(allocator.stats().reserved_bytes, 0);
  cudaStreamDestroy(compute);
  cudaStreamDestroy(comm);
}

TEST(CudaMemoryBackendTest, OutOfMemoryIsResourceExhaustedAndRecoverable) {
  std::string reason;
  if (GpuCount(&reason) == 0) GTEST_SKIP() << "no GPU: " << reason;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  CudaMemoryBackend backend(0);
  DeviceAllocator allocator(&backend, nullptr);
  EXPECT_THAT(allocator.Allocate(static_cast<int64_t>(total_bytes) * 2,
                                 MemoryKind::kWorkspace, nullptr),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // The error was not left behind for the next CUDA call.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* p, allocator.Allocate(kMiB, MemoryKind::kWorkspace, nullptr));
  EXPECT_NE(p, nullptr);
  SHARDD_ASSERT_OK(allocator.Free(p));
}

}  // namespace
}  // namespace shardd
