#include "worker/model/mla_block.h"

#include <algorithm>

#include "common/status_macros.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "worker/model/attention_geometry.h"

namespace shardd {

int64_t MlaActs::bytes() const {
  size_t n_floats = 0;
  for (const std::vector<float>* x :
       {&n, &qa, &qa_inv, &qa_n, &c, &c_inv, &c_n, &q, &k, &v, &o, &lse}) {
    n_floats += x->capacity();
  }
  return static_cast<int64_t>(n_floats * sizeof(float));
}

absl::Status MlaBlock::Prepare(int64_t seq) {
  if (seq <= rope_.positions) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(rope_, RopeTableFor(*arch_, seq));
  return absl::OkStatus();
}

absl::Status MlaBlock::Rotate(float* x, int64_t tokens, int64_t seq,
                              int64_t heads, int64_t stride, int64_t offset,
                              bool inverse) {
  FillPositions(segments_, tokens, seq, 0, &positions_);
  return kernels::RopeRotate(rope_, RopeLayoutOf(*arch_),
                             HeadsRopeShape(tokens, heads, stride, offset),
                             positions_.data(), x, inverse);
}

absl::Status MlaBlock::AddGrad(ParamSource* params, const ArchTensor& t,
                               const std::vector<float>& g) {
  if (t.frozen) return absl::OkStatus();
  return params->AccumulateGrad(t.name, g.data());
}

absl::Status MlaBlock::LinearGrad(ParamSource* params, const ArchTensor& weight,
                                  const float* x, const float* dy,
                                  int64_t tokens, int64_t in, int64_t out,
                                  float* dx, bool accumulate) {
  SHARDD_ASSIGN_OR_RETURN(const float* w, params->Param(weight.name));
  grad_.assign(weight.frozen ? 0 : out * in, 0.0f);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearBackward(x, w, dy, tokens, in, out, dx, accumulate,
                              weight.frozen ? nullptr : grad_.data()));
  return AddGrad(params, weight, grad_);
}

