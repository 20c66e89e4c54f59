#include "kernels/cpu/grouped_experts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/simd_level.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using testing_util::RandomVector;

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Random top-k style indices: K distinct experts per token.
std::vector<int32_t> RandomIndices(int64_t t, int64_t e, int64_t k,
                                   uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out;
  std::vector<int32_t> perm(e);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < e; ++j) perm[j] = j;
    std::shuffle(perm.begin(), perm.end(), rng);
    out.insert(out.end(), perm.begin(), perm.begin() + k);
  }
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Everything the experts read, in double for the reference.
struct Problem {
  ExpertDims dims;
  GatedActivation act = GatedActivation::kSwiGLU;
  std::vector<float> x, weights, w_gu, w_d;
  std::vector<int32_t> indices;
  std::vector<char> mask;  // empty = no mask

  const bool* mask_ptr() const {
    return mask.empty() ? nullptr : reinterpret_cast<const bool*>(mask.data());
  }
};

Problem MakeProblem(ExpertDims dims, GatedActivation act, uint32_t seed) {
  Problem p;
  p.dims = dims;
  p.act = act;
  const int64_t t = dims.tokens, d = dims.dim, i = dims.intermediate,
                e = dims.experts, k = dims.top_k;
  p.x = RandomVector(t * d, seed + 1);
  p.weights = RandomVector(t * k, seed + 2);
  for (float& w : p.weights) w = 0.5f + 0.5f * w;  // in [0, 1]
  p.w_gu = RandomVector(e * d * 2 * i, seed + 3, 0.7f);
  p.w_d = RandomVector(e * i * d, seed + 4, 0.7f);
  p.indices = RandomIndices(t, e, k, seed + 5);
  return p;
}

// The experts written plainly, one token and one assignment at a time.
double RefGate(GatedActivation act, double g) {
  if (act == GatedActivation::kSwiGLU) return g / (1.0 + std::exp(-g));
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g)));
}

struct RefParams {
  std::vector<double> x, weights, w_gu, w_d;
};

RefParams ToRef(const Problem& p) {
  return {ToDouble(p.x), ToDouble(p.weights), ToDouble(p.w_gu),
          ToDouble(p.w_d)};
}

std::vector<double> RefForward(const Problem& p, const RefParams& r) {
  const int64_t t_count = p.dims.tokens, d = p.dims.dim,
                n_i = p.dims.intermediate, k = p.dims.top_k;
  std::vector<double> y(t_count * d, 0.0);
  for (int64_t t = 0; t < t_count; ++t) {
    if (!p.mask.empty() && !p.mask[t]) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = p.indices[t * k + j];
      const double w = r.weights[t * k + j];
      const double* gu = &r.w_gu[e * d * 2 * n_i];
      const double* dn = &r.w_d[e * n_i * d];
      for (int64_t i = 0; i < n_i; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t c = 0; c < d; ++c) {
          g += r.x[t * d + c] * gu[c * 2 * n_i + i];
          u += r.x[t * d + c] * gu[c * 2 * n_i + n_i + i];
        }
        const double a = RefGate(p.act, g) * u * w;
        for (int64_t c = 0; c < d; ++c) y[t * d + c] += a * dn[i * d + c];
      }
    }
  }
  return y;
}

double RefLoss(const Problem& p, const RefParams& r,
               const std::vector<float>& dy) {
  const std::vector<double> y = RefForward(p, r);
  double loss = 0.0;
  for (size_t i = 0; i < y.size(); ++i) loss += dy[i] * y[i];
  return loss;
}

// Central differences of RefLoss with respect to every entry of *param.
std::vector<double> FiniteDiff(const Problem& p, RefParams r,
                               std::vector<double> RefParams::*member,
                               const std::vector<float>& dy) {
  constexpr double kEps = 1e-3;
  std::vector<double>& param = r.*member;
  std::vector<double> grad(param.size());
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + kEps;
    const double up = RefLoss(p, r, dy);
    param[i] = saved - kEps;
    const double down = RefLoss(p, r, dy);
    param[i] = saved;
    grad[i] = (up - down) / (2 * kEps);
  }
  return grad;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 double rel_tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-3;  // absolute floor for all-zero gradients
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rel_tol * scale) << what << "[" << i << "]";
  }
}

struct Grads {
  std::vector<float> y, dx, d_weights, dw_gu, dw_d;
};

// Runs the kernel forward and backward with dy, gradients from zero.
Grads RunKernel(const Problem& p, const std::vector<float>& dy,
                GroupedExpertsWorkspace* ws) {
  const ExpertDims& dm = p.dims;
  Grads g;
  g.y.assign(dm.tokens * dm.dim, 99.0f);  // must be overwritten
  g.dx.assign(dm.tokens * dm.dim, 99.0f);
  g.d_weights.assign(dm.tokens * dm.top_k, 99.0f);
  g.dw_gu.assign(p.w_gu.size(), 0.0f);
  g.dw_d.assign(p.w_d.size(), 0.0f);
  EXPECT_THAT(GroupedExpertsForward(
                  dm, p.act, p.x.data(), p.indices.data(), p.weights.data(),
                  p.mask_ptr(), p.w_gu.data(), p.w_d.data(), g.y.data(), ws),
              IsOk());
  EXPECT_THAT(
      GroupedExpertsBackward(dm, p.act, p.w_gu.data(), p.w_d.data(), dy.data(),
                             g.dx.data(), false, g.d_weights.data(),
                             g.dw_gu.data(), g.dw_d.data(), ws),
      IsOk());
  return g;
}

