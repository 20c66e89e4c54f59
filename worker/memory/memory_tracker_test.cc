#include "worker/memory/memory_tracker.h"

#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

int I(MemoryKind k) { return static_cast<int>(k); }

TEST(MemoryTrackerTest, LiveAndPeakByKind) {
  MemoryTracker tracker;
  tracker.Allocate(MemoryKind::kShardParams, 100);
  tracker.Allocate(MemoryKind::kGatheredParams, 400);
  tracker.Allocate(MemoryKind::kUnshardedGrads, 800);
  tracker.Free(MemoryKind::kGatheredParams, 400);
  tracker.Allocate(MemoryKind::kGatheredParams, 300);
  MemorySnapshot s = tracker.Snapshot();
  EXPECT_EQ(s.live[I(MemoryKind::kGatheredParams)], 300);
  EXPECT_EQ(s.peak[I(MemoryKind::kGatheredParams)], 400);
  EXPECT_EQ(s.live_unsharded, 1100);
  EXPECT_EQ(s.peak_unsharded, 1200);  // 400 + 800 before the free.
  EXPECT_EQ(s.live_total, 1200);
  EXPECT_EQ(s.peak_total, 1300);
  tracker.ResetPeaks();
  s = tracker.Snapshot();
  EXPECT_EQ(s.peak_unsharded, 1100);
  EXPECT_EQ(tracker.over_frees(), 0);
  tracker.Free(MemoryKind::kWorkspace, 1);
  EXPECT_EQ(tracker.over_frees(), 1);
  EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kWorkspace)], 0);
}

TEST(MemoryTrackerTest, TrackedBufferAccountsItsLifetime) {
  MemoryTracker tracker;
  {
    TrackedBuffer a(&tracker, MemoryKind::kGatheredParams, 1000);
    ASSERT_FALSE(a.empty());
    a.as<char>()[999] = 1;  // Writable to its last byte.
    TrackedBuffer b = std::move(a);
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(tracker.Snapshot().live_unsharded, 1000);
    b.Reset();
    EXPECT_EQ(tracker.Snapshot().live_unsharded, 0);
    b = TrackedBuffer(&tracker, MemoryKind::kUnshardedGrads, 64);
  }
  MemorySnapshot s = tracker.Snapshot();
  EXPECT_EQ(s.live_total, 0);
  EXPECT_EQ(s.peak_unsharded, 1000);
  EXPECT_EQ(tracker.over_frees(), 0);
}

TEST(MemoryTrackerTest, CachedBlocksAreReusedAndAccountedApart) {
  MemoryTracker tracker;
  BufferCache cache(&tracker);
  void* first = nullptr;
  {
    TrackedBuffer a(&tracker, MemoryKind::kGatheredParams, 4096, &cache);
    first = a.data();
    EXPECT_EQ(tracker.Snapshot().live_unsharded, 4096);
  }
  // Freed into the cache: not live as gathered params, but reserved.
  MemorySnapshot s = tracker.Snapshot();
  EXPECT_EQ(s.live_unsharded, 0);
  EXPECT_EQ(s.live[I(MemoryKind::kCached)], 4096);
  EXPECT_EQ(cache.cached_bytes(), 4096);
  // The same size comes back as the same block; another size does not.
  TrackedBuffer b(&tracker, MemoryKind::kGatheredParams, 4096, &cache);
  EXPECT_EQ(b.data(), first);
  EXPECT_EQ(tracker.Snapshot().live[I(MemoryKind::kCached)], 0);
  TrackedBuffer c(&tracker, MemoryKind::kUnshardedGrads, 512, &cache);
  EXPECT_NE(c.data(), first);
  b.Reset();
  c.Reset();
  cache.Trim();
  s = tracker.Snapshot();
  EXPECT_EQ(s.live_total, 0);
  EXPECT_EQ(s.peak_unsharded, 4096 + 512);
  EXPECT_EQ(tracker.over_frees(), 0);
}

TEST(MemoryTrackerTest, ConcurrentUpdatesBalance) {
  MemoryTracker tracker;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&tracker] {
      for (int i = 0; i < 1000; ++i) {
        tracker.Allocate(MemoryKind::kWorkspace, 8);
        tracker.Free(MemoryKind::kWorkspace, 8);
      }
    });
  }
  for (auto& t : threads) t.join();
  MemorySnapshot s = tracker.Snapshot();
  EXPECT_EQ(s.live_total, 0);
  EXPECT_GE(s.peak_total, 8);
  EXPECT_LE(s.peak_total, 32);
  EXPECT_EQ(tracker.over_frees(), 0);
}

// (section: timeline-svg)
TEST(MemoryTrackerTest, TimelineRecordsUnshardedChangesOnly) {
  MemoryTracker tracker;
  tracker.Allocate(MemoryKind::kGatheredParams, 100);  // Not recording yet.
  EXPECT_TRUE(tracker.StopTimeline().empty());
  tracker.StartTimeline(3);
  tracker.Allocate(MemoryKind::kWorkspace, 7);  // Other kinds: no point.
  tracker.Allocate(MemoryKind::kUnshardedGrads, 40);
  tracker.Free(MemoryKind::kGatheredParams, 100);
  tracker.Allocate(MemoryKind::kGatheredParams, 10);
  tracker.Allocate(MemoryKind::kGatheredParams, 10);  // Over max_points.
  const std::vector<MemoryTimelinePoint> points = tracker.StopTimeline();
  ASSERT_EQ(points.size(), 3u);
  EXPECT_EQ(points[0].gathered_params, 100);
  EXPECT_EQ(points[0].unsharded_grads, 40);
  EXPECT_EQ(points[1].gathered_params, 0);
  EXPECT_EQ(points[1].unsharded_grads, 40);
  EXPECT_EQ(points[2].gathered_params, 10);
  tracker.Free(MemoryKind::kUnshardedGrads, 40);  // Stopped: no point.
  EXPECT_TRUE(tracker.StopTimeline().empty());
}

}  // namespace
}  // namespace shardd
