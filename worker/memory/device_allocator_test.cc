// The caching logic runs here on host memory (HostMemoryBackend); the same
// code runs over cudaMalloc in cuda_memory_backend_test.

#include "worker/memory/device_allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

int I(MemoryKind kind) { return static_cast<int>(kind); }

DeviceStream Stream(intptr_t n) { return reinterpret_cast<DeviceStream>(n); }

char* Ptr(void* p) { return static_cast<char*>(p); }

// The tracker view must always add up to the allocator's reservation.
void ExpectTrackerMatches(const MemoryTracker& tracker,
                          const DeviceAllocator& allocator) {
  const MemorySnapshot snapshot = tracker.Snapshot();
  const DeviceAllocatorStats stats = allocator.stats();
  EXPECT_EQ(snapshot.live_total, stats.live_bytes);
  EXPECT_EQ(snapshot.live_total + snapshot.live[I(MemoryKind::kCached)],
            stats.reserved_bytes);
  for (int k = 0; k < I(MemoryKind::kCached); ++k) {
    EXPECT_EQ(snapshot.live[k], stats.live_by_kind[k]) << "kind " << k;
  }
  EXPECT_EQ(tracker.over_frees(), 0);
}

TEST(DeviceAllocatorTest, RoundedSizes) {
  EXPECT_EQ(DeviceAllocator::RoundedSize(0), 0);
  EXPECT_EQ(DeviceAllocator::RoundedSize(1), 512);
  EXPECT_EQ(DeviceAllocator::RoundedSize(512), 512);
  EXPECT_EQ(DeviceAllocator::RoundedSize(513), 1024);
  EXPECT_EQ(DeviceAllocator::RoundedSize(3 * kMiB + 1), 3 * kMiB + 512);
}

TEST(DeviceAllocatorTest, SmallRequestsShareOneSegment) {
  HostMemoryBackend backend;
  DeviceAllocator allocator(&backend, nullptr);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* a, allocator.Allocate(1, MemoryKind::kWorkspace, nullptr));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* b, allocator.Allocate(1000, MemoryKind::kWorkspace, nullptr));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* c, allocator.Allocate(kMiB, MemoryKind::kShardParams, nullptr));
  // Carved from one 2 MiB segment, in address order, 512-byte granular.
  EXPECT_EQ(Ptr(b) - Ptr(a), 512);
  EXPECT_EQ(Ptr(c) - Ptr(b), 1024);
  DeviceAllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.backend_mallocs, 1);
  EXPECT_EQ(stats.reserved_bytes, 2 * kMiB);
  EXPECT_EQ(stats.live_bytes, 1 + 1000 + kMiB);
  EXPECT_EQ(stats.allocated_bytes, 512 + 1024 + kMiB);
  EXPECT_EQ(stats.live_by_kind[I(MemoryKind::kWorkspace)], 1001);
  EXPECT_EQ(stats.live_by_kind[I(MemoryKind::kShardParams)], kMiB);
  EXPECT_EQ(stats.allocations, 3);
  EXPECT_EQ(stats.cache_hits, 2);  // b and c came from a's split-off rest.
  // The segment is full now (2 MiB - 1.5 KiB - 1 MiB left, still fits).
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* d,
      allocator.Allocate(kMiB - 1536, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(Ptr(d) - Ptr(c), kMiB);
  EXPECT_EQ(allocator.stats().backend_mallocs, 1);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* e, allocator.Allocate(1, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(allocator.stats().backend_mallocs, 2);
  for (void* p : {a, b, c, d, e}) SHARDD_EXPECT_OK(allocator.Free(p));
  EXPECT_EQ(allocator.stats().live_bytes, 0);
  EXPECT_EQ(allocator.stats().allocated_bytes, 0);
}

TEST(DeviceAllocatorTest, LargeRequestSegments) {
  HostMemoryBackend backend;
  DeviceAllocator allocator(&backend, nullptr);
  // Below 10 MiB: a shared 20 MiB segment, split.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* a,
      allocator.Allocate(3 * kMiB, MemoryKind::kGatheredParams, nullptr));
  EXPECT_EQ(allocator.stats().reserved_bytes, 20 * kMiB);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* b,
      allocator.Allocate(5 * kMiB, MemoryKind::kGatheredParams, nullptr));
  EXPECT_EQ(Ptr(b) - Ptr(a), 3 * kMiB);
  EXPECT_EQ(allocator.stats().backend_mallocs, 1);
  // 10 MiB and up: a segment of its own, rounded to 2 MiB.
  // (It does not fit the 12 MiB left in the shared segment.)
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* c,
      allocator.Allocate(13 * kMiB + 5, MemoryKind::kUnshardedGrads, nullptr));
  EXPECT_EQ(allocator.stats().reserved_bytes, 20 * kMiB + 14 * kMiB);
  EXPECT_EQ(allocator.stats().backend_mallocs, 2);
  // A request that fits the shared segment's rest goes there.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* e, allocator.Allocate(12 * kMiB, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(Ptr(e) - Ptr(a), 8 * kMiB);
  EXPECT_EQ(allocator.stats().backend_mallocs, 2);
  // The 14 MiB segment keeps no 1 MiB - 512 B rest in the large pool, and
  // small requests never come from the large pool: a new small segment.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* d, allocator.Allocate(100, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(allocator.stats().reserved_bytes, 36 * kMiB);
  EXPECT_EQ(allocator.stats().backend_mallocs, 3);
  SHARDD_EXPECT_OK(allocator.Free(e));
  for (void* p : {a, b, c, d}) SHARDD_EXPECT_OK(allocator.Free(p));
}

