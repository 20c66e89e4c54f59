#include "kernels/cpu/router_aux_loss.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/router_aux_loss_element.h"

namespace shardd {
namespace kernels {

absl::Status RouterAuxLossAccumulate(const float* probs, const int32_t* indices,
                                     int64_t rows, int64_t experts,
                                     int64_t top_k, int64_t* counts,
                                     double* prob_sums) {
  if (rows < 0 || experts < 1 || top_k < 1 || top_k > experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router aux loss: rows >= 0, experts >= 1 and top_k in [1, experts] "
        "needed, got ",
        rows, ", ", experts, ", ", top_k));
  }
  if (rows == 0) return absl::OkStatus();
  if (probs == nullptr || indices == nullptr || counts == nullptr ||
      prob_sums == nullptr) {
    return absl::InvalidArgumentError(
        "router aux loss: probs, indices, counts and prob_sums must not be "
        "null");
  }
  for (int64_t i = 0; i < rows * top_k; ++i) {
    if (indices[i] < 0 || indices[i] >= experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("router aux loss: indices[", i, "] = ", indices[i],
                       " is not an expert in [0, ", experts, ")"));
    }
  }
  for (int64_t i = 0; i < rows * top_k; ++i) ++counts[indices[i]];
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = probs + r * experts;
    for (int64_t e = 0; e < experts; ++e) prob_sums[e] += p[e];
  }
  return absl::OkStatus();
}

double RouterAuxLossValue(const int64_t* counts, const double* prob_sums,
                          int64_t total_rows, int64_t experts) {
  if (total_rows <= 0) return 0.0;
  const double r = static_cast<double>(total_rows);
  double sum = 0.0;
  for (int64_t e = 0; e < experts; ++e) {
    sum = RnDAdd(sum, RouterAuxLossTerm(counts[e], prob_sums[e], r));
  }
  return RnDMul(static_cast<double>(experts), sum);
}

absl::Status RouterAuxLossBackward(const float* probs, int64_t rows,
                                   int64_t experts, const int64_t* counts,
                                   int64_t total_rows, double scale,
                                   float* d_logits) {
  if (rows < 0 || experts < 1 || total_rows < rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router aux loss: rows >= 0, experts >= 1 and total_rows >= rows "
        "needed, got ",
        rows, ", ", experts, ", ", total_rows));
  }
  if (rows == 0) return absl::OkStatus();
  if (probs == nullptr || counts == nullptr || d_logits == nullptr) {
    return absl::InvalidArgumentError(
        "router aux loss: probs, counts and d_logits must not be null");
  }
  // g[e] = scale * E * c[e] / R^2, the same for every row.
  const double r = static_cast<double>(total_rows);
  std::vector<double> g(experts);
  for (int64_t e = 0; e < experts; ++e) {
    g[e] = RouterAuxProbGrad(scale, experts, counts[e], r);
  }
  for (int64_t t = 0; t < rows; ++t) {
    const float* p = probs + t * experts;
    double dot = 0.0;
    for (int64_t e = 0; e < experts; ++e) dot = RouterAuxDotStep(dot, p[e], g[e]);
    float* dl = d_logits + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      dl[e] = RouterAuxLogitGrad(p[e], g[e], dot);
    }
  }
  return absl::OkStatus();
}

}  // namespace kernels
}  // namespace shardd
