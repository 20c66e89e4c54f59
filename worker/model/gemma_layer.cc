#include "worker/model/gemma_layer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "worker/model/attention_geometry.h"

namespace shardd {

int64_t GemmaLayerActs::bytes() const {
  size_t floats = 0;
  for (const std::vector<float>* v :
       {&x_in,        &in_inv,      &n,         &q_pre,    &k_pre,
        &v_pre,       &q_inv,       &k_inv,     &v_inv,    &q,
        &k,           &v,           &o,         &lse,      &attn,
        &post_inv,    &m,           &pre_inv,   &dense_in, &dense_out,
        &post1_inv,   &r_inv,       &r_norm,    &r_in,     &pre2_inv,
        &experts_in,  &experts_out, &post2_inv, &sum,      &post_ff_inv,
        &weights,     &dm,          &dsum,      &dweights, &d_post_ff,
        &d_post_ff_2, &d_pre_ff_2,  &layer_w,   &dk_ext,   &dv_ext,
        &x_r,         &w_r,         &y_r,       &dy_r,     &dx_r,
        &dw_r}) {
    floats += v->capacity();
  }
  return static_cast<int64_t>(floats * sizeof(float) +
                              (indices.capacity() + ids_r.capacity()) *
                                  sizeof(int32_t) +
                              router.bytes() + experts.bytes() + mlp.bytes() +
                              route.bytes());
}

absl::Status GemmaLayerBlock::Prepare(int64_t seq) {
  if (seq <= full_rope_.positions) return absl::OkStatus();
  if (seq > arch_->max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seq: ", seq, " tokens exceed the model's max_position_embeddings (",
        arch_->max_positions, ")"));
  }
  SHARDD_ASSIGN_OR_RETURN(full_rope_,
                          kernels::BuildRopeTable(arch_->rope.inv_freq, seq,
                                                  arch_->rope.attention_factor));
  if (!arch_->sliding_rope.inv_freq.empty()) {
    SHARDD_ASSIGN_OR_RETURN(
        sliding_rope_,
        kernels::BuildRopeTable(arch_->sliding_rope.inv_freq, seq,
                                arch_->sliding_rope.attention_factor));
  }
  return absl::OkStatus();
}

const float* GemmaLayerBlock::Ones(int64_t dim) {
  if (static_cast<int64_t>(ones_.size()) < dim) ones_.assign(dim, 1.0f);
  return ones_.data();
}

absl::Status GemmaLayerBlock::AddGrad(ParamSource* params, const ArchTensor& t,
                                      const std::vector<float>& g) {
  if (t.frozen) return absl::OkStatus();
  return params->AccumulateGrad(t.name, g.data());
}

absl::Status GemmaLayerBlock::Rotate(const MoeLayerSpec& layer,
                                     std::vector<float>* x, int64_t tokens,
                                     int64_t seq, int64_t heads, bool inverse,
                                     const GemmaDecode* decode) {
  if (decode == nullptr) {
    FillPositions(segments_, tokens, seq, 0, &positions_);
  } else {
    positions_.resize(tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t p = decode->PrefixOf(t / seq) + t % seq;
      positions_[t] = static_cast<int32_t>(
          decode->row_prefix == nullptr
              ? p
              : std::min<int64_t>(p, decode->encoder_seq - 1));
    }
  }
  return kernels::RopeRotate(
      layer.sliding ? sliding_rope_ : full_rope_, kernels::RopeLayout::kHalf,
      HeadsRopeShape(tokens, heads, layer.layer_head_dim), positions_.data(),
      x->data(), inverse);
}

namespace {

// Rows [begin, begin + len) of each of `batch` sequences of `seq` rows of
// `width` floats, from src into dst (gather) or back (scatter).
void GatherRows(const float* src, int64_t batch, int64_t seq, int64_t width,
                int64_t begin, int64_t len, float* dst) {
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(src + (b * seq + begin) * width, len * width,
                dst + b * len * width);
  }
}
void ScatterRows(const float* src, int64_t batch, int64_t seq, int64_t width,
                 int64_t begin, int64_t len, float* dst) {
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(src + b * len * width, len * width,
                dst + (b * seq + begin) * width);
  }
}

}  // namespace

namespace {

// The decode's sequences in runs of one prefix, with block `blk`'s encoder
// keys for each run.
std::vector<DecodeRows> RowRuns(const MoeArchitecture& arch,
                                const MoeLayerSpec& layer,
                                const GemmaDecode& d,
                                const GemmaDecodeBlock& blk, int64_t batch) {
  return GemmaDecodeRowRuns(arch, layer, d.prefix, d.row_prefix,
                            d.encoder_seq, blk, batch);
}

}  // namespace

