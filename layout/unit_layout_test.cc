#include "layout/unit_layout.h"

#include <cstdint>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/strategy_test_util.h"

namespace shardd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Owns the tensors the ParamRefs point to.
class Params {
 public:
  Params& Add(const std::string& name, std::vector<int64_t> shape,
              bool frozen = false) {
    v1::TensorSpec& tensor = tensors_.emplace_back();
    tensor.set_name(name);
    for (int64_t dim : shape) tensor.add_shape(dim);
    tensor.set_dtype(v1::BFLOAT16);
    tensor.set_frozen(frozen);
    ParamRef ref;
    ref.fqn = name;
    ref.tensor = &tensor;
    refs_.push_back(ref);
    return *this;
  }
  const std::vector<ParamRef>& refs() const { return refs_; }

 private:
  std::deque<v1::TensorSpec> tensors_;  // Stable addresses.
  std::vector<ParamRef> refs_;
};

std::vector<int64_t> Vec(const google::protobuf::RepeatedField<int64_t>& f) {
  return std::vector<int64_t>(f.begin(), f.end());
}

TEST(LayoutDim0Test, DimNotDivisibleByWorld) {
  // d0 = 10 over W = 4: ceil(10/4) = 3 rows per rank, padded to 12; ranks
  // hold 3, 3, 3 and 10 - 9 = 1 real rows.
  Params params;
  params.Add("w", {10, 4});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 4, &unit));
  ASSERT_EQ(unit.params_size(), 1);
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.name(), "w");
  EXPECT_THAT(Vec(p.global_shape()), ElementsAre(10, 4));
  EXPECT_EQ(p.dtype(), v1::BFLOAT16);
  EXPECT_EQ(p.shard_dim(), 0);
  EXPECT_EQ(p.padded_dim0(), 12);
  EXPECT_EQ(p.rows_per_rank(), 3);
  EXPECT_THAT(Vec(p.local_shape()), ElementsAre(3, 4));
  EXPECT_EQ(p.local_numel(), 12);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(3, 3, 3, 1));
  EXPECT_EQ(p.shard_offset(), 0);
  EXPECT_EQ(p.unsharded_offset(), 0);
  EXPECT_EQ(p.numel(), 40);
  EXPECT_EQ(p.first_shard_rank(), 0);
  EXPECT_EQ(p.last_shard_rank(), 0);
  EXPECT_EQ(unit.numel(), 40);
  EXPECT_EQ(unit.shard_numel(), 12);
  EXPECT_EQ(unit.gathered_numel(), 48);
  EXPECT_EQ(unit.trainable_numel(), 40);
}

TEST(LayoutDim0Test, DimDivisibleByWorld) {
  Params params;
  params.Add("w", {8, 2});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 4, &unit));
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.padded_dim0(), 8);
  EXPECT_EQ(p.rows_per_rank(), 2);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(2, 2, 2, 2));
  EXPECT_EQ(p.local_numel(), 4);
  EXPECT_EQ(unit.gathered_numel(), 16);  // No padding: exactly the numel.
}

TEST(LayoutDim0Test, FewerExpertsThanRanks) {
  // 3 experts over 8 ranks on dim 0 (FSDP2's Shard(0)): one expert row per
  // rank on ranks 0-2, ranks 3-7 hold padding only.
  Params params;
  params.Add("experts.down_projs", {3, 4, 5});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(
      LayoutDim0Shards(params.refs(), 8, &unit, ShardPlacement::kDim0));
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.padded_dim0(), 8);
  EXPECT_EQ(p.rows_per_rank(), 1);
  EXPECT_THAT(Vec(p.local_shape()), ElementsAre(1, 4, 5));
  EXPECT_EQ(p.local_numel(), 20);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(1, 1, 1, 0, 0, 0, 0, 0));
  EXPECT_EQ(unit.numel(), 60);
  EXPECT_EQ(unit.shard_numel(), 20);
  EXPECT_EQ(unit.gathered_numel(), 160);
}

