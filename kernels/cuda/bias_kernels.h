#ifndef SHARDD_KERNELS_CUDA_BIAS_KERNELS_H_
#define SHARDD_KERNELS_CUDA_BIAS_KERNELS_H_

// Launchers of the bias kernels (bias_kernels.cu), shared by the linear
// bias op (bias.h), the router's bias and the grouped experts' per-expert
// biases. No absl: nvcc compiles the .cu side.
//
// Rows may be split into segments by device offsets [segments + 1]
// (ascending, offsets[0] = 0, offsets[segments] = rows): segment s owns rows
// [offsets[s], offsets[s + 1]) and its own bias row b[s, :]. A null
// `offsets` means one segment of all rows. A null `row_scale` means 1.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dtype.h"

namespace shardd {
namespace kernels {
namespace cuda {

// y[r, c] += row_scale[r] * b[s(r), c] (or + b[s(r), c] without a scale),
// in fp32, rounded once to y's type. b and y: fp32 or bf16 (b bf16 with y
// fp32 is allowed: a bf16 parameter onto fp32 logits).
cudaError_t LaunchAddRowBias(DType b_type, const void* b, DType y_type,
                             void* y, int64_t rows, int64_t cols,
                             const int32_t* offsets, int64_t segments,
                             const float* row_scale, cudaStream_t stream);

// out[s, c] += sum over the rows r of segment s of row_scale[r] * in[r, c]
// (fp32 products, fp32 sums in a fixed order: 8 strided partial sums per
// column, added in order). Empty segments leave out[s, :] as it is.
cudaError_t LaunchColumnSums(DType in_type, const void* in, int64_t rows,
                             int64_t cols, const int32_t* offsets,
                             int64_t segments, const float* row_scale,
                             float* out, cudaStream_t stream);

// row_out[r] += sum_c in[r, c] * b[s(r), c] (fp32, a fixed-order block
// reduction per row): the routing-weight gradient of a bias scaled by
// row_scale in LaunchAddRowBias. in and b have the same type.
cudaError_t LaunchAddRowBiasDot(DType type, const void* in, const void* b,
                                int64_t rows, int64_t cols,
                                const int32_t* offsets, int64_t segments,
                                float* row_out, cudaStream_t stream);

// The same over fp32 input into double sums (one segment, no scale).
cudaError_t LaunchColumnSumsDouble(const float* in, int64_t rows, int64_t cols,
                                   double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_BIAS_KERNELS_H_
