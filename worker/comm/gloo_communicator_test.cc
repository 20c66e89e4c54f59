#include "worker/comm/gloo_communicator.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/in_memory_kv_client.h"
#include "worker/comm/kv_gloo_store.h"

namespace shardd {
namespace {

using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(10);

// Exact bf16 encodings of small values, written out by hand from the IEEE
// layout (sign | 8-bit exponent, bias 127 | 7-bit mantissa) so the test does
// not depend on the conversion under test.
uint16_t Bf16(float value) {
  // Only used for values with at most 8 significant bits, for which the
  // bf16 pattern is the top half of the fp32 pattern.
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  EXPECT_EQ(bits & 0xFFFFu, 0u) << value << " is not exact in bf16";
  return static_cast<uint16_t>(bits >> 16);
}

// Runs fn(rank) on one thread per rank (ranks are processes in real use) and
// returns each rank's status.
std::vector<absl::Status> OnAllRanks(
    int world_size, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> statuses(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] { statuses[r] = fn(r); });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
  }
}

// A group of communicators created concurrently through one in-memory
// key-value store, the way workers rendezvous through the coordinator.
class Group {
 public:
  Group(int world_size, const std::string& prefix,
        absl::Duration timeout = kTimeout)
      : comms_(world_size) {
    ExpectAllOk(OnAllRanks(world_size, [&](int r) -> absl::Status {
      KvGlooStore store(&kv_, timeout);
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(&store, prefix, r, world_size,
                                   GlooCommunicator::kDefaultBindAddress,
                                   timeout);
      if (!comm.ok()) return comm.status();
      comms_[r] = std::move(*comm);
      return absl::OkStatus();
    }));
  }

  bool ok() const {
    for (const auto& comm : comms_) {
      if (comm == nullptr) return false;
    }
    return true;
  }
  int size() const { return static_cast<int>(comms_.size()); }
  GlooCommunicator& operator[](int rank) { return *comms_[rank]; }
  void Destroy(int rank) { comms_[rank].reset(); }
  InMemoryKeyValueClient& kv() { return kv_; }

 private:
  InMemoryKeyValueClient kv_;
  std::vector<std::unique_ptr<GlooCommunicator>> comms_;
};

class GlooCommunicatorTest : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
  std::string Prefix() const {
    return absl::StrCat(
        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "/",
        world());
  }
};

TEST_P(GlooCommunicatorTest, CreateReportsRankAndSize) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  for (int r = 0; r < world(); ++r) {
    EXPECT_EQ(group[r].rank(), r);
    EXPECT_EQ(group[r].world_size(), world());
    EXPECT_EQ(group[r].prefix(), Prefix());
  }
  // Every rank of a multi-rank group published its endpoints under
  // "<prefix>/<rank>"; a single rank needs no rendezvous.
  if (world() == 1) {
    EXPECT_EQ(group.kv().set_calls(), 0);
  } else {
    for (int r = 0; r < world(); ++r) {
      EXPECT_THAT(
          group.kv().Get(absl::StrCat(Prefix(), "/", r), absl::ZeroDuration()),
          IsOk());
    }
  }
}

TEST_P(GlooCommunicatorTest, AllGatherFp32IsRankMajor) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  for (int64_t count : {1, 5}) {
    std::vector<std::vector<float>> out(world(),
                                        std::vector<float>(world() * count));
    ExpectAllOk(OnAllRanks(world(), [&](int r) {
      std::vector<float> in(count);
      for (int64_t i = 0; i < count; ++i) in[i] = 1000.0f * r + i;
      return group[r].AllGather(in.data(), out[r].data(), count, v1::FLOAT32,
                                kTimeout);
    }));
    for (int r = 0; r < world(); ++r) {
      for (int src = 0; src < world(); ++src) {
        for (int64_t i = 0; i < count; ++i) {
          EXPECT_EQ(out[r][src * count + i], 1000.0f * src + i)
              << "rank " << r << " src " << src << " i " << i;
        }
      }
    }
  }
}