TEST(DeviceAllocatorTest, FreedBlocksCoalesceAndEmptyCacheReleasesThem) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        void* p, allocator.Allocate(4096, MemoryKind::kWorkspace, nullptr));
    blocks.push_back(p);
  }
  ExpectTrackerMatches(tracker, allocator);
  // Free the middle first: nothing merges yet, then everything does.
  SHARDD_ASSERT_OK(allocator.Free(blocks[1]));
  SHARDD_ASSERT_OK(allocator.Free(blocks[0]));
  SHARDD_ASSERT_OK(allocator.Free(blocks[2]));
  ExpectTrackerMatches(tracker, allocator);
  EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kCached)], 2 * kMiB);
  // The coalesced segment serves a request as big as the whole segment.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* whole, allocator.Allocate(kMiB, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(whole, blocks[0]);
  // A segment with a live block stays.
  SHARDD_ASSERT_OK(allocator.EmptyCache());
  EXPECT_EQ(allocator.stats().reserved_bytes, 2 * kMiB);
  EXPECT_EQ(backend.frees(), 0);
  SHARDD_ASSERT_OK(allocator.Free(whole));
  SHARDD_ASSERT_OK(allocator.EmptyCache());
  const DeviceAllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.reserved_bytes, 0);
  EXPECT_EQ(stats.backend_frees, 1);
  EXPECT_EQ(backend.bytes_in_use(), 0);
  EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kCached)], 0);
  ExpectTrackerMatches(tracker, allocator);
}

TEST(DeviceAllocatorTest, FreeListsArePerStream) {
  HostMemoryBackend backend;
  DeviceAllocator allocator(&backend, nullptr);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* a, allocator.Allocate(8192, MemoryKind::kWorkspace, Stream(1)));
  SHARDD_ASSERT_OK(allocator.Free(a));
  // Another stream does not get stream 1's block...
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* b, allocator.Allocate(8192, MemoryKind::kWorkspace, Stream(2)));
  EXPECT_NE(b, a);
  EXPECT_EQ(allocator.stats().backend_mallocs, 2);
  // ...stream 1 does.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* c, allocator.Allocate(8192, MemoryKind::kWorkspace, Stream(1)));
  EXPECT_EQ(c, a);
  EXPECT_EQ(allocator.stats().backend_mallocs, 2);
  SHARDD_EXPECT_OK(allocator.Free(b));
  SHARDD_EXPECT_OK(allocator.Free(c));
}

