#ifndef SHARDD_KERNELS_CPU_GEMM_H_
#define SHARDD_KERNELS_CPU_GEMM_H_

// Row-major single-precision GEMM for the CPU kernels:
//   C [M, N] = alpha * op(A) @ op(B) + beta * C
// with cblas_sgemm's arguments (minus the order, always row-major).
//
// Large products are cut by rows (or, for few rows, columns) of C into
// pieces whose size is a function of the shape alone (SgemmPiecesFor), each
// piece one one-thread OpenBLAS call, and the pieces are spread over the compute pool (compute_pool.h).
// The calls are therefore the same at every thread count, so the result has
// the same bits whatever the pool's size, on any BLAS that is deterministic
// per call, whatever blocking, micro-kernel or small-matrix path it picks
// for a piece (OpenBLAS's SkylakeX kernels pick by the piece's size). The
// bits may differ from one unsplit cblas_sgemm call, and from one OpenBLAS
// kernel (CPU) to another: docs/testing.md.

#include <cblas.h>

#include <cstdint>

namespace shardd {
namespace kernels {

void Sgemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n,
           int k, float alpha, const float* a, int lda, const float* b,
           int ldb, float beta, float* c, int ldc);

// How Sgemm cuts an [m, n] x k product: into pieces of `rows` rows of C
// (cols == n), or, where m is too small for two pieces, of `cols` columns
// (rows == m); rows == m and cols == n is one call. Pieces are multiples of
// 16 (all but the last), with at least 128 rows or columns (256 where the
// operand each call packs again is 4 MiB or more) and 2^20 multiply-adds.
// A function of m, n and k only, never of the thread count.
struct SgemmPieces {
  int64_t rows;
  int64_t cols;
};
SgemmPieces SgemmPiecesFor(int64_t m, int64_t n, int64_t k);

namespace internal {

// One row-major cblas_sgemm-shaped call, as Sgemm makes them.
using SgemmCall = void (*)(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b,
                           int m, int n, int k, float alpha, const float* a,
                           int lda, const float* b, int ldb, float beta,
                           float* c, int ldc);

// Sgemm with `call` in place of OpenBLAS, so a test can give it a BLAS whose
// arithmetic depends on the call's shape (as OpenBLAS's does on some CPUs)
// on any machine.
void SgemmWith(SgemmCall call, CBLAS_TRANSPOSE trans_a,
               CBLAS_TRANSPOSE trans_b, int m, int n, int k, float alpha,
               const float* a, int lda, const float* b, int ldb, float beta,
               float* c, int ldc);

}  // namespace internal
}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_GEMM_H_
