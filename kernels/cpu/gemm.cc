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
// L2 (4 MiB): measured with //bench:sgemm_bench, docs/performance.md. The
// same holds for columns with op(A) in place of op(B). Products under two
// pieces' worth either way are one call.
constexpr int64_t kPieceMacs = int64_t{1} << 20;
constexpr int64_t kMinPieceRows = 128;
constexpr int64_t kLargeOperand = int64_t{1} << 20;
// Pieces are whole register blocks of every x86-64 sgemm kernel (speed
// only: the bits do not depend on where the cuts are, only on their being
// the same at every thread count).
constexpr int64_t kAlign = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void OpenBlasCall(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m,
                  int n, int k, float alpha, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
              beta, c, ldc);
}

// The length of each piece when `extent` (rows or columns of C) is cut and
// each piece multiplies an operand of `other` elements (the other side's
// extent times k) that every call packs again; `extent` when there are not
// two pieces' worth.
int64_t PieceLength(int64_t extent, int64_t other) {
  other = std::max<int64_t>(1, other);
  int64_t length =
      std::max(CeilDiv(kPieceMacs, other),
               other >= kLargeOperand ? 2 * kMinPieceRows : kMinPieceRows);
  if (extent < 2 * length) return std::max<int64_t>(extent, 1);
  // As many pieces as fit whole, the length spread evenly over them (so no
  // piece but the last is shorter, and that one by less than 16 per piece).
  length = CeilDiv(extent, extent / length);
  return std::min(CeilDiv(length, kAlign) * kAlign, extent);
}

}  // namespace

SgemmPieces SgemmPiecesFor(int64_t m, int64_t n, int64_t k) {
  SgemmPieces pieces{std::max<int64_t>(m, 1), std::max<int64_t>(n, 1)};
  if (m <= 0 || n <= 0) return pieces;
  // Rows first: C's rows are op(A)'s, so a row piece reads contiguous rows.
  pieces.rows = PieceLength(m, n * k);
  if (pieces.rows < m) return pieces;
  // Too few rows (an LM head's block of tokens against a large vocabulary):
  // columns.
  pieces.cols = PieceLength(n, m * k);
  return pieces;
}

namespace internal {

void SgemmWith(SgemmCall call, CBLAS_TRANSPOSE trans_a,
               CBLAS_TRANSPOSE trans_b, int m, int n, int k, float alpha,
               const float* a, int lda, const float* b, int ldb, float beta,
               float* c, int ldc) {
  const SgemmPieces pieces = SgemmPiecesFor(m, n, k);
  if (pieces.rows >= m && pieces.cols >= n) {
    call(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Piece p is rows [p rows, (p + 1) rows) of C and of op(A), or columns
  // [p cols, (p + 1) cols) of C and of op(B). One thread runs the same
  // pieces in order, and so does a call inside another ParallelFor.
  const bool by_rows = pieces.rows < m;
  const int64_t length = by_rows ? pieces.rows : pieces.cols;
  const int64_t extent = by_rows ? m : n;
  ParallelFor(CeilDiv(extent, length), 1, [&](int64_t first, int64_t last) {
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t begin = piece * length;
      const int size =
          static_cast<int>(std::min<int64_t>(begin + length, extent) - begin);
      if (by_rows) {
        const float* a_part =
            trans_a == CblasNoTrans ? a + begin * lda : a + begin;
        call(trans_a, trans_b, size, n, k, alpha, a_part, lda, b, ldb, beta,
             c + begin * ldc, ldc);
      } else {
        const float* b_part =
            trans_b == CblasNoTrans ? b + begin : b + begin * ldb;
        call(trans_a, trans_b, m, size, k, alpha, a, lda, b_part, ldb, beta,
             c + begin, ldc);
      }
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