absl::Status GemmaLayerBlock::ComposeBlockKeys(
    const MoeLayerSpec& layer, const GemmaDecode& d, const GemmaDecodeBlock& blk,
    const DecodeRows& rows, int64_t batch, int64_t seq, const GemmaLayerActs& a,
    std::vector<float>* k, std::vector<float>* v) {
  const int64_t row = layer.layer_kv_heads * layer.layer_head_dim;
  const int64_t enc = rows.key_end - rows.key_lo;
  const int64_t len = enc + blk.len;
  const GemmaLayerActs& e = *d.encoder;
  if (static_cast<int64_t>(e.k.size()) != batch * d.encoder_seq * row ||
      rows.key_lo < 0) {
    return absl::FailedPreconditionError(
        "decode: the encode's K/V of this layer do not match the batch");
  }
  const int64_t n = rows.end - rows.begin;
  k->resize(n * len * row);
  v->resize(n * len * row);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = rows.begin + i;
    const int64_t src = (b * d.encoder_seq + rows.key_lo) * row,
                  dst = i * len * row;
    std::copy_n(e.k.data() + src, enc * row, k->data() + dst);
    std::copy_n(e.v.data() + src, enc * row, v->data() + dst);
    const int64_t canvas = (b * seq + blk.begin) * row;
    std::copy_n(a.k.data() + canvas, blk.len * row,
                k->data() + dst + enc * row);
    std::copy_n(a.v.data() + canvas, blk.len * row,
                v->data() + dst + enc * row);
  }
  return absl::OkStatus();
}

absl::Status GemmaLayerBlock::DecodeAttentionForward(const MoeLayerSpec& layer,
                                                     const GemmaDecode& d,
                                                     int64_t batch, int64_t seq,
                                                     GemmaLayerActs* a) {
  const int64_t hq = arch_->q_heads, hd = layer.layer_head_dim;
  const int64_t qrow = hq * hd;
  a->o.resize(batch * seq * qrow);
  a->lse.resize(batch * hq * seq);
  std::vector<float> q, k, v, o, lse;
  for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
    for (const DecodeRows& rows : RowRuns(*arch_, layer, d, blk, batch)) {
      const int64_t n = rows.end - rows.begin;
      SHARDD_RETURN_IF_ERROR(
          ComposeBlockKeys(layer, d, blk, rows, batch, seq, *a, &k, &v));
      q.resize(n * blk.len * qrow);
      GatherRows(a->q.data() + rows.begin * seq * qrow, n, seq, qrow,
                 blk.begin, blk.len, q.data());
      kernels::AttentionDims dims =
          GemmaAttentionDims(*arch_, layer, n, blk.len);
      dims.kv_len =
          static_cast<int64_t>(k.size()) / (n * layer.layer_kv_heads * hd);
      o.resize(q.size());
      lse.resize(n * hq * blk.len);
      SHARDD_RETURN_IF_ERROR(kernels::AttentionForward(
          dims, GemmaAttentionOptions(*arch_, layer, true), q.data(), k.data(),
          v.data(), o.data(), lse.data(), &ws_));
      ScatterRows(o.data(), n, seq, qrow, blk.begin, blk.len,
                  a->o.data() + rows.begin * seq * qrow);
      // lse [batch, hq, rows]: (batch, head) rows of `seq`.
      ScatterRows(lse.data(), n * hq, seq, 1, blk.begin, blk.len,
                  a->lse.data() + rows.begin * hq * seq);
    }
  }
  return absl::OkStatus();
}

