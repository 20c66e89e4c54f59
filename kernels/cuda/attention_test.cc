// The CUDA attention against the CPU kernel (kernels/cpu/attention.h) on the
// same inputs, fp32 and bf16 storage. Skips without a GPU.

#include "kernels/cuda/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/ops_test_util.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

using ops_testing::DeviceBuffer;
using ops_testing::ExpectAllClose;
using ops_testing::ExpectRelL2Close;
using ops_testing::GpuContext;
using ops_testing::RandomVector;
using ops_testing::ToFloat;
using ops_testing::ToStorage;

struct Case {
  std::string name;
  AttentionDims dims;
  AttentionOptions options;
  bool sinks = false;
  // Packed rows: [batch, q_len] first visible keys (empty: none).
  std::vector<int32_t> key_begin;
};

// key_begin of `batch` rows of t tokens packed with examples starting at
// `starts` (the first is 0): each token sees keys from its example's start.
std::vector<int32_t> PackedRows(int64_t batch, int64_t t,
                                const std::vector<int32_t>& starts) {
  std::vector<int32_t> first(batch * t);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < t; ++i) {
      int32_t start = 0;
      for (int32_t s : starts) {
        if (s <= i) start = s;
      }
      // Shift the second row's boundaries so rows differ.
      first[b * t + i] = b == 0 ? start : std::min<int32_t>(i, start + 3);
    }
  }
  return first;
}

int64_t Dv(const AttentionDims& d) {
  return d.v_head_dim == 0 ? d.head_dim : d.v_head_dim;
}

// Whether a bf16 call takes the tensor-core kernels (attention_kernels.h;
// the test's buffers are cudaMalloc'd, so aligned).
bool UsesTensorCores(const AttentionDims& d) {
  return (d.head_dim == 64 || d.head_dim == 128) && Dv(d) == d.head_dim &&
         d.kv_len > 0;
}