TEST_P(GlooCommunicatorTest, AllGatherBf16InPlaceMovesBitPatterns) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  constexpr int64_t kCount = 3;
  std::vector<std::vector<uint16_t>> buf(
      world(), std::vector<uint16_t>(world() * kCount, 0xDEAD));
  ExpectAllOk(OnAllRanks(world(), [&](int r) {
    uint16_t* slot = buf[r].data() + r * kCount;
    // Arbitrary patterns, including a NaN encoding: only bytes move.
    for (int64_t i = 0; i < kCount; ++i) slot[i] = 0x7FC1 + 16 * r + i;
    return group[r].AllGather(slot, buf[r].data(), kCount, v1::BFLOAT16,
                              kTimeout);
  }));
  for (int r = 0; r < world(); ++r) {
    for (int src = 0; src < world(); ++src) {
      for (int64_t i = 0; i < kCount; ++i) {
        EXPECT_EQ(buf[r][src * kCount + i], 0x7FC1 + 16 * src + i);
      }
    }
  }
}

// Rank r contributes x_r[j] = (r + 1) * (j + 1). Summed over ranks:
// (j + 1) * W (W + 1) / 2; averaged: (j + 1) * (W + 1) / 2. Rank r owns
// elements j = r * count + i. All values are small integers or halves, so
// fp32 results are exact.
TEST_P(GlooCommunicatorTest, ReduceScatterFp32SumAndAvg) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    for (int64_t count : {1, 7}) {
      std::vector<std::vector<float>> out(w, std::vector<float>(count, -1));
      ExpectAllOk(OnAllRanks(w, [&](int r) {
        std::vector<float> in(w * count);
        for (int64_t j = 0; j < w * count; ++j) in[j] = (r + 1.0f) * (j + 1);
        return group[r].ReduceScatter(in.data(), out[r].data(), count,
                                      v1::FLOAT32, op, kTimeout);
      }));
      for (int r = 0; r < w; ++r) {
        for (int64_t i = 0; i < count; ++i) {
          const double j1 = r * count + i + 1;
          const double expected = op == ReduceOp::kSum ? j1 * w * (w + 1) / 2.0
                                                       : j1 * (w + 1) / 2.0;
          EXPECT_EQ(out[r][i], expected)
              << "rank " << r << " i " << i << " count " << count << " op "
              << static_cast<int>(op);
        }
      }
    }
  }
}

// Same closed form with x_r[j] = (r + 1) * (j % 8 + 1): sums up to 80 and
// averages in steps of 0.5 below 20, all exact in bf16's 8-bit significand.
TEST_P(GlooCommunicatorTest, ReduceScatterBf16SumAndAvgAreExact) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  constexpr int64_t kCount = 5;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    std::vector<std::vector<uint16_t>> out(w, std::vector<uint16_t>(kCount));
    ExpectAllOk(OnAllRanks(w, [&](int r) {
      std::vector<uint16_t> in(w * kCount);
      for (int64_t j = 0; j < w * kCount; ++j) {
        in[j] = Bf16((r + 1.0f) * (j % 8 + 1));
      }
      return group[r].ReduceScatter(in.data(), out[r].data(), kCount,
                                    v1::BFLOAT16, op, kTimeout);
    }));
    for (int r = 0; r < w; ++r) {
      for (int64_t i = 0; i < kCount; ++i) {
        const float k = (r * kCount + i) % 8 + 1;
        const float expected =
            op == ReduceOp::kSum ? k * w * (w + 1) / 2 : k * (w + 1) / 2;
        EXPECT_EQ(out[r][i], Bf16(expected)) << "rank " << r << " i " << i;
      }
    }
  }
}

