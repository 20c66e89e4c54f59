#include "server/rpc_latencies.h"

#include <cmath>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

TEST(RpcLatenciesTest, CountsEachCallInItsBucket) {
  RpcLatencies latencies;
  latencies.Record(RpcLatencies::kHeartbeat, absl::Microseconds(1));
  latencies.Record(RpcLatencies::kHeartbeat, absl::Microseconds(15));
  const RpcLatencies::Snapshot early = latencies.Get(RpcLatencies::kHeartbeat);
  latencies.Record(RpcLatencies::kHeartbeat, absl::Milliseconds(1));
  latencies.Record(RpcLatencies::kHeartbeat, absl::Seconds(100));
  latencies.Record(RpcLatencies::kBarrier, absl::Milliseconds(40));

  const RpcLatencies::Snapshot s = latencies.Get(RpcLatencies::kHeartbeat);
  ASSERT_EQ(s.bucket_counts.size(), RpcLatencies::kBounds + 1u);
  EXPECT_EQ(s.count, 4u);
  EXPECT_EQ(s.bucket_counts[0], 1u);                      // <= 10 us
  EXPECT_EQ(s.bucket_counts[1], 1u);                      // <= 20 us
  EXPECT_EQ(s.bucket_counts[7], 1u);                      // <= 1.28 ms
  EXPECT_EQ(s.bucket_counts[RpcLatencies::kBounds], 1u);  // > 84 s
  EXPECT_NEAR(s.sum, 100.001016, 1e-9);
  EXPECT_EQ(latencies.Get(RpcLatencies::kBarrier).count, 1u);
  EXPECT_EQ(latencies.Get(RpcLatencies::kPut).count, 0u);

  const RpcLatencies::Snapshot none;
  EXPECT_DOUBLE_EQ(RpcLatencies::Quantile(s, none, 0.5), 2e-5);
  EXPECT_DOUBLE_EQ(RpcLatencies::Quantile(s, none, 0.75), 1.28e-3);
  EXPECT_TRUE(std::isinf(RpcLatencies::Quantile(s, none, 1.0)));
  // Only the calls after `early`: 1 ms and 100 s.
  EXPECT_DOUBLE_EQ(RpcLatencies::Quantile(s, early, 0.5), 1.28e-3);
  EXPECT_EQ(RpcLatencies::Quantile(early, early, 0.5), 0.0);
  EXPECT_STREQ(RpcLatencies::Name(RpcLatencies::kBarrier), "Barrier");
}

TEST(RpcLatenciesTest, RecordsFromManyThreads) {
  RpcLatencies latencies;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        RpcLatencyScope scope(&latencies, RpcLatencies::kGet);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(latencies.Get(RpcLatencies::kGet).count, 40000u);
  // A null recorder records nothing and does not crash.
  { RpcLatencyScope scope(nullptr, RpcLatencies::kGet); }
}

}  // namespace
}  // namespace shardd