// Forward against the reference and every gradient against finite
// differences of the reference.
void CheckAgainstReference(const Problem& p, uint32_t seed) {
  const std::vector<float> dy = RandomVector(p.dims.tokens * p.dims.dim, seed);
  GroupedExpertsWorkspace ws;
  const Grads g = RunKernel(p, dy, &ws);
  const RefParams r = ToRef(p);
  ExpectClose(g.y, RefForward(p, r), 1e-5, "y");
  ExpectClose(g.dx, FiniteDiff(p, r, &RefParams::x, dy), 1e-3, "dx");
  ExpectClose(g.d_weights, FiniteDiff(p, r, &RefParams::weights, dy), 1e-3,
              "d_weights");
  ExpectClose(g.dw_gu, FiniteDiff(p, r, &RefParams::w_gu, dy), 1e-3, "dw_gu");
  ExpectClose(g.dw_d, FiniteDiff(p, r, &RefParams::w_d, dy), 1e-3, "dw_d");
}

class GroupedExpertsActTest : public ::testing::TestWithParam<GatedActivation> {
};

TEST_P(GroupedExpertsActTest, MatchesReferenceAndFiniteDifferences) {
  for (int64_t k : {1, 2, 4}) {
    SCOPED_TRACE(k);
    CheckAgainstReference(MakeProblem({7, 6, 5, 4, k}, GetParam(), 100 + k), 7);
  }
}

TEST_P(GroupedExpertsActTest, MaskedTokensAreDropped) {
  Problem p = MakeProblem({7, 6, 5, 4, 2}, GetParam(), 200);
  p.mask = {1, 0, 1, 1, 0, 1, 1};
  p.indices[1 * 2] = 1234;  // a masked token's index is never read
  CheckAgainstReference(p, 8);
  const std::vector<float> dy = RandomVector(7 * 6, 9);
  GroupedExpertsWorkspace ws;
  const Grads g = RunKernel(p, dy, &ws);
  for (int64_t t : {1, 4}) {
    for (int c = 0; c < 6; ++c) {
      EXPECT_EQ(g.y[t * 6 + c], 0.0f);
      EXPECT_EQ(g.dx[t * 6 + c], 0.0f);
    }
    EXPECT_EQ(g.d_weights[t * 2], 0.0f);
    EXPECT_EQ(g.d_weights[t * 2 + 1], 0.0f);
  }
  EXPECT_EQ(ws.rows, 5 * 2);
}

TEST_P(GroupedExpertsActTest, AllTokensOnOneExpertAndEmptyExperts) {
  // K = 2 with both slots on expert 2: experts 0, 1 and 3 get nothing.
  Problem p = MakeProblem({7, 6, 5, 4, 2}, GetParam(), 300);
  std::fill(p.indices.begin(), p.indices.end(), 2);
  CheckAgainstReference(p, 10);
  const std::vector<float> dy = RandomVector(7 * 6, 11);
  GroupedExpertsWorkspace ws;
  Grads g = RunKernel(p, dy, &ws);
  EXPECT_THAT(std::vector<int64_t>(ws.expert_offsets.begin(),
                                   ws.expert_offsets.begin() + 5),
              ElementsAre(0, 0, 0, 14, 14));
  const int64_t gu = 6 * 2 * 5, dn = 5 * 6;
  for (int64_t e : {0, 1, 3}) {
    for (int64_t i = 0; i < gu; ++i) EXPECT_EQ(g.dw_gu[e * gu + i], 0.0f);
    for (int64_t i = 0; i < dn; ++i) EXPECT_EQ(g.dw_d[e * dn + i], 0.0f);
  }
  // The used expert did get a gradient.
  float norm = 0.0f;
  for (int64_t i = 0; i < gu; ++i) norm += std::abs(g.dw_gu[2 * gu + i]);
  EXPECT_GT(norm, 0.0f);
  // Empty experts' slices keep whatever they held (+= 0).
  std::vector<float> dw_gu(p.w_gu.size(), 3.0f), dw_d(p.w_d.size(), -2.0f);
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      p.dims, p.act, p.w_gu.data(), p.w_d.data(), dy.data(), nullptr, false,
      nullptr, dw_gu.data(), dw_d.data(), &ws));
  for (int64_t e : {0, 1, 3}) {
    for (int64_t i = 0; i < gu; ++i) EXPECT_EQ(dw_gu[e * gu + i], 3.0f);
    for (int64_t i = 0; i < dn; ++i) EXPECT_EQ(dw_d[e * dn + i], -2.0f);
  }
}