TEST_P(GlooCommunicatorTest, ReduceScatterOutputMayAliasOwnInputChunk) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  constexpr int64_t kCount = 4;
  std::vector<std::vector<int64_t>> buf(w, std::vector<int64_t>(w * kCount));
  ExpectAllOk(OnAllRanks(w, [&](int r) {
    for (int64_t j = 0; j < w * kCount; ++j) buf[r][j] = 100 * r + j;
    return group[r].ReduceScatter(buf[r].data(), buf[r].data() + r * kCount,
                                  kCount, v1::INT64, ReduceOp::kSum, kTimeout);
  }));
  // sum_r (100 r + j) = 100 W (W - 1) / 2 + W j.
  for (int r = 0; r < w; ++r) {
    for (int64_t i = 0; i < kCount; ++i) {
      const int64_t j = r * kCount + i;
      EXPECT_EQ(buf[r][r * kCount + i], 50 * w * (w - 1) + w * j);
    }
  }
}

TEST_P(GlooCommunicatorTest, AllReduceFp32Bf16AndInt64) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  // 1 element (fewer than ranks) and enough to span several ring segments.
  for (int64_t count : {1, 3000}) {
    std::vector<std::vector<float>> f(w);
    std::vector<std::vector<uint16_t>> b(w);
    std::vector<std::vector<int64_t>> n(w);
    ExpectAllOk(OnAllRanks(w, [&](int r) -> absl::Status {
      f[r].resize(count);
      b[r].resize(count);
      n[r].resize(count);
      for (int64_t i = 0; i < count; ++i) {
        f[r][i] = (r + 1.0f) * (i % 100);
        b[r][i] = Bf16((r + 1.0f) * (i % 8));
        n[r][i] = (int64_t{1} << 40) * (r + 1) + i;
      }
      absl::Status s = group[r].AllReduce(f[r].data(), count, v1::FLOAT32,
                                          ReduceOp::kSum, kTimeout);
      if (!s.ok()) return s;
      s = group[r].AllReduce(b[r].data(), count, v1::BFLOAT16, ReduceOp::kAvg,
                             kTimeout);
      if (!s.ok()) return s;
      return group[r].AllReduce(n[r].data(), count, v1::INT64, ReduceOp::kSum,
                                kTimeout);
    }));
    const int64_t tri = int64_t{w} * (w + 1) / 2;
    for (int r = 0; r < w; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(f[r][i], static_cast<float>(tri * (i % 100)))
            << "rank " << r << " i " << i;
        ASSERT_EQ(b[r][i], Bf16((w + 1) / 2.0f * (i % 8)))
            << "rank " << r << " i " << i;
        ASSERT_EQ(n[r][i], (int64_t{1} << 40) * tri + w * i)
            << "rank " << r << " i " << i;
      }
    }
  }
}

TEST_P(GlooCommunicatorTest, BroadcastFromLastRank) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  const int root = w - 1;  // Non-zero whenever there are two ranks or more.
  constexpr int64_t kCount = 9;
  std::vector<std::vector<float>> f(w, std::vector<float>(kCount));
  std::vector<std::vector<int64_t>> n(w, std::vector<int64_t>(2));
  ExpectAllOk(OnAllRanks(w, [&](int r) -> absl::Status {
    for (int64_t i = 0; i < kCount; ++i) {
      f[r][i] = r == root ? 0.5f * i - 3 : -999.0f;
    }
    n[r] = {r == root ? int64_t{7} << 50 : 0, r == root ? -5 : 0};
    absl::Status s =
        group[r].Broadcast(f[r].data(), kCount, v1::FLOAT32, root, kTimeout);
    if (!s.ok()) return s;
    return group[r].Broadcast(n[r].data(), 2, v1::INT64, root, kTimeout);
  }));
  for (int r = 0; r < w; ++r) {
    for (int64_t i = 0; i < kCount; ++i) EXPECT_EQ(f[r][i], 0.5f * i - 3);
    EXPECT_EQ(n[r][0], int64_t{7} << 50);
    EXPECT_EQ(n[r][1], -5);
  }
}

