#include "layout/shard_ranges.h"

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/plan.pb.h"
#include "model/model_util.h"
#include "layout/unit_layout.h"

namespace shardd {
namespace checkpoint {
namespace {

using ::testing::HasSubstr;

// Parameters w [10, 4], b [3, 5], n [7], laid out by the planner's code.
class ShardRangesTest : public ::testing::Test {
 protected:
  ShardRangesTest() {
    for (auto [name, shape] :
         std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"w", {10, 4}}, {"b", {3, 5}}, {"n", {7}}}) {
      v1::TensorSpec& t = tensors_.emplace_back();
      t.set_name(name);
      for (int64_t d : shape) t.add_shape(d);
      t.set_dtype(v1::FLOAT32);
      ParamRef ref;
      ref.fqn = name;
      ref.tensor = &t;
      refs_.push_back(ref);
    }
  }

  std::deque<v1::TensorSpec> tensors_;
  std::vector<ParamRef> refs_;
};

TEST_F(ShardRangesTest, Dim0RanksHoldTheirValidRowsOnly) {
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(refs_, 4, &unit));
  const v1::ParamLayout& w = unit.params(0);  // 3 rows per rank.
  const v1::ParamLayout& b = unit.params(1);  // 1 row per rank, rank 3 none.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto w0,
                              OwnedElementRanges(w, unit.shard_numel(), 0));
  ASSERT_EQ(w0.size(), 1u);
  EXPECT_EQ(w0[0].begin, 0);
  EXPECT_EQ(w0[0].end, 12);
  EXPECT_EQ(w0[0].shard_offset, 0);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto w3,
                              OwnedElementRanges(w, unit.shard_numel(), 3));
  ASSERT_EQ(w3.size(), 1u);
  EXPECT_EQ(w3[0].begin, 36);  // Row 9 only; rows 10, 11 are padding.
  EXPECT_EQ(w3[0].end, 40);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b2,
                              OwnedElementRanges(b, unit.shard_numel(), 2));
  ASSERT_EQ(b2.size(), 1u);
  EXPECT_EQ(b2[0].begin, 10);
  EXPECT_EQ(b2[0].end, 15);
  EXPECT_EQ(b2[0].shard_offset, 12);  // After w's 3 padded rows.
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b3,
                              OwnedElementRanges(b, unit.shard_numel(), 3));
  EXPECT_TRUE(b3.empty());
  EXPECT_THAT(OwnedElementRanges(w, unit.shard_numel(), 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("outside the 4 ranks")));
  EXPECT_THAT(OwnedElementRanges(w, unit.shard_numel(), -1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Over all ranks, every element of every parameter is owned exactly once and
// sits inside its rank's shard.
void ExpectExactCover(const v1::FsdpUnit& unit, int world) {
  for (const v1::ParamLayout& p : unit.params()) {
    std::vector<int> owners(p.numel(), 0);
    for (int r = 0; r < world; ++r) {
      auto ranges = OwnedElementRanges(p, unit.shard_numel(), r);
      ASSERT_THAT(ranges, IsOk());
      for (const OwnedRange& o : *ranges) {
        EXPECT_GE(o.shard_offset, 0);
        EXPECT_LE(o.shard_offset + (o.end - o.begin), unit.shard_numel());
        for (int64_t i = o.begin; i < o.end; ++i) ++owners[i];
      }
    }
    for (int64_t i = 0; i < p.numel(); ++i) {
      EXPECT_EQ(owners[i], 1) << p.name() << " element " << i;
    }
  }
}

TEST_F(ShardRangesTest, Dim0CoversEachElementOnce) {
  for (int world : {1, 2, 3, 4, 8, 16}) {
    v1::FsdpUnit unit;
    SHARDD_ASSERT_OK(LayoutDim0Shards(refs_, world, &unit));
    ExpectExactCover(unit, world);
  }
}

TEST_F(ShardRangesTest, FlatRangesMatchTheBucket) {
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutFlatRanges(refs_, 3, &unit));
  // 40 + 15 + 7 = 62 elements, padded to 63: 21 per rank. b = [40, 55)
  // straddles ranks 1 (elements [0, 2)) and 2 ([2, 15)).
  const v1::ParamLayout& b = unit.params(1);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b1,
                              OwnedElementRanges(b, unit.shard_numel(), 1));
  ASSERT_EQ(b1.size(), 1u);
  EXPECT_EQ(b1[0].begin, 0);
  EXPECT_EQ(b1[0].end, 2);
  EXPECT_EQ(b1[0].shard_offset, 19);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b2,
                              OwnedElementRanges(b, unit.shard_numel(), 2));
  ASSERT_EQ(b2.size(), 1u);
  EXPECT_EQ(b2[0].begin, 2);
  EXPECT_EQ(b2[0].end, 15);
  EXPECT_EQ(b2[0].shard_offset, 0);
  SHARDD_ASSERT_OK_AND_ASSIGN(auto b0,
                              OwnedElementRanges(b, unit.shard_numel(), 0));
  EXPECT_TRUE(b0.empty());
  for (int world : {1, 2, 3, 5, 64}) {
    v1::FsdpUnit flat;
    SHARDD_ASSERT_OK(LayoutFlatRanges(refs_, world, &flat));
    ExpectExactCover(flat, world);
  }
}

}  // namespace
}  // namespace checkpoint
}  // namespace shardd

namespace shardd {
namespace {

// Expert parallelism: rank r owns rows of block r / group only; a layout
// whose blocks and valid_rows disagree is refused when read unchecked.
TEST(ExpertParallelRangesTest, RanksOwnRowsOfTheirBlock) {
  v1::ParamLayout p;
  p.set_name("experts");
  p.add_global_shape(8);
  p.add_global_shape(4);
  p.set_shard_dim(0);
  p.set_numel(32);
  p.set_row_numel(4);
  p.set_ep_blocks(2);       // Blocks of 4 experts ...
  p.set_padded_dim0(4);     // ... over 2 ranks of 2 rows.
  p.set_rows_per_rank(2);
  p.add_valid_rows(2);
  p.add_valid_rows(2);
  p.set_local_numel(8);
  p.set_shard_offset(5);
  const std::vector<std::pair<int64_t, int64_t>> want = {
      {0, 8}, {8, 16}, {16, 24}, {24, 32}};
  for (int r = 0; r < 4; ++r) {
    SHARDD_ASSERT_OK_AND_ASSIGN(std::vector<OwnedRange> runs,
                                checkpoint::OwnedElementRanges(p, 13, r));
    ASSERT_EQ(runs.size(), 1u) << r;
    EXPECT_EQ(runs[0].begin, want[r].first) << r;
    EXPECT_EQ(runs[0].end, want[r].second) << r;
    EXPECT_EQ(runs[0].shard_offset, 5);
  }
  EXPECT_THAT(checkpoint::OwnedElementRanges(p, 13, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("outside the 4 ranks")));
  v1::ParamLayout bad = p;
  bad.set_ep_blocks(3);
  EXPECT_THAT(checkpoint::OwnedElementRanges(bad, 13, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::HasSubstr("ep_blocks 3 must divide dim 0 (8)")));
}

}  // namespace
}  // namespace shardd