absl::Status MlaBlock::Forward(const MoeLayerSpec& layer, ParamSource* params,
                               const float* n, int64_t batch, int64_t seq,
                               MlaActs* acts, float* y) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, h = a.q_heads;
  const int64_t nope = a.nope_head_dim, rope = a.rope_head_dim;
  const int64_t qk = nope + rope, dv = a.v_head_dim;
  const int64_t rq = a.q_lora_rank, rkv = a.kv_lora_rank;
  SHARDD_RETURN_IF_ERROR(Prepare(seq));
  acts->n.assign(n, n + t * d);
  // Queries.
  acts->q.resize(t * h * qk);
  if (rq > 0) {
    SHARDD_ASSIGN_OR_RETURN(const float* wqa,
                            params->Param(layer.q_a_proj.name));
    SHARDD_ASSIGN_OR_RETURN(const float* gqa,
                            params->Param(layer.q_a_norm.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wqb,
                            params->Param(layer.q_b_proj.name));
    acts->qa.resize(t * rq);
    SHARDD_RETURN_IF_ERROR(
        kernels::LinearForward(n, wqa, t, d, rq, acts->qa.data()));
    if (layer.attention_bias) {
      SHARDD_ASSIGN_OR_RETURN(const float* b,
                              params->Param(layer.q_a_bias.name));
      kernels::AddBias(b, t, rq, acts->qa.data());
    }
    acts->qa_n.resize(t * rq);
    acts->qa_inv.resize(t);
    SHARDD_RETURN_IF_ERROR(
        kernels::RmsNormForward(acts->qa.data(), gqa, t, rq, kMlaLatentNormEps,
                                acts->qa_n.data(), acts->qa_inv.data()));
    SHARDD_RETURN_IF_ERROR(kernels::LinearForward(acts->qa_n.data(), wqb, t, rq,
                                                  h * qk, acts->q.data()));
  } else {
    SHARDD_ASSIGN_OR_RETURN(const float* wq, params->Param(layer.q_proj.name));
    SHARDD_RETURN_IF_ERROR(
        kernels::LinearForward(n, wq, t, d, h * qk, acts->q.data()));
  }
  // The compressed kv and the shared rope key.
  SHARDD_ASSIGN_OR_RETURN(const float* wkva,
                          params->Param(layer.kv_a_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* gkv,
                          params->Param(layer.kv_a_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wkvb,
                          params->Param(layer.kv_b_proj.name));
  const int64_t wa = rkv + rope;
  kva_.resize(t * wa);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(n, wkva, t, d, wa, kva_.data()));
  if (layer.attention_bias) {
    SHARDD_ASSIGN_OR_RETURN(const float* b,
                            params->Param(layer.kv_a_bias.name));
    kernels::AddBias(b, t, wa, kva_.data());
  }
  acts->c.resize(t * rkv);
  kr_.resize(t * rope);
  for (int64_t i = 0; i < t; ++i) {
    std::copy_n(kva_.data() + i * wa, rkv, acts->c.data() + i * rkv);
    std::copy_n(kva_.data() + i * wa + rkv, rope, kr_.data() + i * rope);
  }
  acts->c_n.resize(t * rkv);
  acts->c_inv.resize(t);
  SHARDD_RETURN_IF_ERROR(
      kernels::RmsNormForward(acts->c.data(), gkv, t, rkv, kMlaLatentNormEps,
                              acts->c_n.data(), acts->c_inv.data()));
  const int64_t wb = nope + dv;
  kvb_.resize(t * h * wb);
  SHARDD_RETURN_IF_ERROR(kernels::LinearForward(acts->c_n.data(), wkvb, t, rkv,
                                                h * wb, kvb_.data()));
  // RoPE on the rope parts: every query head's, and the one shared key.
  SHARDD_RETURN_IF_ERROR(
      Rotate(acts->q.data(), t, seq, h, qk, nope, /*inverse=*/false));
  SHARDD_RETURN_IF_ERROR(Rotate(kr_.data(), t, seq, 1, rope, 0, false));
  acts->k.resize(t * h * qk);
  acts->v.resize(t * h * dv);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < h; ++j) {
      const float* src = kvb_.data() + (i * h + j) * wb;
      float* k = acts->k.data() + (i * h + j) * qk;
      std::copy_n(src, nope, k);
      std::copy_n(kr_.data() + i * rope, rope, k + nope);
      std::copy_n(src + nope, dv, acts->v.data() + (i * h + j) * dv);
    }
  }
  acts->o.resize(t * h * dv);
  acts->lse.resize(batch * h * seq);
  SHARDD_RETURN_IF_ERROR(kernels::AttentionForward(
      SelfAttentionDims(a, batch, seq), Options(layer),
      acts->q.data(), acts->k.data(), acts->v.data(), acts->o.data(),
      acts->lse.data(), &ws_));
  SHARDD_ASSIGN_OR_RETURN(const float* wo, params->Param(layer.o_proj.name));
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(acts->o.data(), wo, t, h * dv, d, y));
  if (layer.attention_bias) {
    SHARDD_ASSIGN_OR_RETURN(const float* bo, params->Param(layer.o_bias.name));
    kernels::AddBias(bo, t, d, y);
  }
  return absl::OkStatus();
}