absl::Status GemmaLayerBlock::DecodeAttentionBackward(const MoeLayerSpec& layer,
                                                      const GemmaDecode& d,
                                                      int64_t batch,
                                                      int64_t seq,
                                                      const GemmaLayerActs& a) {
  const int64_t hq = arch_->q_heads, hkv = layer.layer_kv_heads;
  const int64_t hd = layer.layer_head_dim, row = hkv * hd, qrow = hq * hd;
  const int64_t t = batch * seq;
  dq_.assign(t * qrow, 0.0f);
  dk_.assign(t * row, 0.0f);
  dv_.assign(t * row, 0.0f);
  GemmaLayerActs& e = *d.encoder;
  const int64_t total = batch * d.encoder_seq * row;
  if (static_cast<int64_t>(e.dk_ext.size()) != total) {
    e.dk_ext.assign(total, 0.0f);
    e.dv_ext.assign(total, 0.0f);
  }
  std::vector<float> q, k, v, o, lse, dout, dq, dk, dv;
  for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
    for (const DecodeRows& rows : RowRuns(*arch_, layer, d, blk, batch)) {
      const int64_t n = rows.end - rows.begin;
      SHARDD_RETURN_IF_ERROR(
          ComposeBlockKeys(layer, d, blk, rows, batch, seq, a, &k, &v));
      const int64_t len = static_cast<int64_t>(k.size()) / (n * row);
      const int64_t enc = len - blk.len;
      const int64_t q0 = rows.begin * seq * qrow;
      q.resize(n * blk.len * qrow);
      o.resize(q.size());
      dout.resize(q.size());
      lse.resize(n * hq * blk.len);
      GatherRows(a.q.data() + q0, n, seq, qrow, blk.begin, blk.len, q.data());
      GatherRows(a.o.data() + q0, n, seq, qrow, blk.begin, blk.len, o.data());
      GatherRows(do_.data() + q0, n, seq, qrow, blk.begin, blk.len,
                 dout.data());
      GatherRows(a.lse.data() + rows.begin * hq * seq, n * hq, seq, 1,
                 blk.begin, blk.len, lse.data());
      kernels::AttentionDims dims =
          GemmaAttentionDims(*arch_, layer, n, blk.len);
      dims.kv_len = len;
      dq.assign(q.size(), 0.0f);
      dk.assign(k.size(), 0.0f);
      dv.assign(v.size(), 0.0f);
      SHARDD_RETURN_IF_ERROR(kernels::AttentionBackward(
          dims, GemmaAttentionOptions(*arch_, layer, true), q.data(), k.data(),
          v.data(), o.data(), lse.data(), dout.data(), dq.data(), dk.data(),
          dv.data(), nullptr, &ws_));
      ScatterRows(dq.data(), n, seq, qrow, blk.begin, blk.len,
                  dq_.data() + q0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = rows.begin + i;
        const int64_t src = i * len * row;
        const int64_t dst = (b * d.encoder_seq + rows.key_lo) * row;
        for (int64_t j = 0; j < enc * row; ++j) {
          e.dk_ext[dst + j] += dk[src + j];
          e.dv_ext[dst + j] += dv[src + j];
        }
        const int64_t canvas = (b * seq + blk.begin) * row;
        std::copy_n(dk.data() + src + enc * row, blk.len * row,
                    dk_.data() + canvas);
        std::copy_n(dv.data() + src + enc * row, blk.len * row,
                    dv_.data() + canvas);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status GemmaLayerBlock::ForwardLayer(const MoeLayerSpec& layer,
                                           ParamSource* params, const float* x,
                                           int64_t batch, int64_t seq,
                                           GemmaLayerActs* a,
                                           const GemmaDecode* decode) {
  // A new forward: no decode has read these K/V yet.
  a->dk_ext.clear();
  a->dv_ext.clear();
  a->x_in.assign(x, x + batch * seq * arch_->dim);
  return LayerFromInput(layer, params, batch, seq, a, decode);
}

absl::Status GemmaLayerBlock::RecomputeLayer(const MoeLayerSpec& layer,
                                             ParamSource* params, int64_t batch,
                                             int64_t seq, GemmaLayerActs* a,
                                             const GemmaDecode* decode) {
  if (static_cast<int64_t>(a->x_in.size()) != batch * seq * arch_->dim) {
    return absl::FailedPreconditionError(
        "recompute of a DiffusionGemma layer without its kept input");
  }
  return LayerFromInput(layer, params, batch, seq, a, decode);
}

void GemmaLayerBlock::KeepCheckpoint(bool experts_only, bool keep_kv,
                                     GemmaLayerActs* a) {
  if (experts_only) {
    a->experts = kernels::GroupedExpertsWorkspace();
    a->route = ExpertRoute();  // The recompute routes again.
    std::vector<float>().swap(a->experts_out);
    std::vector<float>().swap(a->post2_inv);
    return;
  }
  GemmaLayerActs keep;
  keep.x_in = std::move(a->x_in);
  keep.m = std::move(a->m);
  keep.sum = std::move(a->sum);
  keep.pre2_inv = std::move(a->pre2_inv);
  keep.post_ff_inv = std::move(a->post_ff_inv);
  keep.experts_in = std::move(a->experts_in);
  keep.indices = std::move(a->indices);
  keep.weights = std::move(a->weights);
  keep.layer_w = std::move(a->layer_w);
  if (keep_kv) {
    keep.k = std::move(a->k);
    keep.v = std::move(a->v);
  }
  *a = std::move(keep);
}

absl::Status GemmaLayerBlock::RecomputeExperts(
    const MoeLayerSpec& layer, ParamSource* params, int64_t t,
    GemmaLayerActs* a, const RoutedExchange* ep) {
  const int64_t d = arch_->dim;
  if (static_cast<int64_t>(a->layer_w.size()) != 3 * d + 1) {
    return absl::FailedPreconditionError(
        "recompute of a DiffusionGemma layer's experts without its forward");
  }
  SHARDD_RETURN_IF_ERROR(RoutedExpertsForward(layer, params, t, a, ep));
  // post_feedforward_layernorm_2's inverse RMS (its weight: the copy).
  a->post2_inv.resize(t);
  g_.resize(t * d);
  return kernels::RmsNormForward(a->experts_out.data(), a->layer_w.data(), t, d,
                                 arch_->eps, g_.data(), a->post2_inv.data());
}

absl::Status GemmaLayerBlock::LayerFromInput(const MoeLayerSpec& layer,
                                             ParamSource* params, int64_t batch,
                                             int64_t seq, GemmaLayerActs* a,
                                             const GemmaDecode* decode) {
  const int64_t t = batch * seq, d = arch_->dim, hq = arch_->q_heads;
  const int64_t hkv = layer.layer_kv_heads, hd = layer.layer_head_dim;
  const float eps = arch_->eps;
  SHARDD_RETURN_IF_ERROR(Prepare(
      decode == nullptr ? seq
      : decode->row_prefix == nullptr ? seq + decode->prefix
                                      : decode->encoder_seq));
  const float* x = a->x_in.data();
  SHARDD_ASSIGN_OR_RETURN(const float* w_in, params->Param(layer.norm.name));
  a->in_inv.resize(t);
  a->n.resize(t * d);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(x, w_in, t, d, eps,
                                                 a->n.data(), a->in_inv.data()));
  // The self-attention.
  SHARDD_ASSIGN_OR_RETURN(const float* wq, params->Param(layer.q_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wk, params->Param(layer.k_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wo, params->Param(layer.o_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* qn, params->Param(layer.q_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* kn, params->Param(layer.k_norm.name));
  a->q_pre.resize(t * hq * hd);
  a->k_pre.resize(t * hkv * hd);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(a->n.data(), wq, t, d, hq * hd, a->q_pre.data()));
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(a->n.data(), wk, t, d, hkv * hd, a->k_pre.data()));
  if (layer.values_from_keys) {
    // Full layers: the values are k_proj's output before k_norm and RoPE.
    a->v_pre = a->k_pre;
  } else {
    SHARDD_ASSIGN_OR_RETURN(const float* wv, params->Param(layer.v_proj.name));
    a->v_pre.resize(t * hkv * hd);
    SHARDD_RETURN_IF_ERROR(kernels::LinearForward(a->n.data(), wv, t, d,
                                                  hkv * hd, a->v_pre.data()));
  }
  a->q.resize(t * hq * hd);
  a->k.resize(t * hkv * hd);
  a->v.resize(t * hkv * hd);
  a->q_inv.resize(t * hq);
  a->k_inv.resize(t * hkv);
  a->v_inv.resize(t * hkv);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->q_pre.data(), qn, t * hq, hd, eps, a->q.data(), a->q_inv.data()));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->k_pre.data(), kn, t * hkv, hd, eps, a->k.data(), a->k_inv.data()));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(a->v_pre.data(), Ones(hd),
                                                 t * hkv, hd, eps, a->v.data(),
                                                 a->v_inv.data()));
  SHARDD_RETURN_IF_ERROR(Rotate(layer, &a->q, t, seq, hq, false, decode));
  SHARDD_RETURN_IF_ERROR(Rotate(layer, &a->k, t, seq, hkv, false, decode));
  if (decode != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        DecodeAttentionForward(layer, *decode, batch, seq, a));
  } else {
    a->o.resize(t * hq * hd);
    a->lse.resize(batch * hq * seq);
    SHARDD_RETURN_IF_ERROR(kernels::AttentionForward(
        GemmaAttentionDims(*arch_, layer, batch, seq), CausalOptions(layer), a->q.data(),
        a->k.data(), a->v.data(), a->o.data(), a->lse.data(), &ws_));
  }
  a->attn.resize(t * d);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(a->o.data(), wo, t, hq * hd, d, a->attn.data()));
  // m = x + post_attention_layernorm(attn).
  SHARDD_ASSIGN_OR_RETURN(const float* w_post,
                          params->Param(layer.post_norm.name));
  a->m.resize(t * d);
  a->post_inv.resize(t);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->attn.data(), w_post, t, d, eps, a->m.data(), a->post_inv.data()));
  for (int64_t i = 0; i < t * d; ++i) a->m[i] += x[i];
  // The dense branch: h1, kept in `sum` until the experts add h2.
  SHARDD_ASSIGN_OR_RETURN(const float* w_pre,
                          params->Param(layer.pre_ff_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* w_post1,
                          params->Param(layer.post_ff_norm_1.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wg, params->Param(layer.mlp_gate.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, params->Param(layer.mlp_up.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, params->Param(layer.mlp_down.name));
  a->pre_inv.resize(t);
  a->dense_in.resize(t * d);
  a->dense_out.resize(t * d);
  a->post1_inv.resize(t);
  a->sum.resize(t * d);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->m.data(), w_pre, t, d, eps, a->dense_in.data(), a->pre_inv.data()));
  SHARDD_RETURN_IF_ERROR(kernels::DenseMlpForward(
      {t, d, layer.mlp_inter}, arch_->activation, a->dense_in.data(), wg, wu,
      wd, a->dense_out.data(), &a->mlp));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(a->dense_out.data(), w_post1,
                                                 t, d, eps, a->sum.data(),
                                                 a->post1_inv.data()));
  // The router reads m itself: RMSNorm without weight, times scale and
  // D^-0.5 (HF's order), then proj.
  SHARDD_ASSIGN_OR_RETURN(const float* scale,
                          params->Param(layer.router_scale.name));
  SHARDD_ASSIGN_OR_RETURN(const float* proj, params->Param(layer.gate.name));
  const float root = static_cast<float>(1.0 / std::sqrt(double(d)));
  a->r_inv.resize(t);
  a->r_norm.resize(t * d);
  a->r_in.resize(t * d);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->m.data(), Ones(d), t, d, eps, a->r_norm.data(), a->r_inv.data()));
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      a->r_in[r * d + j] = a->r_norm[r * d + j] * scale[j] * root;
    }
  }
  const int64_t k = arch_->top_k;
  a->indices.resize(t * k);
  a->weights.resize(t * k);
  kernels::RouterDims rd{t, d, layer.experts, k, arch_->renormalize_topk};
  SHARDD_RETURN_IF_ERROR(kernels::RouterForward(rd, a->r_in.data(), proj,
                                                a->indices.data(),
                                                a->weights.data(), &a->router));
  // The experts' input.
  SHARDD_ASSIGN_OR_RETURN(const float* w_pre2,
                          params->Param(layer.pre_ff_norm_2.name));
  a->pre2_inv.resize(t);
  a->experts_in.resize(t * d);
  return kernels::RmsNormForward(a->m.data(), w_pre2, t, d, eps,
                                 a->experts_in.data(), a->pre2_inv.data());
}

