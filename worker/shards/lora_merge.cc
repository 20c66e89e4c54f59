#include "worker/shards/lora_merge.h"

#include "kernels/cpu/gemm.h"

namespace shardd {
namespace {

int I(int64_t x) { return static_cast<int>(x); }

LoraGemmOperand Op(LoraBuffer buffer, int64_t offset, int64_t ld,
                   bool transpose) {
  LoraGemmOperand o;
  o.buffer = buffer;
  o.offset = offset;
  o.ld = ld;
  o.transpose = transpose;
  return o;
}

LoraGemm Gemm(int64_t m, int64_t n, int64_t k, float alpha, LoraGemmOperand a,
              LoraGemmOperand b, float beta, LoraBuffer c, int64_t c_offset,
              int64_t ldc) {
  LoraGemm g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.a = a;
  g.b = b;
  g.beta = beta;
  g.c = c;
  g.c_offset = c_offset;
  g.ldc = ldc;
  return g;
}

void RunOnHost(const std::vector<LoraGemm>& gemms, const LoraBuffers& buf) {
  for (const LoraGemm& g : gemms) {
    kernels::Sgemm(g.a.transpose ? CblasTrans : CblasNoTrans,
                   g.b.transpose ? CblasTrans : CblasNoTrans, I(g.m), I(g.n),
                   I(g.k), g.alpha, buf.Get(g.a.buffer) + g.a.offset,
                   I(g.a.ld), buf.Get(g.b.buffer) + g.b.offset, I(g.b.ld),
                   g.beta, buf.Mutable(g.c) + g.c_offset, I(g.ldc));
  }
}

}  // namespace

float* LoraBuffers::Mutable(LoraBuffer which) const {
  switch (which) {
    case LoraBuffer::kWeight:
      return weight;
    case LoraBuffer::kGradA:
      return grad_a;
    case LoraBuffer::kGradB:
      return grad_b;
    default:
      return nullptr;
  }
}

const float* LoraBuffers::Get(LoraBuffer which) const {
  switch (which) {
    case LoraBuffer::kA:
      return a;
    case LoraBuffer::kB:
      return b;
    case LoraBuffer::kGrad:
      return grad;
    default:
      return Mutable(which);
  }
}

std::vector<LoraGemm> LoraMergeGemms(const LoraTarget& t, int64_t experts) {
  const float s = static_cast<float>(t.scale);
  const int64_t r = t.rank, in = t.in, out = t.out;
  using B = LoraBuffer;
  if (t.experts == 0) {
    // W [out, in] += s B [out, R] A [R, in].
    return {Gemm(out, in, r, s, Op(B::kB, 0, r, false), Op(B::kA, 0, in, false),
                 1.0f, B::kWeight, 0, in)};
  }
  std::vector<LoraGemm> gemms;
  for (int64_t e = 0; e < experts; ++e) {
    // W[e] [in, out] += s A_e^T B_e^T.
    gemms.push_back(Gemm(in, out, r, s, Op(B::kA, e * r * in, in, true),
                         Op(B::kB, e * out * r, r, true), 1.0f, B::kWeight,
                         e * in * out, out));
  }
  return gemms;
}

std::vector<LoraGemm> LoraSplitGradGemms(const LoraTarget& t,
                                         int64_t experts) {
  const float s = static_cast<float>(t.scale);
  const int64_t r = t.rank, in = t.in, out = t.out;
  using B = LoraBuffer;
  if (t.experts == 0) {
    // dA [R, in] = s B^T G; dB [out, R] = s G A^T; G [out, in].
    return {Gemm(r, in, out, s, Op(B::kB, 0, r, true), Op(B::kGrad, 0, in, false),
                 0.0f, B::kGradA, 0, in),
            Gemm(out, r, in, s, Op(B::kGrad, 0, in, false), Op(B::kA, 0, in, true),
                 0.0f, B::kGradB, 0, r)};
  }
  std::vector<LoraGemm> gemms;
  for (int64_t e = 0; e < experts; ++e) {
    // G[e] [in, out] is G_hf^T: dA_e = s B_e^T G[e]^T, dB_e = s G[e]^T A_e^T.
    const int64_t ge = e * in * out;
    gemms.push_back(Gemm(r, in, out, s, Op(B::kB, e * out * r, r, true),
                         Op(B::kGrad, ge, out, true), 0.0f, B::kGradA,
                         e * r * in, in));
    gemms.push_back(Gemm(out, r, in, s, Op(B::kGrad, ge, out, true),
                         Op(B::kA, e * r * in, in, true), 0.0f, B::kGradB,
                         e * out * r, r));
  }
  return gemms;
}

void LoraMergeInto(const LoraTarget& t, int64_t experts, const float* a,
                   const float* b, float* w) {
  LoraBuffers buf;
  buf.a = a;
  buf.b = b;
  buf.weight = w;
  RunOnHost(LoraMergeGemms(t, experts), buf);
}

void LoraSplitGrad(const LoraTarget& t, int64_t experts, const float* a,
                   const float* b, const float* g, float* da, float* db) {
  LoraBuffers buf;
  buf.a = a;
  buf.b = b;
  buf.grad = g;
  buf.grad_a = da;
  buf.grad_b = db;
  RunOnHost(LoraSplitGradGemms(t, experts), buf);
}

}  // namespace shardd
