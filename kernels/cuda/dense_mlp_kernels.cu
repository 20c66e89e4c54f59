#include <algorithm>
#include <cstdint>

#include "kernels/cuda/dense_mlp_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

// sqrt(2 / pi) and the cubic coefficient of the GELU tanh approximation.
constexpr float kGeluK = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;

int Blocks(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

__device__ __forceinline__ float Sigmoid(float g) {
  // Two branches keep expf from overflowing for large |g| (as the CPU).
  if (g >= 0.0f) return 1.0f / (1.0f + expf(-g));
  const float e = expf(g);
  return e / (1.0f + e);
}

// act(g) and, when dact is non-null, act'(g): kernels/cpu/dense_mlp.cc.
__device__ __forceinline__ void Activate(GateKind kind, float g, float* act,
                                         float* dact) {
  if (kind == GateKind::kSilu) {
    const float s = Sigmoid(g);
    *act = g * s;
    if (dact != nullptr) *dact = s * (1.0f + g * (1.0f - s));
  } else {
    const float inner = kGeluK * (g + kGeluC * g * g * g);
    const float t = tanhf(inner);
    *act = 0.5f * g * (1.0f + t);
    if (dact != nullptr) {
      *dact = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kGeluK *
                                      (1.0f + 3.0f * kGeluC * g * g);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    GatedForwardKernel(GateKind kind, const T* __restrict__ gate,
                       const T* __restrict__ up, int64_t n, T* __restrict__ a) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float act;
    Activate(kind, LoadAsFloat(gate + i), &act, nullptr);
    StoreFromFloat(a + i, act * LoadAsFloat(up + i));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    GatedBackwardKernel(GateKind kind, const T* __restrict__ gate,
                        const T* __restrict__ up, int64_t n,
                        T* __restrict__ d_up, T* __restrict__ d_gate) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float act, dact;
    Activate(kind, LoadAsFloat(gate + i), &act, &dact);
    const float da = LoadAsFloat(d_up + i);
    StoreFromFloat(d_gate + i, da * LoadAsFloat(up + i) * dact);
    StoreFromFloat(d_up + i, da * act);
  }
}

template <typename T>
cudaError_t Forward(GateKind kind, const T* gate, const T* up, int64_t n, T* a,
                    cudaStream_t stream) {
  GatedForwardKernel<T>
      <<<Blocks(n), kThreads, 0, stream>>>(kind, gate, up, n, a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t Backward(GateKind kind, const T* gate, const T* up, int64_t n,
                     T* d_up, T* d_gate, cudaStream_t stream) {
  GatedBackwardKernel<T>
      <<<Blocks(n), kThreads, 0, stream>>>(kind, gate, up, n, d_up, d_gate);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGatedActivationForward(GateKind kind, const float* gate,
                                         const float* up, int64_t n, float* a,
                                         cudaStream_t stream) {
  return Forward(kind, gate, up, n, a, stream);
}

cudaError_t LaunchGatedActivationForward(GateKind kind, const uint16_t* gate,
                                         const uint16_t* up, int64_t n,
                                         uint16_t* a, cudaStream_t stream) {
  return Forward(kind, gate, up, n, a, stream);
}

cudaError_t LaunchGatedActivationBackward(GateKind kind, const float* gate,
                                          const float* up, int64_t n,
                                          float* d_up, float* d_gate,
                                          cudaStream_t stream) {
  return Backward(kind, gate, up, n, d_up, d_gate, stream);
}

cudaError_t LaunchGatedActivationBackward(GateKind kind, const uint16_t* gate,
                                          const uint16_t* up, int64_t n,
                                          uint16_t* d_up, uint16_t* d_gate,
                                          cudaStream_t stream) {
  return Backward(kind, gate, up, n, d_up, d_gate, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
