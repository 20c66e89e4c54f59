#include "worker/shards/lora_merge.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace shardd {
namespace {

std::vector<float> Random(int64_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(*rng);
  return v;
}

// An fp32 sum of k products against the float64 one: within k ulps of
// the sum of the terms' magnitudes (the rounding of a length-k dot product).
void ExpectDot(double got, double want, double magnitude, int64_t k) {
  EXPECT_LE(std::fabs(got - want), (k + 1) * std::ldexp(1.0, -24) * magnitude)
      << got << " vs " << want;
}

// Each value against float64 sums over the HF-layout definition
// (W_hf[e] = W[e]^T for stacked experts): W'_hf = W_hf + s B A,
// dA = s B^T G_hf, dB = s G_hf A^T.
void Check(const LoraTarget& t, int64_t experts) {
  std::mt19937 rng(7);
  const int64_t e_n = t.experts == 0 ? 1 : experts;
  const int64_t r = t.rank, in = t.in, out = t.out;
  const std::vector<float> a = Random(e_n * r * in, &rng);
  const std::vector<float> b = Random(e_n * out * r, &rng);
  const std::vector<float> w0 = Random(e_n * in * out, &rng);
  const std::vector<float> g = Random(e_n * in * out, &rng);
  std::vector<float> w = w0, da(a.size()), db(b.size());
  LoraMergeInto(t, experts, a.data(), b.data(), w.data());
  LoraSplitGrad(t, experts, a.data(), b.data(), g.data(), da.data(),
                db.data());
  // Index of W_hf[e][o][i] in shardd's layout.
  auto wi = [&](int64_t e, int64_t o, int64_t i) {
    return t.experts == 0 ? o * in + i : e * in * out + i * out + o;
  };
  const double s = t.scale;
  for (int64_t e = 0; e < e_n; ++e) {
    const float* ae = a.data() + e * r * in;
    const float* be = b.data() + e * out * r;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        double sum = 0, mag = 0;
        for (int64_t k = 0; k < r; ++k) {
          sum += s * be[o * r + k] * ae[k * in + i];
          mag += std::fabs(s * be[o * r + k] * ae[k * in + i]);
        }
        ExpectDot(w[wi(e, o, i)], w0[wi(e, o, i)] + sum,
                  mag + std::fabs(w0[wi(e, o, i)]), r);
      }
    }
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t i = 0; i < in; ++i) {
        double sum = 0, mag = 0;
        for (int64_t o = 0; o < out; ++o) {
          sum += s * be[o * r + k] * g[wi(e, o, i)];
          mag += std::fabs(s * be[o * r + k] * g[wi(e, o, i)]);
        }
        ExpectDot(da[e * r * in + k * in + i], sum, mag, out);
      }
      for (int64_t o = 0; o < out; ++o) {
        double sum = 0, mag = 0;
        for (int64_t i = 0; i < in; ++i) {
          sum += s * g[wi(e, o, i)] * ae[k * in + i];
          mag += std::fabs(s * g[wi(e, o, i)] * ae[k * in + i]);
        }
        ExpectDot(db[e * out * r + o * r + k], sum, mag, in);
      }
    }
  }
}

TEST(LoraMergeTest, Linear) {
  LoraTarget t;
  t.in = 24;
  t.out = 40;
  t.rank = 3;
  t.scale = 2.5;
  Check(t, 0);
}

TEST(LoraMergeTest, StackedExperts) {
  LoraTarget t;
  t.experts = 4;
  t.in = 16;
  t.out = 36;
  t.rank = 5;
  t.scale = 0.75;
  Check(t, 4);
  // A rank's share under expert parallelism: the first experts only.
  Check(t, 2);
}

// A transposed expert layout (W[e] taken as [out, in]) must fail the check.
TEST(LoraMergeTest, CheckCanFail) {
  LoraTarget t;
  t.experts = 1;
  t.in = 8;
  t.out = 8;
  t.rank = 2;
  t.scale = 1;
  std::mt19937 rng(3);
  const std::vector<float> a = Random(t.rank * t.in, &rng);
  const std::vector<float> b = Random(t.out * t.rank, &rng);
  std::vector<float> w_expert(64, 0.0f), w_linear(64, 0.0f);
  LoraMergeInto(t, 1, a.data(), b.data(), w_expert.data());
  LoraTarget linear = t;
  linear.experts = 0;
  LoraMergeInto(linear, 0, a.data(), b.data(), w_linear.data());
  double diff = 0;
  for (int i = 0; i < 64; ++i) diff += std::fabs(w_expert[i] - w_linear[i]);
  EXPECT_GT(diff, 1.0);  // One is the other's transpose, not equal.
}

}  // namespace
}  // namespace shardd
