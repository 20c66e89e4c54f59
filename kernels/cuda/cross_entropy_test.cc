#include "kernels/cuda/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::DeviceBytes;

// Loss: the logits differ from the CPU's only by summation order (both
// paths see the same, bf16-exact, inputs), so 2e-5 relative for either
// dtype. Gradients: fp32 1e-5; bf16 1e-2 (the logits gradient is rounded to
// bf16 before the backward GEMMs, and dhidden is stored in bf16).
constexpr double kLoss = 2e-5;
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

constexpr int32_t kIgnore = -100;

std::vector<int32_t> Targets(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = (i % 7 == 3) ? kIgnore : dist(rng);
  return t;
}

CrossEntropyDeviceResult Download(
    const DeviceBuffer<CrossEntropyDeviceResult>& result) {
  return result.Download()[0];
}

template <typename T>
class CrossEntropyGpuTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(CrossEntropyGpuTest, StorageTypes);

TYPED_TEST(CrossEntropyGpuTest, MatchesCpu) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  struct Case {
    CrossEntropyDims dims;
    int64_t block_rows;
  };
  // Several blocks with a ragged last one; one block larger than T; an odd
  // vocab.
  for (const Case c : {Case{{300, 64, 1000}, 128}, Case{{50, 32, 517}, 256},
                       Case{{129, 48, 4096}, 1}}) {
    for (const bool accumulate : {false, true}) {
      const CrossEntropyDims& dims = c.dims;
      SCOPED_TRACE(::testing::Message()
                   << "T " << dims.tokens << " D " << dims.dim << " V "
                   << dims.vocab << " block " << c.block_rows << " accumulate "
                   << accumulate);
      const int64_t t = dims.tokens, d = dims.dim, v = dims.vocab;
      const auto hidden = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 1));
      const auto weight = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(v * d, -0.3f, 0.3f, 2));
      const auto targets = Targets(t, v, 3);
      const auto dh0 = ops_testing::RoundedToBf16(
          ops_testing::RandomVector(t * d, -1.0f, 1.0f, 4));
      const auto dw0 = ops_testing::RandomVector(v * d, -1.0f, 1.0f, 5);
      const float loss_scale = 1.0f / 200.0f;

      kernels::CrossEntropyOptions cpu_options;
      cpu_options.ignore_index = kIgnore;
      cpu_options.block_rows = c.block_rows;
      std::vector<float> dh = dh0, dw = dw0;
      SHARDD_ASSERT_OK_AND_ASSIGN(
          const kernels::CrossEntropyResult expected,
          kernels::LmHeadCrossEntropyBackward(
              hidden.data(), weight.data(), t, d, v, targets.data(), loss_scale,
              dh.data(), dw.data(), accumulate, cpu_options));

      CudaCrossEntropyOptions options;
      options.ignore_index = kIgnore;
      options.block_rows = c.block_rows;
      DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
      DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
      DeviceBuffer<int32_t> d_targets(targets);
      DeviceBuffer<CrossEntropyDeviceResult> d_forward(1), d_backward(1);
      DeviceBytes forward_ws(CrossEntropyWorkspaceBytes(
          dims, DTypeOf<T>::value, options, /*with_grad=*/false));
      SHARDD_ASSERT_OK(LmHeadCrossEntropyForward(
          dims, d_hidden.get(), d_weight.get(), d_targets.get(),
          d_forward.get(), forward_ws.get(), forward_ws.size(), options,
          gpu.handle(), gpu.stream()));
      DeviceBuffer<T> d_dh(ops_testing::ToStorage<T>(dh0));
      DeviceBuffer<float> d_dw(dw0);
      DeviceBytes backward_ws(CrossEntropyWorkspaceBytes(
          dims, DTypeOf<T>::value, options, /*with_grad=*/true));
      SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
          dims, d_hidden.get(), d_weight.get(), d_targets.get(), loss_scale,
          d_dh.get(), d_dw.get(), accumulate, d_backward.get(),
          backward_ws.get(), backward_ws.size(), options, gpu.handle(),
          gpu.stream()));
      gpu.Sync();
      for (const CrossEntropyDeviceResult& r :
           {Download(d_forward), Download(d_backward)}) {
        EXPECT_EQ(r.count, expected.count);
        EXPECT_EQ(r.invalid_targets, 0);
        EXPECT_NEAR(r.loss_sum, expected.loss_sum,
                    kLoss * std::abs(expected.loss_sum));
        EXPECT_NEAR(r.mean_loss, expected.mean_loss,
                    kLoss * std::abs(expected.mean_loss));
      }
      constexpr double kGrad = Tolerance<T>::kGrad;
      ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dh.Download()), dh,
                                  kGrad, kGrad, "dhidden");
      ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dweight");
    }
  }
}

