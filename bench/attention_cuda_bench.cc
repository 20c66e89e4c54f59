// Attention forward + backward on one GPU, bf16 storage, causal, on real
// attention shapes: the own kernels (kernels/cuda/attention.h) and cuDNN's
// fused attention (kernels/cuda/cudnn_attention.h; skipped, with the
// reason, when cuDNN does not load); bench/torch_sdpa.py prints the same
// table for torch.nn.functional.scaled_dot_product_attention.
//
//   bazel run --config=cuda -c opt //bench:attention_cuda_bench --
//       [--iters=10] [--warmup=3]
//
// FLOPs (causal, so half of the score matrix): forward 4 B Hq T S D / 2,
// backward 2.5x the forward (the recomputed scores, dV, dP, dQ, dK).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cudnn_attention.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

struct Shape {
  const char* name;
  int64_t batch, seq, q_heads, kv_heads, head_dim;
};

// Qwen3-30B-A3B (32 query heads on 4 kv heads of 128) and Llama-3-8B (32 on
// 8 of 128) at 4k tokens per sequence.
constexpr Shape kShapes[] = {
    {"Qwen3-30B-A3B", 1, 4096, 32, 4, 128},
    {"Llama-3-8B", 1, 4096, 32, 8, 128},
};

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "attention_cuda_bench: %s: %s\n", what,
                 cudaGetErrorString(e));
    std::exit(1);
  }
}

void CheckStatus(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "attention_cuda_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* d = nullptr;
  Check(cudaMalloc(reinterpret_cast<void**>(&d), host.size() * sizeof(T)),
        "cudaMalloc");
  Check(cudaMemcpy(d, host.data(), host.size() * sizeof(T),
                   cudaMemcpyHostToDevice),
        "upload");
  return d;
}

std::vector<uint16_t> RandomBf16(size_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) x = Fp32ToBf16(dist(*rng));
  return out;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  int iters = 10, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--iters=", 0) == 0) iters = std::atoi(a.c_str() + 8);
    if (a.rfind("--warmup=", 0) == 0) warmup = std::atoi(a.c_str() + 9);
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "attention_cuda_bench: no GPU; nothing to measure\n");
    return 1;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf(
      "device: %s, shardd attention, bf16 (tensor cores, fp32 accumulation), "
      "causal, "
      "median of %d after %d warmup\n",
      prop.name, iters, warmup);
  std::printf("%-16s %-6s %6s %8s %8s %9s %9s\n", "shape", "kernel", "seq",
              "fwd_ms", "bwd_ms", "fwd_TF/s", "bwd_TF/s");
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "stream");
  std::unique_ptr<CudnnAttention> cudnn;
  if (absl::StatusOr<std::unique_ptr<CudnnAttention>> c =
          CudnnAttention::Create(stream);
      c.ok()) {
    cudnn = *std::move(c);
    std::printf("cuDNN %lld\n", static_cast<long long>(*LoadCudnn()));
  } else {
    std::printf("cuDNN rows skipped: %s\n", c.status().ToString().c_str());
  }
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    AttentionDims d;
    d.batch = s.batch;
    d.q_len = s.seq;
    d.kv_len = s.seq;
    d.q_heads = s.q_heads;
    d.kv_heads = s.kv_heads;
    d.head_dim = s.head_dim;
    AttentionOptions o;
    o.scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    o.mask = AttentionMask::kCausal;
    const size_t nq = s.batch * s.seq * s.q_heads * s.head_dim;
    const size_t nk = s.batch * s.seq * s.kv_heads * s.head_dim;
    uint16_t* q = Upload(RandomBf16(nq, &rng));
    uint16_t* k = Upload(RandomBf16(nk, &rng));
    uint16_t* v = Upload(RandomBf16(nk, &rng));
    uint16_t* dout = Upload(RandomBf16(nq, &rng));
    uint16_t* out = Upload(std::vector<uint16_t>(nq));
    float* lse = Upload(std::vector<float>(s.batch * s.q_heads * s.seq));
    float* dq = Upload(std::vector<float>(nq));
    float* dk = Upload(std::vector<float>(nk));
    float* dv = Upload(std::vector<float>(nk));
    const size_t ws_bytes = AttentionBackwardWorkspaceBytes(d);
    void* ws = nullptr;
    Check(cudaMalloc(&ws, ws_bytes), "workspace");
    cudaEvent_t a, b, c;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventCreate(&c);
    const double flops =
        4.0 * s.batch * s.q_heads * s.seq * s.seq * s.head_dim / 2.0;
    // One kernel's forward and backward, timed; `fwd` / `bwd` enqueue them.
    auto time = [&](const char* kernel, auto&& fwd_call, auto&& bwd_call) {
      std::vector<float> fwd, bwd;
      for (int it = 0; it < warmup + iters; ++it) {
        Check(cudaEventRecord(a, stream), "record");
        CheckStatus(fwd_call());
        Check(cudaEventRecord(b, stream), "record");
        CheckStatus(bwd_call());
        Check(cudaEventRecord(c, stream), "record");
        Check(cudaEventSynchronize(c), "sync");
        if (it < warmup) continue;
        float f = 0, g = 0;
        cudaEventElapsedTime(&f, a, b);
        cudaEventElapsedTime(&g, b, c);
        fwd.push_back(f);
        bwd.push_back(g);
      }
      const double f = Median(fwd), g = Median(bwd);
      std::printf("%-16s %-6s %6lld %8.3f %8.3f %9.2f %9.2f\n", s.name,
                  kernel, static_cast<long long>(s.seq), f, g,
                  flops / f / 1e9, 2.5 * flops / g / 1e9);
    };
    time(
        "own",
        [&] { return AttentionForward(d, o, q, k, v, out, lse, stream); },
        [&] {
          return AttentionBackward(d, o, q, k, v, out, lse, dout, dq, dk, dv,
                                   nullptr, ws, ws_bytes, stream);
        });
    if (cudnn != nullptr) {
      const absl::StatusOr<size_t> fb = cudnn->ForwardWorkspaceBytes(d, o);
      const absl::StatusOr<size_t> bb = cudnn->BackwardWorkspaceBytes(d, o);
      if (!fb.ok() || !bb.ok()) {
        std::printf("%-16s cudnn  %s\n", s.name,
                    (fb.ok() ? bb.status() : fb.status()).ToString().c_str());
      } else {
        void* cws = nullptr;
        Check(cudaMalloc(&cws, std::max<size_t>(std::max(*fb, *bb), 1)),
              "cuDNN workspace");
        // bf16 gradients (cuDNN writes the inputs' type) into dq/dk/dv.
        auto* dq16 = reinterpret_cast<uint16_t*>(dq);
        auto* dk16 = reinterpret_cast<uint16_t*>(dk);
        auto* dv16 = reinterpret_cast<uint16_t*>(dv);
        time(
            "cudnn",
            [&] {
              return cudnn->Forward(d, o, q, k, v, out, lse, cws, *fb);
            },
            [&] {
              return cudnn->Backward(d, o, q, k, v, out, lse, dout, dq16,
                                     dk16, dv16, cws, *bb);
            });
        cudaFree(cws);
      }
    }
    for (void* p :
         {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
          static_cast<void*>(dout), static_cast<void*>(out),
          static_cast<void*>(lse), static_cast<void*>(dq),
          static_cast<void*>(dk), static_cast<void*>(dv), ws}) {
      cudaFree(p);
    }
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd

int main(int argc, char** argv) {
  return shardd::kernels::cuda::Main(argc, argv);
}