TEST_P(GlooCommunicatorTest, BarrierWaitsForTheLastRank) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  std::atomic<int> arrived{0};
  std::vector<int> seen(world(), -1);
  ExpectAllOk(OnAllRanks(world(), [&](int r) {
    // The last rank arrives late; nobody may leave before it arrived.
    if (r == world() - 1) absl::SleepFor(absl::Milliseconds(50));
    arrived.fetch_add(1);
    absl::Status s = group[r].Barrier(kTimeout);
    seen[r] = arrived.load();
    return s;
  }));
  for (int r = 0; r < world(); ++r) EXPECT_EQ(seen[r], world()) << r;
}

TEST_P(GlooCommunicatorTest, StatsCountCallsAndBytes) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  ExpectAllOk(OnAllRanks(w, [&](int r) -> absl::Status {
    std::vector<float> in(6, 1.0f), out(6 * w);
    std::vector<uint16_t> big(10 * w, Bf16(1.0f)), small(10);
    for (int k = 0; k < 2; ++k) {
      absl::Status s =
          group[r].AllGather(in.data(), out.data(), 6, v1::FLOAT32, kTimeout);
      if (!s.ok()) return s;
    }
    absl::Status s = group[r].ReduceScatter(
        big.data(), small.data(), 10, v1::BFLOAT16, ReduceOp::kSum, kTimeout);
    if (!s.ok()) return s;
    s = group[r].AllReduce(in.data(), 6, v1::FLOAT32, ReduceOp::kAvg, kTimeout);
    if (!s.ok()) return s;
    s = group[r].Broadcast(in.data(), 3, v1::FLOAT32, 0, kTimeout);
    if (!s.ok()) return s;
    return group[r].Barrier(kTimeout);
  }));
  for (int r = 0; r < w; ++r) {
    const CommunicatorStats s = group[r].stats();
    EXPECT_EQ(s.all_gather.calls, 2);
    EXPECT_EQ(s.all_gather.bytes, 2 * 6 * w * 4);
    EXPECT_EQ(s.reduce_scatter.calls, 1);
    EXPECT_EQ(s.reduce_scatter.bytes, 10 * w * 2);
    EXPECT_EQ(s.all_reduce.calls, 1);
    EXPECT_EQ(s.all_reduce.bytes, 6 * 4);
    EXPECT_EQ(s.broadcast.calls, 1);
    EXPECT_EQ(s.broadcast.bytes, 3 * 4);
    EXPECT_EQ(s.barrier.calls, 1);
    EXPECT_EQ(s.barrier.bytes, 0);
    for (const CollectiveStats* c : {&s.all_gather, &s.reduce_scatter,
                                     &s.all_reduce, &s.broadcast, &s.barrier}) {
      EXPECT_EQ(c->failures, 0);
    }
  }
}