// A step loop: after the first step, every request is served from the
// cache and the backend (cudaMalloc) is never called again.
TEST(DeviceAllocatorTest, StepLoopStopsCallingTheBackendAfterTheFirstStep) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  DeviceStream compute = Stream(1);
  DeviceStream all_gather = Stream(2);
  DeviceStream reduce_scatter = Stream(3);
  const std::vector<int64_t> layer_params = {3 * kMiB + 100, 24 * kMiB,
                                             700 * 1024, 5 * kMiB};
  int64_t mallocs_after_first_step = -1;
  for (int step = 0; step < 6; ++step) {
    allocator.ResetPeaks();
    std::vector<DeviceBuffer> gathered;
    std::vector<DeviceBuffer> grads;
    for (int64_t bytes : layer_params) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer params,
          DeviceBuffer::Allocate(&allocator, bytes, MemoryKind::kGatheredParams,
                                 all_gather));
      gathered.push_back(std::move(params));
      SHARDD_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer activations,
          DeviceBuffer::Allocate(&allocator, bytes / 3 + 17,
                                 MemoryKind::kWorkspace, compute));
      (void)activations;  // Freed at the end of the layer.
    }
    for (int i = static_cast<int>(layer_params.size()) - 1; i >= 0; --i) {
      SHARDD_ASSERT_OK_AND_ASSIGN(
          DeviceBuffer grad,
          DeviceBuffer::Allocate(&allocator, layer_params[i],
                                 MemoryKind::kUnshardedGrads, reduce_scatter));
      grads.push_back(std::move(grad));
      gathered[i].Reset();
      if (grads.size() > 2) grads.erase(grads.begin());
    }
    grads.clear();
    ExpectTrackerMatches(tracker, allocator);
    const DeviceAllocatorStats stats = allocator.stats();
    EXPECT_EQ(stats.live_bytes, 0);
    EXPECT_GT(stats.peak_by_kind[I(MemoryKind::kGatheredParams)], 0);
    if (step == 0) {
      mallocs_after_first_step = stats.backend_mallocs;
      EXPECT_GT(mallocs_after_first_step, 0);
    } else {
      EXPECT_EQ(stats.backend_mallocs, mallocs_after_first_step)
          << "step " << step;
    }
    EXPECT_EQ(stats.backend_frees, 0);
  }
  EXPECT_GT(allocator.stats().cache_hits, 0);
}

TEST(DeviceAllocatorTest, ReleasesTheCacheAndRetriesWhenOutOfMemory) {
  HostMemoryBackend backend(/*capacity_bytes=*/21 * kMiB);
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* small, allocator.Allocate(4096, MemoryKind::kWorkspace, nullptr));
  SHARDD_ASSERT_OK(allocator.Free(small));  // 2 MiB cached.
  // A 20 MiB segment fits only once the cached 2 MiB went back.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* big,
      allocator.Allocate(3 * kMiB, MemoryKind::kGatheredParams, nullptr));
  DeviceAllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.backend_frees, 1);
  EXPECT_EQ(stats.reserved_bytes, 20 * kMiB);
  ExpectTrackerMatches(tracker, allocator);
  // Nothing left to release: a clear RESOURCE_EXHAUSTED, and the
  // allocator stays usable.
  EXPECT_THAT(
      allocator.Allocate(30 * kMiB, MemoryKind::kWorkspace, nullptr),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("reserved")));
  EXPECT_EQ(allocator.stats().failed_allocations, 1);
  SHARDD_ASSERT_OK(allocator.Free(big));
  ExpectTrackerMatches(tracker, allocator);
}

