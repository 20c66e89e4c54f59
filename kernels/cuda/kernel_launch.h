#ifndef SHARDD_KERNELS_CUDA_KERNEL_LAUNCH_H_
#define SHARDD_KERNELS_CUDA_KERNEL_LAUNCH_H_

// Launching a kernel that may need more than the default 48 KiB of dynamic
// shared memory (.cu files only; nvcc).

#include <cuda_runtime.h>

#include <cstddef>

namespace shardd {
namespace kernels {
namespace cuda {

// Launches `kernel` on grid x `threads` with `smem` bytes of dynamic shared
// memory, raising the kernel's limit first when it is above 48 KiB; returns
// that call's or the launch's error.
template <typename Kernel, typename... Args>
cudaError_t LaunchWithSharedMemory(Kernel kernel, dim3 grid, int threads,
                                   size_t smem, cudaStream_t stream,
                                   Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(smem));
    if (error != cudaSuccess) return error;
  }
  kernel<<<grid, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_KERNEL_LAUNCH_H_
