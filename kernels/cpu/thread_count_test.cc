// The kernels that spread work over the compute pool give the same bits at
// every thread count (compute_pool.h's fixed chunks; Sgemm's pieces, set by
// the shape alone), so a worker's results do not depend on how many cores it
// has.

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using testing_util::RandomVector;

// Runs `kernel` (which returns every output concatenated) at 1, 2 and 3
// threads and expects the same bits each time.
void ExpectSameBitsAtEveryThreadCount(
    const std::function<std::vector<float>()>& kernel) {
  SHARDD_ASSERT_OK(SetComputeThreads(1));
  const std::vector<float> serial = kernel();
  ASSERT_FALSE(serial.empty());
  for (int threads : {2, 3}) {
    SHARDD_ASSERT_OK(SetComputeThreads(threads));
    const std::vector<float> parallel = kernel();
    ASSERT_EQ(parallel.size(), serial.size());
    EXPECT_EQ(std::memcmp(parallel.data(), serial.data(),
                          serial.size() * sizeof(float)),
              0)
        << "at " << threads << " threads";
  }
}

TEST(ThreadCountTest, AdamWAndGradientNorm) {
  const int64_t n = 300001;  // several chunks and a short last one
  const std::vector<float> grad = RandomVector(n, 1);
  ExpectSameBitsAtEveryThreadCount([&] {
    std::vector<float> param = RandomVector(n, 2), m(n, 0.0f), v(n, 0.0f);
    for (int step = 1; step <= 2; ++step) {
      SHARDD_EXPECT_OK(AdamWStep(param.data(), grad.data(), m.data(), v.data(),
                                 n, step, AdamWConfig{}));
    }
    ScaleInPlace(param.data(), n, 0.5f);
    const double norm = SumOfSquares(grad.data(), n);
    param.push_back(static_cast<float>(norm));
    param.push_back(static_cast<float>(norm - static_cast<float>(norm)));
    return param;
  });
}

TEST(ThreadCountTest, RmsNormForwardAndBackward) {
  const int64_t rows = 777, dim = 192;
  const std::vector<float> x = RandomVector(rows * dim, 3),
                           w = RandomVector(dim, 4);
  const std::vector<float> dy = RandomVector(rows * dim, 5);
  ExpectSameBitsAtEveryThreadCount([&] {
    std::vector<float> y(rows * dim), inv(rows), dx(rows * dim), dw(dim, 0.0f);
    SHARDD_EXPECT_OK(RmsNormForward(x.data(), w.data(), rows, dim, 1e-6f,
                                    y.data(), inv.data()));
    SHARDD_EXPECT_OK(RmsNormBackward(dy.data(), x.data(), w.data(), inv.data(),
                                     rows, dim, dx.data(), dw.data(), false));
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dw.begin(), dw.end());
    return y;
  });
}

TEST(ThreadCountTest, AttentionWithGroupsAndSinks) {
  AttentionDims d;
  d.batch = 3;
  d.q_len = d.kv_len = 200;
  d.q_heads = 4;
  d.kv_heads = 2;
  d.head_dim = 16;
  const std::vector<float> q =
      RandomVector(d.batch * d.q_len * d.q_heads * 16, 6);
  const std::vector<float> k =
      RandomVector(d.batch * d.kv_len * d.kv_heads * 16, 7);
  const std::vector<float> v =
      RandomVector(d.batch * d.kv_len * d.kv_heads * 16, 8);
  const std::vector<float> d_out = RandomVector(q.size(), 9);
  const std::vector<float> sinks = RandomVector(d.q_heads, 10);
  for (bool with_sinks : {false, true}) {
    AttentionOptions o;
    o.scale = 0.25f;
    o.mask = AttentionMask::kSlidingWindow;
    o.window = 150;
    o.sinks = with_sinks ? sinks.data() : nullptr;
    ExpectSameBitsAtEveryThreadCount([&] {
      AttentionWorkspace ws;
      std::vector<float> out(q.size()), lse(d.batch * d.q_heads * d.q_len);
      SHARDD_EXPECT_OK(AttentionForward(d, o, q.data(), k.data(), v.data(),
                                        out.data(), lse.data(), &ws));
      std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f),
          dv(v.size(), 0.0f), ds(d.q_heads, 0.0f);
      SHARDD_EXPECT_OK(
          AttentionBackward(d, o, q.data(), k.data(), v.data(), out.data(),
                            lse.data(), d_out.data(), dq.data(), dk.data(),
                            dv.data(), with_sinks ? ds.data() : nullptr, &ws));
      for (const std::vector<float>* part : {&lse, &dq, &dk, &dv, &ds}) {
        out.insert(out.end(), part->begin(), part->end());
      }
      return out;
    });
  }
}