TEST_P(GroupedExpertsActTest, FloatFiniteDifferencesOfTheKernel) {
  // The kernel differentiated against itself in fp32 (no double reference).
  Problem p = MakeProblem({5, 4, 3, 3, 2}, GetParam(), 400);
  const std::vector<float> dy = RandomVector(5 * 4, 12);
  GroupedExpertsWorkspace ws, scratch;
  const Grads g = RunKernel(p, dy, &ws);
  std::vector<float> y(5 * 4);
  auto loss = [&]() {
    EXPECT_THAT(
        GroupedExpertsForward(p.dims, p.act, p.x.data(), p.indices.data(),
                              p.weights.data(), nullptr, p.w_gu.data(),
                              p.w_d.data(), y.data(), &scratch),
        IsOk());
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i)
      l += static_cast<double>(dy[i]) * y[i];
    return l;
  };
  auto check = [&](std::vector<float>* param, const std::vector<float>& grad,
                   const char* what) {
    constexpr float kEps = 1e-2f;
    for (size_t i = 0; i < param->size(); ++i) {
      const float saved = (*param)[i];
      (*param)[i] = saved + kEps;
      const double up = loss();
      (*param)[i] = saved - kEps;
      const double down = loss();
      (*param)[i] = saved;
      EXPECT_NEAR(grad[i], (up - down) / (2 * kEps), 5e-3) << what << i;
    }
  };
  check(&p.x, g.dx, "dx");
  check(&p.weights, g.d_weights, "d_weights");
  check(&p.w_gu, g.dw_gu, "dw_gu");
  check(&p.w_d, g.dw_d, "dw_d");
}

INSTANTIATE_TEST_SUITE_P(Activations, GroupedExpertsActTest,
                         ::testing::Values(GatedActivation::kSwiGLU,
                                           GatedActivation::kGeGLU),
                         [](const auto& info) {
                           return info.param == GatedActivation::kSwiGLU
                                      ? std::string("SwiGLU")
                                      : std::string("GeGLU");
                         });

// GPT-OSS's experts in double, from the header's definition: biases after
// both matmuls, the clamped SwiGLU, the routing weight on the biased down
// output. Also counts the pre-activations the clamps cut (`clamped`) and
// those within `kink` of a clamp bound, where central differences with a
// step below `kink` would straddle the kink (`near`).
struct OaiParams {
  std::vector<double> x, weights, w_gu, w_d, b_gu, b_d;
};

struct OaiProblem {
  ExpertDims dims;
  ExpertOptions options;  // Bias pointers unset; the vectors below hold them.
  std::vector<float> x, weights, w_gu, w_d, b_gu, b_d;
  std::vector<int32_t> indices;

  OaiParams Ref() const {
    return {ToDouble(x),   ToDouble(weights), ToDouble(w_gu),
            ToDouble(w_d), ToDouble(b_gu),    ToDouble(b_d)};
  }
};

std::vector<double> OaiForward(const OaiProblem& p, const OaiParams& r,
                               int* clamped = nullptr, int* near = nullptr,
                               double kink = 0.0) {
  const int64_t t_count = p.dims.tokens, d = p.dims.dim,
                n_i = p.dims.intermediate, k = p.dims.top_k;
  const double alpha = p.options.alpha, limit = p.options.limit;
  std::vector<double> y(t_count * d, 0.0);
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = p.indices[t * k + j];
      const double w = r.weights[t * k + j];
      const double* gu = &r.w_gu[e * d * 2 * n_i];
      const double* dn = &r.w_d[e * n_i * d];
      std::vector<double> out(d);
      for (int64_t c = 0; c < d; ++c) out[c] = r.b_d[e * d + c];
      for (int64_t i = 0; i < n_i; ++i) {
        double g = r.b_gu[e * 2 * n_i + i], u = r.b_gu[e * 2 * n_i + n_i + i];
        for (int64_t c = 0; c < d; ++c) {
          g += r.x[t * d + c] * gu[c * 2 * n_i + i];
          u += r.x[t * d + c] * gu[c * 2 * n_i + n_i + i];
        }
        if (clamped != nullptr) {
          *clamped += (g > limit) + (std::abs(u) > limit);
          *near += (std::abs(g - limit) < kink) +
                   (std::abs(std::abs(u) - limit) < kink);
        }
        g = std::min(g, limit);
        u = std::clamp(u, -limit, limit);
        const double a = g / (1.0 + std::exp(-alpha * g)) * (u + 1.0);
        for (int64_t c = 0; c < d; ++c) out[c] += a * dn[i * d + c];
      }
      for (int64_t c = 0; c < d; ++c) y[t * d + c] += w * out[c];
    }
  }
  return y;
}

