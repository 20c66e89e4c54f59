#include <algorithm>
#include <cstdint>

#include "kernels/cpu/gate_element.h"
#include "kernels/cuda/dense_mlp_kernels.h"
#include "kernels/cuda/device_math.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

int Blocks(int64_t n) {
  return static_cast<int>(
      std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

// a = act(g) u: the grouped experts' activation (kernels/cpu/gate_element.h)
// with routing weight 1, as kernels/cpu/dense_mlp.cc computes it.
template <typename Gate, typename T>
__global__ void __launch_bounds__(kThreads)
    GatedForwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                       int64_t n, T* __restrict__ a) {
  const Gate g{};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    StoreFromFloat(
        a + i, g.Forward(LoadAsFloat(gate + i), LoadAsFloat(up + i), 1.0f));
  }
}

template <typename Gate, typename T>
__global__ void __launch_bounds__(kThreads)
    GatedBackwardKernel(const T* __restrict__ gate, const T* __restrict__ up,
                        int64_t n, T* __restrict__ d_up,
                        T* __restrict__ d_gate) {
  const Gate g{};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    float w_term, dg, du;  // no routing weight here
    g.Backward(LoadAsFloat(gate + i), LoadAsFloat(up + i),
               LoadAsFloat(d_up + i), 1.0f, &w_term, &dg, &du);
    StoreFromFloat(d_gate + i, dg);
    StoreFromFloat(d_up + i, du);
  }
}

template <typename T>
cudaError_t Forward(GateKind kind, const T* gate, const T* up, int64_t n, T* a,
                    cudaStream_t stream) {
  if (kind == GateKind::kSilu) {
    GatedForwardKernel<ProductGate<SiluGate>, T>
        <<<Blocks(n), kThreads, 0, stream>>>(gate, up, n, a);
  } else {
    GatedForwardKernel<ProductGate<GeluTanhGate>, T>
        <<<Blocks(n), kThreads, 0, stream>>>(gate, up, n, a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t Backward(GateKind kind, const T* gate, const T* up, int64_t n,
                     T* d_up, T* d_gate, cudaStream_t stream) {
  if (kind == GateKind::kSilu) {
    GatedBackwardKernel<ProductGate<SiluGate>, T>
        <<<Blocks(n), kThreads, 0, stream>>>(gate, up, n, d_up, d_gate);
  } else {
    GatedBackwardKernel<ProductGate<GeluTanhGate>, T>
        <<<Blocks(n), kThreads, 0, stream>>>(gate, up, n, d_up, d_gate);
  }
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
