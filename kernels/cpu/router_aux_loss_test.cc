#include "kernels/cpu/router_aux_loss.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/router_aux_loss_element.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing_util::ExpectGradNear;
using testing_util::NumericGrad;

constexpr double kU = 5.960464477539063e-8;  // fp32 unit roundoff, 2^-24.

std::vector<double> Softmax(const double* row, int64_t n) {
  double m = row[0];
  for (int64_t e = 1; e < n; ++e) m = std::max(m, row[e]);
  std::vector<double> p(n);
  double s = 0.0;
  for (int64_t e = 0; e < n; ++e) s += p[e] = std::exp(row[e] - m);
  for (double& x : p) x /= s;
  return p;
}

// HF's load_balancing_loss_func in double with the choices held fixed.
double ReferenceAux(const std::vector<double>& logits,
                    const std::vector<int32_t>& indices, int64_t rows,
                    int64_t experts, int64_t k) {
  std::vector<double> tokens(k * experts, 0.0), probs(experts, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> p = Softmax(logits.data() + r * experts, experts);
    for (int64_t e = 0; e < experts; ++e) probs[e] += p[e] / rows;
    for (int64_t j = 0; j < k; ++j) {
      tokens[j * experts + indices[r * k + j]] += 1.0 / rows;
    }
  }
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t e = 0; e < experts; ++e)
      sum += tokens[j * experts + e] * probs[e];
  }
  return experts * sum;
}

struct Rows {
  int64_t rows, experts, k;
  std::vector<double> logits;
  std::vector<float> probs;      // fp32 softmax of the logits
  std::vector<int32_t> indices;  // top-k of each row
};

Rows RandomRows(int64_t rows, int64_t experts, int64_t k, uint32_t seed) {
  Rows out{rows, experts, k, {}, {}, {}};
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.5);
  for (int64_t i = 0; i < rows * experts; ++i) out.logits.push_back(dist(gen));
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<double> p =
        Softmax(out.logits.data() + r * experts, experts);
    std::vector<int32_t> order(experts);
    for (int64_t e = 0; e < experts; ++e) order[e] = static_cast<int32_t>(e);
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    for (int64_t j = 0; j < k; ++j) out.indices.push_back(order[j]);
    for (double x : p) out.probs.push_back(static_cast<float>(x));
  }
  return out;
}

TEST(RouterAuxLossTest, ValueIsHuggingFacesOnAHandExample) {
  // 2 rows, 2 experts, top-1: row 0 picks expert 0 (p = 0.75, 0.25), row 1
  // expert 1 (p = 0.4, 0.6). tokens = (1/2, 1/2), probs = (0.575, 0.425):
  // aux = 2 * (0.5 * 0.575 + 0.5 * 0.425) = 1.
  const std::vector<float> probs = {0.75f, 0.25f, 0.4f, 0.6f};
  const std::vector<int32_t> idx = {0, 1};
  std::vector<int64_t> counts(2, 0);
  std::vector<double> sums(2, 0.0);
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(probs.data(), idx.data(), 2, 2, 1,
                                           counts.data(), sums.data()));
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 1}));
  // 0.75 + 0.4 in double from fp32 inputs: within 2u of 1.15.
  EXPECT_NEAR(sums[0], 1.15, 2 * kU);
  EXPECT_NEAR(RouterAuxLossValue(counts.data(), sums.data(), 2, 2), 1.0,
              4 * kU);
  // Unbalanced: both rows pick expert 0: aux = 2 * (1 * 0.575) = 1.15.
  const std::vector<int32_t> same = {0, 0};
  counts.assign(2, 0);
  sums.assign(2, 0.0);
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(probs.data(), same.data(), 2, 2, 1,
                                           counts.data(), sums.data()));
  EXPECT_NEAR(RouterAuxLossValue(counts.data(), sums.data(), 2, 2), 1.15,
              4 * kU);
  EXPECT_EQ(RouterAuxLossValue(counts.data(), sums.data(), 0, 2), 0.0);
}