std::vector<double> OaiFiniteDiff(const OaiProblem& p, OaiParams r,
                                  std::vector<double> OaiParams::*member,
                                  const std::vector<float>& dy, double eps) {
  std::vector<double>& param = r.*member;
  std::vector<double> grad(param.size());
  auto loss = [&] {
    const std::vector<double> y = OaiForward(p, r);
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
  };
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + eps;
    const double up = loss();
    param[i] = saved - eps;
    const double down = loss();
    param[i] = saved;
    grad[i] = (up - down) / (2 * eps);
  }
  return grad;
}

// fp32 storage, or bf16 storage (inputs rounded to bf16 values; the kernel
// accumulates in fp32 either way).
class ClampedSwiGLUExpertsTest : public ::testing::TestWithParam<bool> {};

TEST_P(ClampedSwiGLUExpertsTest, MatchesReferenceAndFiniteDifferences) {
  const bool bf16 = GetParam();
  // limit 7 (GPT-OSS's) with pre-activations of spread ~9 (inputs and
  // weights scaled up), and a small limit 0.8 with spread ~1.3: both cut
  // gate values from above and up values on both sides.
  struct Case {
    float limit, x_scale, w_scale;
    int64_t k;
  };
  for (const Case& c : {Case{7.0f, 3.0f, 2.5f, 2}, Case{0.8f, 1.0f, 0.7f, 1},
                        Case{0.8f, 1.0f, 0.7f, 3}}) {
    SCOPED_TRACE(::testing::Message()
                 << "limit " << c.limit << " k " << c.k << " bf16 " << bf16);
    OaiProblem p;
    p.dims = ExpertDims{7, 6, 5, 4, c.k};
    p.options.limit = c.limit;
    const uint32_t seed = 700 + static_cast<uint32_t>(c.k) + (bf16 ? 50 : 0);
    p.x = RandomVector(7 * 6, seed + 1, c.x_scale);
    p.weights = RandomVector(7 * c.k, seed + 2);
    for (float& w : p.weights) w = 0.5f + 0.5f * w;
    p.w_gu = RandomVector(4 * 6 * 10, seed + 3, c.w_scale);
    p.w_d = RandomVector(4 * 5 * 6, seed + 4, 0.7f);
    p.b_gu = RandomVector(4 * 10, seed + 5, c.limit / 2);
    p.b_d = RandomVector(4 * 6, seed + 6);
    p.indices = RandomIndices(7, 4, c.k, seed + 7);
    if (bf16) {
      for (std::vector<float>* v :
           {&p.x, &p.weights, &p.w_gu, &p.w_d, &p.b_gu, &p.b_d}) {
        for (float& f : *v) f = RoundToBf16(f);
      }
    }
    const OaiParams r = p.Ref();
    // Step 1e-4: one perturbed x, weight or bias entry moves a
    // pre-activation by at most eps * max(|x|, |w_gu|, 1) <= 3e-4, so with
    // none within 1e-3 of a bound no difference straddles a kink.
    constexpr double kEps = 1e-4;
    int clamped = 0, near = 0;
    const std::vector<double> want_y = OaiForward(p, r, &clamped, &near, 1e-3);
    EXPECT_GE(clamped, 10);  // The clamps are exercised...
    ASSERT_EQ(near, 0);      // ...and the differences stay smooth.

    ExpertOptions options = p.options;
    options.gate_up_bias = p.b_gu.data();
    options.down_bias = p.b_d.data();
    const std::vector<float> dy = RandomVector(7 * 6, seed + 8);
    std::vector<float> y(7 * 6, 99.0f), dx(7 * 6, 99.0f), dwt(7 * c.k, 99.0f);
    std::vector<float> dw_gu(p.w_gu.size()), dw_d(p.w_d.size());
    std::vector<float> db_gu(p.b_gu.size()), db_d(p.b_d.size());
    GroupedExpertsWorkspace ws;
    SHARDD_ASSERT_OK(GroupedExpertsForward(
        p.dims, GatedActivation::kClampedSwiGLU, options, p.x.data(),
        p.indices.data(), p.weights.data(), nullptr, p.w_gu.data(),
        p.w_d.data(), y.data(), &ws));
    SHARDD_ASSERT_OK(GroupedExpertsBackward(
        p.dims, GatedActivation::kClampedSwiGLU, options, p.w_gu.data(),
        p.w_d.data(), dy.data(), dx.data(), false, dwt.data(), dw_gu.data(),
        dw_d.data(), ExpertBiasGrads{db_gu.data(), db_d.data()}, &ws));
    // fp32 against double: sums of D = 6 and I = 5 terms of values up to
    // ~60 ((u + 1) * glu <= 8 * 7), a few ulp each: 1e-5 of the largest
    // output as for the other activations. The gradients against central
    // differences: the truncation error eps^2 |f'''| / 6 and the double
    // rounding of the loss over 2 eps are both below 1e-6 relative; the
    // kernel's fp32 rounding stays within the other activations' 1e-3.
    ExpectClose(y, want_y, 1e-5, "y");
    ExpectClose(dx, OaiFiniteDiff(p, r, &OaiParams::x, dy, kEps), 1e-3, "dx");
    ExpectClose(dwt, OaiFiniteDiff(p, r, &OaiParams::weights, dy, kEps), 1e-3,
                "d_weights");
    ExpectClose(dw_gu, OaiFiniteDiff(p, r, &OaiParams::w_gu, dy, kEps), 1e-3,
                "dw_gu");
    ExpectClose(dw_d, OaiFiniteDiff(p, r, &OaiParams::w_d, dy, kEps), 1e-3,
                "dw_d");
    ExpectClose(db_gu, OaiFiniteDiff(p, r, &OaiParams::b_gu, dy, kEps), 1e-3,
                "db_gu");
    ExpectClose(db_d, OaiFiniteDiff(p, r, &OaiParams::b_d, dy, kEps), 1e-3,
                "db_d");
    // Clamped values pass no gradient: some db_gu entries are exactly 0
    // only if every row of that expert cut them; at least check that the
    // kernel's zeros agree with the reference's.
    const std::vector<double> fd_bgu =
        OaiFiniteDiff(p, r, &OaiParams::b_gu, dy, kEps);
    for (size_t i = 0; i < fd_bgu.size(); ++i) {
      if (fd_bgu[i] == 0.0) {
        EXPECT_EQ(db_gu[i], 0.0f) << i;
      }
    }
  }
}

