#include "worker/shards/lora_merge.h"

#include "kernels/cpu/gemm.h"

namespace shardd {
namespace {

int I(int64_t x) { return static_cast<int>(x); }

}  // namespace

void LoraMergeInto(const LoraTarget& t, int64_t experts, const float* a,
                   const float* b, float* w) {
  const float s = static_cast<float>(t.scale);
  const int64_t r = t.rank, in = t.in, out = t.out;
  if (t.experts == 0) {
    // W [out, in] += s B [out, R] A [R, in].
    kernels::Sgemm(CblasNoTrans, CblasNoTrans, I(out), I(in), I(r), s, b,
                   I(r), a, I(in), 1.0f, w, I(in));
    return;
  }
  for (int64_t e = 0; e < experts; ++e) {
    // W[e] [in, out] += s A_e^T B_e^T.
    kernels::Sgemm(CblasTrans, CblasTrans, I(in), I(out), I(r), s,
                   a + e * r * in, I(in), b + e * out * r, I(r), 1.0f,
                   w + e * in * out, I(out));
  }
}

void LoraSplitGrad(const LoraTarget& t, int64_t experts, const float* a,
                   const float* b, const float* g, float* da, float* db) {
  const float s = static_cast<float>(t.scale);
  const int64_t r = t.rank, in = t.in, out = t.out;
  if (t.experts == 0) {
    // dA [R, in] = s B^T G; dB [out, R] = s G A^T; G [out, in].
    kernels::Sgemm(CblasTrans, CblasNoTrans, I(r), I(in), I(out), s, b, I(r),
                   g, I(in), 0.0f, da, I(in));
    kernels::Sgemm(CblasNoTrans, CblasTrans, I(out), I(r), I(in), s, g,
                   I(in), a, I(in), 0.0f, db, I(r));
    return;
  }
  for (int64_t e = 0; e < experts; ++e) {
    // G[e] [in, out] is G_hf^T: dA_e = s B_e^T G[e]^T, dB_e = s G[e]^T A_e^T.
    const float* ge = g + e * in * out;
    kernels::Sgemm(CblasTrans, CblasTrans, I(r), I(in), I(out), s,
                   b + e * out * r, I(r), ge, I(out), 0.0f, da + e * r * in,
                   I(in));
    kernels::Sgemm(CblasTrans, CblasTrans, I(out), I(r), I(in), s, ge,
                   I(out), a + e * r * in, I(in), 0.0f, db + e * out * r,
                   I(r));
  }
}

}  // namespace shardd
