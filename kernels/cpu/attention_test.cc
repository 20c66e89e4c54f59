#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/grad_check.h"
#include "kernels/cpu/simd_level.h"
#include "kernels/cpu/test_vectors.h"

namespace shardd {
namespace kernels {
namespace {

using ::testing::HasSubstr;
using testing_util::ExpectGradNear;
using testing_util::NumericGrad;
using testing_util::RandomVector;

int64_t Dv(const AttentionDims& d) {
  return d.v_head_dim == 0 ? d.head_dim : d.v_head_dim;
}

bool RefAllowed(const AttentionOptions& o, int64_t pos, int64_t j) {
  switch (o.mask) {
    case AttentionMask::kBidirectional:
      return true;
    case AttentionMask::kCausal:
      return j <= pos;
    case AttentionMask::kSlidingWindow:
      return j <= pos && pos - j < o.window;
    case AttentionMask::kBlockCausal:
      return j / o.block <= pos / o.block;
  }
  return false;
}

// Naive double attention: the whole score row, max-subtracted softmax with
// the sink in the denominator. Returns out [B, T, Hq, Dv].
template <typename T>
std::vector<double> RefForward(const AttentionDims& d,
                               const AttentionOptions& o,
                               const std::vector<T>& q, const std::vector<T>& k,
                               const std::vector<T>& v,
                               const std::vector<T>& sinks) {
  const int64_t dv = Dv(d), group = d.q_heads / d.kv_heads;
  std::vector<double> out(d.batch * d.q_len * d.q_heads * dv, 0.0);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.q_len; ++i) {
      for (int64_t h = 0; h < d.q_heads; ++h) {
        const int64_t g = h / group;
        std::vector<double> s(d.kv_len, 0.0);
        std::vector<bool> on(d.kv_len, false);
        double mx = sinks.empty() ? -INFINITY : double{sinks[h]};
        for (int64_t j = 0; j < d.kv_len; ++j) {
          on[j] = RefAllowed(o, i + o.q_offset, j) &&
                  (o.key_begin == nullptr ||
                   j >= o.key_begin[b * d.q_len + i]);
          if (!on[j]) continue;
          double dot = 0;
          for (int64_t e = 0; e < d.head_dim; ++e) {
            dot +=
                double{
                    q[((b * d.q_len + i) * d.q_heads + h) * d.head_dim + e]} *
                double{
                    k[((b * d.kv_len + j) * d.kv_heads + g) * d.head_dim + e]};
          }
          s[j] = o.scale * dot;
          mx = std::max(mx, s[j]);
        }
        double denom = sinks.empty() ? 0.0 : std::exp(double{sinks[h]} - mx);
        for (int64_t j = 0; j < d.kv_len; ++j) {
          if (on[j]) denom += std::exp(s[j] - mx);
        }
        if (denom == 0.0) continue;
        double* o_row = &out[((b * d.q_len + i) * d.q_heads + h) * dv];
        for (int64_t j = 0; j < d.kv_len; ++j) {
          if (!on[j]) continue;
          const double p = std::exp(s[j] - mx) / denom;
          for (int64_t e = 0; e < dv; ++e) {
            o_row[e] +=
                p * double{v[((b * d.kv_len + j) * d.kv_heads + g) * dv + e]};
          }
        }
      }
    }
  }
  return out;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

struct Case {
  std::string name;
  AttentionDims dims;
  AttentionOptions options;
  bool sinks = false;
  // Packed sequences: AttentionOptions::key_begin [batch, q_len].
  std::vector<int32_t> key_begin;
};

// Forward against the double reference, then every gradient (q, k, v,
// sinks) against central differences of the double reference's loss
// sum(out * w) for a random w.
void CheckCase(const Case& c) {
  SCOPED_TRACE(c.name);
  const AttentionDims& d = c.dims;
  AttentionOptions o = c.options;
  const int64_t dv = Dv(d);
  std::vector<float> q =
      RandomVector(d.batch * d.q_len * d.q_heads * d.head_dim, 1);
  std::vector<float> k =
      RandomVector(d.batch * d.kv_len * d.kv_heads * d.head_dim, 2);
  std::vector<float> v = RandomVector(d.batch * d.kv_len * d.kv_heads * dv, 3);
  std::vector<float> sinks =
      c.sinks ? RandomVector(d.q_heads, 4, 2.0f) : std::vector<float>();
  const std::vector<float> w =
      RandomVector(d.batch * d.q_len * d.q_heads * dv, 5);
  o.sinks = c.sinks ? sinks.data() : nullptr;
  if (!c.key_begin.empty()) o.key_begin = c.key_begin.data();

  std::vector<float> out(w.size(), std::nanf("")),
      lse(d.batch * d.q_heads * d.q_len);
  AttentionWorkspace ws;
  SHARDD_ASSERT_OK(AttentionForward(d, o, q.data(), k.data(), v.data(),
                                    out.data(), lse.data(), &ws));
  // Forward: fp32 scores are dot products of Dh terms, the softmax sums at
  // most S + 1 terms and each output S more, so the error is within
  // (Dh + 2S + 16) * 2^-24 of the values' scale (inputs in [-1, 1], scale
  // <= 1, outputs convex combinations of v); 4x for exp/log.
  const double fwd_tol =
      4.0 * (d.head_dim + 2.0 * d.kv_len + 16.0) * std::ldexp(1.0, -24);
  const std::vector<double> ref = RefForward(d, o, q, k, v, sinks);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], ref[i], fwd_tol) << "out[" << i << "]";
  }

  std::vector<float> dq(q.size(), 0.0f), dk(k.size(), 0.0f),
      dvv(v.size(), 0.0f), dsinks(sinks.size(), 0.0f);
  SHARDD_ASSERT_OK(AttentionBackward(d, o, q.data(), k.data(), v.data(),
                                     out.data(), lse.data(), w.data(),
                                     dq.data(), dk.data(), dvv.data(),
                                     c.sinks ? dsinks.data() : nullptr, &ws));

  std::vector<double> qd = ToDouble(q), kd = ToDouble(k), vd = ToDouble(v),
                      sd = ToDouble(sinks);
  auto loss = [&]() {
    const std::vector<double> y = RefForward(d, o, qd, kd, vd, sd);
    double sum = 0;
    for (size_t i = 0; i < y.size(); ++i) sum += y[i] * w[i];
    return sum;
  };
  // The kernel's gradients go through at most three fp32 GEMM chains of
  // length <= max(S, Dh, Dv) (< 160 here) on top of the forward: within
  // 3 * 160 * 2^-24 ~ 3e-5 of their scale; the double differences (eps
  // 1e-6) are exact to ~1e-9. 1e-4 leaves margin while a wrong term (a
  // missing scale, a dropped delta, a wrong mask in backward) is off by
  // 1e-2 or more.
  ExpectGradNear(dq, NumericGrad(qd, 1e-6, loss), 1e-4, "dq");
  ExpectGradNear(dk, NumericGrad(kd, 1e-6, loss), 1e-4, "dk");
  ExpectGradNear(dvv, NumericGrad(vd, 1e-6, loss), 1e-4, "dv");
  if (c.sinks) {
    ExpectGradNear(dsinks, NumericGrad(sd, 1e-6, loss), 1e-4, "dsinks");
  }
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

