#ifndef SHARDD_WORKER_SHARDS_DEVICE_SHARD_KERNELS_H_
#define SHARDD_WORKER_SHARDS_DEVICE_SHARD_KERNELS_H_

// Small element-wise kernels of the device shard store and step executor
// (plain launchers, no absl: compiled by nvcc). bf16 values are uint16_t
// bit patterns rounded as kernels/cpu/bf16.h. Asynchronous on `stream`.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace device_kernels {

// dst[i] += scale * src[i] for i in [0, n) (the product rounded first, as
// the CPU store's accumulation; scale 1 adds src exactly); each of src and
// dst is fp32 or bf16 (`*_bf16`). A bf16 dst is rounded once per add, like
// the CPU store's AddInto. n <= 0 launches nothing.
cudaError_t LaunchAddInto(const void* src, bool src_bf16, void* dst,
                          bool dst_bf16, int64_t n, cudaStream_t stream,
                          float scale = 1.0f);

// *dst = float(*src) (one element; the CPU rounds the local sum of squares
// to float before its all-reduce too).
cudaError_t LaunchDoubleToFloat(const double* src, float* dst,
                                cudaStream_t stream);
// *dst = double(*src).
cudaError_t LaunchFloatToDouble(const float* src, double* dst,
                                cudaStream_t stream);

}  // namespace device_kernels
}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_DEVICE_SHARD_KERNELS_H_
