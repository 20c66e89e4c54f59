// The device permutation against the host's rules
// (kernels/cpu/expert_permute_element.h, which worker/model/expert_exchange.cc
// runs on a CPU rank): packed rows equal bit for bit, combines equal bit for
// bit (fp32; bf16: the fp32 sum rounded once). Skips without a GPU.

#include "kernels/cuda/expert_permute.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/expert_permute_element.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;

// A route as ExpertExchange::Route builds it: slots stably sorted by the
// destination rank of their expert.
struct HostRoute {
  std::vector<int64_t> order, position;
};

HostRoute RouteOf(const std::vector<int32_t>& indices, int64_t local) {
  HostRoute r;
  r.order.resize(indices.size());
  std::iota(r.order.begin(), r.order.end(), 0);
  std::stable_sort(r.order.begin(), r.order.end(), [&](int64_t a, int64_t b) {
    return indices[a] / local < indices[b] / local;
  });
  r.position.resize(indices.size());
  for (size_t j = 0; j < r.order.size(); ++j) r.position[r.order[j]] = j;
  return r;
}

template <typename T>
class ExpertPermuteGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(ExpertPermuteGpuTest, StorageTypes);

TYPED_TEST(ExpertPermuteGpuTest, MatchesTheHostRules) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  constexpr int64_t kExperts = 16, kLocal = 4, kT = 37, kD = 300;
  constexpr int kK = 4;
  std::mt19937 rng(5);
  std::vector<int32_t> indices(kT * kK);
  for (int64_t i = 0; i < kT; ++i) {
    std::vector<int32_t> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int s = 0; s < kK; ++s) indices[i * kK + s] = all[s];
  }
  const HostRoute route = RouteOf(indices, kLocal);
  const int64_t rows = kT * kK;
  const auto x = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(kT * kD, -2.0f, 2.0f, 1));
  const auto dy = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(kT * kD, -2.0f, 2.0f, 2));
  const auto weights = ops_testing::RandomVector(rows, 0.0f, 1.0f, 3);
  // Rows coming back, wide enough for combine-grad's weight column; values
  // spread over magnitudes so that the slot order of the sum matters.
  auto back = ops_testing::RandomVector(rows * (kD + 1), -1.0f, 1.0f, 4);
  for (size_t i = 0; i < back.size(); i += 3) back[i] *= 4096.0f;

  // Host: the rules CPU ranks run.
  std::vector<float> want_send(rows * (kD + 2)), want_grad(rows * kD);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t token = RouteRowToken(route.order.data(), kK, j);
    for (int64_t c = 0; c < kD; ++c) {
      want_send[j * (kD + 2) + c] = x[token * kD + c];
      want_grad[j * kD + c] = dy[token * kD + c];
    }
    want_send[j * (kD + 2) + kD] =
        LocalExpertTag(indices[route.order[j]], kLocal);
    want_send[j * (kD + 2) + kD + 1] = weights[route.order[j]];
  }
  std::vector<float> want_y(kT * kD), want_dw(rows);
  for (int64_t i = 0; i < kT; ++i) {
    for (int64_t c = 0; c < kD; ++c) {
      float v = CombineValue(back.data(), route.position.data(), kK, kD + 1, i,
                             c);
      if (std::is_same<T, uint16_t>::value) v = RoundToBf16(v);
      want_y[i * kD + c] = v;
    }
    for (int s = 0; s < kK; ++s) {
      want_dw[i * kK + s] = back[route.position[i * kK + s] * (kD + 1) + kD];
    }
  }

  DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
  DeviceBuffer<T> d_dy(ops_testing::ToStorage<T>(dy));
  DeviceBuffer<float> d_w(weights);
  DeviceBuffer<int32_t> d_idx(indices);
  DeviceBuffer<int64_t> d_order(route.order), d_pos(route.position);
  DeviceBuffer<float> d_send(rows * (kD + 2)), d_grad(rows * kD);
  SHARDD_ASSERT_OK(PackDispatchRows(d_x.get(), d_w.get(), d_idx.get(),
                                    d_order.get(), rows, kK, kD, kLocal,
                                    d_send.get(), gpu.stream()));
  SHARDD_ASSERT_OK(PackGradRows(d_dy.get(), d_order.get(), rows, kK, kD,
                                d_grad.get(), gpu.stream()));
  // Unpack what was packed (the all-to-all moves rows unchanged).
  DeviceBuffer<T> d_xr(rows * kD);
  DeviceBuffer<int32_t> d_ids(rows);
  DeviceBuffer<float> d_wr(rows);
  SHARDD_ASSERT_OK(UnpackDispatchRows(d_send.get(), rows, kD, d_xr.get(),
                                      d_ids.get(), d_wr.get(), gpu.stream()));
  DeviceBuffer<float> d_back(back);
  DeviceBuffer<T> d_y(kT * kD);
  DeviceBuffer<float> d_dw(rows);
  SHARDD_ASSERT_OK(CombineRows(d_back.get(), d_pos.get(), kT, kK, kD + 1, kD,
                               d_y.get(), d_dw.get(), gpu.stream()));
  // Combine-grad's packing of [dx_r | dw_r].
  const auto dx_r = ops_testing::RandomVector(rows * kD, -1.0f, 1.0f, 6);
  DeviceBuffer<float> d_dxr(dx_r), d_dwr(weights), d_cg(rows * (kD + 1));
  SHARDD_ASSERT_OK(PackCombineGradRows(d_dxr.get(), d_dwr.get(), rows, kD,
                                       d_cg.get(), gpu.stream()));
  gpu.Sync();

  EXPECT_EQ(d_send.Download(), want_send);
  EXPECT_EQ(d_grad.Download(), want_grad);
  const auto xr = ops_testing::ToFloat(d_xr.Download());
  const auto ids = d_ids.Download();
  const auto wr = d_wr.Download();
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t token = route.order[j] / kK;
    for (int64_t c = 0; c < kD; ++c) {
      ASSERT_EQ(xr[j * kD + c], x[token * kD + c]) << j << " " << c;
    }
    EXPECT_EQ(ids[j], indices[route.order[j]] % kLocal) << j;
    EXPECT_EQ(wr[j], weights[route.order[j]]) << j;
  }
  EXPECT_EQ(ops_testing::ToFloat(d_y.Download()), want_y);
  EXPECT_EQ(d_dw.Download(), want_dw);
  const auto cg = d_cg.Download();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < kD; ++c) {
      ASSERT_EQ(cg[i * (kD + 1) + c], dx_r[i * kD + c]) << i << " " << c;
    }
    EXPECT_EQ(cg[i * (kD + 1) + kD], weights[i]) << i;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