// Packed rows: each query sees only its own example's keys (causal, or a
// sliding window within it), across two query blocks of 64.
TEST(AttentionTest, PackedSequencesSeeOnlyTheirOwnExample) {
  auto segments = [](const std::vector<int>& lengths) {
    std::vector<int32_t> out;
    int start = 0;
    for (int n : lengths) {
      for (int i = 0; i < n; ++i) out.push_back(start);
      start += n;
    }
    return out;
  };
  std::vector<int32_t> begin = segments({5, 30, 1, 44});
  const std::vector<int32_t> row1 = segments({20, 60});
  begin.insert(begin.end(), row1.begin(), row1.end());
  Case causal{"packed causal", Dims(2, 80, 80, 2, 1, 4),
              Options(AttentionMask::kCausal, 0.35f)};
  causal.key_begin = begin;
  CheckCase(causal);
  AttentionOptions window = Options(AttentionMask::kSlidingWindow, 0.35f);
  window.window = 6;
  Case sliding{"packed sliding window", Dims(2, 80, 80, 2, 2, 4), window,
               /*sinks=*/true};
  sliding.key_begin = begin;
  CheckCase(sliding);
}

TEST(AttentionTest, MultiHeadCausal) {
  CheckCase({"mha causal", Dims(2, 9, 9, 2, 2, 4),
             Options(AttentionMask::kCausal, 0.5f)});
}

TEST(AttentionTest, GroupedQuerySlidingWindowWithSinks) {
  Case c{"gqa sliding sinks", Dims(1, 11, 11, 4, 2, 4),
         Options(AttentionMask::kSlidingWindow, 0.5f), true};
  c.options.window = 3;
  CheckCase(c);
}

TEST(AttentionTest, MultiQueryBidirectionalWithWiderValues) {
  CheckCase({"mqa bidirectional dv 6", Dims(2, 5, 7, 3, 1, 4, 6),
             Options(AttentionMask::kBidirectional, 0.4f)});
}

