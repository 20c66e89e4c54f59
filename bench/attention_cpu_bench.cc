// CPU attention forward + backward (kernels/cpu/attention.h) against plain
// sgemm of the same FLOPs, in the same run: how close the blocked
// online-softmax kernel comes to the machine's GEMM rate.
//
//   bazel run -c opt //bench:attention_cpu_bench -- [--threads=N]
//
// Shapes: the bench Qwen3-MoE config's attention (8 query / 4 kv heads of
// 64) at 256 and 1024 tokens, causal. FLOPs: forward 4 B Hq T S D / 2
// (causal), backward 2.5x. The sgemm baseline multiplies square matrices
// whose 2 n^3 equals the attention's FLOPs, median of the same repeats.

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/gemm.h"

namespace shardd {
namespace {

std::vector<float> Random(size_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

template <typename F>
double MedianSeconds(int repeats, F f) {
  std::vector<double> t;
  for (int i = 0; i < repeats + 1; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    if (i > 0) t.push_back(s);  // The first is a warm-up.
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Main(int argc, char** argv) {
  int threads = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--threads=", 0) == 0) threads = std::atoi(a.c_str() + 10);
  }
  if (absl::Status set = kernels::SetComputeThreads(threads); !set.ok()) {
    std::fprintf(stderr, "%s\n", set.ToString().c_str());
    return 2;
  }
  std::printf(
      "CPU attention (causal, 8 q / 4 kv heads of 64) vs sgemm of "
      "the same FLOPs, %d threads, median of 5\n",
      threads);
  std::printf("%6s %10s %10s %12s %12s %8s\n", "seq", "fwd_ms", "bwd_ms",
              "attn_GF/s", "sgemm_GF/s", "ratio");
  std::mt19937 rng(3);
  for (int64_t seq : {256, 1024}) {
    kernels::AttentionDims d;
    d.batch = 1;
    d.q_len = seq;
    d.kv_len = seq;
    d.q_heads = 8;
    d.kv_heads = 4;
    d.head_dim = 64;
    kernels::AttentionOptions o;
    o.scale = 0.125f;
    const size_t nq = seq * 8 * 64, nk = seq * 4 * 64;
    const std::vector<float> q = Random(nq, &rng), k = Random(nk, &rng),
                             v = Random(nk, &rng), dout = Random(nq, &rng);
    std::vector<float> out(nq), lse(8 * seq), dq(nq), dk(nk), dv(nk);
    kernels::AttentionWorkspace ws;
    const double fwd = MedianSeconds(5, [&] {
      (void)kernels::AttentionForward(d, o, q.data(), k.data(), v.data(),
                                      out.data(), lse.data(), &ws);
    });
    const double bwd = MedianSeconds(5, [&] {
      (void)kernels::AttentionBackward(
          d, o, q.data(), k.data(), v.data(), out.data(), lse.data(),
          dout.data(), dq.data(), dk.data(), dv.data(), nullptr, &ws);
    });
    const double flops = 4.0 * 8 * seq * seq * 64 / 2 * 3.5;  // fwd + bwd
    const int64_t n = static_cast<int64_t>(std::cbrt(flops / 2.0));
    const std::vector<float> a = Random(n * n, &rng), b = Random(n * n, &rng);
    std::vector<float> c(n * n);
    const double gemm = MedianSeconds(5, [&] {
      kernels::Sgemm(CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n,
                     b.data(), n, 0.0f, c.data(), n);
    });
    const double attn_rate = flops / (fwd + bwd) / 1e9;
    const double gemm_rate = 2.0 * n * n * n / gemm / 1e9;
    std::printf("%6lld %10.2f %10.2f %12.2f %12.2f %7.2fx\n",
                static_cast<long long>(seq), fwd * 1e3, bwd * 1e3, attn_rate,
                gemm_rate, attn_rate / gemm_rate);
  }
  return 0;
}

}  // namespace
}  // namespace shardd

int main(int argc, char** argv) { return shardd::Main(argc, argv); }
