// Grouped-expert forward + backward on one GPU (kernels/cuda/grouped_experts)
// in bf16 storage: cuBLAS grouped GEMM, the loop of cublasGemmEx, and
// shardd's default (kAuto: the first below kAutoLoopRows rows per expert, the
// second above), in the same run, on real MoE expert shapes.
//
//   bazel run --config=cuda -c opt //bench:grouped_experts_cuda_bench --
//       [--iters=20] [--warmup=5] [--tokens=4096,16384,65536]
//
// Shapes: Qwen3-30B-A3B experts (E=128, D=2048, I=768, top-8) and
// DiffusionGemma (E=128, D=2816, I=704, top-8), uniform random top-k routing
// (K distinct experts per token), no padding. Each iteration is one forward
// then one backward producing dx, d_weights, dw_gu and dw_d (fp32
// accumulation buffers); timed with cudaEvents around each, median of
// --iters after --warmup. The forward time includes its one host wait for
// the routing counts (the GPU idles while the host launches the GEMMs).
// With bf16 storage the two weight-gradient GEMMs run as the per-expert
// loop on both paths (cuBLAS' grouped GEMM has no bf16 -> fp32 output), so
// the paths differ in the four data GEMMs.
//
// FLOPs: forward 2*T*K*D*2I + 2*T*K*I*D, backward twice the forward.
// bench/torch_grouped_mm.py prints the same table for torch._grouped_mm.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cuda/grouped_experts.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

struct Model {
  const char* name;
  int64_t experts, dim, intermediate, top_k;
};

constexpr Model kModels[] = {
    {"Qwen3-30B-A3B", 128, 2048, 768, 8},
    {"DiffusionGemma", 128, 2816, 704, 8},
};

struct Flags {
  int iters = 20;
  int warmup = 5;
  std::vector<int64_t> tokens = {4096, 16384, 65536};
};

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "grouped_experts_cuda_bench: %s\n", message.c_str());
  std::exit(1);
}

void Check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    Die(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.ToString());
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* prefix) -> const char* {
      const size_t n = std::strlen(prefix);
      return arg.compare(0, n, prefix) == 0 ? arg.c_str() + n : nullptr;
    };
    if (const char* v = value("--iters=")) {
      flags.iters = std::atoi(v);
    } else if (const char* v = value("--warmup=")) {
      flags.warmup = std::atoi(v);
    } else if (const char* v = value("--tokens=")) {
      flags.tokens.clear();
      std::string list = v;
      size_t start = 0;
      while (start <= list.size()) {
        const size_t comma = std::min(list.find(',', start), list.size());
        flags.tokens.push_back(std::atoll(list.substr(start, comma).c_str()));
        start = comma + 1;
      }
    } else {
      Die("unknown argument " + arg +
          " (allowed: --iters=N --warmup=N --tokens=T1,T2,...)");
    }
  }
  if (flags.iters < 1 || flags.warmup < 0) Die("--iters must be >= 1");
  for (int64_t t : flags.tokens) {
    if (t < 1) Die("--tokens entries must be >= 1");
  }
  return flags;
}

// Device buffer freed at scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    Check(cudaMalloc(&ptr, std::max<size_t>(bytes, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

