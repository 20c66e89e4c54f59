#ifndef SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_H_
#define SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_H_

// The router load-balancing loss of Switch Transformer, as Hugging Face's
// load_balancing_loss_func computes it without an attention mask. Over R
// rows (the tokens of every MoE layer of one forward, concatenated) with
// routing probabilities p[r, :] = softmax(logits[r, :]) over E experts and
// the k experts each row chose:
//
//   c[e]  = #{(r, j) : indices[r, j] == e}      (tokens_per_expert * R,
//                                                summed over the k slots)
//   s[e]  = sum_r p[r, e]                       (router_prob_per_expert * R)
//   aux   = E * sum_e (c[e] / R) * (s[e] / R)
//
// c, s and R are sums over rows, so the rows may be split over layers,
// calls and ranks and the sums added before the value or gradient is
// formed. The choice is discrete, so the gradient flows through s only:
//
//   d aux / d p[r, e]      = g[e] = E * c[e] / R^2
//   d aux / d logits[r, e] = p[r, e] * (g[e] - sum_j p[r, j] g[j])
//
// Single-threaded loops, fp32 inputs, sums in double.

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {

// Adds `rows` rows to the sums: counts[e] += the rows' choices of e,
// prob_sums[e] += sum_r probs[r, e]. probs: [rows, experts] (each row a
// softmax); indices: [rows, top_k] in [0, experts).
// Errors: INVALID_ARGUMENT for rows < 0, experts < 1, top_k outside
// [1, experts], a null pointer with rows > 0, or an index out of range
// (nothing is added then).
absl::Status RouterAuxLossAccumulate(const float* probs, const int32_t* indices,
                                     int64_t rows, int64_t experts,
                                     int64_t top_k, int64_t* counts,
                                     double* prob_sums);

// aux from the sums over `total_rows` rows (0 when total_rows is 0).
double RouterAuxLossValue(const int64_t* counts, const double* prob_sums,
                          int64_t total_rows, int64_t experts);

// d_logits [rows, experts] = scale * d aux / d logits of these rows, given
// their probs and the counts over all `total_rows` rows (overwritten).
// Errors: INVALID_ARGUMENT for rows < 0, experts < 1, total_rows < rows, or
// a null pointer with rows > 0.
absl::Status RouterAuxLossBackward(const float* probs, int64_t rows,
                                   int64_t experts, const int64_t* counts,
                                   int64_t total_rows, double scale,
                                   float* d_logits);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROUTER_AUX_LOSS_H_
