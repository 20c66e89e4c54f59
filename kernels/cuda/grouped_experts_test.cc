// The CUDA grouped experts against the CPU kernel (kernels/cpu), which is
// itself checked against a double-precision reference and finite
// differences. Every test skips without a GPU.
//
// Tolerances:
//  * fp32 storage: |gpu - cpu| <= 1e-4 * (|cpu| + rms(cpu)) per element. Both
//    sides store fp32 and accumulate in fp32 (cuBLAS in PEDANTIC fp32, so no
//    TF32); they differ only in summation order (GEMM blocking, <= 64-term
//    dot products here: ~sqrt(64) * 6e-8 relative) and in exp (expf vs the
//    CPU's 1.4-ulp polynomial). 1e-4 leaves ~100x margin; a routing or
//    indexing bug is O(1). The rms term covers entries that cancel to ~0.
//  * bf16 storage: the GPU rounds its stored intermediates (H, A, O, dA, dH,
//    dXs) and outputs to bf16 (unit roundoff 2^-9 ~ 2e-3); both sides read
//    the same bf16-rounded x, weights and dy. A chain of up to ~4 roundings
//    gives elementwise errors up to ~1e-2 of the value, and fp32-accumulated
//    sums average them, so: relative L2 error <= 1e-2 and elementwise
//    |gpu - cpu| <= 4e-2 * (|cpu| + rms(cpu)).

#include "kernels/cuda/grouped_experts.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/grouped_experts.h"
#include "testing/gpu.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

namespace cpu = ::shardd::kernels;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Device helpers.