TEST(DeviceAllocatorTest, WithoutReleaseOnOomTheRequestFails) {
  HostMemoryBackend backend(/*capacity_bytes=*/21 * kMiB);
  DeviceAllocator::Options options;
  options.release_cache_on_oom = false;
  DeviceAllocator allocator(&backend, nullptr, options);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* small, allocator.Allocate(4096, MemoryKind::kWorkspace, nullptr));
  SHARDD_ASSERT_OK(allocator.Free(small));
  EXPECT_THAT(
      allocator.Allocate(3 * kMiB, MemoryKind::kGatheredParams, nullptr),
      StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(allocator.stats().backend_frees, 0);
  EXPECT_THAT(
      allocator.Allocate(int64_t{1} << 62, MemoryKind::kWorkspace, nullptr),
      StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(DeviceAllocatorTest, RejectsBadArguments) {
  HostMemoryBackend backend;
  DeviceAllocator allocator(&backend, nullptr);
  EXPECT_THAT(allocator.Allocate(-1, MemoryKind::kWorkspace, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes")));
  EXPECT_THAT(allocator.Allocate(16, MemoryKind::kCached, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kind")));
  EXPECT_THAT(allocator.Allocate(16, MemoryKind::kNumKinds, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* zero, allocator.Allocate(0, MemoryKind::kWorkspace, nullptr));
  EXPECT_EQ(zero, nullptr);
  EXPECT_EQ(allocator.stats().allocations, 0);
  SHARDD_EXPECT_OK(allocator.Free(nullptr));

  SHARDD_ASSERT_OK_AND_ASSIGN(
      void* p, allocator.Allocate(2048, MemoryKind::kWorkspace, nullptr));
  EXPECT_THAT(allocator.Free(Ptr(p) + 512),
              StatusIs(absl::StatusCode::kInvalidArgument));
  int on_stack = 0;
  EXPECT_THAT(allocator.Free(&on_stack),
              StatusIs(absl::StatusCode::kInvalidArgument));
  SHARDD_ASSERT_OK(allocator.Free(p));
  EXPECT_THAT(allocator.Free(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("already freed")));
  EXPECT_THAT(
      DeviceBuffer::Allocate(nullptr, 1, MemoryKind::kWorkspace, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DeviceAllocatorTest, DeviceBufferReturnsItsMemory) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  {
    SHARDD_ASSERT_OK_AND_ASSIGN(
        DeviceBuffer a,
        DeviceBuffer::Allocate(&allocator, 1000, MemoryKind::kShardGrads,
                               Stream(4)));
    EXPECT_EQ(a.bytes(), 1000);
    EXPECT_EQ(a.kind(), MemoryKind::kShardGrads);
    EXPECT_EQ(a.stream(), Stream(4));
    DeviceBuffer b = std::move(a);
    EXPECT_TRUE(a.empty());
    EXPECT_FALSE(b.empty());
    EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kShardGrads)], 1000);
    b.Reset();
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kShardGrads)], 0);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        b, DeviceBuffer::Allocate(&allocator, 64, MemoryKind::kWorkspace,
                                  nullptr));
  }
  EXPECT_EQ(allocator.stats().live_bytes, 0);
  ExpectTrackerMatches(tracker, allocator);
}

// Random allocations and frees against a model: live blocks never overlap,
// the counters match, and everything coalesces back into whole segments.
TEST(DeviceAllocatorTest, RandomWorkloadKeepsInvariants) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  std::mt19937_64 rng(1234);
  struct Live {
    int64_t bytes;
    DeviceStream stream;
  };
  std::map<char*, Live> live;
  int64_t live_bytes = 0;
  for (int i = 0; i < 3000; ++i) {
    const bool allocate =
        live.empty() || (live.size() < 40 && rng() % 100 < 55);
    if (allocate) {
      // Mostly small, some medium, a few large.
      const int bucket = rng() % 10;
      const int64_t bytes = bucket < 6   ? 1 + rng() % 200000
                            : bucket < 9 ? kMiB + rng() % (8 * kMiB)
                                         : 10 * kMiB + rng() % (6 * kMiB);
      const DeviceStream stream = Stream(1 + rng() % 3);
      auto p = allocator.Allocate(bytes, MemoryKind::kWorkspace, stream);
      ASSERT_TRUE(p.ok()) << p.status();
      char* ptr = Ptr(*p);
      auto next = live.lower_bound(ptr);
      if (next != live.end()) {
        ASSERT_LE(ptr + DeviceAllocator::RoundedSize(bytes), next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(
            prev->first + DeviceAllocator::RoundedSize(prev->second.bytes),
            ptr);
      }
      // Host-backed: the block is writable at both ends.
      std::memset(ptr, 0xab, std::min<int64_t>(bytes, 1024));
      std::memset(ptr + bytes - std::min<int64_t>(bytes, 1024), 0xcd,
                  std::min<int64_t>(bytes, 1024));
      live.emplace(ptr, Live{bytes, stream});
      live_bytes += bytes;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      SHARDD_ASSERT_OK(allocator.Free(it->first));
      live_bytes -= it->second.bytes;
      live.erase(it);
    }
    ASSERT_EQ(allocator.stats().live_bytes, live_bytes);
  }
  ExpectTrackerMatches(tracker, allocator);
  for (auto& [ptr, block] : live) SHARDD_ASSERT_OK(allocator.Free(ptr));
  SHARDD_ASSERT_OK(allocator.EmptyCache());
  const DeviceAllocatorStats stats = allocator.stats();
  EXPECT_EQ(stats.reserved_bytes, 0);
  EXPECT_EQ(stats.allocated_bytes, 0);
  EXPECT_EQ(stats.backend_frees, stats.backend_mallocs);
  EXPECT_EQ(backend.bytes_in_use(), 0);
  ExpectTrackerMatches(tracker, allocator);
}

TEST(DeviceAllocatorTest, ConcurrentThreadsGetDisjointMemory) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  DeviceAllocator allocator(&backend, &tracker);
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<unsigned char*, int64_t>> mine;
      for (int i = 0; i < 400; ++i) {
        if (mine.size() < 8 && rng() % 2 == 0) {
          const int64_t bytes = 1 + rng() % (3 * kMiB);
          auto p =
              allocator.Allocate(bytes, MemoryKind::kWorkspace, Stream(t % 3));
          if (!p.ok()) {
            ++errors;
            return;
          }
          auto* ptr = static_cast<unsigned char*>(*p);
          for (int64_t j = 0; j < bytes; j += 4099) ptr[j] = t + 1;
          mine.emplace_back(ptr, bytes);
        } else if (!mine.empty()) {
          auto [ptr, bytes] = mine.back();
          mine.pop_back();
          // Nobody else wrote into this thread's block.
          for (int64_t j = 0; j < bytes; j += 4099) {
            if (ptr[j] != t + 1) ++errors;
          }
          if (!allocator.Free(ptr).ok()) ++errors;
        }
      }
      for (auto& [ptr, bytes] : mine) {
        if (!allocator.Free(ptr).ok()) ++errors;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(allocator.stats().live_bytes, 0);
  ExpectTrackerMatches(tracker, allocator);
}

TEST(DeviceAllocatorTest, DestructorReturnsCachedSegments) {
  HostMemoryBackend backend;
  MemoryTracker tracker;
  {
    DeviceAllocator allocator(&backend, &tracker);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        void* p, allocator.Allocate(5 * kMiB, MemoryKind::kWorkspace, nullptr));
    SHARDD_ASSERT_OK(allocator.Free(p));
    EXPECT_GT(backend.bytes_in_use(), 0);
  }
  EXPECT_EQ(backend.bytes_in_use(), 0);
  EXPECT_EQ(backend.mallocs(), backend.frees());
  EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kCached)], 0);
}

}  // namespace
}  // namespace shardd
