#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/simd_level.h"

namespace shardd {
namespace kernels {
namespace {

absl::Status CheckRange(const char* op, const char* name, double value,
                        double lo, bool lo_inclusive, double hi,
                        bool hi_inclusive) {
  const bool ok = std::isfinite(value) &&
                  (lo_inclusive ? value >= lo : value > lo) &&
                  (hi_inclusive ? value <= hi : value < hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": ", name, " must be finite and in ", lo_inclusive ? "[" : "(", lo,
      ", ", hi, hi_inclusive ? "]" : ")", ", got ", value));
}

// The update of n elements (AdamWElement). Cloned per SIMD level below;
// IEEE sqrt and division and no FMA contraction keep every clone's bits the
// same.
SHARDD_ALWAYS_INLINE void StepBody(const AdamWScalars& c,
                                   float* __restrict param,
                                   const float* __restrict grad,
                                   float* __restrict exp_avg,
                                   float* __restrict exp_avg_sq, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    AdamWElement(p, grad[i], m, v, c);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
  }
}

#define SHARDD_ADAMW_AT(suffix, attr)                                          \
  attr void Step##suffix(const AdamWScalars& c, float* param,                  \
                         const float* grad, float* exp_avg, float* exp_avg_sq, \
                         int64_t n) {                                          \
    StepBody(c, param, grad, exp_avg, exp_avg_sq, n);                          \
  }
SHARDD_ADAMW_AT(Baseline, )
SHARDD_ADAMW_AT(V3, SHARDD_TARGET_X86_64_V3)
SHARDD_ADAMW_AT(V4, SHARDD_TARGET_X86_64_V4)
#undef SHARDD_ADAMW_AT

}  // namespace

absl::StatusOr<AdamWScalars> AdamWScalarsFor(const AdamWConfig& config,
                                             int64_t step, const char* op) {
  if (step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": step must be >= 1 (1-based), got ", step));
  }
  const double inf = HUGE_VAL;
  SHARDD_RETURN_IF_ERROR(
      CheckRange(op, "lr", config.lr, 0, true, inf, false));
  SHARDD_RETURN_IF_ERROR(
      CheckRange(op, "beta1", config.beta1, 0, true, 1, false));
  SHARDD_RETURN_IF_ERROR(
      CheckRange(op, "beta2", config.beta2, 0, true, 1, false));
  SHARDD_RETURN_IF_ERROR(
      CheckRange(op, "eps", config.eps, 0, true, inf, false));
  SHARDD_RETURN_IF_ERROR(CheckRange(op, "weight_decay", config.weight_decay, 0,
                                    true, inf, false));
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(config.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(config.beta2, t);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - config.lr * config.weight_decay);
  s.beta1 = static_cast<float>(config.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
  s.beta2 = static_cast<float>(config.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
  s.step_size = static_cast<float>(config.lr / bias_correction1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(config.eps);
  return s;
}

absl::Status AdamWStep(float* param, const float* grad, float* exp_avg,
                       float* exp_avg_sq, int64_t n, int64_t step,
                       const AdamWConfig& config) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamw: n must be >= 0, got ", n));
  }
  SHARDD_ASSIGN_OR_RETURN(const AdamWScalars c,
                          AdamWScalarsFor(config, step, "adamw"));
  if (n > 0 && (param == nullptr || grad == nullptr || exp_avg == nullptr ||
                exp_avg_sq == nullptr)) {
    return absl::InvalidArgumentError(
        "adamw: param, grad, exp_avg and exp_avg_sq must be non-null");
  }
  SHARDD_ASSIGN_OR_RETURN(const SimdLevel level, ActiveSimdLevel());
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    const int64_t len = end - begin;
    float* p = param + begin;
    const float* g = grad + begin;
    float* m = exp_avg + begin;
    float* v = exp_avg_sq + begin;
    switch (level) {
      case SimdLevel::kX86_64_V4:
        return StepV4(c, p, g, m, v, len);
      case SimdLevel::kX86_64_V3:
        return StepV3(c, p, g, m, v, len);
      case SimdLevel::kBaseline:
        break;
    }
    StepBaseline(c, p, g, m, v, len);
  });
  return absl::OkStatus();
}

double SumOfSquares(const float* x, int64_t n) {
  // Partial sums over fixed chunks, added in chunk order: the same bits at
  // every thread count.
  const int64_t chunks = n <= 0 ? 0 : (n + kElementGrain - 1) / kElementGrain;
  std::vector<double> partial(chunks, 0.0);
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    double sum = 0.0;
    for (int64_t i = begin; i < end; ++i) sum += double{x[i]} * x[i];
    partial[begin / kElementGrain] = sum;
  });
  double sum = 0.0;
  for (double part : partial) sum += part;
  return sum;
}

void ScaleInPlace(float* x, int64_t n, float scale) {
  ParallelFor(n, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) x[i] *= scale;
  });
}

double ClipCoefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0.0)) return 1.0;
  if (std::isnan(total_norm)) return total_norm;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

}  // namespace kernels
}  // namespace shardd
