#include "kernels/cpu/muon.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/muon_element.h"

namespace shardd {
namespace kernels {
void MuonMomentumStep(const float* grad, float* momentum, int64_t n,
                      float beta) {
  const float one_minus_beta = RnSub(1.0f, beta);
  for (int64_t i = 0; i < n; ++i) {
    momentum[i] = MuonMomentum(momentum[i], grad[i], beta, one_minus_beta);
  }
}

// The same MuonMomentum expression as MuonMomentumStep, so that the
// prepared Nesterov update and the committed momentum agree.
void MuonNesterovUpdate(const float* grad, const float* momentum, int64_t n,
                        float beta, float* out) {
  const float one_minus_beta = RnSub(1.0f, beta);
  for (int64_t i = 0; i < n; ++i) {
    const float m = MuonMomentum(momentum[i], grad[i], beta, one_minus_beta);
    out[i] = MuonNesterov(grad[i], m, beta, one_minus_beta);
  }
}

int64_t NewtonSchulzWorkspace(int64_t rows, int64_t cols) {
  const int64_t r = std::min(rows, cols);
  const int64_t c = std::max(rows, cols);
  // X and its next iterate (r x c each), A and B (r x r each).
  return 2 * r * c + 2 * r * r;
}

absl::Status NewtonSchulz(float* x, int64_t rows, int64_t cols, int steps,
                          float* workspace) {
  constexpr int64_t kMaxBlas = std::numeric_limits<int>::max();
  if (rows < 1 || cols < 1 || rows > kMaxBlas || cols > kMaxBlas ||
      rows * cols > kMaxBlas) {
    return absl::InvalidArgumentError(
        absl::StrCat("newton_schulz: rows and cols must be >= 1 and fit a "
                     "cblas int, got ",
                     rows, " x ", cols));
  }
  if (steps < 1 || steps > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("newton_schulz: steps must be in [1, 100], got ", steps));
  }
  if (x == nullptr || workspace == nullptr) {
    return absl::InvalidArgumentError(
        "newton_schulz: x and workspace must be non-null");
  }
  const bool transpose = rows > cols;
  const int r = static_cast<int>(std::min(rows, cols));
  const int c = static_cast<int>(std::max(rows, cols));
  const int64_t rc = int64_t{r} * c;
  float* X = workspace;
  float* next = X + rc;
  float* A = next + rc;
  float* B = A + int64_t{r} * r;

  // The wide orientation: X is r x c with r <= c.
  if (transpose) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) X[j * c + i] = x[i * cols + j];
    }
  } else {
    std::memcpy(X, x, static_cast<size_t>(rc) * sizeof(float));
  }
  double sum = 0.0;
  for (int64_t i = 0; i < rc; ++i) sum += double{X[i]} * X[i];
  const float denom = MuonNormDenominator(sum, kNewtonSchulzEps);
  for (int64_t i = 0; i < rc; ++i) X[i] = RnDiv(X[i], denom);

  for (int s = 0; s < steps; ++s) {
    // A = X X^T.
    Sgemm(CblasNoTrans, CblasTrans, r, r, c, 1.0f, X, c, X,
                c, 0.0f, A, r);
    // B = b A + c A A.
    std::memcpy(B, A, static_cast<size_t>(r) * r * sizeof(float));
    Sgemm(CblasNoTrans, CblasNoTrans, r, r, r,
                kNewtonSchulzC, A, r, A, r, kNewtonSchulzB, B, r);
    // X = a X + B X.
    std::memcpy(next, X, static_cast<size_t>(rc) * sizeof(float));
    Sgemm(CblasNoTrans, CblasNoTrans, r, c, r, 1.0f, B, r,
                X, c, kNewtonSchulzA, next, c);
    std::swap(X, next);
  }

  if (transpose) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) x[i * cols + j] = X[j * c + i];
    }
  } else {
    std::memcpy(x, X, static_cast<size_t>(rc) * sizeof(float));
  }
  return absl::OkStatus();
}

double MuonShapeScale(int64_t fan_out, int64_t fan_in) {
  if (fan_in < 1) return 1.0;
  return std::sqrt(std::max(
      1.0, static_cast<double>(fan_out) / static_cast<double>(fan_in)));
}

void MuonApply(float* param, const float* update, int64_t n, double lr,
               double weight_decay) {
  const MuonApplyScalars s = MuonApplyScalarsFor(lr, weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    param[i] = MuonParamUpdate(param[i], update[i], s);
  }
}

}  // namespace kernels
}  // namespace shardd