TEST(RouterAuxLossTest, GradientMatchesFiniteDifferences) {
  Rows rows = RandomRows(/*rows=*/12, /*experts=*/6, /*k=*/2, 3);
  std::vector<int64_t> counts(rows.experts, 0);
  std::vector<double> sums(rows.experts, 0.0);
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
      rows.probs.data(), rows.indices.data(), rows.rows, rows.experts, rows.k,
      counts.data(), sums.data()));
  const double value =
      RouterAuxLossValue(counts.data(), sums.data(), rows.rows, rows.experts);
  const double want_value =
      ReferenceAux(rows.logits, rows.indices, rows.rows, rows.experts, rows.k);
  // fp32 probabilities: each within (E + 2) u relative of the double ones
  // (exp, the E-term sum, the division), and aux is a positive combination.
  EXPECT_NEAR(value, want_value, (rows.experts + 2) * kU * want_value);

  const double scale = 0.7;
  std::vector<float> grad(rows.rows * rows.experts);
  SHARDD_ASSERT_OK(RouterAuxLossBackward(rows.probs.data(), rows.rows,
                                         rows.experts, counts.data(), rows.rows,
                                         scale, grad.data()));
  // The reference is all double: central differences with eps = 1e-4 have a
  // truncation error of eps^2 / 6 |f'''| (|f'''| <= 6 scale * aux = O(10):
  // third derivatives of a softmax are bounded by 1 per unit of weight) and
  // a rounding error of 1e-16 / eps, both < 1e-6; the kernel's gradient
  // carries its fp32 probabilities' (E + 2) u = 5e-7 relative error and the
  // final fp32 rounding. 2e-6 covers all of them.
  const std::vector<double> want = NumericGrad(rows.logits, 1e-4, [&] {
    return scale * ReferenceAux(rows.logits, rows.indices, rows.rows,
                                rows.experts, rows.k);
  });
  ExpectGradNear(grad, want, 2e-6, "d aux / d logits");
  // The choice matters: with another expert chosen the gradient changes.
  double largest = 0.0;
  for (double g : want) largest = std::max(largest, std::abs(g));
  EXPECT_GT(largest, 1e-3);
}

TEST(RouterAuxLossTest, SumsSplitOverCallsEqualOneCall) {
  // Rows split over layers and ranks add up: two halves accumulated apart
  // and summed give the same counts (exactly), the same value, and the same
  // per-row gradient from the total counts.
  const Rows rows = RandomRows(10, 4, 2, 9);
  const int64_t e = rows.experts, half = rows.rows / 2;
  std::vector<int64_t> whole(e, 0), a(e, 0), b(e, 0);
  std::vector<double> s_whole(e, 0.0), s_a(e, 0.0), s_b(e, 0.0);
  SHARDD_ASSERT_OK(
      RouterAuxLossAccumulate(rows.probs.data(), rows.indices.data(), rows.rows,
                              e, rows.k, whole.data(), s_whole.data()));
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(rows.probs.data(),
                                           rows.indices.data(), half, e, rows.k,
                                           a.data(), s_a.data()));
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
      rows.probs.data() + half * e, rows.indices.data() + half * rows.k,
      rows.rows - half, e, rows.k, b.data(), s_b.data()));
  for (int64_t x = 0; x < e; ++x) {
    EXPECT_EQ(a[x] + b[x], whole[x]);
    // Two double sums of the same fp32 terms in another grouping.
    EXPECT_NEAR(s_a[x] + s_b[x], s_whole[x], 1e-14);
  }
  std::vector<float> g_whole(rows.rows * e), g_b((rows.rows - half) * e);
  SHARDD_ASSERT_OK(RouterAuxLossBackward(rows.probs.data(), rows.rows, e,
                                         whole.data(), rows.rows, 1.0,
                                         g_whole.data()));
  SHARDD_ASSERT_OK(RouterAuxLossBackward(rows.probs.data() + half * e,
                                         rows.rows - half, e, whole.data(),
                                         rows.rows, 1.0, g_b.data()));
  for (size_t i = 0; i < g_b.size(); ++i) {
    EXPECT_EQ(g_b[i], g_whole[half * e + i]) << i;
  }
}