TEST_P(ClampedSwiGLUExpertsTest, ActivationInClosedForm) {
  // One token, one expert, identity-like weights so h = x: the activation
  // (and its clamps) read off directly. D = 2, I = 1: W_gu maps x[0] to
  // the gate and x[1] to the up value; W_d = [1, 0].
  const ExpertDims dims{1, 2, 1, 1, 1};
  const std::vector<float> w_gu = {1.0f, 0.0f, 0.0f, 1.0f};
  const std::vector<float> w_d = {1.0f, 0.0f};
  const std::vector<float> b_gu = {0.0f, 0.0f}, b_d = {0.25f, -0.5f};
  ExpertOptions options;
  options.gate_up_bias = b_gu.data();
  options.down_bias = b_d.data();
  const int32_t index = 0;
  const float weight = 0.5f;
  struct Point {
    float g, u;
  };
  for (const Point& pt : {Point{2.0f, -3.0f}, Point{9.0f, 8.0f},
                          Point{-4.0f, -12.0f}, Point{7.0f, 7.0f}}) {
    const std::vector<float> x = {pt.g, pt.u};
    std::vector<float> y(2);
    GroupedExpertsWorkspace ws;
    SHARDD_ASSERT_OK(GroupedExpertsForward(
        dims, GatedActivation::kClampedSwiGLU, options, x.data(), &index,
        &weight, nullptr, w_gu.data(), w_d.data(), y.data(), &ws));
    const double g = std::min<double>(pt.g, 7.0);
    const double u = std::clamp<double>(pt.u, -7.0, 7.0);
    const double act = g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0);
    // Values up to 56: 1e-5 relative is ~100 ulp of fp32, room for the
    // polynomial exp (1.4 ulp).
    EXPECT_NEAR(y[0], 0.5 * (act + 0.25), 1e-5 * std::max(1.0, std::abs(act)))
        << pt.g << ", " << pt.u;
    EXPECT_FLOAT_EQ(y[1], 0.5f * -0.5f);
  }
}

TEST_P(ClampedSwiGLUExpertsTest, BadOptionsAreRefused) {
  const ExpertDims dims{1, 2, 1, 1, 1};
  std::vector<float> x(2), w_gu(4), w_d(2), y(2);
  const int32_t index = 0;
  const float weight = 1.0f;
  ExpertOptions options;
  options.limit = 0.0f;
  GroupedExpertsWorkspace ws;
  EXPECT_THAT(GroupedExpertsForward(dims, GatedActivation::kClampedSwiGLU,
                                    options, x.data(), &index, &weight, nullptr,
                                    w_gu.data(), w_d.data(), y.data(), &ws),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("alpha and limit")));
  options.limit = 7.0f;
  SHARDD_ASSERT_OK(GroupedExpertsForward(
      dims, GatedActivation::kClampedSwiGLU, options, x.data(), &index, &weight,
      nullptr, w_gu.data(), w_d.data(), y.data(), &ws));
  options.limit = 6.0f;  // Not the forward's.
  std::vector<float> dy(2), dx(2);
  EXPECT_THAT(
      GroupedExpertsBackward(dims, GatedActivation::kClampedSwiGLU, options,
                             w_gu.data(), w_d.data(), dy.data(), dx.data(),
                             false, nullptr, nullptr, nullptr,
                             ExpertBiasGrads(), &ws),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("options")));
}

INSTANTIATE_TEST_SUITE_P(Storage, ClampedSwiGLUExpertsTest,
                         ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Bf16" : "Fp32";
                         });

