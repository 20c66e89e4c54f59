#ifndef SHARDD_KERNELS_CUDA_BF16_CAST_KERNELS_H_
#define SHARDD_KERNELS_CUDA_BF16_CAST_KERNELS_H_

// Launchers of the fp32 <-> bf16 cast kernels (bf16_cast_kernels.cu). Plain
// C++ for the host wrappers in bf16_cast.cc; arguments are validated there.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// n >= 1. Uses 16-byte vector loads and stores when both pointers are
// 16-byte aligned, scalar accesses otherwise.
cudaError_t LaunchFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                             cudaStream_t stream);
cudaError_t LaunchBf16ToFp32(const uint16_t* in, float* out, int64_t n,
                             cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_BF16_CAST_KERNELS_H_