TEST(AttentionTest, BlockCausalQueriesBehindAPrefixOfKeys) {
  // Decode queries over [8 encoder keys ; 6 canvas keys]: canvas query i at
  // key position 8 + i, blocks of 3.
  Case c{"block causal offset", Dims(1, 6, 14, 2, 1, 4),
         Options(AttentionMask::kBlockCausal, 0.5f)};
  c.options.q_offset = 8;
  c.options.block = 3;
  CheckCase(c);
}

TEST(AttentionTest, ManyBlocksOnlineSoftmax) {
  // 150 queries and keys: three query blocks and two key blocks, so the
  // running max and sum are rescaled across blocks.
  CheckCase({"causal 150", Dims(1, 150, 150, 1, 1, 3),
             Options(AttentionMask::kCausal, 1.0f)});
  Case c{"sliding 150 sinks", Dims(1, 150, 150, 2, 1, 2),
         Options(AttentionMask::kSlidingWindow, 1.0f), true};
  c.options.window = 70;
  CheckCase(c);
}

// The score rows' loops (row max, VecExp, the fixed-lane row sums) run at
// every SimdLevel this CPU supports and must give the same bits at each:
// key ranges that are no multiple of any vector width, two key blocks,
// sinks, and scores large enough that exp's range reduction matters.
TEST(AttentionTest, EverySimdLevelGivesTheSameBits) {
  const SimdLevel supported = SupportedSimdLevel();
  AttentionDims d = Dims(2, 150, 301, 4, 2, 5);
  AttentionOptions o = Options(AttentionMask::kSlidingWindow, 3.0f);
  o.window = 263;
  const std::vector<float> q = RandomVector(2 * 150 * 4 * 5, 21, 2.0f);
  const std::vector<float> k = RandomVector(2 * 301 * 2 * 5, 22, 2.0f);
  const std::vector<float> v = RandomVector(2 * 301 * 2 * 5, 23);
  const std::vector<float> sinks = RandomVector(4, 24, 2.0f);
  const std::vector<float> dout = RandomVector(2 * 150 * 4 * 5, 25);
  o.sinks = sinks.data();
  d.q_len = 150;
  o.q_offset = 151;  // the queries are the last 150 of 301 positions
  auto run = [&] {
    std::vector<float> out(dout.size()), lse(2 * 4 * 150),
        dq(q.size(), 0.0f), dk(k.size(), 0.0f), dv(v.size(), 0.0f),
        ds(4, 0.0f);
    AttentionWorkspace ws;
    EXPECT_TRUE(AttentionForward(d, o, q.data(), k.data(), v.data(),
                                 out.data(), lse.data(), &ws)
                    .ok());
    EXPECT_TRUE(AttentionBackward(d, o, q.data(), k.data(), v.data(),
                                  out.data(), lse.data(), dout.data(),
                                  dq.data(), dk.data(), dv.data(), ds.data(),
                                  &ws)
                    .ok());
    std::vector<float> all;
    for (const std::vector<float>* part : {&out, &lse, &dq, &dk, &dv, &ds}) {
      all.insert(all.end(), part->begin(), part->end());
    }
    return all;
  };
  SHARDD_ASSERT_OK(OverrideSimdLevel(SimdLevel::kBaseline));
  const std::vector<float> base = run();
  int compared = 0;
  for (SimdLevel level : {SimdLevel::kX86_64_V3, SimdLevel::kX86_64_V4}) {
    if (level > supported) continue;
    SCOPED_TRACE(SimdLevelName(level));
    SHARDD_ASSERT_OK(OverrideSimdLevel(level));
    EXPECT_EQ(run(), base);
    ++compared;
  }
  SHARDD_ASSERT_OK(OverrideSimdLevel(supported));
  std::printf("[simd] compared x86-64 with %d higher level(s), up to %s\n",
              compared, SimdLevelName(supported));
}

TEST(AttentionTest, RowsWithNothingToAttendTo) {
  // No keys: zeros and -inf lse, or only the sink: zeros and lse = sink.
  const AttentionDims d = Dims(1, 3, 0, 2, 2, 4);
  AttentionOptions o = Options(AttentionMask::kBidirectional, 0.5f);
  const std::vector<float> q = RandomVector(3 * 2 * 4, 1);
  std::vector<float> out(3 * 2 * 4, 7.0f), lse(2 * 3, 7.0f);
  AttentionWorkspace ws;
  SHARDD_ASSERT_OK(AttentionForward(d, o, q.data(), nullptr, nullptr,
                                    out.data(), lse.data(), &ws));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  const std::vector<float> sinks = {0.25f, -1.5f};
  o.sinks = sinks.data();
  SHARDD_ASSERT_OK(AttentionForward(d, o, q.data(), nullptr, nullptr,
                                    out.data(), lse.data(), &ws));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  EXPECT_FLOAT_EQ(lse[0], 0.25f);
  EXPECT_FLOAT_EQ(lse[3], -1.5f);
  std::vector<float> dq(q.size(), 0.0f), ds(2, 0.0f);
  const std::vector<float> dout = RandomVector(out.size(), 2);
  SHARDD_ASSERT_OK(AttentionBackward(
      d, o, q.data(), nullptr, nullptr, out.data(), lse.data(), dout.data(),
      dq.data(), nullptr, nullptr, ds.data(), &ws));
  for (float x : dq) EXPECT_EQ(x, 0.0f);
  for (float x : ds) EXPECT_EQ(x, 0.0f);  // out == 0: nothing flows back.
}

