#ifndef SHARDD_WORKER_MODEL_DEVICE_LINEAR_H_
#define SHARDD_WORKER_MODEL_DEVICE_LINEAR_H_

// The GEMM the GPU sublayers (device_attention_block, device_mla_block) run
// their projections with: row-major operands in storage type T (float or
// uint16_t bf16), fp32 accumulation, C in `c_type` (the storage type for
// activations, fp32 for the weight gradients they add to).

#include <cublas_v2.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/row_major_gemm.h"

namespace shardd {

// C [m, n] = A [m, k] op B + beta C (op: transposed when tb; A likewise).
template <typename T>
absl::Status StorageGemm(cublasHandle_t h, int64_t m, int64_t n, int64_t k,
                         const void* a, int64_t lda, bool ta, const void* b,
                         int64_t ldb, bool tb, float beta, void* c,
                         kernels::cuda::DType c_type, int64_t ldc,
                         const char* what) {
  namespace kc = ::shardd::kernels::cuda;
  kc::GemmOperand A{a, kc::DTypeOf<T>::value, lda, ta};
  kc::GemmOperand B{b, kc::DTypeOf<T>::value, ldb, tb};
  return kc::RowMajorGemm(h, m, n, k, 1.0f, A, B, beta, c, c_type, ldc, what);
}

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_LINEAR_H_
