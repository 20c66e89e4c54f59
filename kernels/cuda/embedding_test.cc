#include "kernels/cuda/embedding.h"

#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

struct Case {
  int64_t vocab;
  // fp32: 64 and 8 take the 16-byte path, 66 and 67 the 4-byte one; bf16:
  // 64 and 8 the 16-byte path, 66 the 4-byte one, 67 the byte one.
  int64_t dim;
  int64_t tokens;
};

// Ids with many repeats (a small hot set), so rows accumulate several tokens.
std::vector<int32_t> RandomIds(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> any(0, vocab - 1);
  std::uniform_int_distribution<int32_t> hot(0, 4);
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (i % 3 == 0) ? hot(rng) : any(rng);
  return ids;
}

template <typename T>
class EmbeddingGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(EmbeddingGpuTest, StorageTypes);

// Forward is a bit copy and backward adds in token order like the CPU, so
// both must match the CPU reference exactly (bf16 inputs are widened
// exactly; the CPU sees the same rounded values).
TYPED_TEST(EmbeddingGpuTest, MatchesCpuExactly) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const Case c : {Case{1000, 64, 3000}, Case{37, 67, 513},
                       Case{37, 66, 100}, Case{5, 8, 2500}}) {
    SCOPED_TRACE(::testing::Message() << "vocab " << c.vocab << " dim " << c.dim
                                      << " tokens " << c.tokens);
    const std::vector<float> table = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(c.vocab * c.dim, -1.0f, 1.0f, 1));
    const std::vector<int32_t> ids = RandomIds(c.tokens, c.vocab, 2);
    const std::vector<float> dout = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(c.tokens * c.dim, -1.0f, 1.0f, 3));
    const std::vector<float> dtable0 =
        ops_testing::RandomVector(c.vocab * c.dim, -1.0f, 1.0f, 4);

    std::vector<float> expected_out(c.tokens * c.dim);
    SHARDD_ASSERT_OK(kernels::EmbeddingForward(table.data(), c.vocab, c.dim,
                                               ids.data(), c.tokens,
                                               expected_out.data()));
    std::vector<float> expected_dtable = dtable0;
    SHARDD_ASSERT_OK(kernels::EmbeddingBackward(dout.data(), ids.data(),
                                                c.tokens, c.vocab, c.dim,
                                                expected_dtable.data()));

    DeviceBuffer<T> d_table(ops_testing::ToStorage<T>(table));
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<T> d_out(c.tokens * c.dim);
    DeviceBuffer<int32_t> d_bad(std::vector<int32_t>{0});
    SHARDD_ASSERT_OK(EmbeddingForward(d_table.get(), c.vocab, c.dim,
                                      d_ids.get(), c.tokens, d_out.get(),
                                      d_bad.get(), gpu.stream()));
    DeviceBuffer<T> d_dout(ops_testing::ToStorage<T>(dout));
    DeviceBuffer<float> d_dtable(dtable0);
    DeviceBytes workspace(EmbeddingBackwardWorkspaceBytes(c.vocab, c.tokens));
    SHARDD_ASSERT_OK(EmbeddingBackward(
        d_dout.get(), d_ids.get(), c.tokens, c.vocab, c.dim, d_dtable.get(),
        workspace.get(), workspace.size(), d_bad.get(), gpu.stream()));
    gpu.Sync();
    EXPECT_EQ(ops_testing::ToFloat(d_out.Download()), expected_out);
    EXPECT_EQ(d_dtable.Download(), expected_dtable);
    EXPECT_EQ(d_bad.Download()[0], 0);

    // With a padding id (torch.nn.Embedding's padding_idx), as the CPU.
    const int64_t pad = ids[0];
    std::vector<float> expected_padded = dtable0;
    SHARDD_ASSERT_OK(kernels::EmbeddingBackward(dout.data(), ids.data(),
                                                c.tokens, c.vocab, c.dim,
                                                expected_padded.data(), pad));
    DeviceBuffer<float> d_padded(dtable0);
    SHARDD_ASSERT_OK(EmbeddingBackward(
        d_dout.get(), d_ids.get(), c.tokens, c.vocab, c.dim, d_padded.get(),
        workspace.get(), workspace.size(), d_bad.get(), gpu.stream(), pad));
    gpu.Sync();
    EXPECT_EQ(d_padded.Download(), expected_padded);
    EXPECT_NE(expected_padded, expected_dtable);
  }
}

// Out-of-range ids: zero rows forward, no gradient backward, and counted.
TYPED_TEST(EmbeddingGpuTest, BadIdsAreZeroedSkippedAndCounted) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const int64_t vocab = 10, dim = 16;
  const std::vector<int32_t> ids = {3, -1, 3, 10, 9, 1 << 30, 3};
  const int64_t tokens = ids.size();
  std::vector<int32_t> good_ids;
  std::vector<float> good_dout;
  const std::vector<float> table = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(vocab * dim, -1.0f, 1.0f, 5));
  const std::vector<float> dout = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(tokens * dim, -1.0f, 1.0f, 6));
  for (int64_t t = 0; t < tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab) continue;
    good_ids.push_back(ids[t]);
    good_dout.insert(good_dout.end(), dout.begin() + t * dim,
                     dout.begin() + (t + 1) * dim);
  }
  std::vector<float> expected_dtable(vocab * dim, 0.5f);
  SHARDD_ASSERT_OK(kernels::EmbeddingBackward(good_dout.data(), good_ids.data(),
                                              good_ids.size(), vocab, dim,
                                              expected_dtable.data()));

  DeviceBuffer<T> d_table(ops_testing::ToStorage<T>(table));
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<T> d_out(tokens * dim);
  DeviceBuffer<int32_t> d_bad(std::vector<int32_t>{0});
  SHARDD_ASSERT_OK(EmbeddingForward(d_table.get(), vocab, dim, d_ids.get(),
                                    tokens, d_out.get(), d_bad.get(),
                                    gpu.stream()));
  DeviceBuffer<T> d_dout(ops_testing::ToStorage<T>(dout));
  DeviceBuffer<float> d_dtable(std::vector<float>(vocab * dim, 0.5f));
  DeviceBytes workspace(EmbeddingBackwardWorkspaceBytes(vocab, tokens));
  SHARDD_ASSERT_OK(EmbeddingBackward(
      d_dout.get(), d_ids.get(), tokens, vocab, dim, d_dtable.get(),
      workspace.get(), workspace.size(), d_bad.get(), gpu.stream()));
  gpu.Sync();
  const std::vector<float> out = ops_testing::ToFloat(d_out.Download());
  for (int64_t t = 0; t < tokens; ++t) {
    const bool bad = ids[t] < 0 || ids[t] >= vocab;
    for (int64_t d = 0; d < dim; ++d) {
      EXPECT_EQ(out[t * dim + d], bad ? 0.0f : table[ids[t] * dim + d])
          << "token " << t;
    }
  }
  EXPECT_EQ(d_dtable.Download(), expected_dtable);
  EXPECT_EQ(d_bad.Download()[0], 6);  // 3 bad ids, forward and backward
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
