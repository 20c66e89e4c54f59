#include "kernels/cuda/router.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/router.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// Inputs whose logits every summation order computes exactly: x in
// {-1, 0, 1} and w in multiples of 1/64 (also exact in bf16 and TF32). The
// top-k selection then sees identical logits on CPU and GPU; equal logits are
// real ties (testing the lower-index rule) and unequal ones differ by >= 1/64,
// far beyond the softmax's rounding, so no selection can flip.
std::vector<float> TernaryX(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}
std::vector<float> QuantizedW(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-32, 32);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng)) / 64.0f;
  return v;
}

// fp32: rounding of exp/sum order only. bf16: d_logits are rounded to bf16
// before the backward GEMMs (and dx is stored in bf16).
template <typename T>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double kGrad = 1e-5;
};
template <>
struct Tolerance<uint16_t> {
  static constexpr double kGrad = 1e-2;
};
constexpr double kProb = 1e-5;

template <typename T>
class RouterGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(RouterGpuTest, StorageTypes);

TYPED_TEST(RouterGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  for (const RouterDims dims :
       {RouterDims{200, 32, 8, 2}, RouterDims{333, 48, 64, 6},
        RouterDims{64, 32, 256, 16}, RouterDims{40, 16, 1000, 32},
        // Qwen3 with norm_topk_prob false: the weights are the
        // probabilities.
        RouterDims{200, 32, 8, 2, /*renormalize=*/false},
        RouterDims{64, 32, 128, 8, /*renormalize=*/false}}) {
    for (const bool accumulate_dx : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "T " << dims.tokens << " D " << dims.dim << " E "
                   << dims.experts << " K " << dims.top_k << " accumulate "
                   << accumulate_dx << " renormalize " << dims.renormalize);
      const int64_t t = dims.tokens, d = dims.dim, e = dims.experts,
                    k = dims.top_k;
      const auto x = TernaryX(t * d, 1);
      const auto w = QuantizedW(e * d, 2);
      const auto d_weights = ops_testing::RandomVector(t * k, -1.0f, 1.0f, 3);
      const auto dx0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 4));
      const auto dw0 = ops_testing::RandomVector(e * d, -1.0f, 1.0f, 5);

      kernels::RouterDims cpu_dims{t, d, e, k, dims.renormalize};
      kernels::RouterCache cache;
      std::vector<int32_t> indices(t * k);
      std::vector<float> weights(t * k), dx = dx0, dw = dw0;
      SHARDD_ASSERT_OK(kernels::RouterForward(cpu_dims, x.data(), w.data(),
                                              indices.data(), weights.data(),
                                              &cache));
      SHARDD_ASSERT_OK(kernels::RouterBackward(
          cpu_dims, x.data(), w.data(), d_weights.data(), dx.data(),
          accumulate_dx, dw.data(), &cache));

      DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
      DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
      DeviceBuffer<int32_t> d_indices(t * k);
      DeviceBuffer<float> d_weights_out(t * k);
      DeviceBytes saved(RouterSavedBytes(dims));
      SHARDD_ASSERT_OK(RouterForward(
          dims, d_x.get(), d_w.get(), d_indices.get(), d_weights_out.get(),
          saved.get(), saved.size(), gpu.handle(), gpu.stream()));
      DeviceBuffer<float> d_dweights(d_weights);
      DeviceBuffer<T> d_dx(ops_testing::ToStorage<T>(dx0));
      DeviceBuffer<float> d_dw(dw0);
      DeviceBytes workspace(
          RouterBackwardWorkspaceBytes(dims, DTypeOf<T>::value));
      SHARDD_ASSERT_OK(RouterBackward(
          dims, d_x.get(), d_w.get(), d_dweights.get(), saved.get(),
          saved.size(), d_dx.get(), accumulate_dx, d_dw.get(), workspace.get(),
          workspace.size(), gpu.handle(), gpu.stream()));
      gpu.Sync();
      EXPECT_EQ(d_indices.Download(), indices);
      ops_testing::ExpectAllClose(d_weights_out.Download(), weights, kProb, 0.0,
                                  "weights");
      constexpr double kGrad = Tolerance<T>::kGrad;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dx.Download()), dx,
                                  kGrad, kGrad, "dx");
      ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dw");
    }
  }
}

