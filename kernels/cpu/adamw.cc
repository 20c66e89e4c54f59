#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace kernels {
namespace {

absl::Status CheckRange(const char* name, double value, double lo,
                        bool lo_inclusive, double hi, bool hi_inclusive) {
  const bool ok = std::isfinite(value) &&
                  (lo_inclusive ? value >= lo : value > lo) &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "adamw: ", name, " must be finite and in ", lo_inclusive ? "[" : "(", lo,
      ", ", hi, hi_inclusive ? "]" : ")", ", got ", value));
}

}  // namespace

absl::Status AdamWStep(float* param, const float* grad, float* exp_avg,
                       float* exp_avg_sq, int64_t n, int64_t step,
                       const AdamWConfig& config) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamw: n must be >= 0, got ", n));
  }
  if (step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamw: step must be >= 1 (1-based), got ", step));
  }
  const double inf = HUGE_VAL;
  SHARDD_RETURN_IF_ERROR(CheckRange("lr", config.lr, 0, true, inf, false));
  SHARDD_RETURN_IF_ERROR(CheckRange("beta1", config.beta1, 0, true, 1, false));
  SHARDD_RETURN_IF_ERROR(CheckRange("beta2", config.beta2, 0, true, 1, false));
  SHARDD_RETURN_IF_ERROR(CheckRange("eps", config.eps, 0, true, inf, false));
  SHARDD_RETURN_IF_ERROR(
      CheckRange("weight_decay", config.weight_decay, 0, true, inf, false));
  if (n > 0 && (param == nullptr || grad == nullptr || exp_avg == nullptr ||
                exp_avg_sq == nullptr)) {
    return absl::InvalidArgumentError(
        "adamw: param, grad, exp_avg and exp_avg_sq must be non-null");
  }

  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(config.beta2, t);
  const float decay = static_cast<float>(1.0 - config.lr * config.weight_decay);
  const float beta1 = static_cast<float>(config.beta1);
  const float one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  const float beta2 = static_cast<float>(config.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  const float step_size = static_cast<float>(config.lr / bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(config.eps);
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    float p = param[i] * decay;
    const float m = beta1 * exp_avg[i] + one_minus_beta1 * g;
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    p -= step_size * (m / denom);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
  }
  return absl::OkStatus();
}

double SumOfSquares(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double{x[i]} * x[i];
  return sum;
}

void ScaleInPlace(float* x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

double ClipCoefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0.0)) return 1.0;
  if (std::isnan(total_norm)) return total_norm;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

}  // namespace kernels
}  // namespace shardd
