#ifndef SHARDD_KERNELS_CPU_HOST_DEVICE_H_
#define SHARDD_KERNELS_CPU_HOST_DEVICE_H_

// Marks the per-element functions that the CPU kernels and the CUDA kernels
// share (one definition, compiled by g++ and by nvcc).
//   SHARDD_HOST_DEVICE inline f(...)   host and device, inlined as usual.
//   SHARDD_HOST_DEVICE_INLINE f(...)   always inlined: also into the CPU's
//     per-SIMD-level clones, which GCC does not otherwise inline into (their
//     target("arch=...") differs from the function's).

#ifdef __CUDACC__
#define SHARDD_HOST_DEVICE __host__ __device__
#define SHARDD_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
#define SHARDD_HOST_DEVICE
#define SHARDD_HOST_DEVICE_INLINE inline __attribute__((always_inline))
#endif

#endif  // SHARDD_KERNELS_CPU_HOST_DEVICE_H_
