#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/compute_pool.h"

namespace shardd {
namespace kernels {
namespace {

// Below this many multiply-adds a product runs on the calling thread: the
// hand-off to the pool (a few microseconds) would cost more than it saves.
constexpr int64_t kMinSplitMacs = int64_t{1} << 20;
// Pieces start on multiples of 48 rows, a multiple of the row blocks of
// OpenBLAS's x86-64 sgemm micro-kernels (8 to 24), so each row of C is
// computed by the same micro-kernel as without the split: the same bits.
// (Splitting the columns would not: the kernels' column edges sum
// differently.)
constexpr int64_t kRowAlign = 48;

}  // namespace

void Sgemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n,
           int k, float alpha, const float* a, int lda, const float* b, int ldb,
           float beta, float* c, int ldc) {
  const int64_t macs = int64_t{m} * n * k;
  const int64_t threads = UsableThreads();
  // One piece per thread, its first row the multiple of kRowAlign nearest
  // to an even share.
  const int64_t pieces = std::min<int64_t>(threads, m / kRowAlign);
  if (pieces <= 1 || macs < kMinSplitMacs) {
    cblas_sgemm(CblasRowMajor, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
                beta, c, ldc);
    return;
  }
  auto first_row = [&](int64_t piece) {
    if (piece == pieces) return int64_t{m};
    return (m * piece / pieces + kRowAlign / 2) / kRowAlign * kRowAlign;
  };
  ParallelFor(pieces, 1, [&](int64_t piece, int64_t) {
    // Rows [begin, end) of C and of op(A).
    const int64_t begin = first_row(piece), end = first_row(piece + 1);
    if (begin >= end) return;
    const float* a_part = trans_a == CblasNoTrans ? a + begin * lda : a + begin;
    cblas_sgemm(CblasRowMajor, trans_a, trans_b, static_cast<int>(end - begin),
                n, k, alpha, a_part, lda, b, ldb, beta, c + begin * ldc, ldc);
  });
}

}  // namespace kernels
}  // namespace shardd
