#include "planner/activation_model.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/device_saved_bytes.h"
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

// Whose activations: a CPU worker keeps every activation in fp32 and its
// kernels' caches; a GPU worker keeps the stream-shaped ones in the storage
// dtype (`elem` bytes) and its kernels' saved state
// (common/device_saved_bytes.h).
struct Widths {
  bool cuda = false;
  int64_t elem = kF32;
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
                    const EpShape& ep, const Widths& w, LayerBytes* b) {
  const int64_t n = t * k;
  const int64_t local_e = e / ep.ep;
  const int64_t rows =
      ep.ep > 1 ? static_cast<int64_t>(std::ceil(ep.capacity * n)) : n;
  b->routed_rows = n;
  if (w.cuda) {
    // One grouped-experts workspace holds the forward's and the backward's
    // state. With expert parallelism the step keeps the received rows
    // (inputs, local experts, weights) and their outputs from DISPATCH to
    // COMBINE, and backward their gradients.
    const int64_t s = w.elem;
    if (ep.ep > 1) {
      b->dispatch = rows * d * s + rows * 2 * kF32 + rows * d * s;
      b->experts_saved +=
          device_bytes::GroupedExpertsWorkspace(rows, 1, local_e, d, inter, s) +
          b->dispatch;
      b->experts_backward = 2 * rows * d * s + rows * kF32;
    } else {
      b->experts_saved +=
          device_bytes::GroupedExpertsWorkspace(t, k, e, d, inter, s);
    }
    return;
  }
  // The rows sent to the experts and the outputs combined back.
  b->dispatch = ep.ep > 1 ? 2 * n * d * kF32 : 0;
  // The sort (offsets and cursor in int64), each slot's row, each row's
  // token and weight, the permuted inputs, gate/up pre-activations and the
  // weighted activation.
  b->experts_saved +=
      (local_e + 1 + local_e) * kI64 +
      (t * k + rows + rows + rows * d + rows * 2 * inter + rows * inter) *
          kF32 +
      b->dispatch;
  // Backward: the activation's and the pre-activations' gradients, each
  // row's weight gradient, the input rows' and the output rows' gradients.
  b->experts_backward =
      (rows * inter + rows + rows * 2 * inter + rows * d + rows * d) * kF32;
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
                                            int64_t d, const EpShape& ep,
                                            const Widths& w) {
  const v1::ModelDims& dims = model.dims();
  const std::string p = absl::StrCat("model.layers.", layer, ".");
  const int64_t t = batch * seq;
  // Bytes of a stream-shaped activation (the storage dtype on a GPU).
  const int64_t s = w.elem;
  LayerBytes b;
  // input_layernorm: its input, inverse RMS and output (the step's).
  int64_t saved = (t * d + t * d) * s + t * kF32;
  const std::string attn = p + "self_attn.";
  if (Has(shapes, attn + "kv_a_proj_with_mqa.weight")) {
    // DeepSeek-V3's latent attention (worker/model/mla_block.h and
    // device_mla_block.h keep the same tensors).
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
    saved += t * d * s;                              // its normed input
    if (rq > 0) saved += 2 * t * rq * s + t * kF32;  // q_a_proj out, norm
    saved += 2 * t * rkv * s + t * kF32;             // latent, its norm
    saved += 2 * t * h * qk * s;                     // q, k
    saved += 2 * t * h * dv * s + t * h * kF32;      // v, o, lse
    // The residual after it, post_attention_layernorm's inverse RMS.
    saved += t * d * s + t * kF32;
  } else if (Has(shapes, attn + "q_proj.weight")) {
    const AttentionHeads heads = AttentionHeadsOf(dims, d);
    const int64_t hq = heads.q, hkv = heads.kv, hd = heads.dim;
    if (hq < 1 || hkv < 1 || hd < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dims.num_attention_heads / num_key_value_heads / head_dim: layer ",
          layer, " has attention, which needs them >= 1"));
    }
    saved += t * d * s;                             // normed input
    saved += (t * hq * hd + 2 * t * hkv * hd) * s;  // q, k, v
    if (Has(shapes, attn + "q_norm.weight")) {      // pre-norm
      saved += (t * hq * hd + t * hkv * hd) * s + (t * hq + t * hkv) * kF32;
    }
    saved += t * hq * hd * s + t * hq * kF32;  // o, lse
    saved += t * d * s + t * kF32;  // the residual after it, its norm's
  }
  const bool moe = Has(shapes, p + "moe.experts.gate_and_up_projs");
  int64_t mlp_inter = 0;
  if (Has(shapes, p + "mlp.gate_proj.weight")) {
    mlp_inter = Dim(shapes, p + "mlp.gate_proj.weight", 0);
  } else if (Has(shapes, p + "moe.shared_experts.gate_proj.weight")) {
    mlp_inter = Dim(shapes, p + "moe.shared_experts.gate_proj.weight", 0);
  }
  if (mlp_inter > 0) {
    if (w.cuda) {
      // The kernel's gate and up; its backward's scratch is not kept.
      saved += device_bytes::DenseMlpSaved(t, mlp_inter, s);
    } else {
      // Input copy, gate, up, hidden; backward d_hidden, d_gate.
      saved += (t * d + 3 * t * mlp_inter) * kF32;
      b.backward += 2 * t * mlp_inter * kF32;
    }
    if (moe) b.handoff = t * d * s;  // its output, added by EXPERTS
  }
  if (!moe) {
    b.backward += t * d * s;  // the normed input's gradient
    b.saved = saved;
    b.checkpoint = t * d * s;  // the layer's input
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
  const bool aux = dims.router_aux_loss_coef() > 0;
  // The step's choices and weights.
  saved += 2 * t * k * kF32;
  if (w.cuda) {
    // The router kernel's saved state; its backward's logit gradient is
    // scratch.
    saved += device_bytes::RouterSaved(
        t, e, k, dims.router_scoring() != v1::ROUTER_SOFTMAX_THEN_TOPK);
  } else {
    // Its probabilities (logits), a copy of the choices and the
    // denominators; the group-limited scorer's row scratch; the full
    // softmax the load-balancing loss reads; backward the logit gradient.
    int64_t router = t * e + t * k + t;
    switch (dims.router_scoring()) {
      case v1::ROUTER_SIGMOID_GROUP_LIMITED: {
        const int64_t groups = dims.n_group(), top = dims.topk_group();
        router += 2 * e + groups + top + 2 + k + top + 2;
        break;
      }
      case v1::ROUTER_TOPK_THEN_SOFTMAX:
        if (aux) router += t * e;
        break;
      default:
        break;
    }
    saved += router * kF32;
    b.backward += t * e * kF32;
  }
  if (aux) b.backward += t * e * kF32;  // the auxiliary loss's (the step's)
  // The checkpoint keeps the layer's input and the experts' inputs.
  b.checkpoint = 2 * t * d * s + 2 * t * k * kF32;
  b.saved = saved;
  SetExpertBytes(t, k, e, d, inter, ep, w, &b);
  b.experts_grad = t * d * s + t * k * kF32;  // dn and the weights' gradient
  return b;
}