template <typename T>
void CheckCase(const Case& c) {
  SCOPED_TRACE(c.name + (sizeof(T) == 2 ? " bf16" : " fp32"));
  GpuContext gpu;
  const AttentionDims& d = c.dims;
  const int64_t dv = Dv(d);
  const size_t nq = d.batch * d.q_len * d.q_heads * d.head_dim;
  const size_t nk = d.batch * d.kv_len * d.kv_heads * d.head_dim;
  const size_t nv = d.batch * d.kv_len * d.kv_heads * dv;
  const size_t no = d.batch * d.q_len * d.q_heads * dv;
  const size_t nl = d.batch * d.q_heads * d.q_len;
  // Storage values; the CPU sees the same values in fp32.
  const std::vector<T> q = ToStorage<T>(RandomVector(nq, -1.0f, 1.0f, 11));
  const std::vector<T> k = ToStorage<T>(RandomVector(nk, -1.0f, 1.0f, 12));
  const std::vector<T> v = ToStorage<T>(RandomVector(nv, -1.0f, 1.0f, 13));
  const std::vector<T> dout = ToStorage<T>(RandomVector(no, -1.0f, 1.0f, 14));
  const std::vector<float> sinks =
      c.sinks ? RandomVector(d.q_heads, -2.0f, 2.0f, 15) : std::vector<float>();

  // CPU reference.
  AttentionOptions cpu_options = c.options;
  cpu_options.sinks = c.sinks ? sinks.data() : nullptr;
  cpu_options.key_begin = c.key_begin.empty() ? nullptr : c.key_begin.data();
  const std::vector<float> qf = ToFloat(q), kf = ToFloat(k), vf = ToFloat(v),
                           dof = ToFloat(dout);
  std::vector<float> out(no), lse(nl);
  std::vector<float> dq(nq, 0.0f), dk(nk, 0.0f), dvv(nv, 0.0f),
      dsinks(sinks.size(), 0.0f);
  kernels::AttentionWorkspace ws;
  SHARDD_ASSERT_OK(kernels::AttentionForward(d, cpu_options, qf.data(),
                                             kf.data(), vf.data(), out.data(),
                                             lse.data(), &ws));
  // The GPU's backward reads its own (stored) output; so does the CPU's.
  std::vector<float> out_stored = ToFloat(ToStorage<T>(out));
  SHARDD_ASSERT_OK(kernels::AttentionBackward(
      d, cpu_options, qf.data(), kf.data(), vf.data(), out_stored.data(),
      lse.data(), dof.data(), dq.data(), dk.data(), dvv.data(),
      c.sinks ? dsinks.data() : nullptr, &ws));

  // GPU. Outputs poisoned with NaN first: every element must be written.
  DeviceBuffer<T> d_q(q), d_k(k), d_v(v), d_dout(dout);
  DeviceBuffer<T> d_out(ToStorage<T>(std::vector<float>(no, std::nanf(""))));
  DeviceBuffer<float> d_lse(std::vector<float>(nl, std::nanf("")));
  DeviceBuffer<float> d_sinks(sinks.empty() ? std::vector<float>{0.0f} : sinks);
  DeviceBuffer<float> g_dq(std::vector<float>(nq, 0.0f)),
      g_dk(std::vector<float>(std::max<size_t>(nk, 1), 0.0f)),
      g_dv(std::vector<float>(std::max<size_t>(nv, 1), 0.0f)),
      g_ds(std::vector<float>(std::max<size_t>(sinks.size(), 1), 0.0f));
  const size_t ws_bytes = AttentionBackwardWorkspaceBytes(d);
  DeviceBuffer<float> d_ws(std::max<size_t>(ws_bytes / sizeof(float), 1));
  DeviceBuffer<int32_t> d_key_begin(
      c.key_begin.empty() ? std::vector<int32_t>{0} : c.key_begin);
  AttentionOptions gpu_options = c.options;
  gpu_options.sinks = c.sinks ? d_sinks.get() : nullptr;
  gpu_options.key_begin = c.key_begin.empty() ? nullptr : d_key_begin.get();
  SHARDD_ASSERT_OK(AttentionForward(d, gpu_options, d_q.get(), d_k.get(),
                                    d_v.get(), d_out.get(), d_lse.get(),
                                    gpu.stream()));
  SHARDD_ASSERT_OK(AttentionBackward(
      d, gpu_options, d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(),
      d_dout.get(), g_dq.get(), g_dk.get(), g_dv.get(),
      c.sinks ? g_ds.get() : nullptr, d_ws.get(), ws_bytes, gpu.stream()));
  gpu.Sync();
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  // Both sides compute in fp32 from the same values and differ only in
  // summation order: scores over Dh terms, softmax sums over S + 1, outputs
  // over S, each within n * 2^-24 of the values' scale, 4x for exp/log and
  // 2x for the two sides. Gradients chain at most three such sums (over Dh,
  // Dv, S or T terms). bf16 storage: each side rounds its own fp32 output,
  // and two values that straddle a rounding boundary land on adjacent bf16
  // values, up to 2^-7 apart relative to either (seen on an H200: one
  // element of 25600 a whole ulp away); through delta = dO . O the same
  // 2^-7 reaches every gradient.
  const double u = std::ldexp(1.0, -24);
  const double fwd_tol = 8.0 * (d.head_dim + 2.0 * d.kv_len + 16.0) * u;
  const double grad_tol =
      24.0 * (d.head_dim + dv + d.kv_len + d.q_len + 16.0) * u;
  const bool bf16 = sizeof(T) == 2;
  if (bf16 && UsesTensorCores(d)) {
    // The tensor-core path also rounds its products' left operands to bf16
    // (the probabilities before P V and P^T dO, dS before dS K and dS^T Q):
    // one more relative 2^-9 per term, whose sum can cancel, so elementwise
    // bounds would need each sum's absolute terms. Normwise the rounding
    // errors do not cancel with the values: out carries the P rounding plus
    // each side's output rounding, 3 * 2^-9 < 2^-7; a gradient the P or dS
    // rounding, the 2^-8 its delta = dO . O inherits from the two sides'
    // bf16 outputs, and the forward's error through O, under 8 * 2^-9 =
    // 2^-6. A wrong mask, scale or sink is off by O(1).
    ExpectRelL2Close(ToFloat(d_out.Download()), out_stored, std::ldexp(1.0, -7),
                     "out");
    ExpectAllClose(d_lse.Download(), lse, fwd_tol, fwd_tol, "lse");
    const double gl2 = std::ldexp(1.0, -6);
    ExpectRelL2Close(g_dq.Download(), dq, gl2, "dq");
    std::vector<float> got = g_dk.Download();
    got.resize(nk);
    ExpectRelL2Close(got, dk, gl2, "dk");
    got = g_dv.Download();
    got.resize(nv);
    ExpectRelL2Close(got, dvv, gl2, "dv");
    // d_sinks: sums of p_sink * delta from the fp32 lse, as the generic path.
    if (c.sinks) {
      ExpectAllClose(g_ds.Download(), dsinks, 0.0,
                     std::ldexp(1.0, -7) + grad_tol, "d_sinks");
    }
    return;
  }
  ExpectAllClose(ToFloat(d_out.Download()), bf16 ? out_stored : out,
                 bf16 ? std::ldexp(1.0, -7) : 0.0, fwd_tol, "out");
  ExpectAllClose(d_lse.Download(), lse, fwd_tol, fwd_tol, "lse");
  const double gtol = bf16 ? std::ldexp(1.0, -7) + grad_tol : grad_tol;
  ExpectAllClose(g_dq.Download(), dq, 0.0, gtol, "dq");
  if (nk > 0) {
    std::vector<float> got = g_dk.Download();
    got.resize(nk);
    ExpectAllClose(got, dk, 0.0, gtol, "dk");
    got = g_dv.Download();
    got.resize(nv);
    ExpectAllClose(got, dvv, 0.0, gtol, "dv");
  }
  if (c.sinks) ExpectAllClose(g_ds.Download(), dsinks, 0.0, gtol, "d_sinks");
}

