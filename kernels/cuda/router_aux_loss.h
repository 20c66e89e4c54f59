#ifndef SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_H_
#define SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_H_

// The router load-balancing loss on the GPU, the CUDA counterpart of
// kernels/cpu/router_aux_loss.h (Hugging Face's load_balancing_loss_func as
// sums over rows that add over layers, calls and ranks):
//
//   c[e] = #{(r, j) : indices[r, j] == e}     s[e] = sum_r p[r, e]
//   aux  = E * sum_e (c[e] / R) * (s[e] / R)
//   d aux / d logits[r, e] = p[r, e] * (g[e] - sum_j p[r, j] g[j]),
//   g[e] = E * c[e] / R^2
//
// Everything lives on the device so that the sums can be all-reduced (NCCL)
// between the forward and the backward without a host round trip: counts
// [E] int64, prob_sums [E] double, total_rows (R) one int64, the value one
// double. probs [rows, E] is the router's kept softmax (RouterSoftmax in
// kernels/cuda/router.h), indices [rows, K] its choices. Asynchronous on
// `stream`; no synchronization and no allocation. Counts use integer
// atomics (exact); the probability sums and the dot products run in fixed
// orders, so every result is run-to-run deterministic.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// counts[e] += the rows' choices of e; prob_sums[e] += sum_r probs[r, e]
// (double). An index outside [0, E) lives on the device and cannot be
// checked without a sync: it adds nothing and, when `invalid_indices` (one
// device int64) is not null, is counted there for the caller to read at its
// next sync point (the CPU kernel rejects the whole call instead).
// Errors: INVALID_ARGUMENT for rows < 0, E < 1, K outside [1, E], or a null
// pointer (invalid_indices excepted) with rows > 0; launch errors.
absl::Status RouterAuxLossAccumulate(const float* probs,
                                     const int32_t* indices, int64_t rows,
                                     int64_t experts, int64_t top_k,
                                     int64_t* counts, double* prob_sums,
                                     int64_t* invalid_indices,
                                     cudaStream_t stream);

// *value = aux from the sums over *total_rows rows (0 when that is <= 0),
// summed over e in order like the CPU.
// Errors: INVALID_ARGUMENT for E < 1 or a null pointer; launch errors.
absl::Status RouterAuxLossValue(const int64_t* counts, const double* prob_sums,
                                const int64_t* total_rows, int64_t experts,
                                double* value, cudaStream_t stream);

// d_logits [rows, E] fp32 = scale * d aux / d logits of these rows, given
// their probs and the counts over all *total_rows rows (overwritten; zero
// when *total_rows <= 0, which the CPU rejects as total_rows < rows).
// Errors: INVALID_ARGUMENT for rows < 0, E < 1, or a null pointer with
// rows > 0; launch errors.
absl::Status RouterAuxLossBackward(const float* probs, int64_t rows,
                                   int64_t experts, const int64_t* counts,
                                   const int64_t* total_rows, double scale,
                                   float* d_logits, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROUTER_AUX_LOSS_H_