TEST(LayoutDim0Test, AutoSplitsPaddedExpertsByElements) {
  // The same 3 experts over 8 ranks under kAuto: dim 0 would give each rank
  // 20 elements against an even share of 7.5 (+1% + one row of 5 = 12.6),
  // so the 60 elements are split in 8 ranges of 8 (the last 4).
  Params params;
  params.Add("experts.down_projs", {3, 4, 5}).Add("router", {3, 4});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 8, &unit));
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.shard_dim(), 0);
  EXPECT_EQ(p.row_numel(), 1);
  EXPECT_EQ(p.padded_dim0(), 64);
  EXPECT_EQ(p.rows_per_rank(), 8);
  EXPECT_THAT(Vec(p.local_shape()), ElementsAre(8));
  EXPECT_EQ(p.local_numel(), 8);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(8, 8, 8, 8, 8, 8, 8, 4));
  EXPECT_THAT(Vec(p.global_shape()), ElementsAre(3, 4, 5));
  // A 2-D parameter keeps dim 0 (it can never pad a whole extra row).
  const v1::ParamLayout& router = unit.params(1);
  EXPECT_EQ(router.row_numel(), 4);
  EXPECT_THAT(Vec(router.valid_rows()), ElementsAre(1, 1, 1, 0, 0, 0, 0, 0));
  EXPECT_EQ(unit.shard_numel(), 8 + 4);
  // Divisible experts stay on dim 0.
  Params even;
  even.Add("experts.down_projs", {8, 4, 5});
  v1::FsdpUnit even_unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(even.refs(), 8, &even_unit));
  EXPECT_EQ(even_unit.params(0).row_numel(), 20);
  EXPECT_THAT(Vec(even_unit.params(0).local_shape()), ElementsAre(1, 4, 5));
}

TEST(LayoutDim0Test, DimZeroPadsTooMuchIsTheStatedRule) {
  // 1-D and 2-D shapes never: ceil(d0 / W) rows exceed d0 / W by < 1 row.
  EXPECT_FALSE(DimZeroPadsTooMuch({3}, 8));
  EXPECT_FALSE(DimZeroPadsTooMuch({3, 1000}, 8));
  // Mixtral's experts [8, 14336, 4096] at 32 ranks: 4x the even share.
  EXPECT_TRUE(DimZeroPadsTooMuch({8, 14336, 4096}, 32));
  EXPECT_FALSE(DimZeroPadsTooMuch({8, 14336, 4096}, 8));
  EXPECT_FALSE(DimZeroPadsTooMuch({8, 14336, 4096}, 1));
  // 128 experts on 3 ranks: 43 rows against 42.67, 0.8% over: dim 0.
  EXPECT_FALSE(DimZeroPadsTooMuch({128, 2, 2}, 3));
  // 100 experts [4, 1] on 3 ranks: 34 x 4 = 136 elements against
  // 1.01 x 133.33 + 1 = 135.67: elements.
  EXPECT_TRUE(DimZeroPadsTooMuch({100, 4, 1}, 3));
  // [2, 2] experts: 136 against 1.01 x 133.33 + 2 = 136.67: dim 0.
  EXPECT_FALSE(DimZeroPadsTooMuch({100, 2, 2}, 3));
  for (const auto& [name, want] :
       std::vector<std::pair<std::string, ShardPlacement>>{
           {"auto", ShardPlacement::kAuto},
           {"", ShardPlacement::kAuto},
           {"dim0", ShardPlacement::kDim0}}) {
    absl::StatusOr<ShardPlacement> got = ParseShardPlacement(name);
    ASSERT_TRUE(got.ok()) << name;
    EXPECT_EQ(*got, want) << name;
  }
  EXPECT_THAT(ParseShardPlacement("dim1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard_placement")));
}

TEST(LayoutDim0Test, SingleRankHoldsEverything) {
  Params params;
  params.Add("w", {10, 4});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 1, &unit));
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.padded_dim0(), 10);
  EXPECT_EQ(p.rows_per_rank(), 10);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(10));
  EXPECT_EQ(p.local_numel(), 40);
  EXPECT_EQ(unit.gathered_numel(), 40);
}