// Targets outside [0, V) are counted and contribute nothing, like ignored
// ones; the CPU reference sees them as ignore_index.
TYPED_TEST(CrossEntropyGpuTest, InvalidTargetsAreCountedAndSkipped) {
  using T = TypeParam;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  const CrossEntropyDims dims{6, 16, 40};
  const auto hidden = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(dims.tokens * dims.dim, -1.0f, 1.0f, 6));
  const auto weight = ops_testing::RoundedToBf16(
      ops_testing::RandomVector(dims.vocab * dims.dim, -0.3f, 0.3f, 7));
  const std::vector<int32_t> targets = {3, 40, kIgnore, -1, 39, 0};
  std::vector<int32_t> cpu_targets = targets;
  cpu_targets[1] = cpu_targets[3] = kIgnore;
  kernels::CrossEntropyOptions cpu_options;
  cpu_options.ignore_index = kIgnore;
  std::vector<float> dh(hidden.size()), dw(weight.size(), 0.0f);
  SHARDD_ASSERT_OK_AND_ASSIGN(
      const kernels::CrossEntropyResult expected,
      kernels::LmHeadCrossEntropyBackward(
          hidden.data(), weight.data(), dims.tokens, dims.dim, dims.vocab,
          cpu_targets.data(), 0.25f, dh.data(), dw.data(), false, cpu_options));

  CudaCrossEntropyOptions options;
  options.ignore_index = kIgnore;
  DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
  DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
  DeviceBuffer<int32_t> d_targets(targets);
  DeviceBuffer<CrossEntropyDeviceResult> d_result(1);
  DeviceBuffer<T> d_dh(hidden.size());
  DeviceBuffer<float> d_dw(std::vector<float>(weight.size(), 0.0f));
  DeviceBytes ws(
      CrossEntropyWorkspaceBytes(dims, DTypeOf<T>::value, options, true));
  SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
      dims, d_hidden.get(), d_weight.get(), d_targets.get(), 0.25f, d_dh.get(),
      d_dw.get(), false, d_result.get(), ws.get(), ws.size(), options,
      gpu.handle(), gpu.stream()));
  gpu.Sync();
  const CrossEntropyDeviceResult r = Download(d_result);
  EXPECT_EQ(r.count, 3);
  EXPECT_EQ(r.count, expected.count);
  EXPECT_EQ(r.invalid_targets, 2);
  EXPECT_NEAR(r.loss_sum, expected.loss_sum,
              kLoss * std::abs(expected.loss_sum));
  constexpr double kGrad = Tolerance<T>::kGrad;
  ops_testing::ExpectAllClose(ops_testing::ToFloat(d_dh.Download()), dh, kGrad,
                              kGrad, "dhidden");
  ops_testing::ExpectAllClose(d_dw.Download(), dw, kGrad, kGrad, "dweight");
}

// Soft-capped logits (Gemma) are checked against bounds derived from the
// arithmetic, in units of u = 2^-24 (fp32 unit roundoff); bf16 rounds to
// nearest, relative error 2^-8.
constexpr double kU = 0x1p-24;
constexpr double kBf16U = 0x1p-8;

// Double-precision logits of bf16-exact inputs, [T, V]: z = h @ w^T and
// s = |h| @ |w|^T, the scale of a dot product's rounding error (a length-K
// fp32 dot product is within K u s of z in any order; cuBLAS' tensor cores
// may truncate instead of rounding, so 2 K u on the GPU).
struct ReferenceLogits {
  std::vector<double> z, s;
};

