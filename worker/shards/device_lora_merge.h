#ifndef SHARDD_WORKER_SHARDS_DEVICE_LORA_MERGE_H_
#define SHARDD_WORKER_SHARDS_DEVICE_LORA_MERGE_H_

// LoRA's merge and gradient split on the GPU: the GEMMs that
// lora_merge.h lists, run with cuBLAS (kernels/cuda/row_major_gemm.h, fp32
// in CUBLAS_COMPUTE_32F_PEDANTIC, never TF32) on device buffers. Same
// operands and calls as the host's LoraMergeInto / LoraSplitGrad; only the
// order of each dot product's additions is cuBLAS's own. Asynchronous on
// the handle's stream (bound here); no allocation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "model/lora.h"

namespace shardd {

// w += s B A (fp32 device buffers in the layouts of lora_merge.h).
// Errors: INVALID_ARGUMENT for a null handle or buffer, a rank, in or out
// below 1 or beyond a cuBLAS int, experts < 0; cuBLAS errors.
absl::Status DeviceLoraMergeInto(cublasHandle_t handle, cudaStream_t stream,
                                 const LoraTarget& target, int64_t experts,
                                 const float* a, const float* b, float* w);

// da = s B^T G, db = s G A^T (overwritten). Errors as DeviceLoraMergeInto.
absl::Status DeviceLoraSplitGrad(cublasHandle_t handle, cudaStream_t stream,
                                 const LoraTarget& target, int64_t experts,
                                 const float* a, const float* b,
                                 const float* g, float* da, float* db);

}  // namespace shardd

#endif  // SHARDD_WORKER_SHARDS_DEVICE_LORA_MERGE_H_