TEST(RouterAuxLossTest, ThroughTheRouterOfEachScoring) {
  // The loss as the model computes it: the router's own softmax (kept for
  // GPT-OSS's top-k-then-softmax scoring) and its choices, the gradient
  // sent into RouterBackward as extra logit gradient; against central
  // differences of the fp32 forward in W and b.
  const int64_t t = 9, d = 5, e = 6, k = 2;
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(t * d), w(e * d), b(e);
  for (float& v : x) v = dist(gen);
  for (float& v : w) v = 0.5f * dist(gen);
  for (float& v : b) v = 0.3f * dist(gen);
  for (RouterScoring scoring :
       {RouterScoring::kSoftmaxThenTopK, RouterScoring::kTopKThenSoftmax}) {
    SCOPED_TRACE(static_cast<int>(scoring));
    RouterDims dims{t, d, e, k, true};
    dims.scoring = scoring;
    dims.keep_softmax = true;
    RouterCache cache;
    std::vector<int32_t> idx(t * k), chosen;
    std::vector<float> wt(t * k);
    // The gradient is that of the piecewise-smooth loss with the choice held
    // fixed (it is discrete): the differences count the unperturbed choice.
    auto aux = [&]() -> double {
      EXPECT_TRUE(RouterForward(dims, x.data(), w.data(), b.data(), idx.data(),
                                wt.data(), &cache)
                      .ok());
      std::vector<int64_t> counts(e, 0);
      std::vector<double> sums(e, 0.0);
      EXPECT_TRUE(
          RouterAuxLossAccumulate(RouterSoftmax(cache),
                                  chosen.empty() ? idx.data() : chosen.data(),
                                  t, e, k, counts.data(), sums.data())
              .ok());
      return RouterAuxLossValue(counts.data(), sums.data(), t, e);
    };
    aux();
    chosen = idx;
    ASSERT_NE(RouterSoftmax(cache), nullptr);
    std::vector<int64_t> counts(e, 0);
    std::vector<double> sums(e, 0.0);
    SHARDD_ASSERT_OK(RouterAuxLossAccumulate(
        RouterSoftmax(cache), idx.data(), t, e, k, counts.data(), sums.data()));
    std::vector<float> d_logits(t * e), zeros(t * k, 0.0f);
    SHARDD_ASSERT_OK(RouterAuxLossBackward(
        RouterSoftmax(cache), t, e, counts.data(), t, 1.0, d_logits.data()));
    std::vector<float> dw(e * d, 0.0f), db(e, 0.0f), dx(t * d);
    SHARDD_ASSERT_OK(RouterBackward(dims, x.data(), w.data(), zeros.data(),
                                    d_logits.data(), dx.data(), false,
                                    dw.data(), db.data(), &cache));
    // fp32 forward: aux (about k = 2) carries about (D + E + 2) u relative
    // rounding, so a central difference with eps = 1e-2 has a rounding
    // error of 2 (D + E + 2) u / (2 eps) = 1.3e-4 and a truncation error of
    // eps^2 / 6 |f'''| <= 1e-4 (|f'''| <= 6 aux |x|^3 with |x| <= 2.5):
    // 5e-4 bounds both.
    ExpectGradNear(dw, NumericGrad(w, 1e-2, aux), 5e-4, "dW");
    ExpectGradNear(db, NumericGrad(b, 1e-2, aux), 5e-4, "db");
    ExpectGradNear(dx, NumericGrad(x, 1e-2, aux), 5e-4, "dx");
  }
}

// The CUDA kernels share router_aux_loss_element.h; the CPU kernel must
// compute exactly those functions (each double operation rounded once).
TEST(RouterAuxLossTest, TheSharedElementFunctionsAreTheKernel) {
  const Rows in = RandomRows(37, 16, 4, 5);
  std::vector<int64_t> counts(in.experts, 0);
  std::vector<double> prob_sums(in.experts, 0.0);
  SHARDD_ASSERT_OK(RouterAuxLossAccumulate(in.probs.data(), in.indices.data(),
                                           in.rows, in.experts, in.k,
                                           counts.data(), prob_sums.data()));
  const double r = static_cast<double>(in.rows);
  double sum = 0.0;
  for (int64_t e = 0; e < in.experts; ++e) {
    sum = RnDAdd(sum, RouterAuxLossTerm(counts[e], prob_sums[e], r));
  }
  EXPECT_EQ(RouterAuxLossValue(counts.data(), prob_sums.data(), in.rows,
                               in.experts),
            RnDMul(static_cast<double>(in.experts), sum));
  const double scale = 0.013;
  std::vector<float> d(in.rows * in.experts);
  SHARDD_ASSERT_OK(RouterAuxLossBackward(in.probs.data(), in.rows, in.experts,
                                         counts.data(), in.rows, scale,
                                         d.data()));
  for (int64_t t = 0; t < in.rows; ++t) {
    const float* p = in.probs.data() + t * in.experts;
    double dot = 0.0;
    for (int64_t e = 0; e < in.experts; ++e) {
      dot = RouterAuxDotStep(dot, p[e],
                             RouterAuxProbGrad(scale, in.experts, counts[e], r));
    }
    for (int64_t e = 0; e < in.experts; ++e) {
      ASSERT_EQ(d[t * in.experts + e],
                RouterAuxLogitGrad(
                    p[e], RouterAuxProbGrad(scale, in.experts, counts[e], r),
                    dot))
          << t << " " << e;
    }
  }
}

TEST(RouterAuxLossTest, RefusesBadArguments) {
  const std::vector<float> probs = {0.5f, 0.5f};
  const std::vector<int32_t> bad = {2};
  std::vector<int64_t> counts(2, 0);
  std::vector<double> sums(2, 0.0);
  EXPECT_THAT(
      RouterAuxLossAccumulate(probs.data(), bad.data(), 1, 2, 1, counts.data(),
                              sums.data()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not an expert")));
  EXPECT_EQ(counts, (std::vector<int64_t>{0, 0}));
  EXPECT_THAT(RouterAuxLossAccumulate(probs.data(), bad.data(), 1, 2, 3,
                                      counts.data(), sums.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> out(2);
  EXPECT_THAT(RouterAuxLossBackward(probs.data(), 2, 2, counts.data(), 1, 1.0,
                                    out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