// A NaN logit row: the CPU picks experts 0..K-1 and clamps the denominator;
// the GPU must do the same, leaving the other rows alone.
TYPED_TEST(RouterGpuTest, NanRowPicksTheFirstExperts) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const RouterDims dims{3, 8, 16, 4};
  auto x = TernaryX(dims.tokens * dims.dim, 6);
  x[1 * dims.dim + 2] = std::nanf("");
  const auto w = QuantizedW(dims.experts * dims.dim, 7);
  kernels::RouterDims cpu_dims{dims.tokens, dims.dim, dims.experts, dims.top_k};
  kernels::RouterCache cache;
  std::vector<int32_t> indices(dims.tokens * dims.top_k);
  std::vector<float> weights(dims.tokens * dims.top_k);
  SHARDD_ASSERT_OK(kernels::RouterForward(
      cpu_dims, x.data(), w.data(), indices.data(), weights.data(), &cache));
  for (int k = 0; k < dims.top_k; ++k) {
    ASSERT_EQ(indices[dims.top_k + k], k);
  }

  DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
  DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
  DeviceBuffer<int32_t> d_indices(indices.size());
  DeviceBuffer<float> d_weights(weights.size());
  DeviceBytes saved(RouterSavedBytes(dims));
  SHARDD_ASSERT_OK(RouterForward(dims, d_x.get(), d_w.get(), d_indices.get(),
                                 d_weights.get(), saved.get(), saved.size(),
                                 gpu.handle(), gpu.stream()));
  gpu.Sync();
  EXPECT_EQ(d_indices.Download(), indices);
  ops_testing::ExpectAllClose(d_weights.Download(), weights, kProb, 0.0,
                              "weights");
}


// The two newer scorings with a router bias, extra logit gradients and the
// bias gradient, against the CPU router on the same inputs. Inputs are far
// from ties by construction:
//  - kTopKThenSoftmax selects on the logits, which (ternary x, w and bias in
//    multiples of 1/64) both sides compute exactly: equal logits are true
//    ties on both sides, unequal ones differ by >= 1/64.
//  - kSigmoidGroupLimited: w and the bias in multiples of 1/256 with
//    |w|, |b| <= 1/64 keep the logits exact and |logit| <= (D + 1) / 64,
//    so with D = 16 every sigmoid lies in (0.43, 0.57), a range of < 0.135
//    (with D = 32 and one group, sigmoid' > 0.19 keeps distinct logits
//    >= 7e-4 apart after the sigmoid); the selection bias c[e] = (pg[g] * size + pe[i]) / 4 (pg, pe
//    permutations) then spaces the choices of distinct experts >= 1/4 - 0.135
//    apart and the groups' top-2 sums >= 2 size / 4 - 0.27 >= 0.73 apart, so
//    no rounding of the sigmoid (a few ulp) can reorder anything. Without a
//    selection bias and with one group, the choice is monotone in the exact
//    logits, so ties are exact on both sides.
// Tolerances: weights are ratios of <= K + 1 terms, each within 2 ulp
// (expf's bound) of the CPU's: < (2K + 4) 2^-24 <= 4.2e-6 relative for
// K = 32, so kProb (1e-5). Gradients: as MatchesCpu (kGrad). d_bias is a
// column sum over T rows in another order: within (T + 8) 2^-24 of the sum
// of |d_logits| for fp32; with bf16 each d_logit is first rounded (2^-9
// relative), so within 2^-8 of that sum.
struct ScoringCase {
  RouterDims dims;
  bool bias;
  bool selection_bias;
};

std::vector<float> SmallW(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-4, 4);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng)) / 256.0f;
  return v;
}

