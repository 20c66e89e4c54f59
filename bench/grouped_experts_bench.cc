// Grouped-expert forward + backward on the CPU (kernels/cpu/grouped_experts)
// against plain OpenBLAS sgemm on the same GEMMs. Target: at least 0.8 of the
// baseline's throughput.
//
//   bazel run -c opt //bench:grouped_experts_bench
//
// The baseline is what the kernel would cost if it were nothing but GEMMs:
// for every expert, the same six Sgemm calls (two forward, four
// backward) with the same per-expert row counts, shapes, transposes and
// leading dimensions, on buffers that are already contiguous. It skips what
// the kernel adds around them: the counting sort, the row gather and
// scatter, and the activation forward and backward.
//
// Arguments: shape (index into kShapes) and threads, the compute pool's size
// (kernels::SetComputeThreads) for both the kernel and the baseline, whose
// GEMMs go through kernels::Sgemm (1, and every core).
// FLOPs per step are 18 * N * D * I with N = T * K routed rows: forward
// 2N*D*2I + 2N*I*D, backward twice that.
//
// Counters: GFLOP/s of the benchmark's own loop; for BM_GroupedExperts also
// vs_sgemm = t(baseline) / t(grouped), each the minimum of kRatioReps
// interleaved runs, so both see the same machine state.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <random>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/router.h"