TEST_P(GlooCommunicatorTest, BadArgumentsAreRejectedWithoutBreakingTheGroup) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  std::vector<std::vector<absl::Status>> errors(w);
  ExpectAllOk(OnAllRanks(w, [&](int r) {
    GlooCommunicator& c = group[r];
    std::vector<int64_t> buf(4 * w);
    std::vector<int64_t> out(4 * w);
    errors[r] = {
        c.AllGather(buf.data(), out.data(), -1, v1::INT64, kTimeout),
        c.AllGather(buf.data(), out.data(), 4, v1::DTYPE_UNSPECIFIED, kTimeout),
        c.AllGather(nullptr, out.data(), 4, v1::INT64, kTimeout),
        c.ReduceScatter(buf.data(), out.data(), 4, v1::INT64, ReduceOp::kAvg,
                        kTimeout),
        c.ReduceScatter(buf.data(), out.data(), 1, v1::FLOAT8_E4M3,
                        ReduceOp::kSum, kTimeout),
        c.AllReduce(buf.data(), 4, v1::FLOAT32, ReduceOp::kSum,
                    absl::ZeroDuration()),
        c.AllReduce(buf.data(), 4, v1::FLOAT32, ReduceOp::kSum,
                    absl::InfiniteDuration()),
        c.Broadcast(buf.data(), 4, v1::INT64, w, kTimeout),
        c.Broadcast(buf.data(), 4, v1::INT64, -1, kTimeout),
        c.Barrier(-absl::Seconds(1)),
    };
    // Still usable: every rank rejected the same calls.
    return c.AllReduce(buf.data(), 4, v1::INT64, ReduceOp::kSum, kTimeout);
  }));
  const std::vector<std::string> fields = {
      "count_per_rank", "dtype",   "input", "kAvg", "cannot be reduced",
      "timeout",        "timeout", "root",  "root", "timeout"};
  for (int r = 0; r < w; ++r) {
    ASSERT_EQ(errors[r].size(), fields.size());
    for (size_t k = 0; k < fields.size(); ++k) {
      EXPECT_THAT(errors[r][k], StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr(fields[k])))
          << "rank " << r << " case " << k;
    }
    const CommunicatorStats s = group[r].stats();
    EXPECT_EQ(s.all_gather.failures, 3);
    EXPECT_EQ(s.all_reduce.calls, 3);
    EXPECT_EQ(s.all_reduce.failures, 2);
  }
}

// Rank r sends (r + j) % 3 + (r == j) elements to rank j (some pieces
// empty), each element encoding (sender, receiver, index), so every
// received element says where it came from; fp32, bf16 and int64 alike.
TEST_P(GlooCommunicatorTest, AllToAllVDeliversEachPieceToItsRank) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  auto count = [](int from, int to) -> int64_t {
    return (from + to) % 3 + (from == to ? 1 : 0);
  };
  auto value = [](int from, int to, int64_t i) -> int64_t {
    return 1000 * from + 100 * to + i;
  };
  ExpectAllOk(OnAllRanks(w, [&](int r) -> absl::Status {
    std::vector<int64_t> send_counts(w), recv_counts(w);
    std::vector<int64_t> send;
    std::vector<float> send_f;
    for (int j = 0; j < w; ++j) {
      send_counts[j] = count(r, j);
      recv_counts[j] = count(j, r);
      for (int64_t i = 0; i < send_counts[j]; ++i) {
        send.push_back(value(r, j, i));
        send_f.push_back(static_cast<float>(value(r, j, i)));
      }
    }
    int64_t total = 0;
    for (int64_t c : recv_counts) total += c;
    std::vector<int64_t> recv(total, -1);
    std::vector<float> recv_f(total, -1);
    SHARDD_RETURN_IF_ERROR(group[r].AllToAllV(send.data(), send_counts,
                                              recv.data(), recv_counts,
                                              v1::INT64, kTimeout));
    SHARDD_RETURN_IF_ERROR(group[r].AllToAllV(send_f.data(), send_counts,
                                              recv_f.data(), recv_counts,
                                              v1::FLOAT32, kTimeout));
    int64_t at = 0;
    for (int i = 0; i < w; ++i) {
      for (int64_t k = 0; k < recv_counts[i]; ++k, ++at) {
        if (recv[at] != value(i, r, k) ||
            recv_f[at] != static_cast<float>(value(i, r, k))) {
          return absl::InternalError(absl::StrCat(
              "rank ", r, " element ", at, " from rank ", i, ": got ",
              recv[at], " / ", recv_f[at], ", want ", value(i, r, k)));
        }
      }
    }
    // Equal counts exchange the per-expert counts the same way.
    std::vector<int64_t> ones(w, 1), mine(w, r), theirs(w, -1);
    SHARDD_RETURN_IF_ERROR(group[r].AllToAllV(
        mine.data(), ones, theirs.data(), ones, v1::INT64, kTimeout));
    for (int i = 0; i < w; ++i) {
      if (theirs[i] != i) return absl::InternalError("counts exchange");
    }
    return absl::OkStatus();
  }));
  for (int r = 0; r < w; ++r) {
    const CommunicatorStats s = group[r].stats();
    EXPECT_EQ(s.all_to_all.calls, 3);
    EXPECT_EQ(s.all_to_all.failures, 0);
    int64_t sent = 0;
    for (int j = 0; j < w; ++j) sent += count(r, j);
    EXPECT_EQ(s.all_to_all.bytes, sent * 8 + sent * 4 + w * 8);
  }
}

