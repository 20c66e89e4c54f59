#include "planner/activation_model.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "model/model_util.h"
#include "program/pass_layout.h"

namespace shardd {
namespace {

constexpr int64_t kF32 = 4;  // float and int32 elements
constexpr int64_t kI64 = 8;

// Tokens beyond this would overflow the byte counts of wide layers.
constexpr int64_t kMaxTokens = int64_t{1} << 32;

using Shapes = std::map<std::string, std::vector<int64_t>>;

int64_t Dim(const Shapes& shapes, const std::string& name, size_t axis) {
  auto it = shapes.find(name);
  if (it == shapes.end() || it->second.size() <= axis) return 0;
  return it->second[axis];
}

bool Has(const Shapes& shapes, const std::string& name) {
  return shapes.count(name) > 0;
}

// What one decoder layer keeps, in elements of 4 bytes unless noted.
struct LayerBytes {
  int64_t saved = 0;
  int64_t checkpoint = 0;
  int64_t handoff = 0;
  int64_t experts_saved = 0;
  int64_t experts_backward = 0;
  int64_t experts_grad = 0;
  int64_t backward = 0;
  int64_t experts_kept = 0;
  int64_t encoder_kv_grad = 0;
  int64_t experts_checkpoint = 0;
  bool checkpoint_after_experts = false;
  bool has_experts = false;
  int64_t routed_rows = 0;
  int64_t dispatch = 0;
};

// Expert parallelism as the activations see it: a rank's local experts
// (E / ep of them) process the rows all ep ranks of its group route to
// them, at most capacity x the balanced share (T * top_k rows).
struct EpShape {
  int ep = 1;
  double capacity = 1.0;
};

// The grouped experts' state over the n = t * k rows a layer routes:
// experts_saved, experts_backward and the exchange's buffers. Without
// expert parallelism the rows are this rank's own and all e experts are
// local; with it the experts run over the received rows.
void SetExpertBytes(int64_t t, int64_t k, int64_t e, int64_t d, int64_t inter,
                    const EpShape& ep, LayerBytes* b) {
  const int64_t n = t * k;
  const int64_t local_e = e / ep.ep;
  const int64_t rows =
      ep.ep > 1 ? static_cast<int64_t>(std::ceil(ep.capacity * n)) : n;
  b->routed_rows = n;
  // The rows sent to the experts and the outputs combined back.
  b->dispatch = ep.ep > 1 ? 2 * n * d * kF32 : 0;
  // The sort (offsets and cursor in int64), each slot's row, each row's
  // token and weight, the permuted inputs, gate/up pre-activations and the
  // weighted activation.
  b->experts_saved += (local_e + 1 + local_e) * kI64 +
                      (t * k + rows + rows + rows * d + rows * 2 * inter +
                       rows * inter) *
                          kF32 +
                      b->dispatch;
  // Backward: the activation's and the pre-activations' gradients, each
  // row's weight gradient, the input rows' and the output rows' gradients.
  b->experts_backward = (rows * inter + rows + rows * 2 * inter + rows * d +
                         rows * d) *
                        kF32;
}

void SetLayer(int l, const LayerBytes& b, v1::LayerActivations* layer) {
  layer->set_layer(l);
  layer->set_saved_bytes(b.saved);
  layer->set_checkpoint_bytes(b.checkpoint);
  layer->set_handoff_bytes(b.handoff);
  layer->set_experts_saved_bytes(b.experts_saved);
  layer->set_experts_backward_bytes(b.experts_backward);
  layer->set_experts_grad_bytes(b.experts_grad);
  layer->set_backward_bytes(b.backward);
  layer->set_experts_kept_bytes(b.experts_kept);
  layer->set_encoder_kv_grad_bytes(b.encoder_kv_grad);
  layer->set_experts_checkpoint_bytes(b.experts_checkpoint);
  layer->set_checkpoint_after_experts(b.checkpoint_after_experts);
  layer->set_routed_rows(b.routed_rows);
  layer->set_dispatch_bytes(b.dispatch);
}

absl::StatusOr<LayerBytes> LayerActivations(const v1::ModelSpec& model,
                                            const Shapes& shapes, int layer,
                                            int64_t batch, int64_t seq,
                                            int64_t d, const EpShape& ep) {
  const v1::ModelDims& dims = model.dims();
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const int64_t t = batch * seq;
  LayerBytes b;
  // input_layernorm: its input, inverse RMS and output.
  int64_t saved = t * d + t + t * d;
  const std::string attn = p + "self_attn.";
  if (Has(shapes, attn + "kv_a_proj_with_mqa.weight")) {
    // DeepSeek-V3's latent attention (worker/model/mla_block.h).
    const v1::MlaSpec& mla = dims.attention().mla();
    const int64_t h = dims.num_attention_heads();
    const int64_t rq = mla.q_lora_rank(), rkv = mla.kv_lora_rank();
    const int64_t qk = mla.qk_nope_head_dim() + mla.qk_rope_head_dim();
    const int64_t dv = mla.v_head_dim();
    if (h < 1 || rkv < 1 || qk < 1 || dv < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.attention.mla: layer ", layer,
          " has latent attention, which needs num_attention_heads, "
          "kv_lora_rank, the qk head dims and v_head_dim >= 1"));
    }
    saved += t * d;                            // its normed input
    if (rq > 0) saved += t * rq + t + t * rq;  // q_a_proj out, norm
    saved += t * rkv + t + t * rkv;            // latent, its norm
    saved += 2 * t * h * qk;                   // q, k
    saved += t * h * dv + t * h * dv + t * h;  // v, o, lse
    saved += t * d + t;  // the residual after it, post_attention_layernorm
  } else if (Has(shapes, attn + "q_proj.weight")) {
    const AttentionHeads heads = AttentionHeadsOf(dims, d);
    const int64_t hq = heads.q, hkv = heads.kv, hd = heads.dim;
    if (hq < 1 || hkv < 1 || hd < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.num_attention_heads / num_key_value_heads / head_dim: layer ",
          layer, " has attention, which needs them >= 1"));
    }
    saved += t * d;                           // normed input
    saved += t * hq * hd + 2 * t * hkv * hd;  // q, k, v
    if (Has(shapes, attn + "q_norm.weight")) {
      saved += t * hq * hd + t * hkv * hd + t * hq + t * hkv;  // pre-norm
    }
    saved += t * hq * hd + t * hq;  // o, lse
    saved += t * d + t;  // the residual after it, post_attention_layernorm
  }
  const bool moe = Has(shapes, p + "moe.experts.gate_and_up_projs");
  int64_t mlp_inter = 0;
  if (Has(shapes, p + "mlp.gate_proj.weight")) {
    mlp_inter = Dim(shapes, p + "mlp.gate_proj.weight", 0);
  } else if (Has(shapes, p + "moe.shared_experts.gate_proj.weight")) {
    mlp_inter = Dim(shapes, p + "moe.shared_experts.gate_proj.weight", 0);
  }
  if (mlp_inter > 0) {
    saved += t * d + 3 * t * mlp_inter;  // input copy, gate, up, hidden
    b.backward += 2 * t * mlp_inter;     // d_hidden, d_gate
    if (moe) b.handoff = t * d;          // its output, added by EXPERTS
  }
  if (!moe) {
    b.backward += t * d;  // the normed input's gradient
    b.saved = saved * kF32;
    b.checkpoint = t * d * kF32;  // the layer's input
    b.backward *= kF32;
    b.handoff *= kF32;
    return b;
  }
  b.has_experts = true;
  const std::string gu = p + "moe.experts.gate_and_up_projs";
  const int64_t e = Dim(shapes, gu, 0);
  const int64_t inter = Dim(shapes, gu, 2) / 2;
  const int64_t k = dims.top_k();
  if (e < 1 || inter < 1 || k < 1 || k > e) {
    return absl::InvalidArgumentError(absl::StrCat(
        gu, ": layer ", layer,
        " needs [E, D, 2I] experts with dims.top_k in [1, E]; got E ", e,
        ", top_k ", k));
  }
  // The router: choices, weights, its probabilities (logits), a copy of
  // the choices and the denominators; the group-limited scorer's row
  // scratch; the full softmax the load-balancing loss reads.
  saved += 2 * t * k + t * e + t * k + t;
  const bool aux = dims.router_aux_loss_coef() > 0;
  switch (dims.router_scoring()) {
    case v1::ROUTER_SIGMOID_GROUP_LIMITED: {
      const int64_t groups = dims.n_group(), top = dims.topk_group();
      saved += 2 * e + groups + top + 2 + k + top + 2;
      break;
    }
    case v1::ROUTER_TOPK_THEN_SOFTMAX:
      if (aux) saved += t * e;
      break;
    default:
      break;
  }
  b.backward += t * e;           // the router's logit gradient
  if (aux) b.backward += t * e;  // the auxiliary loss's
  // The checkpoint keeps the layer's input and the experts' inputs.
  b.checkpoint = (t * d + t * d + 2 * t * k) * kF32;
  b.saved = saved * kF32;
  b.backward *= kF32;
  b.handoff *= kF32;
  SetExpertBytes(t, k, e, d, inter, ep, &b);
  b.experts_grad = (t * d + t * k) * kF32;  // dn and the weights' gradient
  return b;
}

