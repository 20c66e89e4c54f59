#ifndef SHARDD_KERNELS_CPU_IEEE_OPS_H_
#define SHARDD_KERNELS_CPU_IEEE_OPS_H_

// fp32 operations rounded once each, for per-element arithmetic that the
// CPU kernels and the CUDA kernels share as __host__ __device__ functions
// (adamw_element.h, ...): on the device the _rn intrinsics, which nvcc never
// contracts into FMAs; on the host the plain operators, in libraries built
// with -ffp-contract=off. Either way each result is the correctly rounded
// IEEE one, so both sides give the same bits. Dependency-free so that nvcc
// can include it.

#include <cmath>

#include "kernels/cpu/host_device.h"


namespace shardd {
namespace kernels {

SHARDD_HOST_DEVICE_INLINE float RnAdd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

SHARDD_HOST_DEVICE_INLINE float RnSub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

SHARDD_HOST_DEVICE_INLINE float RnMul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

SHARDD_HOST_DEVICE_INLINE float RnDiv(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// IEEE sqrt is correctly rounded on both sides.
SHARDD_HOST_DEVICE_INLINE float RnSqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The same for double (the load-balancing loss's sums and factors).
SHARDD_HOST_DEVICE_INLINE double RnDAdd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

SHARDD_HOST_DEVICE_INLINE double RnDSub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

SHARDD_HOST_DEVICE_INLINE double RnDMul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

SHARDD_HOST_DEVICE_INLINE double RnDDiv(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// The math library's functions, for element functions that keep them: glibc
// on the host, CUDA's on the device. Unlike the operations above these are
// not correctly rounded, so the two sides may differ in the last bits (CUDA
// documents expf and tanhf within 2 ulp, log within 1 ulp; glibc's are
// within 1 ulp); tests that compare a CUDA kernel with the CPU allow for it.
SHARDD_HOST_DEVICE_INLINE float LibExp(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}

SHARDD_HOST_DEVICE_INLINE float LibTanh(float x) {
#ifdef __CUDA_ARCH__
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

SHARDD_HOST_DEVICE_INLINE double LibLog(double x) {
#ifdef __CUDA_ARCH__
  return log(x);
#else
  return std::log(x);
#endif
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_IEEE_OPS_H_