namespace shardd {
namespace kernels {
namespace {

struct Shape {
  int64_t tokens, dim, inter, experts, top_k;
};

// A mid-sized MoE block, and a fine-grained one (many small experts).
constexpr Shape kShapes[] = {
    {2048, 512, 256, 16, 2},
    {4096, 256, 128, 32, 4},
};

constexpr int kRatioReps = 7;

std::vector<float> RandomVector(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Inputs, parameters, gradients and the routing of one benchmark shape.
struct Setup {
  ExpertDims dims;
  std::vector<float> x, weights, w_gu, w_d, y, dy, dx, d_weights, dw_gu, dw_d;
  std::vector<int32_t> indices;
  GroupedExpertsWorkspace ws;

  explicit Setup(const Shape& s) {
    dims = {s.tokens, s.dim, s.inter, s.experts, s.top_k};
    const int64_t t = s.tokens, d = s.dim, i = s.inter, e = s.experts,
                  k = s.top_k;
    x = RandomVector(t * d, 1, 1.0f);
    w_gu = RandomVector(e * d * 2 * i, 2, 0.05f);
    w_d = RandomVector(e * i * d, 3, 0.05f);
    dy = RandomVector(t * d, 4, 1.0f);
    y.resize(t * d);
    dx.resize(t * d);
    d_weights.resize(t * k);
    dw_gu.assign(w_gu.size(), 0.0f);
    dw_d.assign(w_d.size(), 0.0f);
    // Real (uneven) routing from a random router.
    const std::vector<float> w_router = RandomVector(e * d, 5, 0.1f);
    indices.resize(t * k);
    weights.resize(t * k);
    RouterCache cache;
    if (!RouterForward({t, d, e, k}, x.data(), w_router.data(), indices.data(),
                       weights.data(), &cache)
             .ok()) {
      std::abort();
    }
  }

  void Step() {
    if (!GroupedExpertsForward(dims, GatedActivation::kSwiGLU, x.data(),
                               indices.data(), weights.data(), nullptr,
                               w_gu.data(), w_d.data(), y.data(), &ws)
             .ok() ||
        !GroupedExpertsBackward(
             dims, GatedActivation::kSwiGLU, w_gu.data(), w_d.data(), dy.data(),
             dx.data(), false, d_weights.data(), dw_gu.data(), dw_d.data(), &ws)
             .ok()) {
      std::abort();
    }
  }

  double Flops() const {
    return 18.0 * static_cast<double>(dims.tokens * dims.top_k) * dims.dim *
           dims.intermediate;
  }
};

// The same GEMMs as Setup::Step on contiguous buffers, nothing else.
struct Baseline {
  int64_t d, inter, experts;
  std::vector<int64_t> offsets;
  std::vector<float> xs, h, a, o, d_o, da, dh, dxs;
  const float* w_gu;
  const float* w_d;
  float* dw_gu;
  float* dw_d;

  explicit Baseline(Setup& s) {
    d = s.dims.dim;
    inter = s.dims.intermediate;
    experts = s.dims.experts;
    s.Step();  // fills the routing layout
    offsets.assign(s.ws.expert_offsets.begin(),
                   s.ws.expert_offsets.begin() + experts + 1);
    const int64_t n = offsets[experts];
    xs = RandomVector(n * d, 6, 1.0f);
    d_o = RandomVector(n * d, 7, 1.0f);
    h.resize(n * 2 * inter);
    a.resize(n * inter);
    o.resize(n * d);
    da.resize(n * inter);
    dh = RandomVector(n * 2 * inter, 8, 1.0f);
    dxs.resize(n * d);
    w_gu = s.w_gu.data();
    w_d = s.w_d.data();
    dw_gu = s.dw_gu.data();
    dw_d = s.dw_d.data();
  }

  void Step() {
    const int gu_n = static_cast<int>(2 * inter), di = static_cast<int>(d),
              ii = static_cast<int>(inter);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t b = offsets[e];
      const int rows = static_cast<int>(offsets[e + 1] - b);
      if (rows == 0) continue;
      const float* wg = w_gu + e * d * 2 * inter;
      const float* wd = w_d + e * inter * d;
      kernels::Sgemm(CblasNoTrans, CblasNoTrans, rows, gu_n, di, 1.0f,
                     xs.data() + b * d, di, wg, gu_n, 0.0f,
                     h.data() + b * 2 * inter, gu_n);
      kernels::Sgemm(CblasNoTrans, CblasNoTrans, rows, di, ii, 1.0f,
                     a.data() + b * inter, ii, wd, di, 0.0f, o.data() + b * d,
                     di);
      kernels::Sgemm(CblasNoTrans, CblasTrans, rows, ii, di, 1.0f,
                     d_o.data() + b * d, di, wd, di, 0.0f,
                     da.data() + b * inter, ii);
      kernels::Sgemm(CblasTrans, CblasNoTrans, ii, di, rows, 1.0f,
                     a.data() + b * inter, ii, d_o.data() + b * d, di, 1.0f,
                     dw_d + e * inter * d, di);
      kernels::Sgemm(CblasTrans, CblasNoTrans, di, gu_n, rows, 1.0f,
                     xs.data() + b * d, di, dh.data() + b * 2 * inter, gu_n,
                     1.0f, dw_gu + e * d * 2 * inter, gu_n);
      kernels::Sgemm(CblasNoTrans, CblasTrans, rows, di, gu_n, 1.0f,
                     dh.data() + b * 2 * inter, gu_n, wg, gu_n, 0.0f,
                     dxs.data() + b * d, di);
    }
  }
};

template <typename F>
double Seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

void SetLabels(benchmark::State& state, const Setup& s) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      s.Flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows"] = static_cast<double>(s.dims.tokens * s.dims.top_k);
}

void BM_GroupedExperts(benchmark::State& state) {
  if (!kernels::SetComputeThreads(static_cast<int>(state.range(1))).ok()) {
    state.SkipWithError("SetComputeThreads");
    return;
  }
  Setup s(kShapes[state.range(0)]);
  Baseline base(s);
  s.Step();  // warm the workspace
  for (auto _ : state) {
    s.Step();
    benchmark::ClobberMemory();
  }
  SetLabels(state, s);
  double t_grouped = 1e30, t_base = 1e30;
  for (int r = 0; r < kRatioReps; ++r) {
    t_base = std::min(t_base, Seconds([&] { base.Step(); }));
    t_grouped = std::min(t_grouped, Seconds([&] { s.Step(); }));
  }
  state.counters["vs_sgemm"] = t_base / t_grouped;
  state.counters["sgemm_GFLOP/s"] = s.Flops() * 1e-9 / t_base;
}

void BM_PlainSgemm(benchmark::State& state) {
  if (!kernels::SetComputeThreads(static_cast<int>(state.range(1))).ok()) {
    state.SkipWithError("SetComputeThreads");
    return;
  }
  Setup s(kShapes[state.range(0)]);
  Baseline base(s);
  base.Step();
  for (auto _ : state) {
    base.Step();
    benchmark::ClobberMemory();
  }
  SetLabels(state, s);
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "threads"});
  const int cores =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  for (int shape = 0; shape < static_cast<int>(std::size(kShapes)); ++shape) {
    b->Args({shape, 1});
    if (cores > 1) b->Args({shape, cores});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_GroupedExperts)->Apply(Args);
BENCHMARK(BM_PlainSgemm)->Apply(Args);

}  // namespace
}  // namespace kernels
}  // namespace shardd