TEST(LayoutDim0Test, MultiParamOffsetsAndFrozen) {
  // W = 4. [10,4]: 3 rows/rank, local 12. [3]: 1 row/rank, local 1, valid
  // 1,1,1,0. [5,2]: 2 rows/rank, local 4, valid 2,2,1,0.
  Params params;
  params.Add("a", {10, 4}).Add("b", {3}, /*frozen=*/true).Add("c", {5, 2});
  v1::FsdpUnit unit;
  unit.set_name("u");
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 4, &unit));
  ASSERT_EQ(unit.params_size(), 3);
  EXPECT_EQ(unit.params(0).shard_offset(), 0);
  EXPECT_EQ(unit.params(1).shard_offset(), 12);
  EXPECT_EQ(unit.params(2).shard_offset(), 13);
  EXPECT_EQ(unit.params(0).unsharded_offset(), 0);
  EXPECT_EQ(unit.params(1).unsharded_offset(), 40);
  EXPECT_EQ(unit.params(2).unsharded_offset(), 43);
  EXPECT_THAT(Vec(unit.params(1).valid_rows()), ElementsAre(1, 1, 1, 0));
  EXPECT_THAT(Vec(unit.params(2).valid_rows()), ElementsAre(2, 2, 1, 0));
  EXPECT_TRUE(unit.params(1).frozen());
  EXPECT_FALSE(unit.params(0).frozen());
  EXPECT_EQ(unit.numel(), 53);
  EXPECT_EQ(unit.shard_numel(), 17);
  EXPECT_EQ(unit.gathered_numel(), 68);
  EXPECT_EQ(unit.trainable_numel(), 50);
}

TEST(LayoutDim0Test, ReplacesExistingParams) {
  Params params;
  params.Add("w", {4});
  v1::FsdpUnit unit;
  unit.add_params()->set_name("stale");
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 2, &unit));
  ASSERT_EQ(unit.params_size(), 1);
  EXPECT_EQ(unit.params(0).name(), "w");
}

TEST(LayoutFlatTest, RangesStraddleRanks) {
  // Sizes 5, 7, 3 (total 15) over W = 4: S = ceil(15/4) = 4, padded 16.
  // Rank r owns flat [4r, 4r+4).
  Params params;
  params.Add("a", {5}).Add("b", {7}).Add("c", {3});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutFlatRanges(params.refs(), 4, &unit));
  EXPECT_EQ(unit.numel(), 15);
  EXPECT_EQ(unit.shard_numel(), 4);
  EXPECT_EQ(unit.gathered_numel(), 16);
  ASSERT_EQ(unit.params_size(), 3);
  for (const v1::ParamLayout& p : unit.params()) {
    EXPECT_EQ(p.shard_dim(), -1);
  }
  auto range = [](int rank, int64_t begin, int64_t end, int64_t offset) {
    v1::FlatRange r;
    r.set_shard_rank(rank);
    r.set_param_begin(begin);
    r.set_param_end(end);
    r.set_shard_offset(offset);
    return r.SerializeAsString();
  };
  auto ranges = [&unit](const v1::ParamLayout& p) {
    std::vector<std::string> out;
    for (const v1::FlatRange& r : FlatRangesOf(p, unit.shard_numel())) {
      out.push_back(r.SerializeAsString());
    }
    return out;
  };
  // a = flat [0,5): rank 0 [0,4), rank 1 [4,5).
  EXPECT_THAT(ranges(unit.params(0)),
              ElementsAre(range(0, 0, 4, 0), range(1, 4, 5, 0)));
  // b = flat [5,12): rank 1 [5,8) at local 1, rank 2 [8,12) at local 0.
  EXPECT_THAT(ranges(unit.params(1)),
              ElementsAre(range(1, 0, 3, 1), range(2, 3, 7, 0)));
  // c = flat [12,15): rank 3 only; rank 3's last element is padding.
  EXPECT_THAT(ranges(unit.params(2)), ElementsAre(range(3, 0, 3, 0)));
  EXPECT_EQ(unit.params(1).unsharded_offset(), 5);
  EXPECT_EQ(unit.params(2).unsharded_offset(), 12);
  EXPECT_EQ(unit.params(2).numel(), 3);
  // The stored rank span matches the derived pieces.
  EXPECT_EQ(unit.params(0).first_shard_rank(), 0);
  EXPECT_EQ(unit.params(0).last_shard_rank(), 1);
  EXPECT_EQ(unit.params(1).first_shard_rank(), 1);
  EXPECT_EQ(unit.params(1).last_shard_rank(), 2);
  EXPECT_EQ(unit.params(2).first_shard_rank(), 3);
  EXPECT_EQ(unit.params(2).last_shard_rank(), 3);
}

TEST(LayoutFlatTest, FewerElementsThanRanks) {
  // 3 elements over 8 ranks: S = 1; ranks 3-7 hold padding only.
  Params params;
  params.Add("a", {3});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutFlatRanges(params.refs(), 8, &unit));
  EXPECT_EQ(unit.shard_numel(), 1);
  EXPECT_EQ(unit.gathered_numel(), 8);
  const std::vector<v1::FlatRange> pieces =
      FlatRangesOf(unit.params(0), unit.shard_numel());
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(unit.params(0).first_shard_rank(), 0);
  EXPECT_EQ(unit.params(0).last_shard_rank(), 2);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(pieces[r].shard_rank(), r);
    EXPECT_EQ(pieces[r].param_begin(), r);
    EXPECT_EQ(pieces[r].param_end(), r + 1);
    EXPECT_EQ(pieces[r].shard_offset(), 0);
  }
}

