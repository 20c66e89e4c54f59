#ifndef SHARDD_KERNELS_CPU_LINEAR_H_
#define SHARDD_KERNELS_CPU_LINEAR_H_

// A bias-free linear layer with the Hugging Face (out, in) weight layout, on
// OpenBLAS: y [T, out] = x [T, in] @ W^T. fp32, row-major.

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {

// y is overwritten, or added to with `accumulate`. Errors: INVALID_ARGUMENT
// for T < 0, in or out < 1, sizes beyond cblas' int, or a null pointer with
// T > 0.
absl::Status LinearForward(const float* x, const float* w, int64_t tokens,
                           int64_t in, int64_t out, float* y,
                           bool accumulate = false);

// dx [T, in] = dy @ W, overwritten or (accumulate_dx) added to; dW [out, in]
// += dy^T @ x. Either output may be null to skip it.
absl::Status LinearBackward(const float* x, const float* w, const float* dy,
                            int64_t tokens, int64_t in, int64_t out, float* dx,
                            bool accumulate_dx, float* dw);

// y [T, out] += b [out] on every row (a linear layer's bias).
void AddBias(const float* b, int64_t tokens, int64_t out, float* y);

// db [out] += the sum of dy [T, out] over its rows (the bias gradient).
void BiasBackward(const float* dy, int64_t tokens, int64_t out, float* db);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_LINEAR_H_
