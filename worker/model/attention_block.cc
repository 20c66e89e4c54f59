#include "worker/model/attention_block.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "worker/model/attention_geometry.h"

namespace shardd {

int64_t AttentionActs::bytes() const {
  size_t n_floats = 0;
  for (const std::vector<float>* v :
       {&n, &q_pre, &k_pre, &q_inv, &k_inv, &q, &k, &v, &o, &lse}) {
    n_floats += v->capacity();
  }
  return static_cast<int64_t>(n_floats * sizeof(float));
}

absl::Status AttentionBlock::Prepare(int64_t seq) {
  if (seq <= rope_.positions) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(rope_, RopeTableFor(*arch_, seq));
  return absl::OkStatus();
}

absl::Status AttentionBlock::Rotate(std::vector<float>* x, int64_t tokens,
                                    int64_t seq, int64_t heads, bool inverse) {
  FillPositions(segments_, tokens, seq, 0, &positions_);
  kernels::RopeShape shape;
  shape.tokens = tokens;
  shape.heads = heads;
  shape.token_stride = heads * arch_->head_dim;
  shape.head_stride = arch_->head_dim;
  return kernels::RopeRotate(rope_, RopeLayoutOf(*arch_), shape,
                             positions_.data(), x->data(), inverse);
}

absl::Status AttentionBlock::AddGrad(ParamSource* params, const ArchTensor& t,
                                     const std::vector<float>& g) {
  if (t.frozen) return absl::OkStatus();
  return params->AccumulateGrad(t.name, g.data());
}

absl::Status AttentionBlock::Forward(const MoeLayerSpec& layer,
                                     ParamSource* params, const float* n,
                                     int64_t batch, int64_t seq,
                                     AttentionActs* acts, float* y) {
  const int64_t t = batch * seq, d = arch_->dim, hd = arch_->head_dim;
  const int64_t hq = arch_->q_heads, hkv = arch_->kv_heads;
  SHARDD_RETURN_IF_ERROR(Prepare(seq));
  acts->n.assign(n, n + t * d);
  SHARDD_ASSIGN_OR_RETURN(const float* wq, params->Param(layer.q_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wk, params->Param(layer.k_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wv, params->Param(layer.v_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wo, params->Param(layer.o_proj.name));
  acts->q.resize(t * hq * hd);
  acts->k.resize(t * hkv * hd);
  acts->v.resize(t * hkv * hd);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(n, wq, t, d, hq * hd, acts->q.data()));
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(n, wk, t, d, hkv * hd, acts->k.data()));
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(n, wv, t, d, hkv * hd, acts->v.data()));
  if (layer.attention_bias) {
    // Before the norms and RoPE, as nn.Linear adds them.
    SHARDD_ASSIGN_OR_RETURN(const float* bq, params->Param(layer.q_bias.name));
    SHARDD_ASSIGN_OR_RETURN(const float* bk, params->Param(layer.k_bias.name));
    SHARDD_ASSIGN_OR_RETURN(const float* bv, params->Param(layer.v_bias.name));
    kernels::AddBias(bq, t, hq * hd, acts->q.data());
    kernels::AddBias(bk, t, hkv * hd, acts->k.data());
    kernels::AddBias(bv, t, hkv * hd, acts->v.data());
  }
  if (layer.qk_norm) {
    SHARDD_ASSIGN_OR_RETURN(const float* qn, params->Param(layer.q_norm.name));
    SHARDD_ASSIGN_OR_RETURN(const float* kn, params->Param(layer.k_norm.name));
    acts->q_pre = acts->q;
    acts->k_pre = acts->k;
    acts->q_inv.resize(t * hq);
    acts->k_inv.resize(t * hkv);
    SHARDD_RETURN_IF_ERROR(
        kernels::RmsNormForward(acts->q_pre.data(), qn, t * hq, hd, arch_->eps,
                                acts->q.data(), acts->q_inv.data()));
    SHARDD_RETURN_IF_ERROR(
        kernels::RmsNormForward(acts->k_pre.data(), kn, t * hkv, hd, arch_->eps,
                                acts->k.data(), acts->k_inv.data()));
  }
  SHARDD_RETURN_IF_ERROR(Rotate(&acts->q, t, seq, hq, false));
  SHARDD_RETURN_IF_ERROR(Rotate(&acts->k, t, seq, hkv, false));
  acts->o.resize(t * hq * hd);
  acts->lse.resize(batch * hq * seq);
  SHARDD_ASSIGN_OR_RETURN(const kernels::AttentionOptions options,
                          Options(layer, params));
  SHARDD_RETURN_IF_ERROR(kernels::AttentionForward(
      SelfAttentionDims(*arch_, batch, seq), options, acts->q.data(),
      acts->k.data(), acts->v.data(), acts->o.data(), acts->lse.data(), &ws_));
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(acts->o.data(), wo, t, hq * hd, d, y));
  if (layer.attention_bias) {
    SHARDD_ASSIGN_OR_RETURN(const float* bo, params->Param(layer.o_bias.name));
    kernels::AddBias(bo, t, d, y);
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::AttentionOptions> AttentionBlock::Options(
    const MoeLayerSpec& layer, ParamSource* params) {
  kernels::AttentionOptions options = SelfAttentionOptions(*arch_, layer);
  options.key_begin = segments_;
  if (layer.has_sinks) {
    SHARDD_ASSIGN_OR_RETURN(options.sinks, params->Param(layer.sinks.name));
  }
  return options;
}

absl::Status AttentionBlock::Backward(const MoeLayerSpec& layer,
                                      ParamSource* params,
                                      const AttentionActs& acts, int64_t batch,
                                      int64_t seq, const float* dy, float* dn) {
  const int64_t t = batch * seq, d = arch_->dim, hd = arch_->head_dim;
  const int64_t hq = arch_->q_heads, hkv = arch_->kv_heads;
  SHARDD_ASSIGN_OR_RETURN(const float* wq, params->Param(layer.q_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wk, params->Param(layer.k_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wv, params->Param(layer.v_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wo, params->Param(layer.o_proj.name));
  // y = o Wo^T.
  do_.resize(t * hq * hd);
  grad_.assign(d * hq * hd, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
      acts.o.data(), wo, dy, t, hq * hd, d, do_.data(), false,
      layer.o_proj.frozen ? nullptr : grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.o_proj, grad_));
  if (layer.attention_bias) {
    grad_.assign(d, 0.0f);
    kernels::BiasBackward(dy, t, d, grad_.data());
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.o_bias, grad_));
  }
  // The attention.
  dq_.assign(t * hq * hd, 0.0f);
  dk_.assign(t * hkv * hd, 0.0f);
  dv_.assign(t * hkv * hd, 0.0f);
  SHARDD_ASSIGN_OR_RETURN(const kernels::AttentionOptions options,
                          Options(layer, params));
  std::vector<float> d_sinks(layer.has_sinks ? hq : 0, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::AttentionBackward(
      SelfAttentionDims(*arch_, batch, seq), options, acts.q.data(),
      acts.k.data(), acts.v.data(), acts.o.data(), acts.lse.data(), do_.data(),
      dq_.data(), dk_.data(), dv_.data(),
      layer.has_sinks ? d_sinks.data() : nullptr, &ws_));
  if (layer.has_sinks) {
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.sinks, d_sinks));
  }
  // RoPE is a rotation: its backward is the inverse rotation.
  SHARDD_RETURN_IF_ERROR(Rotate(&dq_, t, seq, hq, true));
  SHARDD_RETURN_IF_ERROR(Rotate(&dk_, t, seq, hkv, true));
  if (layer.qk_norm) {
    SHARDD_ASSIGN_OR_RETURN(const float* qn, params->Param(layer.q_norm.name));
    SHARDD_ASSIGN_OR_RETURN(const float* kn, params->Param(layer.k_norm.name));
    std::vector<float> d_pre(t * hq * hd);
    grad_.assign(hd, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
        dq_.data(), acts.q_pre.data(), qn, acts.q_inv.data(), t * hq, hd,
        d_pre.data(), grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.q_norm, grad_));
    dq_.swap(d_pre);
    d_pre.resize(t * hkv * hd);
    grad_.assign(hd, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
        dk_.data(), acts.k_pre.data(), kn, acts.k_inv.data(), t * hkv, hd,
        d_pre.data(), grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.k_norm, grad_));
    dk_.swap(d_pre);
  }
  // The projections of n.
  struct Projection {
    const ArchTensor* tensor;
    const float* w;
    const std::vector<float>* dy;
    int64_t out;
  };
  const Projection projections[] = {{&layer.q_proj, wq, &dq_, hq * hd},
                                    {&layer.k_proj, wk, &dk_, hkv * hd},
                                    {&layer.v_proj, wv, &dv_, hkv * hd}};
  if (layer.attention_bias) {
    // The biases' gradients are those of the projections' outputs, taken
    // before RoPE and the norms (their backward has run above).
    const ArchTensor* biases[] = {&layer.q_bias, &layer.k_bias, &layer.v_bias};
    for (int i = 0; i < 3; ++i) {
      grad_.assign(projections[i].out, 0.0f);
      kernels::BiasBackward(projections[i].dy->data(), t, projections[i].out,
                            grad_.data());
      SHARDD_RETURN_IF_ERROR(AddGrad(params, *biases[i], grad_));
    }
  }
  bool first = true;
  for (const Projection& p : projections) {
    grad_.assign(p.out * d, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
        acts.n.data(), p.w, p.dy->data(), t, d, p.out, dn, !first,
        p.tensor->frozen ? nullptr : grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, *p.tensor, grad_));
    first = false;
  }
  return absl::OkStatus();
}

}  // namespace shardd
