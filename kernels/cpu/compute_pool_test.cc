#include "kernels/cpu/compute_pool.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class ComputePoolTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SHARDD_ASSERT_OK(SetComputeThreads(GetParam())); }
};

TEST_P(ComputePoolTest, EveryIndexOnceInFixedChunks) {
  for (int64_t n : {0, 1, 7, 64, 1000, 4097}) {
    for (int64_t grain : {-3, 1, 5, 64, 5000}) {
      std::vector<std::atomic<int>> hits(n);
      ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
        const int64_t g = std::max<int64_t>(grain, 1);
        // Boundaries are multiples of the grain, whatever the threads.
        EXPECT_EQ(begin % g, 0);
        EXPECT_EQ(end, std::min(n, begin + g));
        for (int64_t i = begin; i < end; ++i) {
          hits[i].fetch_add(1);
        }
      });
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain;
      }
    }
  }
}

TEST_P(ComputePoolTest, UsesThePoolThreads) {
  if (GetParam() == 1) GTEST_SKIP() << "one thread runs inline";
  // Each chunk waits (bounded) until another thread has started one, which
  // only happens when chunks run concurrently.
  std::atomic<int> started{0};
  std::atomic<bool> overlapped{false};
  ParallelFor(2, 1, [&](int64_t, int64_t) {
    started.fetch_add(1);
    for (int i = 0; i < 2000000 && started.load() < 2; ++i) {
      std::this_thread::yield();
    }
    if (started.load() == 2) overlapped = true;
  });
  EXPECT_TRUE(overlapped.load());
}

TEST_P(ComputePoolTest, NestedCallsRunInline) {
  std::atomic<int64_t> total{0};
  ParallelFor(8, 1, [&](int64_t, int64_t) {
    EXPECT_EQ(InParallelRegion(), GetParam() > 1);
    ParallelFor(100, 7, [&](int64_t begin, int64_t end) {
      total.fetch_add(end - begin);
    });
  });
  EXPECT_EQ(total.load(), 800);
  EXPECT_FALSE(InParallelRegion());
}

TEST_P(ComputePoolTest, ConcurrentCallersAllFinish) {
  // Two threads submitting at once: one gets the pool, the other runs
  // inline; both see every index.
  std::vector<int64_t> sums(2, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 200; ++round) {
        std::atomic<int64_t> sum{0};
        ParallelFor(1000, 10, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) sum.fetch_add(i);
        });
        sums[c] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sums[0], 200 * 999 * 1000 / 2);
  EXPECT_EQ(sums[1], 200 * 999 * 1000 / 2);
}

INSTANTIATE_TEST_SUITE_P(Threads, ComputePoolTest, ::testing::Values(1, 2, 5));

// Sets (or, for null, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old != nullptr) old_ = old;
    had_ = old != nullptr;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(ComputePoolSizeTest, ReadsTheEnvironment) {
  {
    ScopedEnv threads(kComputeThreadsEnv, "3");
    ScopedEnv blas("OPENBLAS_NUM_THREADS", "5");
    EXPECT_THAT(ComputeThreadsFromEnvironment(), IsOkAndHolds(3));
  }
  {
    ScopedEnv threads(kComputeThreadsEnv, nullptr);
    ScopedEnv blas("OPENBLAS_NUM_THREADS", "5");
    EXPECT_THAT(ComputeThreadsFromEnvironment(), IsOkAndHolds(5));
  }
  {
    ScopedEnv threads(kComputeThreadsEnv, nullptr);
    ScopedEnv blas("OPENBLAS_NUM_THREADS", nullptr);
    const absl::StatusOr<int> cpus = ComputeThreadsFromEnvironment();
    ASSERT_TRUE(cpus.ok());
    EXPECT_GE(*cpus, 1);
  }
  for (const char* bad : {"0", "-2", "two", "2x", "257"}) {
    ScopedEnv threads(kComputeThreadsEnv, bad);
    EXPECT_THAT(ComputeThreadsFromEnvironment(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("SHARDD_CPU_THREADS"),
                               HasSubstr("[1, 256]"), HasSubstr(bad))));
  }
}

TEST(ComputePoolSizeTest, RejectsOutOfRange) {
  EXPECT_THAT(SetComputeThreads(0), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("[1, 256]")));
  EXPECT_THAT(SetComputeThreads(257),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("257")));
  SHARDD_ASSERT_OK(SetComputeThreads(3));
  EXPECT_EQ(ComputeThreads(), 3);
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