absl::Status GemmaLayerBlock::ForwardExperts(const MoeLayerSpec& layer,
                                             ParamSource* params, int64_t t,
                                             GemmaLayerActs* a, float* x,
                                             const RoutedExchange* ep,
                                             ExpertsPhase phase) {
  const int64_t d = arch_->dim;
  const float eps = arch_->eps;
  const bool all = phase == ExpertsPhase::kAll;
  if (!all && (ep == nullptr || ep->exchange == nullptr)) {
    return absl::FailedPreconditionError(
        "DISPATCH / COMBINE of a DiffusionGemma layer without expert "
        "parallelism");
  }
  if ((all || phase == ExpertsPhase::kCombine) && x == nullptr) {
    return absl::InvalidArgumentError("EXPERTS' forward without an output");
  }
  if (all || phase == ExpertsPhase::kDispatch) {
    // The layer unit's weights the rest of EXPERTS and its backward read.
    SHARDD_ASSIGN_OR_RETURN(const float* w_post2,
                            params->Param(layer.post_ff_norm_2.name));
    SHARDD_ASSIGN_OR_RETURN(const float* w_post,
                            params->Param(layer.post_ff_norm.name));
    SHARDD_ASSIGN_OR_RETURN(const float* ls,
                            params->Param(layer.layer_scalar.name));
    SHARDD_ASSIGN_OR_RETURN(const float* w_pre2,
                            params->Param(layer.pre_ff_norm_2.name));
    a->layer_w.clear();
    a->layer_w.reserve(3 * d + 1);
    a->layer_w.assign(w_post2, w_post2 + d);
    a->layer_w.insert(a->layer_w.end(), w_post, w_post + d);
    a->layer_w.insert(a->layer_w.end(), w_pre2, w_pre2 + d);
    a->layer_w.push_back(ls[0]);
  }
  if (all) {
    SHARDD_RETURN_IF_ERROR(RoutedExpertsForward(layer, params, t, a, ep));
  } else {
    SHARDD_RETURN_IF_ERROR(ExchangedForward(layer, params, t, a, *ep, phase));
    if (phase != ExpertsPhase::kCombine) return absl::OkStatus();
  }
  if (static_cast<int64_t>(a->layer_w.size()) != 3 * d + 1) {
    return absl::FailedPreconditionError(
        "COMBINE of a DiffusionGemma layer without its DISPATCH");
  }
  const float* w_post2 = a->layer_w.data();
  const float* w_post = w_post2 + d;
  const float* ls = w_post + 2 * d;
  a->post2_inv.resize(t);
  g_.resize(t * d);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(a->experts_out.data(),
                                                 w_post2, t, d, eps, g_.data(),
                                                 a->post2_inv.data()));
  for (int64_t i = 0; i < t * d; ++i) a->sum[i] += g_[i];
  a->post_ff_inv.resize(t);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
      a->sum.data(), w_post, t, d, eps, g_.data(), a->post_ff_inv.data()));
  for (int64_t i = 0; i < t * d; ++i) x[i] = (a->m[i] + g_[i]) * ls[0];
  return absl::OkStatus();
}