class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  void Allocate(size_t bytes) {
    ASSERT_EQ(ptr_, nullptr);
    ASSERT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), cudaSuccess);
    bytes_ = bytes;
  }
  void Upload(const void* host, size_t bytes) {
    ASSERT_NO_FATAL_FAILURE(Allocate(bytes));
    if (bytes > 0) {
      ASSERT_EQ(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  template <typename T>
  void Download(std::vector<T>* host, size_t count) const {
    host->resize(count);
    if (count > 0) {
      ASSERT_EQ(cudaMemcpy(host->data(), ptr_, count * sizeof(T),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Values in the storage type on the device.
void UploadStorage(const std::vector<float>& values, ExpertStorage storage,
                   DeviceMemory* dev) {
  if (storage == ExpertStorage::kFloat32) {
    dev->Upload(values.data(), values.size() * sizeof(float));
    return;
  }
  std::vector<uint16_t> bits(values.size());
  Fp32ToBf16Array(values.data(), bits.data(),
                  static_cast<int64_t>(values.size()));
  dev->Upload(bits.data(), bits.size() * sizeof(uint16_t));
}

void DownloadStorage(const DeviceMemory& dev, size_t count,
                     ExpertStorage storage, std::vector<float>* out) {
  if (storage == ExpertStorage::kFloat32) {
    dev.Download(out, count);
    return;
  }
  std::vector<uint16_t> bits;
  ASSERT_NO_FATAL_FAILURE(dev.Download(&bits, count));
  out->resize(count);
  Bf16ToFp32Array(bits.data(), out->data(), static_cast<int64_t>(count));
}

// ---------------------------------------------------------------------------
// Problems.

std::vector<float> RandomVector(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// K distinct experts per token, never `skipped_expert` (-1: none).
std::vector<int32_t> RandomIndices(int64_t t, int64_t e, int64_t k,
                                   int32_t skipped_expert, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> pool;
  for (int32_t j = 0; j < e; ++j) {
    if (j != skipped_expert) pool.push_back(j);
  }
  std::vector<int32_t> out;
  for (int64_t i = 0; i < t; ++i) {
    std::shuffle(pool.begin(), pool.end(), rng);
    out.insert(out.end(), pool.begin(), pool.begin() + k);
  }
  return out;
}

struct HostProblem {
  ExpertDims dims;
  std::vector<float> x, weights, w_gu, w_d, dy, dx_init, dw_gu_init, dw_d_init;
  std::vector<int32_t> indices;
  std::vector<char> mask;  // empty = no mask

  const bool* mask_ptr() const {
    return mask.empty() ? nullptr : reinterpret_cast<const bool*>(mask.data());
  }
  cpu::ExpertDims cpu_dims() const {
    return {dims.tokens, dims.dim, dims.intermediate, dims.experts, dims.top_k};
  }
};

// Expert `empty_expert` gets no rows; every `mask_every`-th token (if > 0) is
// padding whose index is garbage (never read).
HostProblem MakeProblem(ExpertDims dims, int32_t empty_expert, int mask_every,
                        uint32_t seed) {
  HostProblem p;
  p.dims = dims;
  const int64_t t = dims.tokens, d = dims.dim, i = dims.intermediate,
                e = dims.experts, k = dims.top_k;
  // Scales keep H, A and y of order one.
  p.x = RandomVector(t * d, seed + 1, 1.0f);
  p.weights = RandomVector(t * k, seed + 2, 0.5f);
  for (float& w : p.weights) w += 0.5f;  // in [0, 1]
  p.w_gu = RandomVector(e * d * 2 * i, seed + 3, 3.0f / std::sqrt(float(d)));
  p.w_d = RandomVector(e * i * d, seed + 4, 3.0f / std::sqrt(float(i)));
  p.dy = RandomVector(t * d, seed + 5, 1.0f);
  p.dx_init = RandomVector(t * d, seed + 6, 1.0f);
  p.dw_gu_init = RandomVector(p.w_gu.size(), seed + 7, 1.0f);
  p.dw_d_init = RandomVector(p.w_d.size(), seed + 8, 1.0f);
  p.indices = RandomIndices(t, e, k, empty_expert, seed + 9);
  if (mask_every > 0) {
    p.mask.assign(t, 1);
    for (int64_t tok = 0; tok < t; tok += mask_every) {
      p.mask[tok] = 0;
      p.indices[tok * k] = 1234;  // garbage: masked indices are ignored
    }
  }
  return p;
}

// What the device reads in bf16: inputs rounded so both sides see the same
// values.
void RoundInputsToBf16(HostProblem* p) {
  for (std::vector<float>* v :
       {&p->x, &p->w_gu, &p->w_d, &p->dy, &p->dx_init}) {
    RoundToBf16InPlace(v->data(), static_cast<int64_t>(v->size()));
  }
}

struct Results {
  std::vector<float> y, dx, d_weights, dw_gu, dw_d;
  std::vector<int32_t> row_of_slot;  // [T*K], -1 masked
  std::vector<int32_t> expert_rows;  // [E]
  int64_t rows = 0;
  int64_t syncs_after_forward = 0, syncs_after_backward = 0;
};

void RunCpu(const HostProblem& p, cpu::GatedActivation act, bool accumulate_dx,
            Results* r) {
  const cpu::ExpertDims dims = p.cpu_dims();
  cpu::GroupedExpertsWorkspace ws;
  r->y.assign(p.dims.tokens * p.dims.dim, 0.0f);
  r->dx = p.dx_init;
  r->d_weights.assign(p.dims.tokens * p.dims.top_k, 0.0f);
  r->dw_gu = p.dw_gu_init;
  r->dw_d = p.dw_d_init;
  SHARDD_ASSERT_OK(cpu::GroupedExpertsForward(
      dims, act, p.x.data(), p.indices.data(), p.weights.data(), p.mask_ptr(),
      p.w_gu.data(), p.w_d.data(), r->y.data(), &ws));
  SHARDD_ASSERT_OK(cpu::GroupedExpertsBackward(
      dims, act, p.w_gu.data(), p.w_d.data(), p.dy.data(), r->dx.data(),
      accumulate_dx, r->d_weights.data(), r->dw_gu.data(), r->dw_d.data(),
      &ws));
  r->row_of_slot.assign(ws.row_of_slot.begin(),
                        ws.row_of_slot.begin() + p.dims.tokens * p.dims.top_k);
  r->expert_rows.resize(p.dims.experts);
  for (int64_t e = 0; e < p.dims.experts; ++e) {
    r->expert_rows[e] =
        static_cast<int32_t>(ws.expert_offsets[e + 1] - ws.expert_offsets[e]);
  }
  r->rows = ws.rows;
}

cpu::GatedActivation ToCpu(GatedActivation act) {
  return act == GatedActivation::kSwiGLU ? cpu::GatedActivation::kSwiGLU
                                         : cpu::GatedActivation::kGeGLU;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SHARDD_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cublasCreate(&cublas_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
  }
  void TearDown() override {
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device copies of one problem's inputs and outputs.
  struct DeviceProblem {
    DeviceMemory x, indices, weights, mask, w_gu, w_d, y, dy, dx, d_weights,
        dw_gu, dw_d, workspace;
    std::unique_ptr<GroupedExpertsWorkspace> ws;
  };

  void Upload(const HostProblem& p, ExpertStorage storage, DeviceProblem* dp) {
    const int64_t t = p.dims.tokens, d = p.dims.dim, k = p.dims.top_k;
    const size_t elem = storage == ExpertStorage::kFloat32 ? 4 : 2;
    ASSERT_NO_FATAL_FAILURE(UploadStorage(p.x, storage, &dp->x));
    ASSERT_NO_FATAL_FAILURE(
        dp->indices.Upload(p.indices.data(), p.indices.size() * 4));
    ASSERT_NO_FATAL_FAILURE(
        dp->weights.Upload(p.weights.data(), p.weights.size() * 4));
    if (!p.mask.empty()) {
      ASSERT_NO_FATAL_FAILURE(dp->mask.Upload(p.mask.data(), p.mask.size()));
    }
    ASSERT_NO_FATAL_FAILURE(UploadStorage(p.w_gu, storage, &dp->w_gu));
    ASSERT_NO_FATAL_FAILURE(UploadStorage(p.w_d, storage, &dp->w_d));
    ASSERT_NO_FATAL_FAILURE(dp->y.Allocate(t * d * elem));
    ASSERT_NO_FATAL_FAILURE(UploadStorage(p.dy, storage, &dp->dy));
    ASSERT_NO_FATAL_FAILURE(UploadStorage(p.dx_init, storage, &dp->dx));
    ASSERT_NO_FATAL_FAILURE(dp->d_weights.Allocate(t * k * 4));
    ASSERT_NO_FATAL_FAILURE(
        dp->dw_gu.Upload(p.dw_gu_init.data(), p.dw_gu_init.size() * 4));
    ASSERT_NO_FATAL_FAILURE(
        dp->dw_d.Upload(p.dw_d_init.data(), p.dw_d_init.size() * 4));
    SHARDD_ASSERT_OK_AND_ASSIGN(const size_t ws_bytes,
                                GroupedExpertsWorkspaceBytes(p.dims, storage));
    ASSERT_NO_FATAL_FAILURE(dp->workspace.Allocate(ws_bytes));
    SHARDD_ASSERT_OK_AND_ASSIGN(
        dp->ws, GroupedExpertsWorkspace::Create(dp->workspace.get(), ws_bytes,
                                                p.dims.experts));
  }

  absl::Status Forward(const HostProblem& p,
                       const GroupedExpertsOptions& options,
                       DeviceProblem* dp) {
    return GroupedExpertsForward(
        p.dims, options, dp->x.get(), dp->indices.as<int32_t>(),
        dp->weights.as<float>(), p.mask.empty() ? nullptr : dp->mask.as<bool>(),
        dp->w_gu.get(), dp->w_d.get(), dp->y.get(), dp->ws.get(), cublas_,
        stream_);
  }

  absl::Status Backward(const HostProblem& p,
                        const GroupedExpertsOptions& options, bool accumulate,
                        DeviceProblem* dp) {
    return GroupedExpertsBackward(p.dims, options, dp->w_gu.get(),
                                  dp->w_d.get(), dp->dy.get(), dp->dx.get(),
                                  accumulate, dp->d_weights.as<float>(),
                                  dp->dw_gu.as<float>(), dp->dw_d.as<float>(),
                                  dp->ws.get(), cublas_, stream_);
  }

  void RunGpu(const HostProblem& p, const GroupedExpertsOptions& options,
              bool accumulate_dx, Results* r) {
    DeviceProblem dp;
    ASSERT_NO_FATAL_FAILURE(Upload(p, options.storage, &dp));
    const int64_t t = p.dims.tokens, d = p.dims.dim, k = p.dims.top_k;
    SHARDD_ASSERT_OK(Forward(p, options, &dp));
    r->syncs_after_forward = dp.ws->host_syncs();
    SHARDD_ASSERT_OK(Backward(p, options, accumulate_dx, &dp));
    r->syncs_after_backward = dp.ws->host_syncs();
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(
        DownloadStorage(dp.y, t * d, options.storage, &r->y));
    ASSERT_NO_FATAL_FAILURE(
        DownloadStorage(dp.dx, t * d, options.storage, &r->dx));
    ASSERT_NO_FATAL_FAILURE(dp.d_weights.Download(&r->d_weights, t * k));
    ASSERT_NO_FATAL_FAILURE(dp.dw_gu.Download(&r->dw_gu, p.w_gu.size()));
    ASSERT_NO_FATAL_FAILURE(dp.dw_d.Download(&r->dw_d, p.w_d.size()));
    r->row_of_slot.resize(t * k);
    ASSERT_EQ(cudaMemcpy(r->row_of_slot.data(), dp.ws->device_row_of_slot(),
                         t * k * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    const absl::Span<const int32_t> rows = dp.ws->expert_rows();
    r->expert_rows.assign(rows.begin(), rows.end());
    r->rows = dp.ws->rows();
  }

  cublasHandle_t cublas_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// ---------------------------------------------------------------------------
// Comparisons.

double Rms(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += double(x) * x;
  return v.empty() ? 0.0 : std::sqrt(s / v.size());
}

// Elementwise |got - want| <= tol * (|want| + rms(want)).
void ExpectElementwiseClose(const std::vector<float>& got,
                            const std::vector<float>& want, double tol,
                            const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double rms = std::max(Rms(want), 1e-30);
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tol * (std::abs(double(want[i])) + rms);
    if (!(std::abs(double(got[i]) - want[i]) <= bound) && reported++ < 10) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want "
                    << want[i] << " (bound " << bound << ")";
    }
  }
  EXPECT_EQ(reported, 0) << what << ": elements out of tolerance";
}

void ExpectL2Close(const std::vector<float>& got,
                   const std::vector<float>& want, double tol,
                   const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  EXPECT_LE(std::sqrt(err), tol * std::sqrt(norm)) << what << " relative L2";
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 ExpertStorage storage, const std::string& what) {
  if (storage == ExpertStorage::kFloat32) {
    ExpectElementwiseClose(got, want, 1e-4, what);
  } else {
    ExpectL2Close(got, want, 1e-2, what);
    ExpectElementwiseClose(got, want, 4e-2, what);
  }
}

// got - init: the part a backward added, so large initial values cannot
// hide errors.
std::vector<float> Increment(const std::vector<float>& got,
                             const std::vector<float>& init) {
  std::vector<float> out(got.size());
  for (size_t i = 0; i < got.size(); ++i) out[i] = got[i] - init[i];
  return out;
}

void ExpectMatchesCpu(const HostProblem& p, const Results& gpu,
                      const Results& ref, ExpertStorage storage) {
  EXPECT_THAT(gpu.row_of_slot, ElementsAreArray(ref.row_of_slot))
      << "stable routing order";
  EXPECT_THAT(gpu.expert_rows, ElementsAreArray(ref.expert_rows));
  EXPECT_EQ(gpu.rows, ref.rows);
  ExpectClose(gpu.y, ref.y, storage, "y");
  ExpectClose(Increment(gpu.dx, p.dx_init), Increment(ref.dx, p.dx_init),
              storage, "dx");
  ExpectClose(gpu.d_weights, ref.d_weights, storage, "d_weights");
  ExpectClose(Increment(gpu.dw_gu, p.dw_gu_init),
              Increment(ref.dw_gu, p.dw_gu_init), storage, "dw_gu");
  ExpectClose(Increment(gpu.dw_d, p.dw_d_init),
              Increment(ref.dw_d, p.dw_d_init), storage, "dw_d");
}

// ---------------------------------------------------------------------------
// Forward and backward against the CPU kernel, every activation, storage and
// GEMM path.

struct Config {
  GatedActivation activation;
  ExpertStorage storage;
  ExpertGemmPath path;
};

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) {
  const Config& c = info.param;
  return std::string(c.activation == GatedActivation::kSwiGLU ? "SwiGLU"
                                                              : "GeGLU") +
         (c.storage == ExpertStorage::kFloat32 ? "Fp32" : "Bf16") +
         (c.path == ExpertGemmPath::kGrouped ? "Grouped" : "Loop");
}

class GroupedExpertsCudaTest : public GpuTest,
                               public ::testing::WithParamInterface<Config> {
 protected:
  GroupedExpertsOptions Options() const {
    GroupedExpertsOptions o;
    o.activation = GetParam().activation;
    o.storage = GetParam().storage;
    o.gemm_path = GetParam().path;
    return o;
  }
};

TEST_P(GroupedExpertsCudaTest, MatchesCpuWithEmptyExpertAndMaskedTokens) {
  // Expert 2 gets no rows; every 5th token is padding.
  HostProblem p = MakeProblem({45, 64, 32, 6, 2}, /*empty_expert=*/2,
                              /*mask_every=*/5, 1000);
  if (GetParam().storage == ExpertStorage::kBFloat16) RoundInputsToBf16(&p);
  Results ref, gpu;
  ASSERT_NO_FATAL_FAILURE(
      RunCpu(p, ToCpu(GetParam().activation), /*accumulate_dx=*/false, &ref));
  ASSERT_NO_FATAL_FAILURE(RunGpu(p, Options(), /*accumulate_dx=*/false, &gpu));
  ExpectMatchesCpu(p, gpu, ref, GetParam().storage);

  EXPECT_EQ(gpu.expert_rows[2], 0);
  EXPECT_EQ(gpu.rows, 36 * 2);  // 9 of 45 tokens masked
  // The one host synchronization is the forward's; the backward adds none.
  EXPECT_EQ(gpu.syncs_after_forward, 1);
  EXPECT_EQ(gpu.syncs_after_backward, 1);
  // Masked tokens: zero outputs; the empty expert's gradients untouched.
  const int64_t d = p.dims.dim, k = p.dims.top_k;
  for (int64_t t = 0; t < p.dims.tokens; t += 5) {
    for (int64_t c = 0; c < d; ++c) {
      EXPECT_EQ(gpu.y[t * d + c], 0.0f) << t;
      EXPECT_EQ(gpu.dx[t * d + c], 0.0f) << t;
    }
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(gpu.d_weights[t * k + j], 0.0f);
  }
  const int64_t gu = d * 2 * p.dims.intermediate, dn = p.dims.intermediate * d;
  for (int64_t i = 0; i < gu; ++i) {
    ASSERT_EQ(gpu.dw_gu[2 * gu + i], p.dw_gu_init[2 * gu + i]) << i;
  }
  for (int64_t i = 0; i < dn; ++i) {
    ASSERT_EQ(gpu.dw_d[2 * dn + i], p.dw_d_init[2 * dn + i]) << i;
  }
}

TEST_P(GroupedExpertsCudaTest, OddShapesTakeTheUnvectorizedKernels) {
  // D, I not multiples of the 16-byte vector width; K = 3.
  HostProblem p = MakeProblem({29, 13, 7, 5, 3}, /*empty_expert=*/-1,
                              /*mask_every=*/0, 2000);
  if (GetParam().storage == ExpertStorage::kBFloat16) RoundInputsToBf16(&p);
  Results ref, gpu;
  ASSERT_NO_FATAL_FAILURE(RunCpu(p, ToCpu(GetParam().activation), false, &ref));
  ASSERT_NO_FATAL_FAILURE(RunGpu(p, Options(), false, &gpu));
  ExpectMatchesCpu(p, gpu, ref, GetParam().storage);
}

TEST_P(GroupedExpertsCudaTest, AccumulatesIntoDx) {
  HostProblem p = MakeProblem({20, 32, 16, 4, 2}, -1, 7, 3000);
  if (GetParam().storage == ExpertStorage::kBFloat16) RoundInputsToBf16(&p);
  Results ref, gpu;
  ASSERT_NO_FATAL_FAILURE(RunCpu(p, ToCpu(GetParam().activation), true, &ref));
  ASSERT_NO_FATAL_FAILURE(RunGpu(p, Options(), true, &gpu));
  ExpectMatchesCpu(p, gpu, ref, GetParam().storage);
  // Masked tokens keep what dx held.
  for (int64_t c = 0; c < p.dims.dim; ++c) EXPECT_EQ(gpu.dx[c], p.dx_init[c]);
}

INSTANTIATE_TEST_SUITE_P(
    AllConfigs, GroupedExpertsCudaTest,
    ::testing::Values(Config{GatedActivation::kSwiGLU, ExpertStorage::kFloat32,
                             ExpertGemmPath::kGrouped},
                      Config{GatedActivation::kSwiGLU, ExpertStorage::kFloat32,
                             ExpertGemmPath::kPerExpertLoop},
                      Config{GatedActivation::kSwiGLU, ExpertStorage::kBFloat16,
                             ExpertGemmPath::kGrouped},
                      Config{GatedActivation::kSwiGLU, ExpertStorage::kBFloat16,
                             ExpertGemmPath::kPerExpertLoop},
                      Config{GatedActivation::kGeGLU, ExpertStorage::kFloat32,
                             ExpertGemmPath::kGrouped},
                      Config{GatedActivation::kGeGLU, ExpertStorage::kFloat32,
                             ExpertGemmPath::kPerExpertLoop},
                      Config{GatedActivation::kGeGLU, ExpertStorage::kBFloat16,
                             ExpertGemmPath::kGrouped},
                      Config{GatedActivation::kGeGLU, ExpertStorage::kBFloat16,
                             ExpertGemmPath::kPerExpertLoop}),
    ConfigName);

// ---------------------------------------------------------------------------
// GPT-OSS: the clamped SwiGLU with gate/up and down biases and their
// gradients, against the CPU kernel, each storage and GEMM path. The clamp
// is a discrete choice: the limit is picked so that no gate or up
// pre-activation (CPU, fp32) lies within 0.1 of +-limit, far beyond what
// bf16 storage moves H (a few 2^-9 relative of |H| <= ~5); tolerances as
// ExpectClose (the same chain of roundings, plus one for each bias add).

class GroupedExpertsGptOssTest
    : public GpuTest,
      public ::testing::WithParamInterface<std::pair<ExpertStorage,
                                                     ExpertGemmPath>> {};

TEST_P(GroupedExpertsGptOssTest, MatchesCpuWithBiasesAndClamps) {
  const ExpertStorage storage = GetParam().first;
  HostProblem p = MakeProblem({45, 64, 32, 6, 2}, /*empty_expert=*/2,
                              /*mask_every=*/5, 4000);
  // Smaller gate/up weights (|H| below about 1.5 before the shifts below)
  // leave room for a limit that no pre-activation comes near.
  for (float& w : p.w_gu) w *= 0.25f;
  if (storage == ExpertStorage::kBFloat16) RoundInputsToBf16(&p);
  const int64_t e = p.dims.experts, d = p.dims.dim, inter = p.dims.intermediate;
  std::vector<float> b_gu = RandomVector(e * 2 * inter, 4100, 0.5f);
  // Every 5th gate/up column is shifted by -+4 (their |H| land in about
  // [2.7, 5.1]), so the gate's upper clamp and both of up's are exercised
  // with a clear margin from the limit the loop below picks (2.0 here).
  for (int64_t i = 0; i < e * 2 * inter; ++i) {
    const int64_t c = i % (2 * inter);
    if (c % 5 == 0) b_gu[i] += (c / 5) % 2 == 0 ? -4.0f : 4.0f;
  }
  std::vector<float> b_d = RandomVector(e * d, 4101, 0.5f);
  std::vector<float> db_gu0 = RandomVector(b_gu.size(), 4102, 1.0f);
  std::vector<float> db_d0 = RandomVector(b_d.size(), 4103, 1.0f);
  if (storage == ExpertStorage::kBFloat16) {
    RoundToBf16InPlace(b_gu.data(), static_cast<int64_t>(b_gu.size()));
    RoundToBf16InPlace(b_d.data(), static_cast<int64_t>(b_d.size()));
  }
  cpu::ExpertOptions cpu_options;
  cpu_options.alpha = 1.702f;
  cpu_options.gate_up_bias = b_gu.data();
  cpu_options.down_bias = b_d.data();
  const cpu::ExpertDims dims = p.cpu_dims();
  constexpr auto kClamped = cpu::GatedActivation::kClampedSwiGLU;

  // The limit: the first of 2.0, 2.05, ... with every |H| 0.1 away from it
  // (the unshifted |H| stay under about 1.5, the shifted ones above 2.7).
  float limit = 2.0f;
  {
    cpu::GroupedExpertsWorkspace probe;
    std::vector<float> y(p.dims.tokens * d);
    SHARDD_ASSERT_OK(cpu::GroupedExpertsForward(
        dims, kClamped, cpu_options, p.x.data(), p.indices.data(),
        p.weights.data(), p.mask_ptr(), p.w_gu.data(), p.w_d.data(), y.data(),
        &probe));
    auto near = [&](float l) {
      for (int64_t i = 0; i < probe.rows * 2 * inter; ++i) {
        if (std::abs(std::abs(probe.h[i]) - l) < 0.1f) return true;
      }
      return false;
    };
    while (near(limit)) limit += 0.05f;
    ASSERT_LT(limit, 2.5f) << "no clear limit for these inputs";
  }
  cpu_options.limit = limit;

  Results ref;
  std::vector<float> ref_db_gu = db_gu0, ref_db_d = db_d0;
  {
    cpu::GroupedExpertsWorkspace ws;
    ref.y.assign(p.dims.tokens * d, 0.0f);
    ref.dx = p.dx_init;
    ref.d_weights.assign(p.dims.tokens * p.dims.top_k, 0.0f);
    ref.dw_gu = p.dw_gu_init;
    ref.dw_d = p.dw_d_init;
    SHARDD_ASSERT_OK(cpu::GroupedExpertsForward(
        dims, kClamped, cpu_options, p.x.data(), p.indices.data(),
        p.weights.data(), p.mask_ptr(), p.w_gu.data(), p.w_d.data(),
        ref.y.data(), &ws));
    int64_t clamped = 0;
    for (int64_t i = 0; i < ws.rows * 2 * inter; ++i) {
      clamped += std::abs(ws.h[i]) > limit;
    }
    EXPECT_GT(clamped, 0) << "the clamps must be exercised";
    cpu::ExpertBiasGrads grads{ref_db_gu.data(), ref_db_d.data()};
    SHARDD_ASSERT_OK(cpu::GroupedExpertsBackward(
        dims, kClamped, cpu_options, p.w_gu.data(), p.w_d.data(), p.dy.data(),
        ref.dx.data(), false, ref.d_weights.data(), ref.dw_gu.data(),
        ref.dw_d.data(), grads, &ws));
  }

  DeviceProblem dp;
  ASSERT_NO_FATAL_FAILURE(Upload(p, storage, &dp));
  DeviceMemory d_b_gu, d_b_d, d_db_gu, d_db_d;
  ASSERT_NO_FATAL_FAILURE(UploadStorage(b_gu, storage, &d_b_gu));
  ASSERT_NO_FATAL_FAILURE(UploadStorage(b_d, storage, &d_b_d));
  ASSERT_NO_FATAL_FAILURE(d_db_gu.Upload(db_gu0.data(), db_gu0.size() * 4));
  ASSERT_NO_FATAL_FAILURE(d_db_d.Upload(db_d0.data(), db_d0.size() * 4));
  GroupedExpertsOptions options;
  options.activation = GatedActivation::kClampedSwiGLU;
  options.storage = storage;
  options.gemm_path = GetParam().second;
  options.alpha = cpu_options.alpha;
  options.limit = limit;
  options.gate_up_bias = d_b_gu.get();
  options.down_bias = d_b_d.get();
  SHARDD_ASSERT_OK(Forward(p, options, &dp));
  ExpertBiasGrads grads{d_db_gu.as<float>(), d_db_d.as<float>()};
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      p.dims, options, dp.w_gu.get(), dp.w_d.get(), dp.dy.get(), dp.dx.get(),
      false, dp.d_weights.as<float>(), dp.dw_gu.as<float>(),
      dp.dw_d.as<float>(), grads, dp.ws.get(), cublas_, stream_));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  Results gpu;
  const int64_t t = p.dims.tokens, k = p.dims.top_k;
  ASSERT_NO_FATAL_FAILURE(DownloadStorage(dp.y, t * d, storage, &gpu.y));
  ASSERT_NO_FATAL_FAILURE(DownloadStorage(dp.dx, t * d, storage, &gpu.dx));
  ASSERT_NO_FATAL_FAILURE(dp.d_weights.Download(&gpu.d_weights, t * k));
  ASSERT_NO_FATAL_FAILURE(dp.dw_gu.Download(&gpu.dw_gu, p.w_gu.size()));
  ASSERT_NO_FATAL_FAILURE(dp.dw_d.Download(&gpu.dw_d, p.w_d.size()));
  std::vector<float> db_gu, db_d;
  ASSERT_NO_FATAL_FAILURE(d_db_gu.Download(&db_gu, db_gu0.size()));
  ASSERT_NO_FATAL_FAILURE(d_db_d.Download(&db_d, db_d0.size()));
  ExpectClose(gpu.y, ref.y, storage, "y");
  ExpectClose(gpu.dx, ref.dx, storage, "dx");
  ExpectClose(gpu.d_weights, ref.d_weights, storage, "d_weights");
  ExpectClose(Increment(gpu.dw_gu, p.dw_gu_init),
              Increment(ref.dw_gu, p.dw_gu_init), storage, "dw_gu");
  ExpectClose(Increment(gpu.dw_d, p.dw_d_init),
              Increment(ref.dw_d, p.dw_d_init), storage, "dw_d");
  ExpectClose(Increment(db_gu, db_gu0), Increment(ref_db_gu, db_gu0), storage,
              "db_gu");
  ExpectClose(Increment(db_d, db_d0), Increment(ref_db_d, db_d0), storage,
              "db_d");
  // The empty expert's bias gradients are left as they were.
  for (int64_t i = 0; i < 2 * inter; ++i) {
    EXPECT_EQ(db_gu[2 * 2 * inter + i], db_gu0[2 * 2 * inter + i]);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllConfigs, GroupedExpertsGptOssTest,
    ::testing::Values(
        std::make_pair(ExpertStorage::kFloat32, ExpertGemmPath::kGrouped),
        std::make_pair(ExpertStorage::kFloat32, ExpertGemmPath::kPerExpertLoop),
        std::make_pair(ExpertStorage::kBFloat16, ExpertGemmPath::kGrouped),
        std::make_pair(ExpertStorage::kBFloat16,
                       ExpertGemmPath::kPerExpertLoop)));

// ---------------------------------------------------------------------------
// Routing, synchronization and error behaviour.

using GroupedExpertsCudaRoutingTest = GpuTest;

TEST_F(GroupedExpertsCudaRoutingTest, StableAcrossRoutingChunks) {
  // 5000 slots span three 2048-slot routing chunks; routing is skewed so
  // warps see many lanes on the same expert.
  HostProblem p = MakeProblem({2500, 16, 8, 7, 2}, -1, 11, 4000);
  std::mt19937 rng(4001);
  for (int64_t t = 0; t < p.dims.tokens; ++t) {
    if (rng() % 10 < 6 && p.indices[t * 2] != 1234) {
      p.indices[t * 2] = 0;
      if (p.indices[t * 2 + 1] == 0) p.indices[t * 2 + 1] = 1;
    }
  }
  GroupedExpertsOptions options;
  options.storage = ExpertStorage::kFloat32;
  Results ref, gpu;
  ASSERT_NO_FATAL_FAILURE(
      RunCpu(p, cpu::GatedActivation::kSwiGLU, false, &ref));
  ASSERT_NO_FATAL_FAILURE(RunGpu(p, options, false, &gpu));
  ExpectMatchesCpu(p, gpu, ref, ExpertStorage::kFloat32);
}

TEST_F(GroupedExpertsCudaRoutingTest, DeterministicAndOneSyncPerForward) {
  HostProblem p = MakeProblem({64, 64, 32, 8, 2}, 3, 0, 5000);
  RoundInputsToBf16(&p);
  GroupedExpertsOptions options;  // bf16, grouped
  DeviceProblem dp;
  ASSERT_NO_FATAL_FAILURE(Upload(p, options.storage, &dp));
  std::vector<uint16_t> first, second;
  const size_t n = p.dims.tokens * p.dims.dim;
  for (int round = 0; round < 2; ++round) {
    SHARDD_ASSERT_OK(Forward(p, options, &dp));
    EXPECT_EQ(dp.ws->host_syncs(), round + 1);
    SHARDD_ASSERT_OK(Backward(p, options, false, &dp));
    SHARDD_ASSERT_OK(Backward(p, options, false, &dp));  // twice: no sync
    EXPECT_EQ(dp.ws->host_syncs(), round + 1);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(dp.y.Download(round == 0 ? &first : &second, n));
  }
  EXPECT_EQ(first, second) << "forward is bitwise deterministic";
}

TEST_F(GroupedExpertsCudaRoutingTest, AllMaskedAndZeroTokens) {
  HostProblem p = MakeProblem({6, 16, 8, 4, 2}, -1, 1, 6000);  // all masked
  GroupedExpertsOptions options;
  options.storage = ExpertStorage::kFloat32;
  Results gpu;
  ASSERT_NO_FATAL_FAILURE(RunGpu(p, options, false, &gpu));
  EXPECT_EQ(gpu.rows, 0);
  EXPECT_EQ(gpu.syncs_after_forward, 1);
  for (float v : gpu.y) EXPECT_EQ(v, 0.0f);
  for (float v : gpu.dx) EXPECT_EQ(v, 0.0f);
  for (float v : gpu.d_weights) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(gpu.dw_gu, p.dw_gu_init);
  EXPECT_EQ(gpu.dw_d, p.dw_d_init);

  // T = 0: nothing to do, no sync.
  HostProblem empty = MakeProblem({0, 16, 8, 4, 2}, -1, 0, 6001);
  DeviceProblem dp;
  ASSERT_NO_FATAL_FAILURE(Upload(empty, options.storage, &dp));
  SHARDD_ASSERT_OK(GroupedExpertsForward(
      empty.dims, options, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
      nullptr, dp.ws.get(), cublas_, stream_));
  SHARDD_ASSERT_OK(GroupedExpertsBackward(
      empty.dims, options, nullptr, nullptr, nullptr, nullptr, false, nullptr,
      nullptr, nullptr, dp.ws.get(), cublas_, stream_));
  EXPECT_EQ(dp.ws->host_syncs(), 0);
  EXPECT_TRUE(dp.ws->has_forward());
  EXPECT_EQ(dp.ws->rows(), 0);
}

TEST_F(GroupedExpertsCudaRoutingTest, RejectsOutOfRangeIndex) {
  HostProblem p = MakeProblem({10, 16, 8, 4, 2}, -1, 0, 7000);
  p.indices[3 * 2 + 1] = 4;  // E = 4
  GroupedExpertsOptions options;
  DeviceProblem dp;
  ASSERT_NO_FATAL_FAILURE(Upload(p, options.storage, &dp));
  EXPECT_THAT(Forward(p, options, &dp),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("indices[3, 1] must be in [0, 4), got 4")));
  EXPECT_FALSE(dp.ws->has_forward());
  EXPECT_THAT(Backward(p, options, false, &dp),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(GroupedExpertsCudaRoutingTest, BackwardChecksTheForward) {
  HostProblem p = MakeProblem({10, 16, 8, 4, 2}, -1, 0, 8000);
  GroupedExpertsOptions options;
  DeviceProblem dp;
  ASSERT_NO_FATAL_FAILURE(Upload(p, options.storage, &dp));
  SHARDD_ASSERT_OK(Forward(p, options, &dp));
  GroupedExpertsOptions other = options;
  other.activation = GatedActivation::kGeGLU;
  EXPECT_THAT(Backward(p, other, false, &dp),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("differ from the forward")));
  // The GEMM path may change between forward and backward.
  other = options;
  other.gemm_path = ExpertGemmPath::kPerExpertLoop;
  SHARDD_EXPECT_OK(Backward(p, other, false, &dp));
  EXPECT_THAT(
      GroupedExpertsBackward(p.dims, options, dp.w_gu.get(), dp.w_d.get(),
                             nullptr, nullptr, false, nullptr, nullptr, nullptr,
                             dp.ws.get(), cublas_, stream_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dy")));
  // A workspace smaller than the dims need is refused.
  SHARDD_ASSERT_OK_AND_ASSIGN(
      auto small, GroupedExpertsWorkspace::Create(dp.workspace.get(), 256, 4));
  EXPECT_THAT(GroupedExpertsForward(
                  p.dims, options, dp.x.get(), dp.indices.as<int32_t>(),
                  dp.weights.as<float>(), nullptr, dp.w_gu.get(), dp.w_d.get(),
                  dp.y.get(), small.get(), cublas_, stream_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GroupedExpertsWorkspaceBytes")));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