std::vector<float> SpacedSelectionBias(const RouterDims& d, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t size = d.experts / d.groups;
  std::vector<int> pg(d.groups), pe(size);
  for (int i = 0; i < d.groups; ++i) pg[i] = i;
  std::shuffle(pg.begin(), pg.end(), rng);
  std::vector<float> c(d.experts);
  for (int64_t g = 0; g < d.groups; ++g) {
    for (int i = 0; i < size; ++i) pe[i] = i;
    std::shuffle(pe.begin(), pe.end(), rng);
    for (int64_t i = 0; i < size; ++i) {
      c[g * size + i] = static_cast<float>(pg[g] * size + pe[i]) / 4.0f;
    }
  }
  return c;
}

TYPED_TEST(RouterGpuTest, NewerScoringsMatchCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  auto topk_softmax = [](int64_t t, int64_t d, int64_t e, int64_t k,
                         bool keep) {
    RouterDims dims{t, d, e, k};
    dims.scoring = RouterScoring::kTopKThenSoftmax;
    dims.keep_softmax = keep;
    return dims;
  };
  auto grouped = [](int64_t t, int64_t d, int64_t e, int64_t k, int64_t g,
                    int64_t tg, float scale, bool renormalize) {
    RouterDims dims{t, d, e, k, renormalize};
    dims.scoring = RouterScoring::kSigmoidGroupLimited;
    dims.groups = g;
    dims.top_groups = tg;
    dims.scale = scale;
    return dims;
  };
  const ScoringCase cases[] = {
      {topk_softmax(200, 32, 32, 4, true), true, false},    // GPT-OSS
      {topk_softmax(77, 16, 128, 4, false), false, false},
      {topk_softmax(40, 16, 1000, 32, true), true, false},
      {grouped(200, 16, 64, 6, 8, 3, 2.5f, true), false, true},  // DeepSeek
      {grouped(96, 16, 256, 8, 8, 4, 2.5f, true), true, true},
      {grouped(50, 16, 32, 4, 4, 2, 1.0f, false), false, true},
      {grouped(64, 32, 16, 4, 1, 1, 1.0f, true), true, false},
  };
  for (const ScoringCase& c : cases) {
    const RouterDims& dims = c.dims;
    const bool group_limited =
        dims.scoring == RouterScoring::kSigmoidGroupLimited;
    SCOPED_TRACE(::testing::Message()
                 << "T " << dims.tokens << " E " << dims.experts << " K "
                 << dims.top_k << " scoring " << static_cast<int>(dims.scoring)
                 << " bias " << c.bias << " selection " << c.selection_bias);
    const int64_t t = dims.tokens, d = dims.dim, e = dims.experts,
                  k = dims.top_k;
    const auto x = TernaryX(t * d, 11);
    const auto w = group_limited ? SmallW(e * d, 12) : QuantizedW(e * d, 12);
    const auto bias = group_limited ? SmallW(e, 13) : QuantizedW(e, 13);
    const auto selection =
        group_limited ? SpacedSelectionBias(dims, 14) : std::vector<float>();
    const auto d_weights = ops_testing::RandomVector(t * k, -1.0f, 1.0f, 15);
    const auto extra = ops_testing::RandomVector(t * e, -0.1f, 0.1f, 16);
    const auto dx0 = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(t * d, -1.0f, 1.0f, 17));
    const auto dw0 = ops_testing::RandomVector(e * d, -1.0f, 1.0f, 18);
    const auto db0 = ops_testing::RandomVector(e, -1.0f, 1.0f, 19);

    kernels::RouterDims cpu{t, d, e, k, dims.renormalize, dims.scoring,
                            dims.groups, dims.top_groups, dims.scale,
                            dims.keep_softmax};
    kernels::RouterCache cache;
    std::vector<int32_t> indices(t * k);
    std::vector<float> weights(t * k), dx = dx0, dw = dw0, db = db0;
    const float* bias_ptr = c.bias ? bias.data() : nullptr;
    const float* sel_ptr = c.selection_bias ? selection.data() : nullptr;
    SHARDD_ASSERT_OK(kernels::RouterForward(cpu, x.data(), w.data(), bias_ptr,
                                            sel_ptr, indices.data(),
                                            weights.data(), &cache));
    std::vector<float> softmax;
    if (const float* p = kernels::RouterSoftmax(cache)) {
      softmax.assign(p, p + t * e);
    }
    SHARDD_ASSERT_OK(kernels::RouterBackward(
        cpu, x.data(), w.data(), d_weights.data(), extra.data(), dx.data(),
        /*accumulate_dx=*/false, dw.data(), c.bias ? db.data() : nullptr,
        &cache));
    std::vector<double> abs_dl(e, 0.0);
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t j = 0; j < e; ++j) {
        abs_dl[j] += std::fabs(cache.d_logits[r * e + j]);
      }
    }

    DeviceBuffer<T> d_x(ops_testing::ToStorage<T>(x));
    DeviceBuffer<T> d_w(ops_testing::ToStorage<T>(w));
    DeviceBuffer<T> d_bias(ops_testing::ToStorage<T>(bias));
    DeviceBuffer<float> d_sel(selection);
    DeviceBuffer<int32_t> d_indices(t * k);
    DeviceBuffer<float> d_weights_out(t * k);
    DeviceBytes saved(RouterSavedBytes(dims));
    SHARDD_ASSERT_OK(RouterForward(
        dims, d_x.get(), d_w.get(), c.bias ? d_bias.get() : nullptr,
        c.selection_bias ? d_sel.get() : nullptr, d_indices.get(),
        d_weights_out.get(), saved.get(), saved.size(), gpu.handle(),
        gpu.stream()));
    const float* gpu_softmax = RouterSoftmax(dims, saved.get());
    ASSERT_EQ(gpu_softmax == nullptr, softmax.empty());
    std::vector<float> gpu_softmax_host(softmax.size());
    gpu.Sync();
    if (!softmax.empty()) {
      ASSERT_EQ(cudaMemcpy(gpu_softmax_host.data(), gpu_softmax,
                           softmax.size() * sizeof(float),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    DeviceBuffer<float> d_dweights(d_weights);
    DeviceBuffer<float> d_extra(extra);
    DeviceBuffer<T> d_dx(ops_testing::ToStorage<T>(dx0));
    DeviceBuffer<float> d_dw(dw0);
    DeviceBuffer<float> d_db(db0);
    DeviceBytes workspace(
        RouterBackwardWorkspaceBytes(dims, DTypeOf<T>::value));
    SHARDD_ASSERT_OK(RouterBackward(
        dims, d_x.get(), d_w.get(), d_dweights.get(), d_extra.get(),
        saved.get(), saved.size(), d_dx.get(), /*accumulate_dx=*/false,
        d_dw.get(), c.bias ? d_db.get() : nullptr, workspace.get(),
        workspace.size(), gpu.handle(), gpu.stream()));
    gpu.Sync();
    EXPECT_EQ(d_indices.Download(), indices);
    ops_testing::ExpectAllClose(d_weights_out.Download(), weights, kProb, 0.0,
                                "weights");
    // The kept softmax: E-term sums in another order, 2-ulp exps.
    ops_testing::ExpectAllClose(gpu_softmax_host, softmax, kProb, 0.0,
                                "softmax");
    constexpr double kGrad = Tolerance<T>::kGrad;
    ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dx.Download()), dx,
                                kGrad, kGrad, "dx");
    ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dw");
    if (c.bias) {
      const auto got = d_db.Download();
      const double rel = std::is_same<T, float>::value
                             ? (t + 8) * std::ldexp(1.0, -24)
                             : std::ldexp(1.0, -8);
      for (int64_t j = 0; j < e; ++j) {
        EXPECT_NEAR(got[j], db[j], rel * abs_dl[j] + 1e-6) << "d_bias " << j;
      }
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