// A DiffusionGemma layer (worker/model/gemma_layer.h) over t tokens;
// `encoder_rows` > 0 for a decode layer: the encode's rows per micro-batch
// whose K/V gradients its backward adds.
absl::StatusOr<LayerBytes> GemmaLayerActivations(const v1::ModelSpec& model,
                                                 const Shapes& shapes,
                                                 int layer, int64_t t,
                                                 int64_t encoder_rows,
                                                 bool keep_kv, int64_t d,
                                                 const EpShape& ep) {
  const v1::ModelDims& dims = model.dims();
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const int64_t hq = dims.num_attention_heads();
  const int64_t q_rows = Dim(shapes, p + "self_attn.q_proj.weight", 0);
  const int64_t hd = hq > 0 ? q_rows / hq : 0;
  const int64_t hkv =
      hd > 0 ? Dim(shapes, p + "self_attn.k_proj.weight", 0) / hd : 0;
  const int64_t inter_dense = Dim(shapes, p + "mlp.gate_proj.weight", 0);
  const std::string gu = p + "moe.experts.gate_and_up_projs";
  const int64_t e = Dim(shapes, gu, 0);
  const int64_t inter = Dim(shapes, gu, 2) / 2;
  const int64_t k = dims.top_k();
  if (hq < 1 || hd < 1 || hkv < 1 || inter_dense < 1 || e < 1 || inter < 1 ||
      k < 1 || k > e) {
    return absl::InvalidArgumentError(absl::StrCat(
        p,
        ": a DiffusionGemma layer needs attention heads, an mlp and [E, D, "
        "2I] experts with dims.top_k in [1, E]"));
  }
  LayerBytes b;
  b.has_experts = true;
  // The input, normed input, attention output, mid residual, dense input
  // and output, their sum, the MLP's input copy, the router's normed and
  // scaled inputs, the experts' input; six inverse RMS; q before and after
  // its norm, o; k and v before and after theirs; q's and lse's, k's and
  // v's inverse RMS; the MLP's gate, up, hidden; the router.
  const int64_t per_token = 11 * d + 6 + 3 * hq * hd + 4 * hkv * hd + 2 * hq +
                            2 * hkv + 3 * inter_dense + 3 * k + e + 1;
  b.saved = t * per_token * kF32;
  // Recomputed, it keeps (after its experts' forward) the input, the mid
  // residual, the sum, the experts' input and inverse RMS, the choices and
  // weights; an encode layer its K/V for the decodes; and of the experts'
  // part the copied weights and the sum's inverse RMS.
  b.checkpoint = t * (4 * d + 1 + 2 * k + (keep_kv ? 2 * hkv * hd : 0)) * kF32;
  b.experts_checkpoint = (3 * d + 1 + t) * kF32;
  b.checkpoint_after_experts = true;
  b.backward = t * (e + 2 * inter_dense) * kF32;  // router, MLP gradients
  // FORWARD(EXPERTS): the layer unit's weights it copies (three norms and
  // the scalar), the experts' output and two inverse RMS, kept until
  // BACKWARD(LAYER); the grouped experts' state as for other layers.
  b.experts_kept = (3 * d + 1 + t * d + 2 * t) * kF32;
  b.experts_saved = b.experts_kept;
  SetExpertBytes(t, k, e, d, inter, ep, &b);
  // The mid residual's and the sum's gradients, the weights', three norm
  // weights' gradients.
  b.experts_grad = (2 * t * d + t * k + 3 * d) * kF32;
  b.encoder_kv_grad = 2 * encoder_rows * hkv * hd * kF32;
  return b;
}