absl::Status GemmaLayerBlock::BackwardExperts(const MoeLayerSpec& layer,
                                              ParamSource* params, int64_t t,
                                              const float* dx,
                                              GemmaLayerActs* a,
                                              const RoutedExchange* ep,
                                              ExpertsPhase phase) {
  const int64_t d = arch_->dim;
  if (static_cast<int64_t>(a->layer_w.size()) != 3 * d + 1) {
    return absl::FailedPreconditionError(
        "BACKWARD(EXPERTS) of a DiffusionGemma layer without its forward");
  }
  const bool all = phase == ExpertsPhase::kAll;
  if (!all && (ep == nullptr || ep->exchange == nullptr)) {
    return absl::FailedPreconditionError(
        "BACKWARD DISPATCH / COMBINE of a DiffusionGemma layer without "
        "expert parallelism");
  }
  const float* w_post2 = a->layer_w.data();
  const float* w_post = w_post2 + d;
  const float* w_pre2 = w_post + d;
  const float* ls = w_pre2 + d;
  if (all || phase == ExpertsPhase::kCombine) {
    // The residual and the post-feed-forward norm both see dx *
    // layer_scalar.
    a->dm.resize(t * d);
    for (int64_t i = 0; i < t * d; ++i) a->dm[i] = dx[i] * ls[0];
    a->dsum.resize(t * d);
    a->d_post_ff.assign(d, 0.0f);
    SHARDD_RETURN_IF_ERROR(
        kernels::RmsNormBackward(a->dm.data(), a->sum.data(), w_post,
                                 a->post_ff_inv.data(), t, d, a->dsum.data(),
                                 a->d_post_ff.data()));
    g2_.resize(t * d);
    a->d_post_ff_2.assign(d, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
        a->dsum.data(), a->experts_out.data(), w_post2, a->post2_inv.data(), t,
        d, g2_.data(), a->d_post_ff_2.data()));
  }
  g_.resize(t * d);
  if (all) {
    SHARDD_RETURN_IF_ERROR(
        RoutedExpertsBackward(layer, params, t, g2_.data(), g_.data(), a, ep));
  } else {
    SHARDD_RETURN_IF_ERROR(ExchangedBackward(layer, params, t, g2_.data(),
                                             g_.data(), a, *ep, phase));
    if (phase != ExpertsPhase::kDispatch) return absl::OkStatus();
  }
  a->d_pre_ff_2.assign(d, 0.0f);
  return kernels::RmsNormBackward(g_.data(), a->m.data(), w_pre2,
                                  a->pre2_inv.data(), t, d, a->dm.data(),
                                  a->d_pre_ff_2.data(), /*accumulate_dx=*/true);
}

