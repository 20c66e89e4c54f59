#include "worker/data/rng.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace data {
namespace {

// Reference outputs of Vigna's splitmix64.c seeded with x = 0; pins the
// generator so every machine draws the same data.
TEST(SplitMix64Test, MatchesReferenceOutputs) {
  SplitMix64 rng(0);
  EXPECT_EQ(rng.Next(), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(rng.Next(), 0x6e789e6aa1b965f4ULL);
  EXPECT_EQ(rng.Next(), 0x06c45d188009454fULL);
}

TEST(SplitMix64Test, NextDoubleIsInUnitInterval) {
  SplitMix64 rng(42);
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = rng.NextDouble();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  // Mean of U[0,1) is 1/2 with standard error sqrt(1/12 / n) ~ 0.0009.
  EXPECT_NEAR(sum / n, 0.5, 0.005);
}

TEST(SplitMix64Test, NextBelowIsUniformOverRange) {
  SplitMix64 rng(7);
  const int n = 10;
  const int draws = 200000;
  std::vector<int> counts(n, 0);
  for (int i = 0; i < draws; ++i) {
    const uint64_t v = rng.NextBelow(n);
    ASSERT_LT(v, static_cast<uint64_t>(n));
    ++counts[v];
  }
  // Each bin expects 20000 with standard deviation ~134.
  for (int c : counts) EXPECT_NEAR(c, draws / n, 800);
  EXPECT_EQ(rng.NextBelow(1), 0u);
}

TEST(StreamSeedTest, DistinctKeysGiveDistinctSeeds) {
  std::set<uint64_t> seeds;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    for (uint64_t domain = 1; domain <= 3; ++domain) {
      for (uint64_t index = 0; index < 100; ++index) {
        seeds.insert(StreamSeed(seed, domain, index));
      }
    }
  }
  EXPECT_EQ(seeds.size(), 4u * 3u * 100u);
  EXPECT_EQ(StreamSeed(5, kSequenceDomain, 9),
            StreamSeed(5, kSequenceDomain, 9));
}

}  // namespace
}  // namespace data
}  // namespace shardd
