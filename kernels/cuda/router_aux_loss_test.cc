#include "kernels/cuda/router_aux_loss.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/router_aux_loss.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;

// Random softmax rows and choices, accumulated in two calls (layers) as the
// model does, against kernels/cpu/router_aux_loss.h. Counts are integers:
// exact. prob_sums: double sums of fp32 values in another order, within
// (R + 8) 2^-53 of the sum (= the sum itself: probabilities are positive).
// The value is then the CPU's loop term for term on those sums: within
// 4 (R + 8) 2^-53 relative. d_logits: the double dot product differs by
// ~E 2^-53 relative, far below the final fp32 rounding: within 2 ulp.
TEST(RouterAuxLossGpuTest, MatchesCpu) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const int64_t experts = 64, top_k = 6, rows_a = 300, rows_b = 211;
  const int64_t rows = rows_a + rows_b;
  std::vector<float> probs = ops_testing::RandomVector(rows * experts, 0.0f,
                                                       1.0f, 1);
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[r * experts + e];
    for (int64_t e = 0; e < experts; ++e) probs[r * experts + e] /= sum;
  }
  std::vector<int32_t> indices(rows * top_k);
  for (int64_t i = 0; i < rows * top_k; ++i) {
    indices[i] = static_cast<int32_t>((i * 37 + i / top_k) % experts);
  }
  std::vector<int64_t> counts(experts, 0);
  std::vector<double> sums(experts, 0.0);
  SHARDD_ASSERT_OK(kernels::RouterAuxLossAccumulate(
      probs.data(), indices.data(), rows_a, experts, top_k, counts.data(),
      sums.data()));
  SHARDD_ASSERT_OK(kernels::RouterAuxLossAccumulate(
      probs.data() + rows_a * experts, indices.data() + rows_a * top_k, rows_b,
      experts, top_k, counts.data(), sums.data()));
  const double value =
      kernels::RouterAuxLossValue(counts.data(), sums.data(), rows, experts);
  const double scale = 0.01 * 3;
  std::vector<float> d_logits(rows * experts);
  SHARDD_ASSERT_OK(kernels::RouterAuxLossBackward(
      probs.data(), rows, experts, counts.data(), rows, scale,
      d_logits.data()));

  DeviceBuffer<float> d_probs(probs);
  DeviceBuffer<int32_t> d_indices(indices);
  DeviceBuffer<int64_t> d_counts(std::vector<int64_t>(experts, 0));
  DeviceBuffer<double> d_sums(std::vector<double>(experts, 0.0));
  DeviceBuffer<int64_t> d_invalid(std::vector<int64_t>{0});
  DeviceBuffer<int64_t> d_rows(std::vector<int64_t>{rows});
  DeviceBuffer<double> d_value(1);
  DeviceBuffer<float> d_dl(rows * experts);
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
      d_probs.get(), d_indices.get(), rows_a, experts, top_k, d_counts.get(),
      d_sums.get(), d_invalid.get(), gpu.stream()));
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
      d_probs.get() + rows_a * experts, d_indices.get() + rows_a * top_k,
      rows_b, experts, top_k, d_counts.get(), d_sums.get(), d_invalid.get(),
      gpu.stream()));
  SHARDD_ASSERT_OK(RouterAuxLossValue(d_counts.get(), d_sums.get(),
                                      d_rows.get(), experts, d_value.get(),
                                      gpu.stream()));
  SHARDD_ASSERT_OK(RouterAuxLossBackward(d_probs.get(), rows, experts,
                                         d_counts.get(), d_rows.get(), scale,
                                         d_dl.get(), gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_counts.Download(), counts);
  EXPECT_EQ(d_invalid.Download()[0], 0);
  const auto got_sums = d_sums.Download();
  for (int64_t e = 0; e < experts; ++e) {
    EXPECT_NEAR(got_sums[e], sums[e], (rows + 8) * std::ldexp(sums[e], -53));
  }
  EXPECT_NEAR(d_value.Download()[0], value,
              4 * (rows + 8) * std::ldexp(value, -53));
  ops_testing::ExpectAllClose(d_dl.Download(), d_logits, 2 * std::ldexp(1.0, -23),
                              0.0, "d_logits");
}

// Out-of-range choices add nothing and are counted.
TEST(RouterAuxLossGpuTest, CountsInvalidIndices) {
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  DeviceBuffer<float> d_probs(std::vector<float>{0.25f, 0.75f, 0.5f, 0.5f});
  DeviceBuffer<int32_t> d_indices(std::vector<int32_t>{1, -1, 2, 0});
  DeviceBuffer<int64_t> d_counts(std::vector<int64_t>{0, 0});
  DeviceBuffer<double> d_sums(std::vector<double>{0.0, 0.0});
  DeviceBuffer<int64_t> d_invalid(std::vector<int64_t>{0});
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
      d_probs.get(), d_indices.get(), 2, 2, 2, d_counts.get(), d_sums.get(),
      d_invalid.get(), gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_counts.Download(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(d_invalid.Download()[0], 2);
  EXPECT_EQ(d_sums.Download(), (std::vector<double>{0.75, 1.25}));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
