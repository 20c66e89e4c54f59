#ifndef SHARDD_KERNELS_CUDA_ROPE_KERNELS_H_
#define SHARDD_KERNELS_CUDA_ROPE_KERNELS_H_

// Launcher of the RoPE kernel (rope_kernels.cu); validated by rope.cc.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace kernels {
namespace cuda {

struct RopeLaunch {
  const float* cos;
  const float* sin;
  int64_t half;  // rotary_dim / 2
  int64_t positions;
  bool interleaved;
  int64_t tokens, heads, token_stride, head_stride, dim_offset;
  float sign;  // -1 for the inverse rotation
};

template <typename T>
cudaError_t LaunchRope(const RopeLaunch& r, const int32_t* positions, T* x,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROPE_KERNELS_H_