ReferenceLogits LogitsInDouble(const std::vector<float>& hidden,
                               const std::vector<float>& weight,
                               const CrossEntropyDims& dims) {
  const int64_t t = dims.tokens, d = dims.dim, v = dims.vocab;
  ReferenceLogits ref{std::vector<double>(t * v), std::vector<double>(t * v)};
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t j = 0; j < v; ++j) {
      double z = 0.0, s = 0.0;
      for (int64_t k = 0; k < d; ++k) {
        const double p = double{hidden[r * d + k]} * weight[j * d + k];
        z += p;
        s += std::fabs(p);
      }
      ref.z[r * v + j] = z;
      ref.s[r * v + j] = s;
    }
  }
  return ref;
}

double CapInDouble(double z, double cap) {
  return cap > 0 ? cap * std::tanh(z / cap) : z;
}

// |actual - expected| <= bound elementwise; reports the first 10 failures.
void ExpectWithin(const std::vector<float>& actual,
                  const std::vector<double>& expected,
                  const std::vector<double>& bound, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_EQ(bound.size(), expected.size()) << what;
  int64_t failures = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double error = std::fabs(double{actual[i]} - expected[i]);
    if (!(error <= bound[i]) && ++failures <= 10) {
      ADD_FAILURE() << what << "[" << i << "]: actual " << actual[i]
                    << " expected " << expected[i] << " bound " << bound[i];
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << actual.size()
                         << " elements out of bounds";
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Soft-capped loss and gradients against the CPU kernel with the same cap.
// Weights in [-1, 1] give logits of standard deviation sqrt(D) / 3 (2.1 and
// 2.7 here), so cap 2 saturates a good share of them (asserted below).
//
// Bounds (both sides start from the same bf16-exact inputs; s = loss_scale,
// p the softmax of the capped logits y, g = 1 - (y / cap)^2 the cap's slope,
// S = |h| @ |w|^T):
// - Logits: the CPU's and the GPU's differ by at most 3 D u S_tj (K u and
//   2 K u above); the cap is 1-Lipschitz and each side's x / cap, tanhf
//   (2 ulp) and product add at most |x| u + 5 cap u, so the capped logits
//   differ by dy_tj = (4 D S_tj + 4 |z_tj| + 12 cap) u.
// - Loss of row t: the log-sum-exp and the target logit each move by at
//   most dy_t = max_j dy_tj; per side each exp(y - max) errs by at most
//   (2 cap + 4) u relative (the argument's rounding, 2 ulp), and the GPU's
//   fp32 online sum of exps by 4 V u more, so |d loss_t| <= e_t = 2 dy_t +
//   (4 V + 8 cap + 16) u, which also bounds the softmax's relative error.
// - dlogits = s (p - onehot) g: g moves by at most 2 dy_tj / cap + 4 u, so
//   dlogits_tj moves by E_tj = s (p_tj e_t + |p_tj - onehot| (2 dy_tj / cap
//   + 4 u)), plus 2^-8 |dlogits_tj| with bf16 (rounded before the GEMMs).
// - dhidden_tk = sum_j dlogits_tj w_jk: within sum_j E_tj |w_jk| plus the
//   two GEMMs' 3 V u sum_j |dlogits_tj w_jk| (4 V u used), plus 2^-8
//   |dhidden_tk| when stored in bf16; dweight_jk likewise over t, with
//   T + blocks additions (one GEMM per block added into dweight) for V.
// Each bound is doubled for second-order terms and for being evaluated at
// the double-precision reference instead of either side.
TYPED_TEST(CrossEntropyGpuTest, SoftcapMatchesCpu) {
  using T = TypeParam;
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  constexpr float kCap = 2.0f;
  constexpr double cap = kCap;
  struct Case {
    CrossEntropyDims dims;
    int64_t block_rows;
  };
  // A ragged last block (300 = 2 * 128 + 44; 77 = 2 * 32 + 13).
  for (const Case c : {Case{{300, 64, 1000}, 128}, Case{{77, 40, 517}, 32}}) {
    const CrossEntropyDims& dims = c.dims;
    SCOPED_TRACE(::testing::Message()
                 << "T " << dims.tokens << " D " << dims.dim << " V "
                 << dims.vocab << " block " << c.block_rows);
    const int64_t t = dims.tokens, d = dims.dim, v = dims.vocab;
    const auto hidden = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(t * d, -1.0f, 1.0f, 11));
    const auto weight = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(v * d, -1.0f, 1.0f, 12));
    const auto targets = Targets(t, v, 13);
    const float loss_scale = 1.0f / 200.0f;
    const double s = loss_scale;

    const ReferenceLogits ref = LogitsInDouble(hidden, weight, dims);
    const int64_t beyond_cap =
        std::count_if(ref.z.begin(), ref.z.end(),
                      [&](double z) { return std::fabs(z) > cap; });
    ASSERT_GT(beyond_cap, t * v / 4)
        << "the data must drive many logits into the cap's saturation";

    kernels::CrossEntropyOptions cpu_options;
    cpu_options.ignore_index = kIgnore;
    cpu_options.block_rows = c.block_rows;
    cpu_options.softcap = kCap;
    std::vector<float> dh(t * d), dw(v * d, 0.0f);
    SHARDD_ASSERT_OK_AND_ASSIGN(
        const kernels::CrossEntropyResult expected,
        kernels::LmHeadCrossEntropyBackward(
            hidden.data(), weight.data(), t, d, v, targets.data(), loss_scale,
            dh.data(), dw.data(), /*accumulate_dhidden=*/false, cpu_options));

    CudaCrossEntropyOptions options;
    options.ignore_index = kIgnore;
    options.block_rows = c.block_rows;
    options.softcap = kCap;
    DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
    DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
    DeviceBuffer<int32_t> d_targets(targets);
    DeviceBuffer<CrossEntropyDeviceResult> d_forward(1), d_backward(1);
    DeviceBytes forward_ws(CrossEntropyWorkspaceBytes(
        dims, DTypeOf<T>::value, options, /*with_grad=*/false));
    SHARDD_ASSERT_OK(LmHeadCrossEntropyForward(
        dims, d_hidden.get(), d_weight.get(), d_targets.get(), d_forward.get(),
        forward_ws.get(), forward_ws.size(), options, gpu.handle(),
        gpu.stream()));
    DeviceBuffer<T> d_dh(t * d);
    DeviceBuffer<float> d_dw(std::vector<float>(v * d, 0.0f));
    DeviceBytes backward_ws(CrossEntropyWorkspaceBytes(
        dims, DTypeOf<T>::value, options, /*with_grad=*/true));
    SHARDD_ASSERT_OK(LmHeadCrossEntropyBackward(
        dims, d_hidden.get(), d_weight.get(), d_targets.get(), loss_scale,
        d_dh.get(), d_dw.get(), /*accumulate_dhidden=*/false, d_backward.get(),
        backward_ws.get(), backward_ws.size(), options, gpu.handle(),
        gpu.stream()));
    gpu.Sync();

    // The bounds above, from the double-precision reference.
    std::vector<double> dl(t * v, 0.0), dl_bound(t * v, 0.0);
    double loss_bound = 0.0;
    for (int64_t r = 0; r < t; ++r) {
      const int32_t target = targets[r];
      if (target == kIgnore) continue;  // exact zeros on both sides
      const double* z = &ref.z[r * v];
      const double* sc = &ref.s[r * v];
      std::vector<double> y(v), dy(v);
      double top = -INFINITY, dy_max = 0.0;
      for (int64_t j = 0; j < v; ++j) {
        y[j] = CapInDouble(z[j], cap);
        dy[j] = (4 * d * sc[j] + 4 * std::fabs(z[j]) + 12 * cap) * kU;
        top = std::max(top, y[j]);
        dy_max = std::max(dy_max, dy[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < v; ++j) sum += std::exp(y[j] - top);
      const double e = 2 * dy_max + (4.0 * v + 8 * cap + 16) * kU;
      loss_bound += 2 * e;
      for (int64_t j = 0; j < v; ++j) {
        const double p = std::exp(y[j] - top) / sum;
        const double p_minus_onehot = j == target ? p - 1.0 : p;
        const double slope = 1.0 - (y[j] / cap) * (y[j] / cap);
        const double g = s * p_minus_onehot * slope;
        double bound = s * (p * e + std::fabs(p_minus_onehot) *
                                        (2 * dy[j] / cap + 4 * kU));
        if (kBf16) bound += kBf16U * std::fabs(g);
        dl[r * v + j] = g;
        dl_bound[r * v + j] = bound;
      }
    }
    const int64_t blocks = (t + c.block_rows - 1) / c.block_rows;
    std::vector<double> dh_bound(t * d), dw_bound(v * d);
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t k = 0; k < d; ++k) {
        double carried = 0.0, gemm = 0.0, value = 0.0;
        for (int64_t j = 0; j < v; ++j) {
          const double w = weight[j * d + k];
          carried += dl_bound[r * v + j] * std::fabs(w);
          gemm += std::fabs(dl[r * v + j] * w);
          value += dl[r * v + j] * w;
        }
        double bound = carried + 4.0 * v * kU * gemm;
        if (kBf16) bound += kBf16U * std::fabs(value);
        dh_bound[r * d + k] = 2 * bound;
      }
    }
    for (int64_t j = 0; j < v; ++j) {
      for (int64_t k = 0; k < d; ++k) {
        double carried = 0.0, gemm = 0.0;
        for (int64_t r = 0; r < t; ++r) {
          const double h = hidden[r * d + k];
          carried += dl_bound[r * v + j] * std::fabs(h);
          gemm += std::fabs(dl[r * v + j] * h);
        }
        dw_bound[j * d + k] = 2 * (carried + 4.0 * (t + blocks) * kU * gemm);
      }
    }

    for (const CrossEntropyDeviceResult& r :
         {Download(d_forward), Download(d_backward)}) {
      EXPECT_EQ(r.count, expected.count);
      EXPECT_EQ(r.invalid_targets, 0);
      EXPECT_NEAR(r.loss_sum, expected.loss_sum, loss_bound);
      EXPECT_NEAR(r.mean_loss, expected.mean_loss, loss_bound / r.count);
    }
    ExpectWithin(ops_testing::ToFloat(d_dh.Download()), ToDouble(dh), dh_bound,
                 "dhidden");
    ExpectWithin(d_dw.Download(), ToDouble(dw), dw_bound, "dweight");
  }
}