TEST_P(GlooCommunicatorTest, AllToAllVRejectsBadCountsWithoutBreakingTheGroup) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  const int w = world();
  std::vector<std::vector<absl::Status>> errors(w);
  ExpectAllOk(OnAllRanks(w, [&](int r) {
    GlooCommunicator& c = group[r];
    std::vector<int64_t> buf(4 * w), out(4 * w);
    std::vector<int64_t> ok(w, 1), shorter(w + 1, 1), negative(w, 1),
        self(w, 1);
    negative[w - 1] = -1;
    self[r] = 2;
    errors[r] = {
        c.AllToAllV(buf.data(), shorter, out.data(), ok, v1::INT64, kTimeout),
        c.AllToAllV(buf.data(), ok, out.data(), negative, v1::INT64, kTimeout),
        c.AllToAllV(buf.data(), ok, out.data(), self, v1::INT64, kTimeout),
        c.AllToAllV(nullptr, ok, out.data(), ok, v1::INT64, kTimeout),
        c.AllToAllV(buf.data(), ok, buf.data() + w - 1, ok, v1::INT64, kTimeout),
        c.AllToAllV(buf.data(), ok, out.data(), ok, v1::DTYPE_UNSPECIFIED,
                    kTimeout),
    };
    // Still usable: every rank rejected the same calls.
    return c.AllToAllV(buf.data(), ok, out.data(), ok, v1::INT64, kTimeout);
  }));
  const std::vector<std::string> fields = {
      "send_counts must have one entry per rank", "recv_counts[",
      "must equal send_counts", "send must not be null", "overlap", "dtype"};
  for (int r = 0; r < w; ++r) {
    ASSERT_EQ(errors[r].size(), fields.size());
    for (size_t k = 0; k < fields.size(); ++k) {
      EXPECT_THAT(errors[r][k], StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr(fields[k])))
          << "rank " << r << " case " << k;
    }
    EXPECT_EQ(group[r].stats().all_to_all.failures, 6);
  }
}

TEST_P(GlooCommunicatorTest, ZeroCountIsANoOp) {
  Group group(world(), Prefix());
  ASSERT_TRUE(group.ok());
  ExpectAllOk(OnAllRanks(world(), [&](int r) -> absl::Status {
    absl::Status s =
        group[r].AllGather(nullptr, nullptr, 0, v1::FLOAT32, kTimeout);
    if (!s.ok()) return s;
    s = group[r].ReduceScatter(nullptr, nullptr, 0, v1::FLOAT32, ReduceOp::kAvg,
                               kTimeout);
    if (!s.ok()) return s;
    return group[r].Barrier(kTimeout);
  }));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooCommunicatorTest,
                         ::testing::Values(1, 2, 3, 4),
                         ::testing::PrintToStringParamName());

