#ifndef SHARDD_KERNELS_CUDA_ROPE_H_
#define SHARDD_KERNELS_CUDA_ROPE_H_

// Rotary embeddings on the GPU, with the semantics and shapes of
// kernels/cpu/rope.h (RopeLayout, RopeShape); the cos/sin table is the CPU
// RopeTable's, uploaded once. x is fp32 or bf16 (uint16_t bit patterns),
// rotated in place in fp32. Device pointers; asynchronous on `stream`.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/rope.h"

namespace shardd {
namespace kernels {
namespace cuda {

struct DeviceRopeTable {
  const float* cos = nullptr;  // [positions, rotary_dim / 2]
  const float* sin = nullptr;
  int64_t rotary_dim = 0;
  int64_t positions = 0;
};

// positions [T] (device int32): the caller keeps them in [0,
// table.positions) (a position outside leaves its token unrotated; memory
// stays safe). Errors: INVALID_ARGUMENT for negative sizes, an odd or
// non-positive rotary_dim, or null pointers with T > 0; launch errors.
absl::Status RopeRotate(const DeviceRopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        float* x, bool inverse, cudaStream_t stream);
absl::Status RopeRotate(const DeviceRopeTable& table, RopeLayout layout,
                        const RopeShape& shape, const int32_t* positions,
                        uint16_t* x, bool inverse, cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CUDA_ROPE_H_