absl::Status MlaBlock::Backward(const MoeLayerSpec& layer, ParamSource* params,
                                const MlaActs& acts, int64_t batch, int64_t seq,
                                const float* dy, float* dn) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, h = a.q_heads;
  const int64_t nope = a.nope_head_dim, rope = a.rope_head_dim;
  const int64_t qk = nope + rope, dv = a.v_head_dim;
  const int64_t rq = a.q_lora_rank, rkv = a.kv_lora_rank;
  // y = o Wo^T (+ bo).
  do_.resize(t * h * dv);
  SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.o_proj, acts.o.data(), dy, t,
                                    h * dv, d, do_.data(), false));
  if (layer.attention_bias) {
    grad_.assign(d, 0.0f);
    kernels::BiasBackward(dy, t, d, grad_.data());
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.o_bias, grad_));
  }
  // The attention.
  dq_.assign(t * h * qk, 0.0f);
  dk_.assign(t * h * qk, 0.0f);
  dv_.assign(t * h * dv, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::AttentionBackward(
      SelfAttentionDims(a, batch, seq), Options(layer),
      acts.q.data(), acts.k.data(), acts.v.data(), acts.o.data(),
      acts.lse.data(), do_.data(), dq_.data(), dk_.data(), dv_.data(),
      /*d_sinks=*/nullptr, &ws_));
  // RoPE is a rotation: its backward is the inverse rotation. The shared
  // rope key collects every head's gradient first.
  SHARDD_RETURN_IF_ERROR(Rotate(dq_.data(), t, seq, h, qk, nope, true));
  const int64_t wa = rkv + rope, wb = nope + dv;
  dkva_.assign(t * wa, 0.0f);
  dkvb_.resize(t * h * wb);
  for (int64_t i = 0; i < t; ++i) {
    float* dkr = dkva_.data() + i * wa + rkv;
    for (int64_t j = 0; j < h; ++j) {
      const float* dk = dk_.data() + (i * h + j) * qk;
      float* dst = dkvb_.data() + (i * h + j) * wb;
      std::copy_n(dk, nope, dst);
      std::copy_n(dv_.data() + (i * h + j) * dv, dv, dst + nope);
      for (int64_t r = 0; r < rope; ++r) dkr[r] += dk[nope + r];
    }
  }
  SHARDD_RETURN_IF_ERROR(Rotate(dkva_.data(), t, seq, 1, wa, rkv, true));
  // kv_b_proj, then kv_a_layernorm into the latent part of dkva.
  dlat_.resize(t * rkv);
  SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.kv_b_proj, acts.c_n.data(),
                                    dkvb_.data(), t, rkv, h * wb, dlat_.data(),
                                    false));
  {
    SHARDD_ASSIGN_OR_RETURN(const float* gkv,
                            params->Param(layer.kv_a_norm.name));
    dlat_pre_.resize(t * rkv);
    grad_.assign(rkv, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
        dlat_.data(), acts.c.data(), gkv, acts.c_inv.data(), t, rkv,
        dlat_pre_.data(), grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.kv_a_norm, grad_));
    for (int64_t i = 0; i < t; ++i) {
      std::copy_n(dlat_pre_.data() + i * rkv, rkv, dkva_.data() + i * wa);
    }
  }
  if (layer.attention_bias) {
    grad_.assign(wa, 0.0f);
    kernels::BiasBackward(dkva_.data(), t, wa, grad_.data());
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.kv_a_bias, grad_));
  }
  SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.kv_a_proj, acts.n.data(),
                                    dkva_.data(), t, d, wa, dn, false));
  // The queries.
  if (rq > 0) {
    dlat_.resize(t * rq);
    SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.q_b_proj, acts.qa_n.data(),
                                      dq_.data(), t, rq, h * qk, dlat_.data(),
                                      false));
    SHARDD_ASSIGN_OR_RETURN(const float* gqa,
                            params->Param(layer.q_a_norm.name));
    dlat_pre_.resize(t * rq);
    grad_.assign(rq, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
        dlat_.data(), acts.qa.data(), gqa, acts.qa_inv.data(), t, rq,
        dlat_pre_.data(), grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.q_a_norm, grad_));
    if (layer.attention_bias) {
      grad_.assign(rq, 0.0f);
      kernels::BiasBackward(dlat_pre_.data(), t, rq, grad_.data());
      SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.q_a_bias, grad_));
    }
    SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.q_a_proj, acts.n.data(),
                                      dlat_pre_.data(), t, d, rq, dn, true));
  } else {
    SHARDD_RETURN_IF_ERROR(LinearGrad(params, layer.q_proj, acts.n.data(),
                                      dq_.data(), t, d, h * qk, dn, true));
  }
  return absl::OkStatus();
}

}  // namespace shardd