TEST(ThreadCountTest, GroupedExpertsAcrossAndWithinExperts) {
  // 8 experts share out over the threads; 2 run in order with split GEMMs.
  for (int64_t experts : {8, 2}) {
    ExpertDims d;
    d.tokens = 300;
    d.dim = 64;
    d.intermediate = 96;
    d.experts = experts;
    d.top_k = 2;
    const std::vector<float> x = RandomVector(d.tokens * d.dim, 11);
    const std::vector<float> w_gu =
        RandomVector(experts * d.dim * 2 * d.intermediate, 12, 0.2f);
    const std::vector<float> w_d =
        RandomVector(experts * d.intermediate * d.dim, 13, 0.2f);
    const std::vector<float> dy = RandomVector(d.tokens * d.dim, 14);
    std::vector<int32_t> indices(d.tokens * 2);
    std::vector<float> weights(d.tokens * 2);
    for (int64_t t = 0; t < d.tokens; ++t) {
      indices[2 * t] = static_cast<int32_t>(t % experts);
      indices[2 * t + 1] = static_cast<int32_t>((t * 7 + 1) % experts);
      if (indices[2 * t + 1] == indices[2 * t]) {
        indices[2 * t + 1] = static_cast<int32_t>((t + 1) % experts);
      }
      weights[2 * t] = 0.6f;
      weights[2 * t + 1] = 0.4f;
    }
    ExpectSameBitsAtEveryThreadCount([&] {
      GroupedExpertsWorkspace ws;
      std::vector<float> y(d.tokens * d.dim), dx(y.size());
      std::vector<float> dwt(d.tokens * 2), dw_gu(w_gu.size(), 0.0f),
          dw_d(w_d.size(), 0.0f);
      SHARDD_EXPECT_OK(GroupedExpertsForward(
          d, GatedActivation::kSwiGLU, x.data(), indices.data(), weights.data(),
          nullptr, w_gu.data(), w_d.data(), y.data(), &ws));
      SHARDD_EXPECT_OK(GroupedExpertsBackward(
          d, GatedActivation::kSwiGLU, w_gu.data(), w_d.data(), dy.data(),
          dx.data(), false, dwt.data(), dw_gu.data(), dw_d.data(), &ws));
      for (const std::vector<float>* part : {&dx, &dwt, &dw_gu, &dw_d}) {
        y.insert(y.end(), part->begin(), part->end());
      }
      return y;
    });
  }
}

TEST(ThreadCountTest, LmHeadCrossEntropy) {
  const int64_t tokens = 300, dim = 64, vocab = 1000;
  const std::vector<float> h = RandomVector(tokens * dim, 15),
                           w = RandomVector(vocab * dim, 16);
  std::vector<int32_t> targets(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    targets[t] = t % 11 == 0 ? -1 : static_cast<int32_t>((t * 37) % vocab);
  }
  ExpectSameBitsAtEveryThreadCount([&] {
    std::vector<float> dh(tokens * dim), dw(vocab * dim, 0.0f);
    absl::StatusOr<CrossEntropyResult> r = LmHeadCrossEntropyBackward(
        h.data(), w.data(), tokens, dim, vocab, targets.data(), 1.0f / tokens,
        dh.data(), dw.data());
    SHARDD_EXPECT_OK(r.status());
    dh.insert(dh.end(), dw.begin(), dw.end());
    if (r.ok()) dh.push_back(static_cast<float>(r->loss_sum));
    return dh;
  });
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
