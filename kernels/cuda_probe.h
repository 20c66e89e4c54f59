#ifndef SHARDD_KERNELS_CUDA_PROBE_H_
#define SHARDD_KERNELS_CUDA_PROBE_H_

// The smallest CUDA target: proves that --config=cuda compiles .cu sources
// with nvcc and links cudart, cuBLAS and NCCL. Later GPU kernels live beside
// it.

#include <string>

namespace shardd {

// Number of visible CUDA devices; 0 when there is no GPU or no driver
// (`*reason` then says why).
int CudaDeviceCount(std::string* reason);

// y[i] += a * x[i] on device 0, copying through device memory. Returns an
// empty string on success, else the CUDA error.
std::string CudaAxpy(float a, const float* x, float* y, int n);

// NCCL version as an integer (e.g. 22809); links libnccl.
int NcclVersion();

}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_PROBE_H_