TEST(GlooCommunicatorCreateTest, RejectsBadArguments) {
  InMemoryKeyValueClient kv;
  KvGlooStore store(&kv, absl::Seconds(1));
  const std::string local = GlooCommunicator::kDefaultBindAddress;
  EXPECT_THAT(GlooCommunicator::Create(nullptr, "p", 0, 1, local, kTimeout),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("store")));
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "", 0, 1, local, kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix")));
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "p", 0, 0, local, kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size")));
  EXPECT_THAT(GlooCommunicator::Create(&store, "p", 2, 2, local, kTimeout),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "p", 0, 2, "", kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bind_address")));
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "p", 0, 2, local, absl::ZeroDuration()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("timeout")));
  // 192.0.2.1 (TEST-NET-1) is never an address of this machine.
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "p", 0, 2, "192.0.2.1", kTimeout),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("bind_address '192.0.2.1'")));
  EXPECT_EQ(kv.set_calls(), 0);
}

TEST(GlooCommunicatorCreateTest, MissingPeerTimesOutTheRendezvous) {
  InMemoryKeyValueClient kv;
  const absl::Duration timeout = absl::Milliseconds(300);
  KvGlooStore store(&kv, timeout);
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      GlooCommunicator::Create(&store, "lonely", 0, 2,
                               GlooCommunicator::kDefaultBindAddress, timeout),
      StatusIs(absl::StatusCode::kDeadlineExceeded,
               AllOf(HasSubstr("lonely"), HasSubstr("rank 0 of 2"))));
  EXPECT_LT(absl::Now() - start, 2 * timeout);
}