TEST(GroupedExpertsTest, ActivationsInClosedForm) {
  // One token, D = I = E = K = 1: h = [g, u] = [1, 2], w = 0.5, W_d = 3, so
  // y = 3 * act(1) * 2 * 0.5 = 3 * act(1).
  const std::vector<float> x = {1.0f}, w_gu = {1.0f, 2.0f}, w_d = {3.0f},
                           weights = {0.5f};
  const std::vector<int32_t> idx = {0};
  GroupedExpertsWorkspace ws;
  float y = 0.0f;
  SHARDD_ASSERT_OK(GroupedExpertsForward(
      {1, 1, 1, 1, 1}, GatedActivation::kSwiGLU, x.data(), idx.data(),
      weights.data(), nullptr, w_gu.data(), w_d.data(), &y, &ws));
  EXPECT_NEAR(y, 3.0 * 0.7310585786300049, 1e-6);  // silu(1) = sigmoid(1)
  SHARDD_ASSERT_OK(GroupedExpertsForward(
      {1, 1, 1, 1, 1}, GatedActivation::kGeGLU, x.data(), idx.data(),
      weights.data(), nullptr, w_gu.data(), w_d.data(), &y, &ws));
  // GELU(1) = Phi(1) = 0.8413447 exactly; the tanh approximation NeMo uses
  // is 0.5 * (1 + tanh(sqrt(2 / pi) * 1.044715)) = 0.8411920, 1.5e-4 lower.
  EXPECT_NEAR(y, 3.0 * 0.8411919906082768, 1e-6);
  EXPECT_GT(std::abs(y - 3.0 * 0.8413447460685429), 3e-4);
}

TEST(GroupedExpertsTest, ActivationsSaturateAndPropagateNaN) {
  // D = 2, x = [g, 1], W_gu = identity: h = [g, u = 1]; W_d = [1, 0], w = 1:
  // y = [act(g), 0] and, with dy = [1, 0], dx[0] = act'(g). Far from 0 both
  // gates are the identity (g > 0) or vanish (g < 0), with finite gradients.
  const std::vector<float> w_gu = {1.0f, 0.0f, 0.0f, 1.0f}, w_d = {1.0f, 0.0f},
                           weights = {1.0f}, dy = {1.0f, 0.0f};
  const std::vector<int32_t> idx = {0};
  const ExpertDims dm{1, 2, 1, 1, 1};
  for (GatedActivation act :
       {GatedActivation::kSwiGLU, GatedActivation::kGeGLU}) {
    for (float g : {-1e30f, -1000.0f, -60.0f, 60.0f, 1000.0f, 1e30f}) {
      GroupedExpertsWorkspace ws;
      const std::vector<float> x = {g, 1.0f};
      std::vector<float> y(2), dx(2);
      float dwt = 0.0f;
      SHARDD_ASSERT_OK(GroupedExpertsForward(
          dm, act, x.data(), idx.data(), weights.data(), nullptr, w_gu.data(),
          w_d.data(), y.data(), &ws));
      SHARDD_ASSERT_OK(GroupedExpertsBackward(dm, act, w_gu.data(), w_d.data(),
                                              dy.data(), dx.data(), false, &dwt,
                                              nullptr, nullptr, &ws));
      EXPECT_EQ(y[0], g > 0 ? g : 0.0f) << g;
      EXPECT_EQ(dx[0], g > 0 ? 1.0f : 0.0f) << g;
      EXPECT_EQ(dwt, y[0]) << g;  // dL/dw = act(g) * u
    }
    GroupedExpertsWorkspace ws;
    const std::vector<float> x = {std::nanf(""), 1.0f};
    std::vector<float> y(2);
    SHARDD_ASSERT_OK(GroupedExpertsForward(dm, act, x.data(), idx.data(),
                                           weights.data(), nullptr, w_gu.data(),
                                           w_d.data(), y.data(), &ws));
    EXPECT_TRUE(std::isnan(y[0]));
  }
}

TEST(GroupedExpertsTest, StableSortByExpert) {
  // E = 4, K = 2. Hand-derived layout (rows in token order, then k order):
  //   expert 0: t0k1 t1k0 t2k1 t4k1   expert 1: t2k0 t3k1
  //   expert 2: t0k0 t1k1 t3k0        expert 3: t4k0
  Problem p = MakeProblem({5, 3, 2, 4, 2}, GatedActivation::kSwiGLU, 500);
  p.indices = {2, 0, 0, 2, 1, 0, 2, 1, 3, 0};
  std::vector<float> y(5 * 3);
  GroupedExpertsWorkspace ws;
  SHARDD_ASSERT_OK(GroupedExpertsForward(
      p.dims, p.act, p.x.data(), p.indices.data(), p.weights.data(), nullptr,
      p.w_gu.data(), p.w_d.data(), y.data(), &ws));
  EXPECT_THAT(std::vector<int64_t>(ws.expert_offsets.begin(),
                                   ws.expert_offsets.begin() + 5),
              ElementsAre(0, 4, 6, 9, 10));
  EXPECT_THAT(
      std::vector<int32_t>(ws.row_token.begin(), ws.row_token.begin() + 10),
      ElementsAre(0, 1, 2, 4, 2, 3, 0, 1, 3, 4));
  EXPECT_THAT(
      std::vector<int32_t>(ws.row_of_slot.begin(), ws.row_of_slot.begin() + 10),
      ElementsAre(6, 0, 1, 7, 4, 2, 8, 5, 9, 3));
  for (int64_t row = 0; row < 10; ++row) {
    // Each row carries its own slot's routing weight and token's input.
    const int64_t slot =
        std::find(ws.row_of_slot.begin(), ws.row_of_slot.begin() + 10, row) -
        ws.row_of_slot.begin();
    EXPECT_EQ(ws.row_weight[row], p.weights[slot]);
    EXPECT_EQ(ws.xs[row * 3], p.x[ws.row_token[row] * 3]);
  }
}