absl::Status GemmaLayerBlock::RoutedExpertsForward(
    const MoeLayerSpec& layer, ParamSource* params, int64_t t,
    GemmaLayerActs* a, const RoutedExchange* ep) {
  if (ep != nullptr && ep->exchange != nullptr) {
    for (ExpertsPhase phase : {ExpertsPhase::kDispatch, ExpertsPhase::kCompute,
                               ExpertsPhase::kCombine}) {
      SHARDD_RETURN_IF_ERROR(ExchangedForward(layer, params, t, a, *ep, phase));
    }
    return absl::OkStatus();
  }
  a->experts_out.resize(t * arch_->dim);
  return ExpertsKernelForward(layer, params, t, arch_->top_k,
                              a->experts_in.data(), a->indices.data(),
                              a->weights.data(), a->experts_out.data(), a);
}

absl::Status GemmaLayerBlock::ExpertsKernelForward(
    const MoeLayerSpec& layer, ParamSource* params, int64_t rows, int k,
    const float* x, const int32_t* ids, const float* w, float* y,
    GemmaLayerActs* a) {
  SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(layer.w_gu.name));
  SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(layer.w_d.name));
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsForward(
      {rows, arch_->dim, layer.moe_inter, layer.experts, k}, arch_->activation,
      x, ids, w, nullptr, w_gu, w_d, y, &a->experts));
  // The per-row outputs are the kernel's scratch; backward regrows them.
  decltype(a->experts.o)().swap(a->experts.o);
  return absl::OkStatus();
}

absl::Status GemmaLayerBlock::ExpertsKernelBackward(
    const MoeLayerSpec& layer, ParamSource* params, int64_t rows, int k,
    const float* dy, float* dx, float* dweights, GemmaLayerActs* a) {
  SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(layer.w_gu.name));
  SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(layer.w_d.name));
  std::vector<float> dw_gu(layer.w_gu.frozen ? 0 : layer.w_gu.numel(), 0.0f);
  std::vector<float> dw_d(layer.w_d.frozen ? 0 : layer.w_d.numel(), 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsBackward(
      {rows, arch_->dim, layer.moe_inter, layer.experts, k},
      arch_->activation, w_gu, w_d, dy, dx, /*accumulate_dx=*/false, dweights,
      dw_gu.empty() ? nullptr : dw_gu.data(),
      dw_d.empty() ? nullptr : dw_d.data(), &a->experts));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.w_gu, dw_gu));
  return AddGrad(params, layer.w_d, dw_d);
}

absl::Status GemmaLayerBlock::ExchangedForward(const MoeLayerSpec& layer,
                                               ParamSource* params, int64_t t,
                                               GemmaLayerActs* a,
                                               const RoutedExchange& ep,
                                               ExpertsPhase phase) {
  const int64_t d = arch_->dim;
  const int k = arch_->top_k;
  ExpertExchange& ex = *ep.exchange;
  const int64_t r = a->route.received;
  switch (phase) {
    case ExpertsPhase::kDispatch:
      // Each received row is one (token, slot) for one local expert.
      SHARDD_RETURN_IF_ERROR(ex.Route(a->indices.data(), t, k,
                                      ep.max_received_rows, &a->route));
      a->x_r.resize(a->route.received * d);
      a->w_r.resize(a->route.received);
      a->ids_r.resize(a->route.received);
      return ex.Dispatch(a->route, a->experts_in.data(), a->weights.data(),
                         a->indices.data(), d, a->x_r.data(), a->ids_r.data(),
                         a->w_r.data());
    case ExpertsPhase::kCompute: {
      if (a->route.t != t || static_cast<int64_t>(a->x_r.size()) != r * d) {
        return absl::FailedPreconditionError(
            "EXPERTS of an expert-parallel DiffusionGemma layer before its "
            "DISPATCH");
      }
      // Top-1 over the block, each row's weight applied here as on one rank.
      a->y_r.resize(r * d);
      SHARDD_RETURN_IF_ERROR(ExpertsKernelForward(
          layer, params, r, /*k=*/1, a->x_r.data(), a->ids_r.data(),
          a->w_r.data(), a->y_r.data(), a));
      std::vector<float>().swap(a->x_r);
      std::vector<float>().swap(a->w_r);
      std::vector<int32_t>().swap(a->ids_r);
      return absl::OkStatus();
    }
    case ExpertsPhase::kCombine:
      if (a->route.t != t || static_cast<int64_t>(a->y_r.size()) != r * d) {
        return absl::FailedPreconditionError(
            "COMBINE of an expert-parallel DiffusionGemma layer before its "
            "EXPERTS");
      }
      a->experts_out.resize(t * d);
      SHARDD_RETURN_IF_ERROR(
          ex.Combine(a->route, a->y_r.data(), d, a->experts_out.data()));
      std::vector<float>().swap(a->y_r);
      return absl::OkStatus();
    case ExpertsPhase::kAll:
      break;
  }
  return absl::InternalError("ExchangedForward of the whole EXPERTS");
}

absl::Status GemmaLayerBlock::RoutedExpertsBackward(
    const MoeLayerSpec& layer, ParamSource* params, int64_t t,
    const float* dy, float* dx, GemmaLayerActs* a,
    const RoutedExchange* ep) {
  if (ep != nullptr && ep->exchange != nullptr) {
    for (ExpertsPhase phase : {ExpertsPhase::kCombine, ExpertsPhase::kCompute,
                               ExpertsPhase::kDispatch}) {
      SHARDD_RETURN_IF_ERROR(
          ExchangedBackward(layer, params, t, dy, dx, a, *ep, phase));
    }
    return absl::OkStatus();
  }
  a->dweights.resize(t * arch_->top_k);
  return ExpertsKernelBackward(layer, params, t, arch_->top_k, dy, dx,
                               a->dweights.data(), a);
}