TEST(AttentionTest, GradientsAccumulate) {
  const AttentionDims d = Dims(1, 4, 4, 1, 1, 2);
  const AttentionOptions o = Options(AttentionMask::kCausal, 1.0f);
  const std::vector<float> q = RandomVector(8, 1), k = RandomVector(8, 2),
                           v = RandomVector(8, 3), dout = RandomVector(8, 4);
  std::vector<float> out(8), lse(4);
  AttentionWorkspace ws;
  SHARDD_ASSERT_OK(AttentionForward(d, o, q.data(), k.data(), v.data(),
                                    out.data(), lse.data(), &ws));
  std::vector<float> once(8, 0.0f), twice(8, 0.0f);
  SHARDD_ASSERT_OK(AttentionBackward(
      d, o, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
      nullptr, once.data(), nullptr, nullptr, &ws));
  for (int i = 0; i < 2; ++i) {
    SHARDD_ASSERT_OK(AttentionBackward(
        d, o, q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
        nullptr, twice.data(), nullptr, nullptr, &ws));
  }
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(twice[i], 2.0f * once[i]);
}

// The key and query ranges the kernels skip by cover every visible pair.
TEST(AttentionMaskTest, RangesCoverEveryVisiblePair) {
  for (AttentionMask mask :
       {AttentionMask::kBidirectional, AttentionMask::kCausal,
        AttentionMask::kSlidingWindow, AttentionMask::kBlockCausal}) {
    for (int64_t offset : {0, 3, 9}) {
      MaskRule r;
      r.mask = mask;
      r.q_offset = offset;
      r.window = 4;
      r.block = 3;
      const int64_t t = 11, s = 20;
      for (int64_t i0 = 0; i0 < t; i0 += 4) {
        const int64_t i1 = std::min(t, i0 + 4) - 1;
        int64_t kb, ke;
        MaskKeyRange(r, i0 + offset, i1 + offset, s, &kb, &ke);
        for (int64_t i = i0; i <= i1; ++i) {
          for (int64_t j = 0; j < s; ++j) {
            if (MaskAllows(r, i + offset, j)) {
              EXPECT_TRUE(j >= kb && j < ke) << "key " << j << " query " << i;
            }
          }
        }
      }
      for (int64_t j0 = 0; j0 < s; j0 += 5) {
        const int64_t j1 = std::min(s, j0 + 5) - 1;
        int64_t qb, qe;
        MaskQueryRange(r, j0, j1, t, &qb, &qe);
        for (int64_t j = j0; j <= j1; ++j) {
          for (int64_t i = 0; i < t; ++i) {
            if (MaskAllows(r, i + offset, j)) {
              EXPECT_TRUE(i >= qb && i < qe) << "query " << i << " key " << j;
            }
          }
        }
      }
    }
  }
}

TEST(AttentionTest, BadArgumentsNameTheField) {
  AttentionWorkspace ws;
  float x = 0.0f;
  AttentionDims d = Dims(1, 1, 1, 3, 2, 4);
  AttentionOptions o = Options(AttentionMask::kCausal, 1.0f);
  EXPECT_THAT(AttentionForward(d, o, &x, &x, &x, &x, &x, &ws),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("kv_heads: must divide q_heads (3)")));
  d = Dims(1, 1, 1, 2, 2, 0);
  EXPECT_THAT(
      ValidateAttention(d, o),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim 0")));
  d = Dims(1, 1, 1, 2, 2, 4);
  o.mask = AttentionMask::kSlidingWindow;
  EXPECT_THAT(ValidateAttention(d, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.window")));
  o.mask = AttentionMask::kBlockCausal;
  EXPECT_THAT(
      ValidateAttention(d, o),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.block")));
  o = Options(AttentionMask::kCausal, std::nanf(""));
  EXPECT_THAT(
      ValidateAttention(d, o),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("options.scale")));
  o = Options(AttentionMask::kCausal, 1.0f);
  o.q_offset = -1;
  EXPECT_THAT(ValidateAttention(d, o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("options.q_offset")));
  o.q_offset = 0;
  EXPECT_THAT(AttentionForward(d, o, nullptr, &x, &x, &x, &x, &ws),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must not be null")));
}

}  // namespace
}  // namespace kernels
}  // namespace shardd
