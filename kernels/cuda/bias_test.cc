#include "kernels/cuda/bias.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/linear.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;

template <typename T>
class BiasGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(BiasGpuTest, StorageTypes);

// Against kernels/cpu/linear.h on bf16-representable inputs. AddBias is one
// fp32 addition, rounded once to the storage type on both sides (the CPU
// result is rounded here for bf16): exact. BiasBackward sums T rows in
// another order: within (T + 8) 2^-24 of the column's sum of |dy| (fp32
// sums on both sides; the inputs are exact in bf16).
TYPED_TEST(BiasGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const auto& [tokens, out] : {std::pair<int64_t, int64_t>{1, 1},
                                   {300, 96},
                                   {1000, 33},
                                   {7, 5000}}) {
    SCOPED_TRACE(::testing::Message() << "T " << tokens << " out " << out);
    const auto y0 = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(tokens * out, -2.0f, 2.0f, 1));
    const auto b = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(out, -1.0f, 1.0f, 2));
    const auto dy = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(tokens * out, -1.0f, 1.0f, 3));
    const auto db0 = ops_testing::RandomVector(out, -1.0f, 1.0f, 4);
    std::vector<float> y = y0, db = db0;
    kernels::AddBias(b.data(), tokens, out, y.data());
    kernels::BiasBackward(dy.data(), tokens, out, db.data());
    if (std::is_same<T, uint16_t>::value) y = ops_testing::RoundedToBf16(y);

    DeviceBuffer<T> d_y(ops_testing::ToStorage<T>(y0));
    DeviceBuffer<T> d_b(ops_testing::ToStorage<T>(b));
    DeviceBuffer<T> d_dy(ops_testing::ToStorage<T>(dy));
    DeviceBuffer<float> d_db(db0);
    SHARDD_ASSERT_OK(AddBias(d_b.get(), tokens, out, d_y.get(), gpu.stream()));
    SHARDD_ASSERT_OK(
        BiasBackward(d_dy.get(), tokens, out, d_db.get(), gpu.stream()));
    gpu.Sync();
    EXPECT_EQ(ops_testing::ToFloat(d_y.Download()), y);
    const auto got = d_db.Download();
    for (int64_t o = 0; o < out; ++o) {
      double abs_sum = std::fabs(db0[o]);
      for (int64_t t = 0; t < tokens; ++t) abs_sum += std::fabs(dy[t * out + o]);
      EXPECT_NEAR(got[o], db[o], (tokens + 8) * std::ldexp(abs_sum, -24))
          << "db " << o;
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
