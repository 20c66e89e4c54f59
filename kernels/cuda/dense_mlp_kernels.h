#ifndef SHARDD_KERNELS_CUDA_DENSE_MLP_KERNELS_H_
#define SHARDD_KERNELS_CUDA_DENSE_MLP_KERNELS_H_

// Launchers of the gated-activation kernels of the dense MLP
// (dense_mlp_kernels.cu); the GEMMs and checks are in dense_mlp.cc. n >= 1.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

// 0: SwiGLU (silu), 1: GeGLU (gelu, tanh approximation).
enum class GateKind : int { kSilu = 0, kGeluTanh = 1 };

// a[i] = act(gate[i]) * up[i].
cudaError_t LaunchGatedActivationForward(GateKind kind, const float* gate,
                                         const float* up, int64_t n, float* a,
                                         cudaStream_t stream);
cudaError_t LaunchGatedActivationForward(GateKind kind, const uint16_t* gate,
                                         const uint16_t* up, int64_t n,
                                         uint16_t* a, cudaStream_t stream);

// On entry d_up holds dA; on exit d_up = dA * act(gate) and
// d_gate = dA * up * act'(gate).
cudaError_t LaunchGatedActivationBackward(GateKind kind, const float* gate,
                                          const float* up, int64_t n,
                                          float* d_up, float* d_gate,
                                          cudaStream_t stream);
cudaError_t LaunchGatedActivationBackward(GateKind kind, const uint16_t* gate,
                                          const uint16_t* up, int64_t n,
                                          uint16_t* d_up, uint16_t* d_gate,
                                          cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_DENSE_MLP_KERNELS_H_