absl::Status GemmaLayerBlock::ExchangedBackward(
    const MoeLayerSpec& layer, ParamSource* params, int64_t t,
    const float* dy, float* dx, GemmaLayerActs* a, const RoutedExchange& ep,
    ExpertsPhase phase) {
  const int64_t d = arch_->dim;
  const int k = arch_->top_k;
  ExpertExchange& ex = *ep.exchange;
  const int64_t r = a->route.received;
  if (a->route.t != t || a->route.k != k) {
    return absl::FailedPreconditionError(
        "BACKWARD of an expert-parallel DiffusionGemma layer without its "
        "forward's route");
  }
  switch (phase) {
    case ExpertsPhase::kCombine:
      a->dy_r.resize(r * d);
      return ex.DispatchGrad(a->route, dy, d, a->dy_r.data());
    case ExpertsPhase::kCompute: {
      if (static_cast<int64_t>(a->dy_r.size()) != r * d) {
        return absl::FailedPreconditionError(
            "BACKWARD EXPERTS of an expert-parallel DiffusionGemma layer "
            "before its BACKWARD COMBINE");
      }
      a->dx_r.resize(r * d);
      a->dw_r.resize(r);
      SHARDD_RETURN_IF_ERROR(ExpertsKernelBackward(
          layer, params, r, /*k=*/1, a->dy_r.data(), a->dx_r.data(),
          a->dw_r.data(), a));
      std::vector<float>().swap(a->dy_r);
      return absl::OkStatus();
    }
    case ExpertsPhase::kDispatch:
      if (static_cast<int64_t>(a->dx_r.size()) != r * d) {
        return absl::FailedPreconditionError(
            "BACKWARD DISPATCH of an expert-parallel DiffusionGemma layer "
            "before its BACKWARD EXPERTS");
      }
      a->dweights.resize(t * k);
      SHARDD_RETURN_IF_ERROR(ex.CombineGrad(a->route, a->dx_r.data(),
                                            a->dw_r.data(), d, dx,
                                            a->dweights.data()));
      std::vector<float>().swap(a->dx_r);
      std::vector<float>().swap(a->dw_r);
      a->route = ExpertRoute();
      return absl::OkStatus();
    case ExpertsPhase::kAll:
      break;
  }
  return absl::InternalError("ExchangedBackward of the whole EXPERTS");
}