TEST(GroupedExpertsTest, ZeroTokens) {
  GroupedExpertsWorkspace ws;
  const ExpertDims dm{0, 6, 5, 4, 2};
  std::vector<float> w_gu(4 * 6 * 10, 1.0f), w_d(4 * 5 * 6, 1.0f);
  SHARDD_ASSERT_OK(GroupedExpertsForward(dm, GatedActivation::kGeGLU, nullptr,
                                         nullptr, nullptr, nullptr, w_gu.data(),
                                         w_d.data(), nullptr, &ws));
  std::vector<float> dw_gu(w_gu.size(), 0.0f), dw_d(w_d.size(), 0.0f);
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      dm, GatedActivation::kGeGLU, w_gu.data(), w_d.data(), nullptr, nullptr,
      false, nullptr, dw_gu.data(), dw_d.data(), &ws));
  for (float v : dw_gu) EXPECT_EQ(v, 0.0f);
  for (float v : dw_d) EXPECT_EQ(v, 0.0f);

  // Tokens present but all masked: zero outputs and gradients, no GEMM.
  const ExpertDims masked{3, 6, 5, 4, 2};
  Problem p = MakeProblem(masked, GatedActivation::kSwiGLU, 900);
  p.mask = {0, 0, 0};
  const std::vector<float> dy = RandomVector(3 * 6, 17);
  const Grads g = RunKernel(p, dy, &ws);
  EXPECT_EQ(ws.rows, 0);
  for (float v : g.y) EXPECT_EQ(v, 0.0f);
  for (float v : g.dx) EXPECT_EQ(v, 0.0f);
  for (float v : g.d_weights) EXPECT_EQ(v, 0.0f);
  for (float v : g.dw_gu) EXPECT_EQ(v, 0.0f);
  for (float v : g.dw_d) EXPECT_EQ(v, 0.0f);
}

// The activation loops run at every SimdLevel this CPU supports and must
// give the same bits at each (no FMA contraction, per-lane math, fixed-lane
// sums): an intermediate size that is no multiple of any vector width, both
// activations, gate values far into saturation, and a mask.
TEST(GroupedExpertsTest, EverySimdLevelGivesTheSameBits) {
  const SimdLevel supported = SupportedSimdLevel();
  for (GatedActivation act :
       {GatedActivation::kSwiGLU, GatedActivation::kGeGLU}) {
    Problem p = MakeProblem({23, 9, 37, 5, 2}, act, 900);
    for (float& w : p.w_gu) w *= 40.0f;  // gates in the hundreds
    p.mask.assign(23, 1);
    p.mask[4] = 0;
    const std::vector<float> dy = RandomVector(23 * 9, 15);
    SHARDD_ASSERT_OK(OverrideSimdLevel(SimdLevel::kBaseline));
    GroupedExpertsWorkspace base_ws;
    const Grads base = RunKernel(p, dy, &base_ws);
    for (SimdLevel level : {SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
      if (level > supported) continue;
      SCOPED_TRACE(SimdLevelName(level));
      SHARDD_ASSERT_OK(OverrideSimdLevel(level));
      GroupedExpertsWorkspace ws;
      const Grads got = RunKernel(p, dy, &ws);
      EXPECT_EQ(got.y, base.y);
      EXPECT_EQ(got.dx, base.dx);
      EXPECT_EQ(got.d_weights, base.d_weights);
      EXPECT_EQ(got.dw_gu, base.dw_gu);
      EXPECT_EQ(got.dw_d, base.dw_d);
    }
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(supported));
  std::printf("[simd] compared x86-64 with every level up to %s\n",
              SimdLevelName(supported));
}

TEST(GroupedExpertsTest, BackwardAccumulates) {
  Problem p = MakeProblem({7, 6, 5, 4, 2}, GatedActivation::kGeGLU, 600);
  const std::vector<float> dy = RandomVector(7 * 6, 13);
  GroupedExpertsWorkspace ws;
  const Grads g = RunKernel(p, dy, &ws);
  // Second backward on the same forward: parameter gradients double, dx is
  // overwritten or added to as asked, d_weights overwritten.
  std::vector<float> dw_gu = g.dw_gu, dw_d = g.dw_d, dx(7 * 6, 1.0f),
                     d_weights(14, 50.0f);
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      p.dims, p.act, p.w_gu.data(), p.w_d.data(), dy.data(), dx.data(), true,
      d_weights.data(), dw_gu.data(), dw_d.data(), &ws));
  for (size_t i = 0; i < dw_gu.size(); ++i) {
    EXPECT_NEAR(dw_gu[i], 2.0f * g.dw_gu[i], 1e-6);
  }
  for (size_t i = 0; i < dw_d.size(); ++i) {
    EXPECT_NEAR(dw_d[i], 2.0f * g.dw_d[i], 1e-6);
  }
  for (size_t i = 0; i < dx.size(); ++i) {
    EXPECT_NEAR(dx[i], 1.0f + g.dx[i], 1e-6);
  }
  for (size_t i = 0; i < d_weights.size(); ++i) {
    EXPECT_FLOAT_EQ(d_weights[i], g.d_weights[i]);
  }
  // Frozen experts: only dx and d_weights.
  std::vector<float> dx2(7 * 6, 0.0f), dwt2(14, 0.0f);
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      p.dims, p.act, p.w_gu.data(), p.w_d.data(), dy.data(), dx2.data(), false,
      dwt2.data(), nullptr, nullptr, &ws));
  for (size_t i = 0; i < dx2.size(); ++i) EXPECT_FLOAT_EQ(dx2[i], g.dx[i]);
  // Only the routing-weight gradient.
  std::vector<float> dwt3(14, 0.0f);
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      p.dims, p.act, p.w_gu.data(), p.w_d.data(), dy.data(), nullptr, false,
      dwt3.data(), nullptr, nullptr, &ws));
  for (size_t i = 0; i < dwt3.size(); ++i) {
    EXPECT_NEAR(dwt3[i], g.d_weights[i], 1e-6);
  }
}