// LmHeadSoftmax against softmax(cap(h @ w^T)) in double. Bounds: the GPU's
// logits are within 2 D u S_tj of exact and its cap adds |z| u + 5 cap u
// (see SoftcapMatchesCpu), dy_tj = (2 D S_tj + |z_tj| + 5 cap) u; the
// probability's relative error is at most e_t = 2 dy_t + (2 range_t + 10) u
// (dy_t = max_j dy_tj; range_t = max_j y_tj - min_j y_tj bounds the
// rounding of each exp's argument; exp 2 ulp, in the element and in the
// sum; the quotient rounds to float; the double sum's own error is
// V 2^-53), doubled as above, plus 2^-8 for the bf16 store. Each
// row sums to 1 within the roundings of its V quotients: 2 u (fp32) or
// 2^-8 + 2 u (bf16), plus 4 V 2^-53 for the sums in double.
TYPED_TEST(CrossEntropyGpuTest, SoftmaxMatchesDoubleReference) {
  using T = TypeParam;
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value;
  SHARDD_SKIP_WITHOUT_GPU();
  ops_testing::GpuContext gpu;
  struct Case {
    CrossEntropyDims dims;
    int64_t block_rows;
    float softcap;
  };
  // A ragged last block (300 = 2 * 128 + 44) with a saturating cap; one
  // block larger than T without a cap; blocks of one row with Gemma's 30.
  for (const Case c :
       {Case{{300, 64, 1000}, 128, 2.0f}, Case{{50, 32, 517}, 256, 0.0f},
        Case{{129, 48, 4096}, 1, 30.0f}}) {
    const CrossEntropyDims& dims = c.dims;
    SCOPED_TRACE(::testing::Message()
                 << "T " << dims.tokens << " D " << dims.dim << " V "
                 << dims.vocab << " block " << c.block_rows << " softcap "
                 << c.softcap);
    const int64_t t = dims.tokens, d = dims.dim, v = dims.vocab;
    const auto hidden = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(t * d, -1.0f, 1.0f, 21));
    const auto weight = ops_testing::RoundedToBf16(
        ops_testing::RandomVector(v * d, -1.0f, 1.0f, 22));
    const double cap = c.softcap;

    CudaCrossEntropyOptions options;
    options.block_rows = c.block_rows;
    options.softcap = c.softcap;
    DeviceBuffer<T> d_hidden(ops_testing::ToStorage<T>(hidden));
    DeviceBuffer<T> d_weight(ops_testing::ToStorage<T>(weight));
    // Guard elements after the T x V probabilities must stay untouched.
    constexpr int64_t kGuard = 1024;
    constexpr float kSentinel = -7.0f;
    DeviceBuffer<T> d_probs(ops_testing::ToStorage<T>(
        std::vector<float>(t * v + kGuard, kSentinel)));
    DeviceBytes ws(
        LmHeadSoftmaxWorkspaceBytes(dims, DTypeOf<T>::value, options));
    SHARDD_ASSERT_OK(LmHeadSoftmax(dims, d_hidden.get(), d_weight.get(),
                                   d_probs.get(), ws.get(), ws.size(), options,
                                   gpu.handle(), gpu.stream()));
    gpu.Sync();
    std::vector<float> probs = ops_testing::ToFloat(d_probs.Download());
    for (int64_t i = t * v; i < t * v + kGuard; ++i) {
      ASSERT_EQ(probs[i], kSentinel) << "written past the end at " << i;
    }
    probs.resize(t * v);

    const ReferenceLogits ref = LogitsInDouble(hidden, weight, dims);
    std::vector<double> expected(t * v), bound(t * v);
    for (int64_t r = 0; r < t; ++r) {
      std::vector<double> y(v);
      double top = -INFINITY, bottom = INFINITY, dy_max = 0.0;
      for (int64_t j = 0; j < v; ++j) {
        const double z = ref.z[r * v + j];
        y[j] = CapInDouble(z, cap);
        const double dy =
            (2 * d * ref.s[r * v + j] + std::fabs(z) + 5 * cap) * kU;
        top = std::max(top, y[j]);
        bottom = std::min(bottom, y[j]);
        dy_max = std::max(dy_max, dy);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < v; ++j) sum += std::exp(y[j] - top);
      const double e = 2 * dy_max + (2 * (top - bottom) + 10) * kU;
      for (int64_t j = 0; j < v; ++j) {
        const double p = std::exp(y[j] - top) / sum;
        expected[r * v + j] = p;
        bound[r * v + j] = (2 * e + (kBf16 ? kBf16U * (1 + 2 * e) : 0.0)) * p;
      }
    }
    ExpectWithin(probs, expected, bound, "probs");

    const double sum_bound =
        (kBf16 ? kBf16U : 0.0) + 2 * kU + 4.0 * v * 0x1p-53;
    for (int64_t r = 0; r < t; ++r) {
      double sum = 0.0;
      for (int64_t j = 0; j < v; ++j) sum += probs[r * v + j];
      EXPECT_NEAR(sum, 1.0, sum_bound) << "row " << r;
    }
  }
}