TEST(LayoutErrorsTest, RejectsBadShardSize) {
  Params params;
  params.Add("w", {4});
  v1::FsdpUnit unit;
  for (int bad : {0, -1, std::numeric_limits<int>::max()}) {
    EXPECT_THAT(
        LayoutDim0Shards(params.refs(), bad, &unit),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_size")));
    EXPECT_THAT(
        LayoutFlatRanges(params.refs(), bad, &unit),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_size")));
  }
}

TEST(LayoutErrorsTest, RejectsEmptyAndMalformedParams) {
  v1::FsdpUnit unit;
  EXPECT_THAT(
      LayoutDim0Shards({}, 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("params")));
  EXPECT_THAT(
      LayoutFlatRanges({}, 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("params")));
  Params zero_dim;
  zero_dim.Add("bad", {4, 0});
  EXPECT_THAT(LayoutDim0Shards(zero_dim.refs(), 2, &unit),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad")));
  Params negative;
  negative.Add("neg", {-3});
  EXPECT_THAT(LayoutFlatRanges(negative.refs(), 2, &unit),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("neg")));
  Params scalar;
  scalar.Add("scalar", {});
  EXPECT_THAT(
      LayoutDim0Shards(scalar.refs(), 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scalar")));
  ParamRef null_ref;
  null_ref.fqn = "null";
  EXPECT_THAT(LayoutDim0Shards({null_ref}, 2, &unit),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
}

TEST(LayoutErrorsTest, RejectsOverflowAndLeavesUnitUnchanged) {
  const int64_t big = int64_t{1} << 62;
  const int64_t max = std::numeric_limits<int64_t>::max();
  v1::FsdpUnit unit;
  unit.add_params()->set_name("keep");

  // 2^62 * 4 elements.
  Params numel;
  numel.Add("huge", {big, 4});
  EXPECT_THAT(
      LayoutDim0Shards(numel.refs(), 1, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  EXPECT_THAT(
      LayoutFlatRanges(numel.refs(), 1, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));

  // INT64_MAX rows over 2 ranks: 2^62 rows each, padded 2^63.
  Params padded;
  padded.Add("rows", {max});
  EXPECT_THAT(
      LayoutDim0Shards(padded.refs(), 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  // Same for the flat layout's padded total.
  EXPECT_THAT(
      LayoutFlatRanges(padded.refs(), 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));

  // Each fits, the sum (2^63) does not.
  Params sum;
  sum.Add("a", {big}).Add("b", {big});
  EXPECT_THAT(
      LayoutDim0Shards(sum.refs(), 1, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
  EXPECT_THAT(
      LayoutFlatRanges(sum.refs(), 1, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));

  // Fits unsharded but the all-gather buffer W * shard_numel does not.
  Params gathered;
  // 3 rows of 2^61 over W = 2: 2 rows per rank, a 2^62 shard, 2^63 gathered.
  gathered.Add("a", {3, big / 2});
  EXPECT_THAT(
      LayoutDim0Shards(gathered.refs(), 2, &unit),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));

  ASSERT_EQ(unit.params_size(), 1);
  EXPECT_EQ(unit.params(0).name(), "keep");
}

// Random shapes and world sizes: every element of every parameter is held by
// exactly one rank, at the gathered position the header promises.
TEST(LayoutPropertyTest, Dim0CoversEveryElementOnce) {
  std::mt19937 rng(1234);
  auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 300; ++iter) {
    const int world = uniform(1, 24);
    Params params;
    const int n = uniform(1, 5);
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape = {uniform(1, 30)};
      const int extra = uniform(0, 2);
      for (int k = 0; k < extra; ++k) shape.push_back(uniform(1, 4));
      params.Add(absl::StrCat("p", i), shape, uniform(0, 3) == 0);
    }
    v1::FsdpUnit unit;
    const ShardPlacement placement =
        iter % 2 == 0 ? ShardPlacement::kAuto : ShardPlacement::kDim0;
    SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), world, &unit, placement));
    SCOPED_TRACE(absl::StrCat("iter ", iter, " world ", world));

    // Per-rank chunks of the parameters tile [0, shard_numel) in order.
    int64_t expect_offset = 0;
    int64_t expect_unsharded = 0;
    int64_t total = 0;
    int64_t trainable = 0;
    for (int i = 0; i < n; ++i) {
      const v1::ParamLayout& p = unit.params(i);
      int64_t d0 = p.global_shape(0);
      int64_t row = 1;
      for (int k = 1; k < p.global_shape_size(); ++k) row *= p.global_shape(k);
      // Split by elements exactly when dim 0 pads too much (kAuto).
      const bool elements =
          placement == ShardPlacement::kAuto &&
          DimZeroPadsTooMuch({p.global_shape().begin(), p.global_shape().end()},
                             world);
      EXPECT_EQ(p.row_numel(), elements ? 1 : row);
      if (elements) {
        d0 *= row;
        row = 1;
      }
      // rows_per_rank is the least r with r * W >= d0.
      EXPECT_GE(p.rows_per_rank() * world, d0);
      EXPECT_LT((p.rows_per_rank() - 1) * world, d0);
      EXPECT_EQ(p.padded_dim0(), p.rows_per_rank() * world);
      EXPECT_EQ(p.local_numel(), p.rows_per_rank() * row);
      EXPECT_EQ(p.shard_offset(), expect_offset);
      EXPECT_EQ(p.unsharded_offset(), expect_unsharded);
      EXPECT_EQ(p.numel(), d0 * row);
      ASSERT_EQ(p.valid_rows_size(), world);
      // Padding only at the tail: full ranks, at most one partial, then
      // empty ones.
      int64_t sum = 0;
      int partial = 0;
      for (int r = 0; r < world; ++r) {
        const int64_t v = p.valid_rows(r);
        EXPECT_GE(v, 0);
        EXPECT_LE(v, p.rows_per_rank());
        if (r > 0) {
          EXPECT_LE(v, p.valid_rows(r - 1));
        }
        if (v > 0 && v < p.rows_per_rank()) ++partial;
        sum += v;
      }
      EXPECT_LE(partial, 1);
      EXPECT_EQ(sum, d0);
      expect_offset += p.local_numel();
      expect_unsharded += p.numel();
      total += p.numel();
      if (!p.frozen()) trainable += p.numel();
    }
    EXPECT_EQ(unit.shard_numel(), expect_offset);
    EXPECT_EQ(unit.gathered_numel(), expect_offset * world);
    EXPECT_EQ(unit.numel(), total);
    EXPECT_EQ(unit.trainable_numel(), trainable);

    // Walk each rank's valid rows into the gathered buffer and map each back
    // to its unsharded element: every element exactly once, and the gathered
    // slot of rank r, param p, local index i is r*S + offset(p) + i.
    std::vector<int> hits(total, 0);
    std::vector<int> slot_used(unit.gathered_numel(), 0);
    for (int r = 0; r < world; ++r) {
      for (const v1::ParamLayout& p : unit.params()) {
        const int64_t row = p.local_numel() / p.rows_per_rank();
        for (int64_t i = 0; i < p.valid_rows(r) * row; ++i) {
          const int64_t slot = r * unit.shard_numel() + p.shard_offset() + i;
          ASSERT_LT(slot, unit.gathered_numel());
          ++slot_used[slot];
          const int64_t element = r * p.rows_per_rank() * row + i;
          ASSERT_LT(element, p.numel());
          ++hits[p.unsharded_offset() + element];
        }
      }
    }
    for (int64_t e = 0; e < total; ++e) ASSERT_EQ(hits[e], 1) << "elem " << e;
    for (int used : slot_used) ASSERT_LE(used, 1);
  }
}

TEST(LayoutPropertyTest, FlatCoversEveryElementOnce) {
  std::mt19937 rng(99);
  auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 300; ++iter) {
    const int world = uniform(1, 24);
    Params params;
    const int n = uniform(1, 5);
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape = {uniform(1, 30)};
      if (uniform(0, 1)) shape.push_back(uniform(1, 4));
      params.Add(absl::StrCat("p", i), shape);
    }
    v1::FsdpUnit unit;
    SHARDD_ASSERT_OK(LayoutFlatRanges(params.refs(), world, &unit));
    SCOPED_TRACE(absl::StrCat("iter ", iter, " world ", world));
    const int64_t shard = unit.shard_numel();
    EXPECT_EQ(unit.gathered_numel(), shard * world);
    // Least S with S * W >= total.
    EXPECT_GE(shard * world, unit.numel());
    EXPECT_LT((shard - 1) * world, unit.numel());

    std::vector<int> hits(unit.numel(), 0);
    std::vector<int> slot_used(unit.gathered_numel(), 0);
    int64_t offset = 0;
    for (const v1::ParamLayout& p : unit.params()) {
      EXPECT_EQ(p.shard_dim(), -1);
      EXPECT_EQ(p.unsharded_offset(), offset);
      offset += p.numel();
      // Pieces ascend by rank and tile [0, numel) of the parameter.
      int64_t next = 0;
      int last_rank = -1;
      const std::vector<v1::FlatRange> pieces = FlatRangesOf(p, shard);
      ASSERT_FALSE(pieces.empty());
      EXPECT_EQ(pieces.front().shard_rank(), p.first_shard_rank());
      EXPECT_EQ(pieces.back().shard_rank(), p.last_shard_rank());
      for (const v1::FlatRange& r : pieces) {
        EXPECT_GT(r.shard_rank(), last_rank);
        EXPECT_LT(r.shard_rank(), world);
        last_rank = r.shard_rank();
        EXPECT_EQ(r.param_begin(), next);
        EXPECT_GT(r.param_end(), r.param_begin());
        EXPECT_LE(r.shard_offset() + (r.param_end() - r.param_begin()), shard);
        next = r.param_end();
        for (int64_t k = r.param_begin(); k < r.param_end(); ++k) {
          const int64_t slot =
              r.shard_rank() * shard + r.shard_offset() + (k - r.param_begin());
          // Back to back: the gathered buffer is the unsharded layout.
          ASSERT_EQ(slot, p.unsharded_offset() + k);
          ++slot_used[slot];
          ++hits[p.unsharded_offset() + k];
        }
      }
      EXPECT_EQ(next, p.numel());
    }
    for (int h : hits) ASSERT_EQ(h, 1);
    for (int used : slot_used) ASSERT_LE(used, 1);
  }
}

}  // namespace
}  // namespace shardd

namespace shardd {
namespace {

// Expert parallelism: [8, 3, 2] experts in 4 blocks of 2 over 2 ranks
// each: every block laid out alone (1 row per rank), global sizes kept.
TEST(LayoutDim0Test, ExpertParallelBlocks) {
  Params params;
  params.Add("experts", {8, 3, 2}).Add("bias", {8, 3});
  v1::FsdpUnit unit;
  SHARDD_ASSERT_OK(LayoutDim0Shards(params.refs(), 2, &unit,
                                    ShardPlacement::kAuto, /*ep_blocks=*/4));
  EXPECT_EQ(unit.ep(), 4);
  EXPECT_EQ(unit.numel(), 48 + 24);
  EXPECT_EQ(unit.trainable_numel(), 48 + 24);
  EXPECT_EQ(unit.shard_numel(), 6 + 3);
  EXPECT_EQ(unit.gathered_numel(), 2 * 9);
  const v1::ParamLayout& p = unit.params(0);
  EXPECT_EQ(p.ep_blocks(), 4);
  EXPECT_THAT(Vec(p.global_shape()), ElementsAre(8, 3, 2));
  EXPECT_EQ(p.numel(), 48);
  EXPECT_EQ(p.padded_dim0(), 2);
  EXPECT_EQ(p.rows_per_rank(), 1);
  EXPECT_THAT(Vec(p.valid_rows()), ElementsAre(1, 1));
  EXPECT_THAT(Vec(p.local_shape()), ElementsAre(1, 3, 2));
  EXPECT_EQ(unit.params(1).unsharded_offset(), 12);  // One block's elements.

  // A dim 0 the blocks do not divide is refused, naming the parameter.
  Params odd;
  odd.Add("experts", {6, 2});
  v1::FsdpUnit untouched;
  EXPECT_THAT(LayoutDim0Shards(odd.refs(), 1, &untouched,
                               ShardPlacement::kAuto, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'experts'"),
                             HasSubstr("must be divisible by the 4"))));
  EXPECT_EQ(untouched.params_size(), 0);
  EXPECT_THAT(LayoutDim0Shards(odd.refs(), 1, &untouched,
                               ShardPlacement::kAuto, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("ep_blocks must be in [1,")));
}

}  // namespace
}  // namespace shardd
