#ifndef SHARDD_KERNELS_CUDA_BF16_CAST_H_
#define SHARDD_KERNELS_CUDA_BF16_CAST_H_

// fp32 <-> bf16 array casts on the GPU: the copy-in (fp32 master shard ->
// bf16 gather buffer) and copy-out of the unshard path. bf16 values are
// uint16_t bit patterns. Rounding is bit-identical to kernels/cpu/bf16.h
// (round to nearest even; every NaN becomes a quiet NaN with its sign and top
// payload bits; finite values past the bf16 range round to Inf).
//
// Both run asynchronously on `stream` and never synchronize. 16-byte vector
// accesses are used when both pointers are 16-byte aligned.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace shardd {
namespace kernels {
namespace cuda {

// out[i] = Fp32ToBf16(in[i]) for i in [0, n), device pointers. n == 0 does
// nothing.
// Errors: INVALID_ARGUMENT for n < 0, a null pointer with n > 0, or
// overlapping `in` and `out`; launch errors via CudaStatus.
absl::Status CastFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                            cudaStream_t stream);

// out[i] = Bf16ToFp32(in[i]) (exact). Errors: as CastFp32ToBf16.
absl::Status CastBf16ToFp32(const uint16_t* in, float* out, int64_t n,
                            cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_BF16_CAST_H_