absl::Status GemmaLayerBlock::BackwardLayer(const MoeLayerSpec& layer,
                                            ParamSource* params, int64_t batch,
                                            int64_t seq, GemmaLayerActs* a,
                                            float* dx,
                                            const GemmaDecode* decode) {
  const int64_t t = batch * seq, d = arch_->dim, hq = arch_->q_heads;
  const int64_t hkv = layer.layer_kv_heads, hd = layer.layer_head_dim;
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.post_ff_norm, a->d_post_ff));
  SHARDD_RETURN_IF_ERROR(
      AddGrad(params, layer.post_ff_norm_2, a->d_post_ff_2));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.pre_ff_norm_2, a->d_pre_ff_2));
  // The dense branch, from d(h1 + h2).
  SHARDD_ASSIGN_OR_RETURN(const float* w_post1,
                          params->Param(layer.post_ff_norm_1.name));
  SHARDD_ASSIGN_OR_RETURN(const float* w_pre,
                          params->Param(layer.pre_ff_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wg, params->Param(layer.mlp_gate.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, params->Param(layer.mlp_up.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, params->Param(layer.mlp_down.name));
  g_.resize(t * d);
  g2_.resize(t * d);
  grad_.assign(d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      a->dsum.data(), a->dense_out.data(), w_post1, a->post1_inv.data(), t, d,
      g2_.data(), grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.post_ff_norm_1, grad_));
  const int64_t n_mlp = layer.mlp_inter * d;
  std::vector<float> dwg(layer.mlp_gate.frozen ? 0 : n_mlp, 0.0f);
  std::vector<float> dwu(layer.mlp_up.frozen ? 0 : n_mlp, 0.0f);
  std::vector<float> dwd(layer.mlp_down.frozen ? 0 : n_mlp, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::DenseMlpBackward(
      {t, d, layer.mlp_inter}, arch_->activation, wg, wu, wd, g2_.data(),
      g_.data(), /*accumulate_dx=*/false, dwg.empty() ? nullptr : dwg.data(),
      dwu.empty() ? nullptr : dwu.data(), dwd.empty() ? nullptr : dwd.data(),
      &a->mlp));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.mlp_gate, dwg));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.mlp_up, dwu));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.mlp_down, dwd));
  grad_.assign(d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      g_.data(), a->m.data(), w_pre, a->pre_inv.data(), t, d, a->dm.data(),
      grad_.data(), /*accumulate_dx=*/true));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.pre_ff_norm, grad_));
  // The router: frozen in the release, but its weights depend on m.
  SHARDD_ASSIGN_OR_RETURN(const float* scale,
                          params->Param(layer.router_scale.name));
  SHARDD_ASSIGN_OR_RETURN(const float* proj, params->Param(layer.gate.name));
  std::vector<float> dproj(layer.gate.frozen ? 0 : layer.gate.numel(), 0.0f);
  kernels::RouterDims rd{t, d, layer.experts, arch_->top_k,
                         arch_->renormalize_topk};
  SHARDD_RETURN_IF_ERROR(kernels::RouterBackward(
      rd, a->r_in.data(), proj, a->dweights.data(), g_.data(),
      /*accumulate_dx=*/false, dproj.empty() ? nullptr : dproj.data(),
      &a->router));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.gate, dproj));
  const float root = static_cast<float>(1.0 / std::sqrt(double(d)));
  if (!layer.router_scale.frozen) {
    std::vector<double> ds(d, 0.0);
    for (int64_t r = 0; r < t; ++r) {
      for (int64_t j = 0; j < d; ++j) {
        ds[j] += double{g_[r * d + j]} * a->r_norm[r * d + j] * root;
      }
    }
    grad_.assign(ds.begin(), ds.end());
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.router_scale, grad_));
  }
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t j = 0; j < d; ++j) g_[r * d + j] *= scale[j] * root;
  }
  grad_.assign(d, 0.0f);  // The weightless norm's: dropped.
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      g_.data(), a->m.data(), Ones(d), a->r_inv.data(), t, d, a->dm.data(),
      grad_.data(), /*accumulate_dx=*/true));
  // m = x + post_attention_layernorm(attn).
  SHARDD_ASSIGN_OR_RETURN(const float* w_post,
                          params->Param(layer.post_norm.name));
  grad_.assign(d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      a->dm.data(), a->attn.data(), w_post, a->post_inv.data(), t, d,
      g_.data(), grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.post_norm, grad_));
  std::copy(a->dm.begin(), a->dm.begin() + t * d, dx);
  // The attention, from d(attn) in g_.
  SHARDD_ASSIGN_OR_RETURN(const float* wq, params->Param(layer.q_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wk, params->Param(layer.k_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wo, params->Param(layer.o_proj.name));
  SHARDD_ASSIGN_OR_RETURN(const float* qn, params->Param(layer.q_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* kn, params->Param(layer.k_norm.name));
  do_.resize(t * hq * hd);
  grad_.assign(d * hq * hd, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
      a->o.data(), wo, g_.data(), t, hq * hd, d, do_.data(), false,
      layer.o_proj.frozen ? nullptr : grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.o_proj, grad_));
  if (decode != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        DecodeAttentionBackward(layer, *decode, batch, seq, *a));
  } else {
    dq_.assign(t * hq * hd, 0.0f);
    dk_.assign(t * hkv * hd, 0.0f);
    dv_.assign(t * hkv * hd, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::AttentionBackward(
        GemmaAttentionDims(*arch_, layer, batch, seq), CausalOptions(layer), a->q.data(),
        a->k.data(), a->v.data(), a->o.data(), a->lse.data(), do_.data(),
        dq_.data(), dk_.data(), dv_.data(), nullptr, &ws_));
  }
  if (!a->dk_ext.empty()) {
    // The encode: the decode's gradients of the same (post-RoPE) k and v.
    for (int64_t i = 0; i < t * hkv * hd; ++i) {
      dk_[i] += a->dk_ext[i];
      dv_[i] += a->dv_ext[i];
    }
    a->dk_ext.clear();
    a->dv_ext.clear();
  }
  SHARDD_RETURN_IF_ERROR(Rotate(layer, &dq_, t, seq, hq, true, decode));
  SHARDD_RETURN_IF_ERROR(Rotate(layer, &dk_, t, seq, hkv, true, decode));
  std::vector<float> dq_pre(t * hq * hd), dk_pre(t * hkv * hd),
      dv_pre(t * hkv * hd);
  grad_.assign(hd, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dq_.data(), a->q_pre.data(), qn, a->q_inv.data(), t * hq, hd,
      dq_pre.data(), grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.q_norm, grad_));
  grad_.assign(hd, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dk_.data(), a->k_pre.data(), kn, a->k_inv.data(), t * hkv, hd,
      dk_pre.data(), grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.k_norm, grad_));
  grad_.assign(hd, 0.0f);  // v_norm has no weight.
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dv_.data(), a->v_pre.data(), Ones(hd), a->v_inv.data(), t * hkv, hd,
      dv_pre.data(), grad_.data()));
  if (layer.values_from_keys) {
    for (int64_t i = 0; i < t * hkv * hd; ++i) dk_pre[i] += dv_pre[i];
  }
  // The projections of n; g_ becomes d(n).
  grad_.assign(hq * hd * d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
      a->n.data(), wq, dq_pre.data(), t, d, hq * hd, g_.data(), false,
      layer.q_proj.frozen ? nullptr : grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.q_proj, grad_));
  grad_.assign(hkv * hd * d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
      a->n.data(), wk, dk_pre.data(), t, d, hkv * hd, g_.data(), true,
      layer.k_proj.frozen ? nullptr : grad_.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.k_proj, grad_));
  if (!layer.values_from_keys) {
    SHARDD_ASSIGN_OR_RETURN(const float* wv, params->Param(layer.v_proj.name));
    grad_.assign(hkv * hd * d, 0.0f);
    SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
        a->n.data(), wv, dv_pre.data(), t, d, hkv * hd, g_.data(), true,
        layer.v_proj.frozen ? nullptr : grad_.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, layer.v_proj, grad_));
  }
  SHARDD_ASSIGN_OR_RETURN(const float* w_in, params->Param(layer.norm.name));
  grad_.assign(d, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      g_.data(), a->x_in.data(), w_in, a->in_inv.data(), t, d, dx,
      grad_.data(), /*accumulate_dx=*/true));
  return AddGrad(params, layer.norm, grad_);
}

}  // namespace shardd