void SetPolicy(const CheckpointPolicy& policy, int l, bool has_experts,
               v1::LayerActivations* layer) {
  const bool whole =
      policy.kind == CheckpointPolicy::kAll ||
      (policy.kind == CheckpointPolicy::kEveryK && l % policy.every == 0);
  layer->set_recompute(whole);
  layer->set_recompute_experts(
      !whole && policy.kind == CheckpointPolicy::kExperts && has_experts);
}

}  // namespace

std::string CheckpointPolicy::Text() const {
  switch (kind) {
    case kAll:
      return "all";
    case kExperts:
      return "experts";
    case kEveryK:
      return absl::StrCat("every:", every);
    default:
      return "none";
  }
}

absl::StatusOr<CheckpointPolicy> ParseCheckpointPolicy(absl::string_view text) {
  CheckpointPolicy policy;
  if (text.empty() || text == "none") return policy;
  if (text == "all") {
    policy.kind = CheckpointPolicy::kAll;
    return policy;
  }
  if (text == "experts") {
    policy.kind = CheckpointPolicy::kExperts;
    return policy;
  }
  absl::string_view rest = text;
  int every = 0;
  if (absl::ConsumePrefix(&rest, "every:") && absl::SimpleAtoi(rest, &every) &&
      every >= 1) {
    policy.kind = CheckpointPolicy::kEveryK;
    policy.every = every;
    return policy;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "activation_checkpointing: must be none, all, experts or every:K with "
      "K >= 1, got '",
      text, "'"));
}