// A DiffusionGemma layer (worker/model/gemma_layer.h) over t tokens;
// `encoder_rows` > 0 for a decode layer: the encode's rows per micro-batch
// whose K/V gradients its backward adds.
absl::StatusOr<LayerBytes> GemmaLayerActivations(
    const v1::ModelSpec& model, const Shapes& shapes, int layer, int64_t t,
    int64_t encoder_rows, bool keep_kv, int64_t d, const EpShape& ep,
    const Widths& w) {
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
  // The encode's K/V gradients a decode adds (fp32 on every device).
  b.encoder_kv_grad = 2 * encoder_rows * hkv * hd * kF32;
  if (w.cuda) {
    // worker/model/cuda_block_ops_gemma.cc's GemmaState, in the storage
    // dtype but its inverse RMS, lse, choices and weights: the input,
    // normed input, attention output, mid residual, dense input and
    // output, their sum, the router's input, the experts' input; six
    // inverse RMS; q before and after its norm, o; k and v before and after
    // theirs; q's, k's, v's inverse RMS and lse; the choices and weights;
    // the MLP's and the router's saved state. Its backward keeps nothing
    // but what BACKWARD(EXPERTS) hands it.
    const int64_t s = w.elem;
    b.saved = t * ((9 * d + 3 * hq * hd + 4 * hkv * hd) * s +
                   (6 + 2 * hq + 2 * hkv + 2 * k) * kF32) +
              device_bytes::DenseMlpSaved(t, inter_dense, s) +
              device_bytes::RouterSaved(t, e, k, /*keeps_selected=*/false);
    // As on the CPU (GemmaTrim).
    b.checkpoint =
        t * ((4 * d + (keep_kv ? 2 * hkv * hd : 0)) * s + (2 + 2 * k) * kF32);
    b.experts_checkpoint = (3 * d + 1) * s + t * kF32;
    b.checkpoint_after_experts = true;
    // The copied layer weights, the experts' output, two inverse RMS.
    b.experts_kept = (3 * d + 1 + t * d) * s + 2 * t * kF32;
    b.experts_saved = b.experts_kept;
    SetExpertBytes(t, k, e, d, inter, ep, w, &b);
    // d(m), d(sum), the weights' and three norm weights' gradients.
    b.experts_grad = 2 * t * d * s + t * k * kF32 + 3 * d * kF32;
    return b;
  }
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
  SetExpertBytes(t, k, e, d, inter, ep, w, &b);
  // The mid residual's and the sum's gradients, the weights', three norm
  // weights' gradients.
  b.experts_grad = (2 * t * d + t * k + 3 * d) * kF32;
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
    const v1::ModelSpec& model, const v1::PlanOptions& options,
    bool bf16_storage) {
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
  Widths w;
  w.cuda = options.worker_device() == v1::WORKER_DEVICE_CUDA;
  w.elem = w.cuda && bf16_storage ? 2 : kF32;
  const int64_t s = w.elem;
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
  out.set_worker_device(options.worker_device());
  out.set_storage_bytes(static_cast<int32_t>(s));
  // The stream; the final norm's input, inverse RMS and output; the
  // stream's gradient (the step's, on every device).
  out.set_stream_bytes(t * d * s);
  out.set_head_bytes(2 * t * d * s + t * kF32);
  out.set_hidden_bytes(t * d * s);
  out.set_grad_stream_bytes(t * d * s);
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
    out.set_decode_stream_bytes(r * d * s);
    out.set_decode_head_bytes(2 * r * d * s + r * kF32);
    out.set_decode_grad_stream_bytes(r * d * s);
    // The softmaxed logits pass 2 reads (the step's, fp32).
    out.set_sc_probs_bytes(r * vocab * kF32);
    if (w.cuda) {
      // The GPU's pass 1 keeps nothing of its self-conditioning block; pass
      // 2 keeps the signal, its pre-norm output and inverse RMS, the MLP's
      // saved state, the embeddings' sum and its inverse RMS. The backward
      // keeps nothing.
      out.set_sc_signal_bytes(3 * r * d * s + 2 * r * kF32 +
                              device_bytes::DenseMlpSaved(r, sc_inter, s));
    } else {
      // The canvas embeddings and their sum, its inverse RMS; the signal,
      // its pre-norm output and inverse RMS, the MLP output, its input copy,
      // gate, up and hidden; the MLP's two gradients.
      out.set_sc_embed_bytes((2 * r * d + r) * kF32);
      out.set_sc_signal_bytes(
          (r * d + r * d + r + r * d + r * d + 3 * r * sc_inter) * kF32);
      out.set_sc_backward_bytes(2 * r * sc_inter * kF32);
    }
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
      SHARDD_ASSIGN_OR_RETURN(b, GemmaLayerActivations(model, shapes, l, t, 0,
                                                       diffusion, d, ep, w));
      if (diffusion) {
        SHARDD_ASSIGN_OR_RETURN(
            LayerBytes decode,
            GemmaLayerActivations(model, shapes, l, batch * rows, t, false, d,
                                  ep, w));
        v1::LayerActivations* dl = out.add_decode_layers();
        SetLayer(l, decode, dl);
        SetPolicy(policy, l, decode.has_experts, dl);
      }
    } else {
      SHARDD_ASSIGN_OR_RETURN(
          b, LayerActivations(model, shapes, l, batch, seq, d, ep, w));
    }
    v1::LayerActivations* layer = out.add_layers();
    SetLayer(l, b, layer);
    SetPolicy(policy, l, b.has_experts, layer);
  }
  return out;
}

}  // namespace shardd
