#ifndef SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_H_
#define SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_H_

// Expert parallelism's row permutation on the GPU: the device side of
// worker/model/expert_exchange.h's Dispatch, Combine, DispatchGrad and
// CombineGrad, around the all-to-alls (which move the fp32 rows these
// produce through NCCL). The per-element rules are the host's own
// (kernels/cpu/expert_permute_element.h), so rows are packed and a token's
// slots summed in slot order exactly as on a CPU rank.
//
// The route (order and position, kernels/cpu/expert_permute_element.h) is
// computed on the host from the router's indices, as the counts must be
// exchanged before the rows anyway, and uploaded. Activations and
// gradients are fp32 or bf16 (uint16_t bit patterns) in the model's
// storage type; exchanged rows are always fp32 (the expert tag and the
// routing weight must be exact). Device pointers; asynchronous on `stream`;
// no synchronization and no allocation.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// send [rows, d + 2] = [x[token of order[j]] | local expert tag | weight]
// for route rows j in [0, rows); x [t, d], weights and indices [t * k]
// (global expert ids; the tag is the id modulo local_experts).
// Errors: INVALID_ARGUMENT for rows < 0, k < 1, d < 1, local_experts < 1 or
// a null pointer with rows > 0; launch errors via CudaStatus.
absl::Status PackDispatchRows(const float* x, const float* weights,
                              const int32_t* indices, const int64_t* order,
                              int64_t rows, int k, int64_t d,
                              int64_t local_experts, float* send,
                              cudaStream_t stream);
absl::Status PackDispatchRows(const uint16_t* x, const float* weights,
                              const int32_t* indices, const int64_t* order,
                              int64_t rows, int k, int64_t d,
                              int64_t local_experts, float* send,
                              cudaStream_t stream);

// The received dispatch rows recv [received, d + 2] split into x_r
// [received, d] (rounded once to its type), ids_r and w_r [received].
// Errors: INVALID_ARGUMENT for received < 0, d < 1 or a null pointer with
// received > 0; launch errors.
absl::Status UnpackDispatchRows(const float* recv, int64_t received,
                                int64_t d, float* x_r, int32_t* ids_r,
                                float* w_r, cudaStream_t stream);
absl::Status UnpackDispatchRows(const float* recv, int64_t received,
                                int64_t d, uint16_t* x_r, int32_t* ids_r,
                                float* w_r, cudaStream_t stream);

// send [rows, d] = dy[token of order[j]] (dispatch-grad). Errors as
// PackDispatchRows.
absl::Status PackGradRows(const float* dy, const int64_t* order, int64_t rows,
                          int k, int64_t d, float* send, cudaStream_t stream);
absl::Status PackGradRows(const uint16_t* dy, const int64_t* order,
                          int64_t rows, int k, int64_t d, float* send,
                          cudaStream_t stream);

// send [received, d + 1] = [dx_r | dw_r] (combine-grad, before it goes
// back). Errors as UnpackDispatchRows.
absl::Status PackCombineGradRows(const float* dx_r, const float* dw_r,
                                 int64_t received, int64_t d, float* send,
                                 cudaStream_t stream);

// Token i's rows come back at back[position[i * k + s]] (rows of `width`
// values): y [t, d] = the sum of columns [0, d) over s in slot order,
// rounded once to y's type (overwritten). With width > d and a non-null
// d_weights [t * k], d_weights[i * k + s] = column d of slot s's row
// (combine-grad's weight gradients).
// Errors: INVALID_ARGUMENT for t < 0, k < 1, d < 1, width < d, a null
// back, position or y with t > 0, or d_weights with width == d; launch
// errors.
absl::Status CombineRows(const float* back, const int64_t* position, int64_t t,
                         int k, int64_t width, int64_t d, float* y,
                         float* d_weights, cudaStream_t stream);
absl::Status CombineRows(const float* back, const int64_t* position, int64_t t,
                         int k, int64_t width, int64_t d, uint16_t* y,
                         float* d_weights, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_EXPERT_PERMUTE_H_