absl::StatusOr<v1::ActivationModel> ModelActivations(
    const v1::ModelSpec& model, const v1::PlanOptions& options) {
  const int64_t batch = options.micro_batch_size();
  const int64_t seq = options.seq_len();
  if (batch < 1 || seq < 1 || batch > kMaxTokens / seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro_batch_size / seq_len: need both >= 1 and at most 2^32 tokens "
        "per micro-batch, got ",
        batch, " x ", seq));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const CheckpointPolicy policy,
      ParseCheckpointPolicy(options.activation_checkpointing()));
  Shapes shapes;
  for (const ParamRef& ref : ListParams(model)) {
    shapes[ref.fqn].assign(ref.tensor->shape().begin(),
                           ref.tensor->shape().end());
  }
  const int64_t d = Dim(shapes, "model.embed_tokens.weight", 1);
  if (d < 1) {
    return absl::InvalidArgumentError(
        "model.embed_tokens.weight: the activation model needs [vocab, "
        "hidden]");
  }
  const int64_t t = batch * seq;
  EpShape ep;
  if (options.mesh().ep() > 1) {
    ep.ep = options.mesh().ep();
    ep.capacity = options.ep_capacity_factor() > 0
                      ? options.ep_capacity_factor()
                      : kDefaultEpCapacityFactor;
  }
  v1::ActivationModel out;
  if (ep.ep > 1) {
    out.set_ep(ep.ep);
    out.set_ep_capacity_factor(ep.capacity);
    out.set_ep_capacity_enforced(options.ep_capacity_factor() > 0);
  }
  out.set_hidden_size(d);
  out.set_micro_batch_size(static_cast<int32_t>(batch));
  out.set_seq_len(seq);
  out.set_checkpointing(policy.Text());
  out.set_stream_bytes(t * d * kF32);
  out.set_head_bytes((t * d + t + t * d) * kF32);
  out.set_hidden_bytes(t * d * kF32);
  out.set_grad_stream_bytes(t * d * kF32);
  const bool gemma = model.architecture() == kBlockDiffusionArchitecture;
  // The block-diffusion step (3 passes, 1 without gradients) decodes the
  // response rows of each sequence after encoding it.
  const bool diffusion = gemma && options.passes() == 3 &&
                         options.has_no_grad_passes() &&
                         options.no_grad_passes() == 1;
  int64_t rows = 0;
  if (diffusion) {
    rows = options.response_length() > 0 ? options.response_length()
                                         : model.dims().canvas_length();
    if (rows < 1 || rows >= seq) {
      return absl::InvalidArgumentError(absl::StrCat(
          "response_length: DiffusionGemma's block-diffusion step decodes "
          "between 1 and seq_len - 1 rows per sequence, got ",
          rows, " of ", seq));
    }
    const int64_t r = batch * rows;
    const int64_t vocab = Dim(shapes, "model.embed_tokens.weight", 0);
    const int64_t sc_inter =
        Dim(shapes, "model.self_conditioning.gate_proj.weight", 0);
    out.set_block_diffusion(true);
    out.set_response_length(rows);
    out.set_decode_stream_bytes(r * d * kF32);
    out.set_decode_head_bytes((r * d + r + r * d) * kF32);
    out.set_decode_grad_stream_bytes(r * d * kF32);
    // The canvas embeddings and their sum, its inverse RMS; the signal,
    // its pre-norm output and inverse RMS, the MLP output, its input copy,
    // gate, up and hidden; the MLP's two gradients; the probabilities.
    out.set_sc_embed_bytes((2 * r * d + r) * kF32);
    out.set_sc_signal_bytes(
        (r * d + r * d + r + r * d + r * d + 3 * r * sc_inter) * kF32);
    out.set_sc_backward_bytes(2 * r * sc_inter * kF32);
    out.set_sc_probs_bytes(r * vocab * kF32);
  }
  for (int l = 0;; ++l) {
    if (!Has(shapes,
             absl::StrCat("model.layers.", l, ".input_layernorm.weight"))) {
      break;
    }
    LayerBytes b;
    if (gemma) {
      // The encode of the block-diffusion step keeps its K/V for the
      // decodes when recomputed.
      SHARDD_ASSIGN_OR_RETURN(
          b, GemmaLayerActivations(model, shapes, l, t, 0, diffusion, d, ep));
      if (diffusion) {
        SHARDD_ASSIGN_OR_RETURN(
            LayerBytes decode,
            GemmaLayerActivations(model, shapes, l, batch * rows, t, false, d,
                                  ep));
        v1::LayerActivations* dl = out.add_decode_layers();
        SetLayer(l, decode, dl);
        SetPolicy(policy, l, decode.has_experts, dl);
      }
    } else {
      SHARDD_ASSIGN_OR_RETURN(
          b, LayerActivations(model, shapes, l, batch, seq, d, ep));
    }
    v1::LayerActivations* layer = out.add_layers();
    SetLayer(l, b, layer);
    SetPolicy(policy, l, b.has_experts, layer);
  }
  return out;
}

}  // namespace shardd
