#include "worker/comm/collective_args.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kT = absl::Seconds(1);

void ExpectInvalid(const absl::Status& status, const char* needle) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr(needle)) << status;
}

CollectiveArgs Host(int rank, int world) {
  return CollectiveArgs(CollectiveArgs::Options{rank, world});
}

TEST(CollectiveArgsTest, SizesOfEachCollective) {
  const CollectiveArgs args = Host(1, 4);
  std::vector<float> buf(400);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CollectiveSizes g,
      args.AllGather(buf.data() + 10, buf.data(), 10, v1::FLOAT32, kT));
  EXPECT_EQ(g.element, 4);
  EXPECT_EQ(g.chunk, 40);
  EXPECT_EQ(g.total, 160);
  EXPECT_TRUE(g.in_place);  // rank 1's slot starts at element 10
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CollectiveSizes rs, args.ReduceScatter(buf.data(), buf.data() + 200, 25,
                                             v1::BFLOAT16, ReduceOp::kAvg, kT));
  EXPECT_EQ(rs.chunk, 50);
  EXPECT_EQ(rs.total, 200);
  EXPECT_FALSE(rs.in_place);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CollectiveSizes ar,
      args.AllReduce(buf.data(), 7, v1::INT64, ReduceOp::kSum, kT));
  EXPECT_EQ(ar.total, 56);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      AllToAllVBytes a2a,
      args.AllToAllV(buf.data(), {1, 2, 3, 4}, buf.data() + 100, {5, 2, 0, 0},
                     v1::FLOAT32, kT));
  EXPECT_EQ(a2a.send, 40);
  EXPECT_EQ(a2a.recv, 28);
  EXPECT_EQ(a2a.element, 4);
}

TEST(CollectiveArgsTest, RefusesWhatEveryBackendRefuses) {
  const CollectiveArgs args = Host(0, 2);
  std::vector<float> buf(64);
  ExpectInvalid(args.AllGather(buf.data(), buf.data() + 8, -1, v1::FLOAT32, kT)
                    .status(),
                "count_per_rank");
  ExpectInvalid(args.AllGather(nullptr, buf.data(), 4, v1::FLOAT32, kT).status(),
                "input");
  ExpectInvalid(
      args.AllGather(buf.data() + 2, buf.data(), 4, v1::FLOAT32, kT).status(),
      "overlaps");
  ExpectInvalid(args.AllReduce(buf.data(), 4, v1::INT32, ReduceOp::kAvg, kT)
                    .status(),
                "kAvg");
  ExpectInvalid(args.AllReduce(buf.data(), 4, v1::FLOAT16, ReduceOp::kSum, kT)
                    .status(),
                "cannot be reduced");
  ExpectInvalid(
      args.Broadcast(buf.data(), 4, v1::FLOAT32, 2, kT).status(), "root");
  ExpectInvalid(args.AllReduce(buf.data(), 4, v1::FLOAT32, ReduceOp::kSum,
                               absl::InfiniteDuration())
                    .status(),
                "timeout");
  ExpectInvalid(args.Barrier(absl::ZeroDuration()), "timeout");
  ExpectInvalid(args.AllToAllV(buf.data(), {1, 1}, buf.data() + 1, {1, 1},
                               v1::FLOAT32, kT)
                    .status(),
                "overlap");
  ExpectInvalid(args.AllToAllV(buf.data(), {1}, buf.data() + 8, {1, 1},
                               v1::FLOAT32, kT)
                    .status(),
                "send_counts");
  // Nothing to move: null buffers are fine.
  SHARDD_EXPECT_OK(args.AllGather(nullptr, nullptr, 0, v1::FLOAT32, kT).status());
}

TEST(CollectiveArgsTest, ReduceScatterOverlapFollowsTheBackend) {
  std::vector<float> buf(64);
  // Output overlapping input off this rank's chunk: Gloo reduces from a
  // copy and accepts it; NCCL-like backends refuse it.
  const CollectiveArgs gloo = Host(1, 2);
  SHARDD_EXPECT_OK(gloo.ReduceScatter(buf.data(), buf.data() + 3, 8,
                                      v1::FLOAT32, ReduceOp::kSum, kT)
                       .status());
  CollectiveArgs::Options strict{1, 2};
  strict.reduce_scatter_overlap_anywhere = false;
  const CollectiveArgs nccl(strict);
  ExpectInvalid(nccl
                    .ReduceScatter(buf.data(), buf.data() + 3, 8, v1::FLOAT32,
                                   ReduceOp::kSum, kT)
                    .status(),
                "overlaps input");
  SHARDD_ASSERT_OK_AND_ASSIGN(
      CollectiveSizes in_place,
      nccl.ReduceScatter(buf.data(), buf.data() + 8, 8, v1::FLOAT32,
                         ReduceOp::kSum, kT));
  EXPECT_TRUE(in_place.in_place);
}

TEST(CollectiveArgsTest, TheBackendsBufferCheckRunsOnEveryBuffer) {
  std::vector<std::string> seen;
  CollectiveArgs::Options options{0, 2};
  options.check_buffer = [&seen](const void*, int64_t bytes,
                                 absl::string_view name) {
    seen.push_back(std::string(name) + ":" + std::to_string(bytes));
    return name == "recv" ? absl::InvalidArgumentError("recv is host memory")
                          : absl::OkStatus();
  };
  const CollectiveArgs args(options);
  std::vector<float> buf(64);
  ExpectInvalid(args.AllToAllV(buf.data(), {2, 1}, buf.data() + 32, {2, 3},
                               v1::FLOAT32, kT)
                    .status(),
                "host memory");
  EXPECT_THAT(seen, ::testing::ElementsAre("send:12", "recv:20"));
}

}  // namespace
}  // namespace shardd
