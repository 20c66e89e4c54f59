#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "kernels/cuda_probe.h"

namespace shardd {
namespace {

__global__ void AxpyKernel(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

std::string Err(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

}  // namespace

int CudaDeviceCount(std::string* reason) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (reason != nullptr) *reason = Err("cudaGetDeviceCount", e);
    return 0;
  }
  if (count == 0 && reason != nullptr) *reason = "no CUDA devices";
  return count;
}

std::string CudaAxpy(float a, const float* x, float* y, int n) {
  float* dx = nullptr;
  float* dy = nullptr;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  cudaError_t e = cudaMalloc(&dx, bytes);
  if (e != cudaSuccess) return Err("cudaMalloc", e);
  e = cudaMalloc(&dy, bytes);
  if (e == cudaSuccess) e = cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    AxpyKernel<<<(n + 255) / 256, 256>>>(a, dx, dy, n);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(dy);
  return e == cudaSuccess ? std::string() : Err("axpy", e);
}

int NcclVersion() {
  int version = 0;
  ncclGetVersion(&version);
  return version;
}

}  // namespace shardd
