#ifndef SHARDD_WORKER_MODEL_DEVICE_MLA_KERNELS_H_
#define SHARDD_WORKER_MODEL_DEVICE_MLA_KERNELS_H_

// The layout glue of DeviceMlaBlock (worker/model/device_mla_block.h):
// splitting the latent projection, assembling per-head keys from the
// per-head no-RoPE part and the one shared RoPE key, and the reverse for the
// gradients. Plain launchers returning cudaError_t (nvcc compiles this);
// asynchronous on `stream`. bf16 is uint16_t bit patterns, rounded to
// nearest even exactly as kernels/cpu/bf16.h.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shardd {
namespace device_model {

// dst[r * dst_stride + c] = src[(r / src_row_div) * src_stride + c] for r in
// [0, rows), c in [0, width), converted to the destination type (fp32 ->
// bf16 rounds). The pointers already point at the first column to copy.
// src_row_div >= 1 repeats each source row that many times (a key shared
// by every head). rows, width >= 0.
cudaError_t LaunchStridedCopy(const float* src, int64_t src_stride,
                              int64_t src_row_div, float* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream);
cudaError_t LaunchStridedCopy(const uint16_t* src, int64_t src_stride,
                              int64_t src_row_div, uint16_t* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream);
cudaError_t LaunchStridedCopy(const float* src, int64_t src_stride,
                              int64_t src_row_div, uint16_t* dst,
                              int64_t dst_stride, int64_t rows, int64_t width,
                              cudaStream_t stream);

// out[i * out_stride + c] = sum over j in [0, heads), in that order, of
// x[(i * heads + j) * head_stride + c], for i in [0, tokens), c in [0,
// width) (x already points at the first summed column): the gradient of a
// key shared by every head.
cudaError_t LaunchSumHeads(const float* x, int64_t tokens, int64_t heads,
                           int64_t head_stride, int64_t width, float* out,
                           int64_t out_stride, cudaStream_t stream);

}  // namespace device_model
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_MLA_KERNELS_H_
