#include "testing/numerics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace shardd {
namespace testing_util {
namespace {

double Norm2(const std::vector<double>& x) {
  double sum = 0.0;
  for (double v : x) sum += v * v;
  return std::sqrt(sum);
}

double Distance(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    sum += d * d;
  }
  return std::sqrt(sum);
}

double Norm2(const std::vector<float>& x) {
  double sum = 0.0;
  for (float v : x) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

// Share of `bound` that `diff` uses; 0 when both are 0.
double Share(double diff, double bound) {
  if (diff == 0.0) return 0.0;
  return bound > 0.0 ? diff / bound : INFINITY;
}

}  // namespace

double Gamma(double n) {
  return n * kFp32UnitRoundoff / (1.0 - n * kFp32UnitRoundoff);
}

StepTolerances MoeStepTolerances(const v1::ModelDims& dims, int64_t tokens,
                                 int world) {
  const double d = dims.hidden_size(), e = dims.num_experts(),
               i = dims.moe_intermediate_size(),
               m = dims.dense_intermediate_size(), v = dims.vocab_size(),
               k = dims.top_k();
  double n_fwd = dims.num_layers() * (4 * d + e + i + m + k + 2) + 2 * d + v;
  if (dims.router_aux_loss_coef() > 0) {
    // The load-balancing loss: per-expert probability sums rounded to fp32
    // once, summed over the world's ranks, and the E-term value.
    n_fwd += e + world + 2;
  }
  const double n_bwd = n_fwd + static_cast<double>(tokens) + world + 1;
  StepTolerances t;
  t.loss = 2 * Gamma(n_fwd);
  t.grad = 2 * Gamma(n_fwd + n_bwd) * std::sqrt(static_cast<double>(tokens));
  return t;
}

double ExpectRelativelyNear(double got, double want, double rel_tol) {
  const double bound = rel_tol * std::fabs(want);
  const double diff = std::fabs(got - want);
  EXPECT_LE(diff, bound) << got << " vs " << want;
  return Share(diff, bound);
}

void BoundUse::Merge(const BoundUse& o) {
  loss = std::max(loss, o.loss);
  grad_norm = std::max(grad_norm, o.grad_norm);
  exp_avg = std::max(exp_avg, o.exp_avg);
  exp_avg_sq = std::max(exp_avg_sq, o.exp_avg_sq);
  params = std::max(params, o.params);
}

std::string BoundUse::ToString() const {
  return absl::StrFormat(
      "loss %.2e, grad norm %.2e, first moment %.2e, second moment %.2e, "
      "parameters %.2e",
      loss, grad_norm, exp_avg, exp_avg_sq, params);
}

void ExpectStepWithinRounding(const std::set<std::string>& frozen,
                              const kernels::AdamWConfig& adamw, int step,
                              const StepTolerances& tol,
                              const TrainingState& before,
                              const TrainingState& want,
                              const TrainingState& got, BoundUse* use) {
  BoundUse local;
  const double u = kFp32UnitRoundoff;
  const double b1 = adamw.beta1, b2 = adamw.beta2;
  const double bc1 = 1.0 - std::pow(b1, step + 1);
  const double bc2 = 1.0 - std::pow(b2, step + 1);
  for (const auto& [name, p_want] : *want.params) {
    SCOPED_TRACE(absl::StrCat(name, " after step ", step));
    ASSERT_EQ(got.params->count(name), 1u);
    const std::vector<float>& p_got = got.params->at(name);
    const std::vector<float>& m_got = got.exp_avg->at(name);
    const std::vector<float>& v_got = got.exp_avg_sq->at(name);
    ASSERT_EQ(p_got.size(), p_want.size());
    if (frozen.count(name) != 0) {
      EXPECT_EQ(p_got, before.params->at(name));
      EXPECT_EQ(Norm2(m_got), 0.0);
      EXPECT_EQ(Norm2(v_got), 0.0);
      continue;
    }
    const std::vector<float>& m_want = want.exp_avg->at(name);
    const std::vector<float>& v_want = want.exp_avg_sq->at(name);
    const std::vector<float>& m_prev = before.exp_avg->at(name);
    // The reference's clipped gradient, recovered from its first moment.
    std::vector<double> g(p_want.size());
    double g_max = 0.0;
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = (m_want[i] - b1 * m_prev[i]) / (1.0 - b1);
      g_max = std::max(g_max, std::fabs(g[i]));
    }
    // Bound on |g_got - g_want|: normwise, so for every element too.
    const double dg = 2 * tol.grad * Norm2(g);
    const double m_bound = (1 - b1) * dg + 2 * u * Norm2(m_want);
    const double v_bound =
        (1 - b2) * (2 * g_max + dg) * dg + 2 * u * Norm2(v_want);
    const double m_diff = Distance(m_got, m_want);
    const double v_diff = Distance(v_got, v_want);
    EXPECT_LE(m_diff, m_bound) << "first moment (the clipped gradient)";
    EXPECT_LE(v_diff, v_bound) << "second moment";
    local.exp_avg = std::max(local.exp_avg, Share(m_diff, m_bound));
    local.exp_avg_sq = std::max(local.exp_avg_sq, Share(v_diff, v_bound));
    int bad = 0;
    for (size_t i = 0; i < p_want.size(); ++i) {
      const double m_hat = m_want[i] / bc1;
      const double v_hat = v_want[i] / bc2;
      const double den = std::sqrt(v_hat) + adamw.eps;
      const double dm_hat =
          ((1 - b1) * dg + 2 * u * std::fabs(m_want[i])) / bc1;
      const double dv_hat =
          ((1 - b2) * (2 * std::fabs(g[i]) + dg) * dg + 2 * u * v_want[i]) /
          bc2;
      // |sqrt(a) - sqrt(b)| <= min(|a - b| / sqrt(a), sqrt(|a - b|)).
      const double ds =
          v_hat > 0 ? std::min(dv_hat / std::sqrt(v_hat), std::sqrt(dv_hat))
                    : std::sqrt(dv_hat);
      const double den_other = std::max(den - ds, adamw.eps);
      const double update = std::fabs(m_hat) / den;
      // The update's own evaluation rounds a few times in each run (m, v,
      // sqrt, the division and the product: 4 u each); the decay product
      // and the subtraction round p once each.
      const double bound =
          adamw.lr * (dm_hat / den_other + update * ds / den_other) +
          8 * u * adamw.lr * update + 2 * u * std::fabs(p_want[i]);
      const double diff = std::fabs(static_cast<double>(p_got[i]) - p_want[i]);
      local.params = std::max(local.params, Share(diff, bound));
      if (!(diff <= bound) && ++bad <= 3) {
        ADD_FAILURE() << name << "[" << i << "]: " << p_got[i] << " vs "
                      << p_want[i] << ", allowed +-" << bound;
      }
    }
    EXPECT_EQ(bad, 0);
  }
  if (use != nullptr) use->Merge(local);
}

double FreeRunningLossTolerance(int updates, double loss,
                                const kernels::AdamWConfig& adamw,
                                double clipped_norm,
                                const StepTolerances& tol) {
  constexpr double kLambda = 7.0;
  double drift = 0.0;
  for (int s = 0; s < updates; ++s) {
    const double t = s + 1;
    const double bc1 = 1.0 - std::pow(adamw.beta1, t);
    const double bc2 = 1.0 - std::pow(adamw.beta2, t);
    const double kappa = (1 - adamw.beta1) / bc1 *
                         std::sqrt(bc2 / (1 - adamw.beta2)) *
                         (1 + std::sqrt(t));
    drift += adamw.lr * kappa * kLambda * 2 * tol.grad * clipped_norm;
  }
  return tol.loss * std::fabs(loss) + drift;
}

}  // namespace testing_util
}  // namespace shardd
