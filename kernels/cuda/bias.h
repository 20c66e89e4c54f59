#ifndef SHARDD_KERNELS_CUDA_BIAS_H_
#define SHARDD_KERNELS_CUDA_BIAS_H_

// A linear layer's bias on the GPU, the CUDA counterpart of AddBias and
// BiasBackward in kernels/cpu/linear.h (the projections themselves are
// RowMajorGemm calls, row_major_gemm.h). y, b and dy are fp32 or bf16
// (uint16_t bit patterns, one type per call); the bias gradient is fp32 and
// ADDED to. Device pointers; asynchronous on `stream`; no synchronization
// and no allocation. The column sums run in a fixed order (8 strided
// partial sums per column, added in order), so they are deterministic.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// y [T, out] += b [out] on every row (fp32 sum, rounded once to y's type).
// Errors: INVALID_ARGUMENT for T < 0, out outside [1, 2^31), or a null
// pointer with T > 0; launch errors via CudaStatus.
absl::Status AddBias(const float* b, int64_t tokens, int64_t out, float* y,
                     cudaStream_t stream);
absl::Status AddBias(const uint16_t* b, int64_t tokens, int64_t out,
                     uint16_t* y, cudaStream_t stream);

// db [out] += the sum of dy [T, out] over its rows. Errors as AddBias.
absl::Status BiasBackward(const float* dy, int64_t tokens, int64_t out,
                          float* db, cudaStream_t stream);
absl::Status BiasBackward(const uint16_t* dy, int64_t tokens, int64_t out,
                          float* db, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_BIAS_H_
