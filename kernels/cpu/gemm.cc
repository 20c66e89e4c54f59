#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/compute_pool.h"

namespace shardd {
namespace kernels {
namespace {

// A piece gets at least this many multiply-adds (each OpenBLAS call costs a
// few microseconds besides the product) and rows (each call packs the whole
// of op(B) again), and twice the rows once op(B) no longer fits in a core's
// L2 (4 MiB): measured with //bench:sgemm_bench, docs/performance.md.
// Products under two pieces' worth are one call.
constexpr int64_t kPieceMacs = int64_t{1} << 20;
constexpr int64_t kMinPieceRows = 128;
constexpr int64_t kLargeB = int64_t{1} << 20;
// Pieces are whole register blocks of every x86-64 sgemm kernel (speed
// only: the bits do not depend on where the cuts are, only on their being
// the same at every thread count).
constexpr int64_t kRowAlign = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void OpenBlasCall(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m,
                  int n, int k, float alpha, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}

}  // namespace

int64_t SgemmPieceRows(int64_t m, int64_t n, int64_t k) {
  const int64_t row_macs = std::max<int64_t>(1, n * k);
  int64_t rows = std::max(CeilDiv(kPieceMacs, row_macs),
                          row_macs >= kLargeB ? 2 * kMinPieceRows
                                              : kMinPieceRows);
  if (m < 2 * rows) return std::max<int64_t>(m, 1);
  // As many pieces as fit whole, the rows spread evenly over them (so no
  // piece but the last is shorter, and that one by less than 16 per piece).
  rows = CeilDiv(m, m / rows);
  return std::min(CeilDiv(rows, kRowAlign) * kRowAlign, m);
}

namespace internal {

void SgemmWith(SgemmCall call, CBLAS_TRANSPOSE trans_a,
               CBLAS_TRANSPOSE trans_b, int m, int n, int k, float alpha,
               const float* a, int lda, const float* b, int ldb, float beta,
               float* c, int ldc) {
  const int64_t rows = SgemmPieceRows(m, n, k);
  if (rows >= m) {
    call(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Piece p is rows [p rows, (p + 1) rows) of C and of op(A); run inline in
  // order on one thread, or inside another ParallelFor: the same calls.
  ParallelFor(CeilDiv(m, rows), 1, [&](int64_t first, int64_t last) {
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t begin = piece * rows;
      const int64_t end = std::min<int64_t>(begin + rows, m);
      const float* a_part =
          trans_a == CblasNoTrans ? a + begin * lda : a + begin;
      call(trans_a, trans_b, static_cast<int>(end - begin), n, k, alpha,
           a_part, lda, b, ldb, beta, c + begin * ldc, ldc);
    }
  });
}

}  // namespace internal

void Sgemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n,
           int k, float alpha, const float* a, int lda, const float* b, int ldb,
           float beta, float* c, int ldc) {
  // The pool holds OpenBLAS at one thread (compute_pool.cc), so each call
  // below is a one-thread call whatever the pool's size.
  ComputeThreads();
  internal::SgemmWith(&OpenBlasCall, trans_a, trans_b, m, n, k, alpha, a, lda,
                      b, ldb, beta, c, ldc);
}

}  // namespace kernels
}  // namespace shardd
