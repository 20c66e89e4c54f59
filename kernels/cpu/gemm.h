#ifndef SHARDD_KERNELS_CPU_GEMM_H_
#define SHARDD_KERNELS_CPU_GEMM_H_

// Row-major single-precision GEMM for the CPU kernels:
//   C [M, N] = alpha * op(A) @ op(B) + beta * C
// with cblas_sgemm's arguments (minus the order, always row-major). Large
// products are split over the compute pool (compute_pool.h) by rows of C,
// each piece a one-thread OpenBLAS call, at row offsets that keep every
// element's arithmetic what it is unsplit: the same bits at every thread
// count (kernels/cpu/thread_count_test.cc).

#include <cblas.h>

namespace shardd {
namespace kernels {

void Sgemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n,
           int k, float alpha, const float* a, int lda, const float* b,
           int ldb, float beta, float* c, int ldc);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_GEMM_H_
