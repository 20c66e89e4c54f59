// kernels::Sgemm (pieces by rows or columns of C, their size set by the
// shape alone, so the bits do not depend on the thread count) against one unsplit
// one-thread cblas_sgemm call of the same product, in the same run: what the
// fixed pieces cost on one thread, and what they gain on several.
//
//   bazel run -c opt //bench:sgemm_bench -- [--threads=N] [--repeats=R]
//
// Each cell is the minimum time of R runs (after one warm-up), interleaved
// with the other columns' so that all see the same machine load.
// vs_call is the unsplit call's time over Sgemm's on one thread; scaling is
// Sgemm's one-thread time over its N-thread time.

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/gemm.h"

namespace shardd {
namespace {

struct Shape {
  int m, n, k;
  CBLAS_TRANSPOSE tb;
  const char* what;
};

double Seconds(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                       start)
      .count();
}

int Main(int argc, char** argv) {
  int threads = 2, repeats = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--threads=", 0) == 0) {
      threads = std::atoi(a.c_str() + 10);
    } else if (a.rfind("--repeats=", 0) == 0) {
      repeats = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "usage: %s [--threads=N] [--repeats=R]\n", argv[0]);
      return 2;
    }
  }
  if (threads < 1 || repeats < 1) {
    std::fprintf(stderr, "--threads and --repeats must be at least 1\n");
    return 2;
  }
  // x @ W^T shapes of the kernels: the tiny test models' projections, the
  // grouped-experts bench's experts, and larger square ones.
  const Shape shapes[] = {
      {300, 40, 96, CblasNoTrans, "unit-test size"},
      {4096, 128, 64, CblasTrans, "tiny MLP up"},
      {4096, 64, 128, CblasTrans, "tiny MLP down"},
      {2048, 512, 256, CblasNoTrans, "expert up"},
      {2048, 256, 512, CblasNoTrans, "expert down"},
      {1024, 1024, 1024, CblasTrans, "square 1k"},
      {4096, 4096, 1024, CblasTrans, "wide"},
      {2048, 2048, 2048, CblasNoTrans, "square 2k"},
      {128, 32000, 512, CblasTrans, "LM head block"},
  };
  std::printf("Sgemm vs one unsplit one-thread cblas_sgemm, %d threads, "
              "min of %d\n",
              threads, repeats);
  std::printf("%-16s %6s %6s %6s %7s %10s %10s %10s %8s %8s\n", "shape", "m",
              "n", "k", "pieces", "call_GF/s", "1t_GF/s", "Nt_GF/s",
              "vs_call", "scaling");
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (const Shape& s : shapes) {
    std::vector<float> a(int64_t{s.m} * s.k), b(int64_t{s.k} * s.n),
        c(int64_t{s.m} * s.n);
    for (float& x : a) x = dist(rng);
    for (float& x : b) x = dist(rng);
    const int ldb = s.tb == CblasNoTrans ? s.n : s.k;
    double call = 1e30, one = 1e30, many = 1e30;
    for (int r = 0; r <= repeats; ++r) {
      if (!kernels::SetComputeThreads(1).ok()) return 1;
      auto start = std::chrono::steady_clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, s.tb, s.m, s.n, s.k, 1.0f,
                  a.data(), s.k, b.data(), ldb, 0.0f, c.data(), s.n);
      const double t_call = Seconds(start);
      start = std::chrono::steady_clock::now();
      kernels::Sgemm(CblasNoTrans, s.tb, s.m, s.n, s.k, 1.0f, a.data(), s.k,
                     b.data(), ldb, 0.0f, c.data(), s.n);
      const double t_one = Seconds(start);
      if (!kernels::SetComputeThreads(threads).ok()) return 1;
      // The new pool's threads start running in this untimed call.
      kernels::Sgemm(CblasNoTrans, s.tb, s.m, s.n, s.k, 1.0f, a.data(), s.k,
                     b.data(), ldb, 0.0f, c.data(), s.n);
      start = std::chrono::steady_clock::now();
      kernels::Sgemm(CblasNoTrans, s.tb, s.m, s.n, s.k, 1.0f, a.data(), s.k,
                     b.data(), ldb, 0.0f, c.data(), s.n);
      const double t_many = Seconds(start);
      if (r == 0) continue;  // warm-up
      call = std::min(call, t_call);
      one = std::min(one, t_one);
      many = std::min(many, t_many);
    }
    const double gf = 2.0 * s.m * s.n * s.k / 1e9;
    const kernels::SgemmPieces p = kernels::SgemmPiecesFor(s.m, s.n, s.k);
    const int64_t pieces = ((s.m + p.rows - 1) / p.rows) *
                           ((s.n + p.cols - 1) / p.cols);
    std::printf("%-16s %6d %6d %6d %7lld %10.1f %10.1f %10.1f %8.2f %8.2f\n",
                s.what, s.m, s.n, s.k,
                static_cast<long long>(pieces), gf / call,
                gf / one, gf / many, call / one, one / many);
  }
  return 0;
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) { return shardd::Main(argc, argv); }
