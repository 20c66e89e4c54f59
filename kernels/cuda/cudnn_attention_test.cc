// cuDNN's fused attention against the CPU kernel (kernels/cpu/attention.h)
// on the same bf16 values, forward and backward, for the shapes the rule
// sends to it; the plan cache; run-to-run determinism. Skips without a GPU
// or without cuDNN 9 (the message says which).

#include "kernels/cuda/cudnn_attention.h"

#include <cmath>
#include <cstdint>
#include <cstring>
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
using ops_testing::ExpectRelL2Close;
using ops_testing::FromBf16;
using ops_testing::GpuAvailable;
using ops_testing::GpuContext;
using ops_testing::RandomVector;
using ops_testing::RoundedToBf16;
using ops_testing::ToBf16;


struct Case {
  std::string name;
  AttentionDims dims;
  AttentionOptions options;
};

void CheckCase(const Case& c) {
  SCOPED_TRACE(c.name);
  std::string why;
  if (!GpuAvailable(&why)) GTEST_SKIP() << why;
  absl::StatusOr<int64_t> version = LoadCudnn();
  if (!version.ok()) GTEST_SKIP() << version.status();
  SHARDD_ASSERT_OK(CudnnAttentionSupports(c.dims, c.options, true));
  GpuContext gpu;
  const AttentionDims& d = c.dims;
  const size_t nq = d.batch * d.q_len * d.q_heads * d.head_dim;
  const size_t nk = d.batch * d.kv_len * d.kv_heads * d.head_dim;
  const size_t nl = d.batch * d.q_heads * d.q_len;
  const std::vector<float> q = RoundedToBf16(RandomVector(nq, -1, 1, 21));
  const std::vector<float> k = RoundedToBf16(RandomVector(nk, -1, 1, 22));
  const std::vector<float> v = RoundedToBf16(RandomVector(nk, -1, 1, 23));
  const std::vector<float> dout = RoundedToBf16(RandomVector(nq, -1, 1, 24));

  // CPU reference in fp32 from the same values; its backward reads the
  // bf16-rounded output, as the GPU's does.
  std::vector<float> out(nq), lse(nl), dq(nq, 0.0f), dk(nk, 0.0f),
      dv(nk, 0.0f);
  AttentionWorkspace ws;
  SHARDD_ASSERT_OK(AttentionForward(d, c.options, q.data(), k.data(),
                                    v.data(), out.data(), lse.data(), &ws));
  const std::vector<float> out_stored = RoundedToBf16(out);
  SHARDD_ASSERT_OK(AttentionBackward(d, c.options, q.data(), k.data(),
                                     v.data(), out_stored.data(), lse.data(),
                                     dout.data(), dq.data(), dk.data(),
                                     dv.data(), nullptr, &ws));

  SHARDD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CudnnAttention> cudnn,
                              CudnnAttention::Create(gpu.stream()));
  SHARDD_ASSERT_OK_AND_ASSIGN(const size_t fwd_bytes,
                              cudnn->ForwardWorkspaceBytes(d, c.options));
  SHARDD_ASSERT_OK_AND_ASSIGN(const size_t bwd_bytes,
                              cudnn->BackwardWorkspaceBytes(d, c.options));
  EXPECT_EQ(cudnn->plans_built(), 2);
  DeviceBuffer<uint16_t> g_q(ToBf16(q)), g_k(ToBf16(k)), g_v(ToBf16(v)),
      g_dout(ToBf16(dout)), g_out(nq), g_dq(nq), g_dk(nk), g_dv(nk);
  DeviceBuffer<float> g_lse(nl);
  DeviceBuffer<unsigned char> g_ws(std::max(fwd_bytes, bwd_bytes) + 1);
  SHARDD_ASSERT_OK(cudnn->Forward(d, c.options, g_q.get(), g_k.get(),
                                  g_v.get(), g_out.get(), g_lse.get(),
                                  g_ws.get(), fwd_bytes));
  SHARDD_ASSERT_OK(cudnn->Backward(
      d, c.options, g_q.get(), g_k.get(), g_v.get(), g_out.get(), g_lse.get(),
      g_dout.get(), g_dq.get(), g_dk.get(), g_dv.get(), g_ws.get(),
      bwd_bytes));
  gpu.Sync();
  EXPECT_EQ(cudnn->plans_built(), 2);  // Served from the cache.

  // Bounds as kernels/cuda/attention_test.cc derives them for the
  // tensor-core path: bf16 rounding of P and dS (2^-9 per term) and of each
  // side's outputs, normwise 2^-7 on out and 2^-6 on the gradients (which
  // also come back rounded to bf16 here: one more 2^-9); the lse is fp32 on
  // both sides from the same bf16 inputs. A wrong mask, scale or layout is
  // off by O(1).
  ExpectRelL2Close(FromBf16(g_out.Download()), out_stored,
                   std::ldexp(1.0, -7), "out");
  ExpectRelL2Close(g_lse.Download(), lse, std::ldexp(1.0, -12), "lse");
  const double gl2 = std::ldexp(1.0, -6) + std::ldexp(1.0, -9);
  ExpectRelL2Close(FromBf16(g_dq.Download()), dq, gl2, "dq");
  ExpectRelL2Close(FromBf16(g_dk.Download()), dk, gl2, "dk");
  ExpectRelL2Close(FromBf16(g_dv.Download()), dv, gl2, "dv");

  // Deterministic: a second backward writes the same bits.
  const std::vector<uint16_t> first = g_dk.Download();
  SHARDD_ASSERT_OK(cudnn->Backward(
      d, c.options, g_q.get(), g_k.get(), g_v.get(), g_out.get(), g_lse.get(),
      g_dout.get(), g_dq.get(), g_dk.get(), g_dv.get(), g_ws.get(),
      bwd_bytes));
  gpu.Sync();
  EXPECT_EQ(first, g_dk.Download());
  // Too small a workspace is refused before cuDNN runs.
  if (fwd_bytes > 0) {
    EXPECT_THAT(cudnn->Forward(d, c.options, g_q.get(), g_k.get(), g_v.get(),
                               g_out.get(), g_lse.get(), g_ws.get(),
                               fwd_bytes - 1),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

AttentionDims Dims(int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t dh) {
  AttentionDims d;
  d.batch = b;
  d.q_len = d.kv_len = t;
  d.q_heads = hq;
  d.kv_heads = hkv;
  d.head_dim = dh;
  return d;
}

AttentionOptions Mask(AttentionMask mask, int64_t window, int64_t dh) {
  AttentionOptions o;
  o.mask = mask;
  o.window = window;
  o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dh)));
  return o;
}

TEST(CudnnAttentionTest, CausalGqaLikeQwen3) {
  CheckCase({"qwen3", Dims(2, 256, 8, 2, 128),
             Mask(AttentionMask::kCausal, 0, 128)});
}

TEST(CudnnAttentionTest, CausalMultiHeadLikeLlama) {
  CheckCase({"llama", Dims(1, 320, 4, 4, 64),
             Mask(AttentionMask::kCausal, 0, 64)});
}

TEST(CudnnAttentionTest, SlidingWindowLikeGptOssAndGemma) {
  CheckCase({"sliding", Dims(2, 200, 4, 1, 256),
             Mask(AttentionMask::kSlidingWindow, 64, 256)});
}

}  // namespace
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