// Fills `count` bf16 values by tiling a random pool (generating hundreds of
// millions of values on the host would dominate the run).
void FillBf16(void* dst, size_t count, float scale,
              const std::vector<float>& pool) {
  std::vector<uint16_t> bits(pool.size());
  for (size_t i = 0; i < pool.size(); ++i) {
    bits[i] = Fp32ToBf16(pool[i] * scale);
  }
  char* out = static_cast<char*>(dst);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(bits.size(), count - done);
    Check(
        cudaMemcpy(out + done * 2, bits.data(), n * 2, cudaMemcpyHostToDevice),
        "fill");
    done += n;
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Timing {
  double fwd_ms, bwd_ms, total_ms;
};

void PrintHeader() {
  std::printf("%-16s %7s %-18s %9s %9s %9s %9s %9s %9s\n", "model", "tokens",
              "path", "fwd_ms", "bwd_ms", "total_ms", "fwd_TF/s", "bwd_TF/s",
              "total_TF/s");
}

void PrintRow(const Model& m, int64_t tokens, const char* path,
              const Timing& t) {
  const double fwd_flops = 6.0 * tokens * m.top_k * m.dim * m.intermediate;
  std::printf("%-16s %7lld %-18s %9.3f %9.3f %9.3f %9.1f %9.1f %9.1f\n", m.name,
              static_cast<long long>(tokens), path, t.fwd_ms, t.bwd_ms,
              t.total_ms, fwd_flops / (t.fwd_ms * 1e9),
              2 * fwd_flops / (t.bwd_ms * 1e9),
              3 * fwd_flops / (t.total_ms * 1e9));
  std::fflush(stdout);
}

void RunModel(const Model& m, int64_t tokens, const Flags& flags,
              const std::vector<float>& pool, cublasHandle_t cublas,
              cudaStream_t stream) {
  const ExpertDims dims{tokens, m.dim, m.intermediate, m.experts, m.top_k};
  const int64_t d = m.dim, inter = m.intermediate, e = m.experts, k = m.top_k;
  const size_t gu = static_cast<size_t>(e * d * 2 * inter);
  const size_t dn = static_cast<size_t>(e * inter * d);
  const size_t act = static_cast<size_t>(tokens * d);

  DeviceBuffer x(act * 2), y(act * 2), dy(act * 2), dx(act * 2);
  DeviceBuffer w_gu(gu * 2), w_d(dn * 2);
  DeviceBuffer dw_gu(gu * 4), dw_d(dn * 4);
  DeviceBuffer indices(tokens * k * 4), weights(tokens * k * 4),
      d_weights(tokens * k * 4);
  FillBf16(x.ptr, act, 1.0f, pool);
  FillBf16(dy.ptr, act, 1.0f, pool);
  FillBf16(w_gu.ptr, gu, 1.0f / 32, pool);
  FillBf16(w_d.ptr, dn, 1.0f / 32, pool);
  Check(cudaMemset(dw_gu.ptr, 0, gu * 4), "memset");
  Check(cudaMemset(dw_d.ptr, 0, dn * 4), "memset");

  // Uniform random routing: K distinct experts per token.
  std::mt19937 rng(1234);
  std::vector<int32_t> host_indices(tokens * k);
  std::vector<float> host_weights(tokens * k);
  std::vector<int32_t> perm(e);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      std::swap(perm[j], perm[j + rng() % (e - j)]);
      host_indices[t * k + j] = perm[j];
      host_weights[t * k + j] = uniform(rng) / k;
    }
  }
  Check(cudaMemcpy(indices.ptr, host_indices.data(), tokens * k * 4,
                   cudaMemcpyHostToDevice),
        "indices");
  Check(cudaMemcpy(weights.ptr, host_weights.data(), tokens * k * 4,
                   cudaMemcpyHostToDevice),
        "weights");

  const auto ws_bytes =
      GroupedExpertsWorkspaceBytes(dims, ExpertStorage::kBFloat16);
  Check(ws_bytes.status(), "GroupedExpertsWorkspaceBytes");
  DeviceBuffer workspace(*ws_bytes);
  auto ws = GroupedExpertsWorkspace::Create(workspace.ptr, *ws_bytes, e);
  Check(ws.status(), "GroupedExpertsWorkspace::Create");

  cudaEvent_t start, mid, end;
  Check(cudaEventCreate(&start), "event");
  Check(cudaEventCreate(&mid), "event");
  Check(cudaEventCreate(&end), "event");
  for (ExpertGemmPath path :
       {ExpertGemmPath::kGrouped, ExpertGemmPath::kPerExpertLoop,
        ExpertGemmPath::kAuto}) {
    GroupedExpertsOptions options;
    options.storage = ExpertStorage::kBFloat16;
    options.gemm_path = path;
    std::vector<double> fwd, bwd, total;
    for (int it = 0; it < flags.warmup + flags.iters; ++it) {
      Check(cudaEventRecord(start, stream), "record");
      Check(GroupedExpertsForward(dims, options, x.ptr, indices.as<int32_t>(),
                                  weights.as<float>(), nullptr, w_gu.ptr,
                                  w_d.ptr, y.ptr, ws->get(), cublas, stream),
            "forward");
      Check(cudaEventRecord(mid, stream), "record");
      Check(GroupedExpertsBackward(dims, options, w_gu.ptr, w_d.ptr, dy.ptr,
                                   dx.ptr, false, d_weights.as<float>(),
                                   dw_gu.as<float>(), dw_d.as<float>(),
                                   ws->get(), cublas, stream),
            "backward");
      Check(cudaEventRecord(end, stream), "record");
      Check(cudaEventSynchronize(end), "sync");
      if (it < flags.warmup) continue;
      float f = 0, b = 0;
      Check(cudaEventElapsedTime(&f, start, mid), "elapsed");
      Check(cudaEventElapsedTime(&b, mid, end), "elapsed");
      fwd.push_back(f);
      bwd.push_back(b);
      total.push_back(f + b);
    }
    PrintRow(m, tokens,
             path == ExpertGemmPath::kGrouped         ? "cublas_grouped"
             : path == ExpertGemmPath::kPerExpertLoop ? "cublas_loop"
                                                      : "shardd_auto",
             {Median(fwd), Median(bwd), Median(total)});
  }
  cudaEventDestroy(start);
  cudaEventDestroy(mid);
  cudaEventDestroy(end);
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::fprintf(stderr,
                 "grouped_experts_cuda_bench: no GPU (%s); nothing to "
                 "measure. Run it on a machine with a CUDA device.\n",
                 err != cudaSuccess ? cudaGetErrorString(err)
                                    : "cudaGetDeviceCount returned 0");
    return 1;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf(
      "device: %s (sm_%d%d), bf16 storage, fp32 accumulation, "
      "median of %d after %d warmup\n",
      prop.name, prop.major, prop.minor, flags.iters, flags.warmup);
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) Die("cublasCreate");
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> pool((1 << 22) + 7);  // odd length: tiles do not align
  for (float& v : pool) v = dist(rng);

  PrintHeader();
  for (const Model& m : kModels) {
    for (int64_t tokens : flags.tokens) {
      RunModel(m, tokens, flags, pool, cublas, stream);
    }
  }
  cublasDestroy(cublas);
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
