#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using testing_util::RandomVector;

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(EmbeddingTest, ForwardGathersRows) {
  const int64_t vocab = 5, dim = 3;
  std::vector<float> table(vocab * dim);
  // table[v, d] = 10 v + d: each element names its own row and column.
  for (int64_t v = 0; v < vocab; ++v)
    for (int64_t d = 0; d < dim; ++d) table[v * dim + d] = 10.0f * v + d;
  const std::vector<int32_t> ids = {4, 0, 2, 4};
  std::vector<float> out(ids.size() * dim, -1.0f);
  SHARDD_ASSERT_OK(EmbeddingForward(table.data(), vocab, dim, ids.data(),
                                    ids.size(), out.data()));
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t d = 0; d < dim; ++d)
      EXPECT_EQ(out[t * dim + d], 10.0f * ids[t] + d);
}

TEST(EmbeddingTest, OutOfRangeIdRejectedBeforeAnyWrite) {
  const int64_t vocab = 4, dim = 2;
  std::vector<float> table = RandomVector(vocab * dim, 1);
  // The bad id is last, so a kernel that wrote as it went would have
  // touched the first rows.
  for (int32_t bad : {4, -1, 1000}) {
    const std::vector<int32_t> ids = {0, 1, bad};
    std::vector<float> out(ids.size() * dim, 7.0f);
    EXPECT_THAT(EmbeddingForward(table.data(), vocab, dim, ids.data(),
                                 ids.size(), out.data()),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr(std::to_string(bad)),
                               HasSubstr("vocab_size=4"))));
    for (float x : out) EXPECT_EQ(x, 7.0f);

    std::vector<float> dtable(vocab * dim, 3.0f);
    std::vector<float> dout(ids.size() * dim, 1.0f);
    EXPECT_THAT(EmbeddingBackward(dout.data(), ids.data(), ids.size(), vocab,
                                  dim, dtable.data()),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(std::to_string(bad))));
    for (float x : dtable) EXPECT_EQ(x, 3.0f);
  }
}

TEST(EmbeddingTest, BadSizesAndNullPointers) {
  std::vector<float> table(4), out(4);
  std::vector<int32_t> ids = {0, 1};
  EXPECT_THAT(
      EmbeddingForward(table.data(), -1, 2, ids.data(), 2, out.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab_size")));
  EXPECT_THAT(EmbeddingForward(nullptr, 2, 2, ids.data(), 2, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("table")));
  EXPECT_THAT(EmbeddingForward(table.data(), 2, 2, nullptr, 2, out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ids")));
  // Zero tokens is a valid no-op.
  SHARDD_EXPECT_OK(EmbeddingForward(table.data(), 2, 2, nullptr, 0, nullptr));
}

TEST(EmbeddingTest, BackwardScatterAddsAndAccumulates) {
  const int64_t vocab = 3, dim = 2;
  const std::vector<int32_t> ids = {2, 0, 2};
  const std::vector<float> dout = {1, 2, 10, 20, 100, 200};
  std::vector<float> dtable = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  SHARDD_ASSERT_OK(EmbeddingBackward(dout.data(), ids.data(), ids.size(), vocab,
                                     dim, dtable.data()));
  // Row 0 gets token 1, row 1 nothing, row 2 tokens 0 and 2; all on top of
  // the existing 0.5.
  EXPECT_THAT(dtable,
              ::testing::ElementsAre(10.5f, 20.5f, 0.5f, 0.5f, 101.5f, 202.5f));
}

// torch.nn.Embedding's padding_idx: the padding row's lookups add nothing;
// the other rows are as without it.
TEST(EmbeddingTest, BackwardSkipsThePaddingId) {
  const int64_t vocab = 3, dim = 2;
  const std::vector<int32_t> ids = {2, 0, 2};
  const std::vector<float> dout = {1, 2, 10, 20, 100, 200};
  std::vector<float> dtable = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  SHARDD_ASSERT_OK(EmbeddingBackward(dout.data(), ids.data(), ids.size(), vocab,
                                     dim, dtable.data(), /*padding_id=*/2));
  EXPECT_THAT(dtable,
              ::testing::ElementsAre(10.5f, 20.5f, 0.5f, 0.5f, 0.5f, 0.5f));
  // An id no token has changes nothing.
  std::vector<float> plain(vocab * dim, 0.0f), skipped(vocab * dim, 0.0f);
  SHARDD_ASSERT_OK(EmbeddingBackward(dout.data(), ids.data(), ids.size(), vocab,
                                     dim, plain.data()));
  SHARDD_ASSERT_OK(EmbeddingBackward(dout.data(), ids.data(), ids.size(), vocab,
                                     dim, skipped.data(), /*padding_id=*/1));
  EXPECT_EQ(plain, skipped);
}

TEST(EmbeddingTest, BackwardMatchesFiniteDifferences) {
  const int64_t vocab = 6, dim = 4;
  const std::vector<int32_t> ids = {1, 5, 1, 3, 0};
  const int64_t n = ids.size();
  std::vector<float> table = RandomVector(vocab * dim, 2);
  // Loss L = sum(out * r): dL/dout = r.
  const std::vector<float> r = RandomVector(n * dim, 3);
  auto loss = [&]() {
    std::vector<float> out(n * dim);
    EXPECT_TRUE(
        EmbeddingForward(table.data(), vocab, dim, ids.data(), n, out.data())
            .ok());
    double l = 0;
    for (int64_t i = 0; i < n * dim; ++i) l += double{out[i]} * r[i];
    return l;
  };
  std::vector<float> dtable(vocab * dim, 0.0f);
  SHARDD_ASSERT_OK(
      EmbeddingBackward(r.data(), ids.data(), n, vocab, dim, dtable.data()));
  const float eps = 1e-3f;
  for (int64_t i = 0; i < vocab * dim; ++i) {
    const float saved = table[i];
    table[i] = saved + eps;
    const double lp = loss();
    table[i] = saved - eps;
    const double lm = loss();
    table[i] = saved;
    const double numeric = (lp - lm) / (2.0 * eps);
    EXPECT_NEAR(dtable[i], numeric, 1e-2 * std::max(1.0, std::abs(numeric)))
        << i;
  }
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