AttentionDims Dims(int64_t b, int64_t t, int64_t s, int64_t hq, int64_t hkv,
                   int64_t dh, int64_t dv = 0) {
  AttentionDims d;
  d.batch = b;
  d.q_len = t;
  d.kv_len = s;
  d.q_heads = hq;
  d.kv_heads = hkv;
  d.head_dim = dh;
  d.v_head_dim = dv;
  return d;
}

AttentionOptions Options(AttentionMask mask, float scale) {
  AttentionOptions o;
  o.mask = mask;
  o.scale = scale;
  return o;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  cases.push_back({"mha causal", Dims(2, 70, 70, 2, 2, 32),
                   Options(AttentionMask::kCausal, 0.18f)});
  Case sliding{"gqa sliding sinks", Dims(1, 100, 100, 4, 2, 64),
               Options(AttentionMask::kSlidingWindow, 0.125f), true};
  sliding.options.window = 16;
  cases.push_back(sliding);
  cases.push_back({"mqa bidirectional dv 48", Dims(2, 33, 50, 3, 1, 64, 48),
                   Options(AttentionMask::kBidirectional, 0.125f)});
  Case block{"block causal offset", Dims(1, 40, 100, 2, 1, 16),
             Options(AttentionMask::kBlockCausal, 0.25f)};
  block.options.q_offset = 60;
  block.options.block = 8;
  cases.push_back(block);
  // MLA-like head dims: more than 48 KiB of shared memory per block.
  cases.push_back({"mla dims causal", Dims(1, 65, 65, 2, 2, 192, 128),
                   Options(AttentionMask::kCausal, 0.072f)});
  // DiffusionGemma's full-attention heads (values are the keys: dv = dh):
  // the widest the kernels take, with the narrower dQ key tile.
  cases.push_back({"gemma full 512 bidirectional",
                   Dims(1, 37, 45, 2, 1, 512),
                   Options(AttentionMask::kBidirectional, 0.0442f)});
  Case wide_block{"gemma full 512 block causal", Dims(1, 24, 56, 2, 2, 512),
                  Options(AttentionMask::kBlockCausal, 0.0442f)};
  wide_block.options.q_offset = 32;
  wide_block.options.block = 8;
  cases.push_back(wide_block);
  Case empty{"no keys, sinks", Dims(1, 5, 0, 2, 2, 8),
             Options(AttentionMask::kBidirectional, 0.3f), true};
  cases.push_back(empty);
  // Tensor-core shapes (bf16): partial tiles at both ends, several query
  // and key tiles, every mask.
  cases.push_back({"mma gqa causal 128", Dims(2, 150, 150, 4, 2, 128),
                   Options(AttentionMask::kCausal, 0.088f)});
  Case mma_block{"mma block causal offset 64", Dims(1, 70, 200, 2, 1, 64),
                 Options(AttentionMask::kBlockCausal, 0.125f)};
  mma_block.options.q_offset = 130;
  mma_block.options.block = 16;
  cases.push_back(mma_block);
  cases.push_back({"mma bidirectional sinks 128", Dims(1, 90, 130, 2, 2, 128),
                   Options(AttentionMask::kBidirectional, 0.088f), true});
  Case mma_sliding{"mma mqa sliding 64", Dims(1, 200, 200, 4, 1, 64),
                   Options(AttentionMask::kSlidingWindow, 0.125f)};
  mma_sliding.options.window = 70;
  cases.push_back(mma_sliding);
  // Packed SFT rows (key_begin): examples restart inside a row, on the
  // generic kernels (fp32, and bf16 with dh 32) and on the tensor-core ones.
  Case packed{"packed causal", Dims(2, 70, 70, 2, 1, 32),
              Options(AttentionMask::kCausal, 0.18f)};
  packed.key_begin = PackedRows(2, 70, {0, 20, 45, 46});
  cases.push_back(packed);
  Case packed_sliding{"packed sliding sinks", Dims(1, 90, 90, 2, 2, 48),
                      Options(AttentionMask::kSlidingWindow, 0.14f), true};
  packed_sliding.options.window = 24;
  packed_sliding.key_begin = PackedRows(1, 90, {0, 33, 70});
  cases.push_back(packed_sliding);
  Case packed_mma{"mma packed gqa causal 128", Dims(2, 150, 150, 4, 2, 128),
                  Options(AttentionMask::kCausal, 0.088f)};
  packed_mma.key_begin = PackedRows(2, 150, {0, 17, 64, 65, 130});
  cases.push_back(packed_mma);
  Case packed_mma64{"mma packed mqa 64", Dims(1, 200, 200, 4, 1, 64),
                    Options(AttentionMask::kCausal, 0.125f)};
  packed_mma64.key_begin = PackedRows(1, 200, {0, 100, 150});
  cases.push_back(packed_mma64);
  return cases;
}

TEST(AttentionGpuTest, MatchesTheCpuKernelFp32) {
  SHARDD_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) CheckCase<float>(c);
}

TEST(AttentionGpuTest, MatchesTheCpuKernelBf16) {
  SHARDD_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) CheckCase<uint16_t>(c);
}

TEST(AttentionGpuTest, RefusesWhatItCannotRun) {
  AttentionDims d = Dims(1, 4, 4, 1, 1, 513);
  EXPECT_THAT(
      AttentionForward(d, Options(AttentionMask::kCausal, 1.0f),
                       static_cast<const float*>(nullptr), nullptr, nullptr,
                       nullptr, nullptr, static_cast<cudaStream_t>(nullptr)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::HasSubstr("dims.head_dim")));
  d = Dims(1, 4, 4, 1, 1, 8);
  EXPECT_THAT(
      AttentionForward(d, Options(AttentionMask::kCausal, 1.0f),
                       static_cast<const float*>(nullptr), nullptr, nullptr,
                       nullptr, nullptr, static_cast<cudaStream_t>(nullptr)),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("q")));
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