TEST(GroupedExpertsTest, WarmWorkspaceDoesNotReallocate) {
  Problem big = MakeProblem({9, 6, 5, 4, 2}, GatedActivation::kSwiGLU, 700);
  Problem small = MakeProblem({6, 6, 5, 4, 2}, GatedActivation::kSwiGLU, 701);
  GroupedExpertsWorkspace ws;
  RunKernel(big, RandomVector(9 * 6, 14), &ws);
  const size_t bytes = ws.bytes();
  const float* xs = ws.xs.data();
  const float* h = ws.h.data();
  const float* dh = ws.dh.data();
  EXPECT_GT(bytes, 0u);
  RunKernel(small, RandomVector(6 * 6, 15), &ws);
  RunKernel(big, RandomVector(9 * 6, 16), &ws);
  EXPECT_EQ(ws.bytes(), bytes);
  EXPECT_EQ(ws.xs.data(), xs);
  EXPECT_EQ(ws.h.data(), h);
  EXPECT_EQ(ws.dh.data(), dh);
}

TEST(GroupedExpertsTest, RejectsBadArguments) {
  Problem p = MakeProblem({3, 4, 2, 2, 2}, GatedActivation::kSwiGLU, 800);
  std::vector<float> y(12);
  GroupedExpertsWorkspace ws;
  auto forward = [&](const ExpertDims& dm) {
    return GroupedExpertsForward(dm, p.act, p.x.data(), p.indices.data(),
                                 p.weights.data(), nullptr, p.w_gu.data(),
                                 p.w_d.data(), y.data(), &ws);
  };
  EXPECT_THAT(forward({3, 4, 2, 2, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("top_k must be in [1, experts=2]")));
  EXPECT_THAT(
      forward({3, 4, 0, 2, 2}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("intermediate")));
  EXPECT_THAT(
      forward({-3, 4, 2, 2, 2}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens")));
  p.indices[3] = 2;
  EXPECT_THAT(forward({3, 4, 2, 2, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("indices[1, 1] must be in [0, 2), got 2")));
  p.indices[3] = -1;
  EXPECT_THAT(
      forward({3, 4, 2, 2, 2}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("got -1")));
  // A failed forward leaves nothing for the backward.
  std::vector<float> dy(12), dx(12);
  EXPECT_THAT(GroupedExpertsBackward({3, 4, 2, 2, 2}, p.act, p.w_gu.data(),
                                     p.w_d.data(), dy.data(), dx.data(), false,
                                     nullptr, nullptr, nullptr, &ws),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("GroupedExpertsForward")));
  p.indices[3] = 0;
  SHARDD_ASSERT_OK(forward({3, 4, 2, 2, 2}));
  EXPECT_THAT(
      GroupedExpertsBackward({3, 4, 2, 2, 2}, GatedActivation::kGeGLU,
                             p.w_gu.data(), p.w_d.data(), dy.data(), dx.data(),
                             false, nullptr, nullptr, nullptr, &ws),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("differ")));
  EXPECT_THAT(GroupedExpertsBackward({3, 4, 2, 2, 2}, p.act, p.w_gu.data(),
                                     p.w_d.data(), nullptr, dx.data(), false,
                                     nullptr, nullptr, nullptr, &ws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dy")));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