// Ranks 0 and 1 run an all-gather that rank 2 never joins: both fail within
// about the timeout instead of hanging, the group refuses further work, and
// everything can be torn down.
TEST(GlooCommunicatorFaultTest, RankThatNeverJoinsTimesOutTheOthers) {
  Group group(3, "never-joins");
  ASSERT_TRUE(group.ok());
  const absl::Duration timeout = absl::Milliseconds(400);
  std::vector<absl::Duration> elapsed(3);
  std::vector<absl::Status> statuses = OnAllRanks(3, [&](int r) {
    if (r == 2) return absl::OkStatus();  // Alive, but never calls.
    std::vector<float> in(16, 1.0f), out(48);
    const absl::Time start = absl::Now();
    absl::Status s =
        group[r].AllGather(in.data(), out.data(), 16, v1::FLOAT32, timeout);
    elapsed[r] = absl::Now() - start;
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(statuses[r].code(), AnyOf(absl::StatusCode::kDeadlineExceeded,
                                          absl::StatusCode::kAborted))
        << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(std::string(statuses[r].message()),
                HasSubstr("AllGather on 'never-joins'"));
    EXPECT_LT(elapsed[r], 2 * timeout) << "rank " << r;
  }
  // At least one rank saw the timeout itself (the other may see the
  // connection it closed as a result).
  EXPECT_TRUE(statuses[0].code() == absl::StatusCode::kDeadlineExceeded ||
              statuses[1].code() == absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(group[0].Barrier(timeout),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("earlier failure")));
  EXPECT_EQ(group[0].stats().all_gather.failures, 1);
  EXPECT_EQ(group[0].stats().barrier.failures, 1);
  // The late rank finds its peers gone rather than waiting forever.
  const absl::Time start = absl::Now();
  const absl::Status late = group[2].Barrier(timeout);
  EXPECT_THAT(late.code(), AnyOf(absl::StatusCode::kAborted,
                                 absl::StatusCode::kDeadlineExceeded))
      << late;
  EXPECT_LT(absl::Now() - start, 2 * timeout);
  for (int r = 0; r < 3; ++r) group.Destroy(r);
}

// Rank 2 goes away (its connections close, as when its process dies) before
// the others start an all-reduce: they fail promptly with a clear status.
TEST(GlooCommunicatorFaultTest, VanishedPeerAbortsTheCollective) {
  Group group(3, "vanished");
  ASSERT_TRUE(group.ok());
  group.Destroy(2);
  const absl::Duration timeout = absl::Seconds(2);
  std::vector<absl::Duration> elapsed(2);
  std::vector<absl::Status> statuses = OnAllRanks(2, [&](int r) {
    std::vector<float> buf(64, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status s = group[r].AllReduce(buf.data(), 64, v1::FLOAT32,
                                        ReduceOp::kSum, timeout);
    elapsed[r] = absl::Now() - start;
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(statuses[r].code(), AnyOf(absl::StatusCode::kAborted,
                                          absl::StatusCode::kDeadlineExceeded))
        << "rank " << r << ": " << statuses[r];
    EXPECT_THAT(std::string(statuses[r].message()),
                HasSubstr("AllReduce on 'vanished'"));
    EXPECT_LT(elapsed[r], 2 * timeout) << "rank " << r;
  }
}

// Rank 2 goes away while ranks 0 and 1 are in the middle of an all-gather
// large enough to fill the socket buffers: writes to the dead connection
// must fail (not raise SIGPIPE) and both ranks return a clear status.
TEST(GlooCommunicatorFaultTest, PeerVanishingMidCollectiveAbortsIt) {
  Group group(3, "mid-collective");
  ASSERT_TRUE(group.ok());
  const absl::Duration timeout = absl::Seconds(3);
  constexpr int64_t kCount = 4 << 20;  // 16 MiB of fp32 per rank.
  std::vector<absl::Duration> elapsed(3);
  std::vector<absl::Status> statuses = OnAllRanks(3, [&](int r) {
    if (r == 2) {
      absl::SleepFor(absl::Milliseconds(100));
      group.Destroy(2);
      return absl::OkStatus();
    }
    std::vector<float> in(kCount, 1.0f), out(3 * kCount);
    const absl::Time start = absl::Now();
    absl::Status s =
        group[r].AllGather(in.data(), out.data(), kCount, v1::FLOAT32, timeout);
    elapsed[r] = absl::Now() - start;
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(statuses[r].code(), AnyOf(absl::StatusCode::kAborted,
                                          absl::StatusCode::kDeadlineExceeded))
        << "rank " << r << ": " << statuses[r];
    EXPECT_LT(elapsed[r], 2 * timeout) << "rank " << r;
  }
}

TEST(GlooCommunicatorHsdpTest, TwoGroupsPerRankWithDifferentPrefixes) {
  // 4 ranks as 2 replicas x 2 shards: shard group {2k, 2k+1}, replicate
  // group {k, k+2}. Both groups of one rank share one key-value store.
  InMemoryKeyValueClient kv;
  std::vector<std::unique_ptr<GlooCommunicator>> shard(4), replicate(4);
  std::vector<std::vector<float>> result(4);
  ExpectAllOk(OnAllRanks(4, [&](int r) -> absl::Status {
    KvGlooStore store(&kv, kTimeout);
    const std::string local = GlooCommunicator::kDefaultBindAddress;
    auto s = GlooCommunicator::Create(&store, absl::StrCat("shard", r / 2),
                                      r % 2, 2, local, kTimeout);
    if (!s.ok()) return s.status();
    shard[r] = std::move(*s);
    auto p = GlooCommunicator::Create(&store, absl::StrCat("replicate", r % 2),
                                      r / 2, 2, local, kTimeout);
    if (!p.ok()) return p.status();
    replicate[r] = std::move(*p);
    // Gradient r+1 everywhere: reduce-scatter within the shard group, then
    // all-reduce (average) across replicas.
    std::vector<float> grad(4, r + 1.0f);
    result[r].resize(2);
    absl::Status st =
        shard[r]->ReduceScatter(grad.data(), result[r].data(), 2, v1::FLOAT32,
                                ReduceOp::kAvg, kTimeout);
    if (!st.ok()) return st;
    return replicate[r]->AllReduce(result[r].data(), 2, v1::FLOAT32,
                                   ReduceOp::kAvg, kTimeout);
  }));
  // Average of 1..4 = 2.5 on every rank.
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(result[r], std::vector<float>({2.5f, 2.5f})) << r;
  }
}

}  // namespace
}  // namespace shardd