// Argument checks return before any CUDA call, so this runs without a GPU.
// Stand-ins for device pointers: never dereferenced, aligned to 256 bytes.
template <typename P>
P* Fake(uintptr_t slot) {
  return reinterpret_cast<P*>(slot * 4096);
}

TEST(CrossEntropyArgsTest, SoftcapAndSoftmax) {
  using ::testing::HasSubstr;
  constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const CrossEntropyDims dims{300, 64, 1000};
  CudaCrossEntropyOptions options;
  options.block_rows = 128;
  // One block of fp32 logits whatever the storage type.
  EXPECT_EQ(LmHeadSoftmaxWorkspaceBytes(dims, DType::kBFloat16, options),
            AlignWorkspaceBytes(128 * 1000 * 4));
  options.block_rows = 100000;  // clamped to T
  EXPECT_EQ(LmHeadSoftmaxWorkspaceBytes(dims, DType::kFloat32, options),
            AlignWorkspaceBytes(300 * 1000 * 4));
  options.block_rows = 0;
  EXPECT_EQ(LmHeadSoftmaxWorkspaceBytes(dims, DType::kFloat32, options), 0u);
  EXPECT_THAT(
      LmHeadSoftmax(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                    Fake<char>(4), 1 << 30, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("block_rows")));
  options.block_rows = 128;

  for (const float bad : {-1.0f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(::testing::Message() << "softcap " << bad);
    options.softcap = bad;
    const auto names_softcap =
        StatusIs(kInvalid, HasSubstr("softcap must be finite and >= 0"));
    EXPECT_EQ(CrossEntropyWorkspaceBytes(dims, DType::kFloat32, options, true),
              0u);
    EXPECT_EQ(LmHeadSoftmaxWorkspaceBytes(dims, DType::kFloat32, options), 0u);
    EXPECT_THAT(LmHeadCrossEntropyForward(
                    dims, Fake<float>(1), Fake<float>(2), Fake<int32_t>(3),
                    Fake<CrossEntropyDeviceResult>(4), Fake<char>(5), 1 << 30,
                    options, nullptr, nullptr),
                names_softcap);
    EXPECT_THAT(LmHeadCrossEntropyBackward(
                    dims, Fake<uint16_t>(1), Fake<uint16_t>(2),
                    Fake<int32_t>(3), 1.0f, Fake<uint16_t>(4), Fake<float>(5),
                    false, Fake<CrossEntropyDeviceResult>(6), Fake<char>(7),
                    1 << 30, options, nullptr, nullptr),
                names_softcap);
    EXPECT_THAT(
        LmHeadSoftmax(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                      Fake<char>(4), 1 << 30, options, nullptr, nullptr),
        names_softcap);
    // Checked even when there is nothing to do.
    EXPECT_THAT(LmHeadSoftmax(CrossEntropyDims{0, 64, 1000}, nullptr, nullptr,
                              static_cast<uint16_t*>(nullptr), nullptr, 0,
                              options, nullptr, nullptr),
                names_softcap);
  }

  options.softcap = 30.0f;
  const size_t ce_need =
      CrossEntropyWorkspaceBytes(dims, DType::kBFloat16, options, true);
  EXPECT_EQ(ce_need, AlignWorkspaceBytes(128 * 1000 * 4) +
                         AlignWorkspaceBytes(128 * 1000 * 2) +
                         AlignWorkspaceBytes(300 * 8) +
                         AlignWorkspaceBytes(300 * 4));
  EXPECT_THAT(LmHeadCrossEntropyBackward(
                  dims, Fake<uint16_t>(1), Fake<uint16_t>(2), Fake<int32_t>(3),
                  1.0f, Fake<uint16_t>(4), Fake<float>(5), false,
                  Fake<CrossEntropyDeviceResult>(6), Fake<char>(7), ce_need - 1,
                  options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("workspace_bytes is")));
  const size_t need =
      LmHeadSoftmaxWorkspaceBytes(dims, DType::kFloat32, options);
  EXPECT_THAT(
      LmHeadSoftmax(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                    Fake<char>(4), need - 1, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("workspace_bytes is")));
  EXPECT_THAT(
      LmHeadSoftmax(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                    Fake<char>(4) + 16, need, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("aligned")));
  EXPECT_THAT(LmHeadSoftmax(dims, Fake<uint16_t>(1), Fake<uint16_t>(2), nullptr,
                            Fake<char>(4), need, options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("probs is null")));
  EXPECT_THAT(LmHeadSoftmax(dims, Fake<float>(1), nullptr, Fake<float>(3),
                            Fake<char>(4), need, options, nullptr, nullptr),
              StatusIs(kInvalid, HasSubstr("weight is null")));
  EXPECT_THAT(
      LmHeadSoftmax(dims, Fake<float>(1), Fake<float>(2), Fake<float>(3),
                    Fake<char>(4), need, options, nullptr, nullptr),
      StatusIs(kInvalid, HasSubstr("cuBLAS handle is null")));
  // T = 0: nothing to do, nothing needed.
  const CrossEntropyDims empty{0, 64, 1000};
  EXPECT_EQ(LmHeadSoftmaxWorkspaceBytes(empty, DType::kFloat32, options), 0u);
  SHARDD_EXPECT_OK(LmHeadSoftmax(empty, static_cast<const float*>(nullptr),
                                 nullptr, nullptr, nullptr, 0, options, nullptr,
                                 nullptr));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
