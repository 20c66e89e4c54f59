#ifndef SHARDD_WORKER_MODEL_GEMMA_LAYER_H_
#define SHARDD_WORKER_MODEL_GEMMA_LAYER_H_

// DiffusionGemma's decoder layer on the CPU (Gemma 4's, as Hugging Face's
// DiffusionGemmaEncoderTextLayer computes its causal pass), forward and
// backward, split as the step program's LAYER and EXPERTS commands:
//
//   LAYER:   n  = RMSNorm(x; input_layernorm)
//            q  = RoPE(RMSNorm_h(n Wq^T; q_norm))
//            kp = n Wk^T;  k = RoPE(RMSNorm_h(kp; k_norm))
//            v  = RMSNorm_h(kp (full layers: no v_proj) or n Wv^T; no weight)
//            m  = x + RMSNorm(softmax(q k^T * scale + mask) v Wo^T;
//                             post_attention_layernorm)
//            h1 = RMSNorm(mlp(RMSNorm(m; pre_feedforward_layernorm));
//                         post_feedforward_layernorm_1)
//            r  = RMSNorm(m; no weight) * moe.gate.scale * D^-0.5
//            (indices, weights) = top-k of softmax(r Wproj^T), renormalised
//            e  = RMSNorm(m; pre_feedforward_layernorm_2)
//   EXPERTS: h2 = RMSNorm(experts(e; indices, weights);
//                         post_feedforward_layernorm_2)
//            x' = (m + RMSNorm(h1 + h2; post_feedforward_layernorm))
//                 * layer_scalar
//
// RMSNorm_h is per head. Sliding layers use head_dim, num_key_value_heads,
// the sliding rope and the window; full layers global_head_dim,
// num_global_key_value_heads and `rope` (proportional), causal. The router's
// scale and proj and layer_scalar are frozen in the released model (their
// gradients are dropped); the gradient still flows through the router into m.
//
// Block diffusion (docs/model-spec.md): the encode is the causal pass above
// and keeps k and v; a decode (GemmaDecode) runs the canvas queries at
// positions prefix + j under the block-causal training mask: the canvas is
// cut into blocks of `block` rows, and the queries of the block starting at
// canvas row c see [encoder K/V rows lo..prefix+c-1 ; that block's canvas
// K/V] (the prompt and the response blocks before theirs, clean; lo = 0 on
// full layers, prefix + c - sliding_window + 1 on sliding ones), every key
// visible; its backward adds the encoder rows' K/V gradients to the
// encode's acts.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/param_source.h"

namespace shardd {

// One layer's activations in one pass, kept for its backward.
struct GemmaLayerActs {
  std::vector<float> x_in, in_inv, n;              // [T, D], [T], [T, D]
  std::vector<float> q_pre, k_pre, v_pre;          // projections
  std::vector<float> q_inv, k_inv, v_inv;          // per (token, head)
  std::vector<float> q, k, v, o, lse;              // the attention's
  std::vector<float> attn, post_inv;               // o Wo^T, its norm
  std::vector<float> m;                            // [T, D] mid residual
  std::vector<float> pre_inv, dense_in, dense_out, post1_inv;
  std::vector<float> r_inv, r_norm, r_in;          // the router's input
  std::vector<float> pre2_inv, experts_in, experts_out, post2_inv;
  std::vector<float> sum, post_ff_inv;             // h1 + h2
  std::vector<int32_t> indices;                    // [T, K]
  std::vector<float> weights;                      // [T, K]
  kernels::RouterCache router;
  kernels::GroupedExpertsWorkspace experts;
  // With expert parallelism: where the experts' rows went, from DISPATCH
  // (or the recompute) to BACKWARD DISPATCH, and the rows between the
  // commands: received (x_r, their local experts and weights), their
  // outputs (y_r), and backward dy_r, then dx_r and the weights' dw_r.
  ExpertRoute route;
  std::vector<float> x_r, w_r, y_r, dy_r, dx_r, dw_r;
  std::vector<int32_t> ids_r;
  kernels::DenseMlpWorkspace mlp;
  // Between BACKWARD(EXPERTS) and BACKWARD(LAYER): the gradients of m, of
  // h1 + h2 and of the routing weights.
  std::vector<float> dm, dsum, dweights;
  // And the three feed-forward norms' weight gradients [D] each, added by
  // BACKWARD(LAYER): they belong to the layer's unit, whose gradient
  // buffer a strategy that puts the experts in a unit of their own (e.g.
  // diffusion_gemma) allocates only for BACKWARD(LAYER).
  std::vector<float> d_post_ff, d_post_ff_2, d_pre_ff_2;
  // The layer unit's weights BACKWARD(EXPERTS) needs, copied by
  // FORWARD(EXPERTS) for the same reason: post_feedforward_layernorm_2,
  // post_feedforward_layernorm, pre_feedforward_layernorm_2 ([D] each),
  // layer_scalar.
  std::vector<float> layer_w;
  // A decode's keys and values [B, L, Hkv, Dh]: the encoder rows, then the
  // canvas's.
  // The encode's: gradients of k and v [B, S, Hkv, Dh] from the decode
  // (empty: none), added by its BACKWARD(LAYER).
  std::vector<float> dk_ext, dv_ext;
  int64_t bytes() const;
};

// A decode's view of the encode (the same layer's acts).
struct GemmaDecode {
  int64_t prefix = 0;        // P: canvas query j sits at position P + j.
  int64_t encoder_seq = 0;   // S: rows per sequence of encoder->k / v.
  int64_t block = 0;         // Canvas rows per block; 0: one block.
  GemmaLayerActs* encoder = nullptr;
  // SFT rows: [batch] each row's own P (null: `prefix` for every row).
  // A block's encoder keys end at min(P + begin, S) and canvas positions
  // at S - 1 (rows past a row's response; they are scored nowhere).
  const int32_t* row_prefix = nullptr;
  int64_t PrefixOf(int64_t row) const {
    return row_prefix == nullptr ? prefix : row_prefix[row];
  }
};

class GemmaLayerBlock {
 public:
  // `arch` (arch->gemma) outlives the block.
  explicit GemmaLayerBlock(const MoeArchitecture* arch) : arch_(arch) {}

  // Packed rows (docs/sft_data.md): segment_starts [batch * seq] gives
  // each token's example start within its row; RoPE positions restart
  // there and causal attention stays inside the example. Null: one sequence per
  // row. Not owned; valid until the next call.
  void SetSegments(const int32_t* segment_starts) {
    segments_ = segment_starts;
  }

  // RoPE tables for positions [0, seq). INVALID_ARGUMENT beyond
  // max_position_embeddings.
  absl::Status Prepare(int64_t seq);

  // LAYER: reads x [T, D] (the layer's input), fills `acts`. With
  // `decode`, seq is the canvas length and the keys include the encoder's.
  absl::Status ForwardLayer(const MoeLayerSpec& layer, ParamSource* params,
                            const float* x, int64_t batch, int64_t seq,
                            GemmaLayerActs* acts,
                            const GemmaDecode* decode = nullptr);
  // LAYER's forward again in its backward (activation checkpointing): from
  // acts->x_in, refilling what KeepCheckpoint dropped with the same values
  // and keeping the K/V gradients a decode added.
  absl::Status RecomputeLayer(const MoeLayerSpec& layer, ParamSource* params,
                              int64_t batch, int64_t seq, GemmaLayerActs* acts,
                              const GemmaDecode* decode = nullptr);
  // The grouped experts' forward state (acts->experts, experts_out,
  // post2_inv) again from the kept experts_in, choices, weights and copied
  // layer weights, before BACKWARD(EXPERTS) of a recomputed layer.
  absl::Status RecomputeExperts(const MoeLayerSpec& layer, ParamSource* params,
                                int64_t tokens, GemmaLayerActs* acts,
                                const RoutedExchange* ep = nullptr);
  // What a recomputed layer keeps once its forward is done: the input and
  // what BACKWARD(EXPERTS) reads besides the experts' state (m, the sum,
  // two inverse RMS, the experts' input, choices, weights, the copied
  // layer weights), and with `keep_kv` the K/V a later decode reads.
  // With `experts_only`, only the experts' state and output go.
  static void KeepCheckpoint(bool experts_only, bool keep_kv,
                             GemmaLayerActs* acts);
  // EXPERTS: writes the layer's output to x [T, D].
  // With `ep`, the experts run expert-parallel (the same `ep` in the
  // recompute and the backward): `phase` kAll runs the whole exchange,
  // the others the share of the DISPATCH, EXPERTS or COMBINE command (x is
  // written by COMBINE). FAILED_PRECONDITION for a phase without `ep` or
  // out of order.
  absl::Status ForwardExperts(const MoeLayerSpec& layer, ParamSource* params,
                              int64_t tokens, GemmaLayerActs* acts, float* x,
                              const RoutedExchange* ep = nullptr,
                              ExpertsPhase phase = ExpertsPhase::kAll);
  // BACKWARD(EXPERTS): dx [T, D] is the gradient of the layer's output
  // (read by the kAll and kCombine phases; BACKWARD COMBINE, EXPERTS,
  // DISPATCH in that order).
  absl::Status BackwardExperts(const MoeLayerSpec& layer, ParamSource* params,
                               int64_t tokens, const float* dx,
                               GemmaLayerActs* acts,
                               const RoutedExchange* ep = nullptr,
                               ExpertsPhase phase = ExpertsPhase::kAll);
  // BACKWARD(LAYER): dx [T, D] becomes the gradient of the layer's input.
  // With `decode` (the forward's), decode->encoder's dk_ext / dv_ext gain
  // the encoder rows' gradients.
  absl::Status BackwardLayer(const MoeLayerSpec& layer, ParamSource* params,
                             int64_t batch, int64_t seq, GemmaLayerActs* acts,
                             float* dx, const GemmaDecode* decode = nullptr);

 private:
  absl::Status AddGrad(ParamSource* params, const ArchTensor& t,
                       const std::vector<float>& g);
  // The routed experts: acts->experts_out [T, D] from experts_in, indices
  // and weights, over all experts or (with ep) exchanged.
  absl::Status RoutedExpertsForward(const MoeLayerSpec& layer,
                                    ParamSource* params, int64_t tokens,
                                    GemmaLayerActs* acts,
                                    const RoutedExchange* ep);
  // Their backward: dx [T, D] (overwritten) and acts->dweights [T, K] from
  // dy, the experts' weight gradients added to params.
  absl::Status RoutedExpertsBackward(const MoeLayerSpec& layer,
                                     ParamSource* params, int64_t tokens,
                                     const float* dy, float* dx,
                                     GemmaLayerActs* acts,
                                     const RoutedExchange* ep);
  // The grouped-experts kernel over `rows` rows of k choices (all experts:
  // the tokens, top_k; the received rows of an exchange: 1) into
  // acts->experts, and its backward with the experts' weight gradients
  // added to params.
  absl::Status ExpertsKernelForward(const MoeLayerSpec& layer,
                                    ParamSource* params, int64_t rows, int k,
                                    const float* x, const int32_t* ids,
                                    const float* w, float* y,
                                    GemmaLayerActs* acts);
  absl::Status ExpertsKernelBackward(const MoeLayerSpec& layer,
                                     ParamSource* params, int64_t rows, int k,
                                     const float* dy, float* dx,
                                     float* dweights, GemmaLayerActs* acts);
  // One phase of the exchanged experts (not kAll): kDispatch routes and
  // fills x_r / ids_r / w_r, kCompute runs the local experts into y_r,
  // kCombine sums y_r back into acts->experts_out.
  absl::Status ExchangedForward(const MoeLayerSpec& layer, ParamSource* params,
                                int64_t tokens, GemmaLayerActs* acts,
                                const RoutedExchange& ep, ExpertsPhase phase);
  // Backward: kCombine sends dy to the experts (dy_r), kCompute runs their
  // backward (dx_r, dw_r, the weight gradients), kDispatch returns dx
  // [T, D] and acts->dweights.
  absl::Status ExchangedBackward(const MoeLayerSpec& layer,
                                 ParamSource* params, int64_t tokens,
                                 const float* dy, float* dx,
                                 GemmaLayerActs* acts,
                                 const RoutedExchange& ep, ExpertsPhase phase);
  // LAYER's forward from acts->x_in.
  absl::Status LayerFromInput(const MoeLayerSpec& layer, ParamSource* params,
                              int64_t batch, int64_t seq, GemmaLayerActs* acts,
                              const GemmaDecode* decode);
  // RoPE at the causal pass's positions, or at a decode's canvas ones.
  absl::Status Rotate(const MoeLayerSpec& layer, std::vector<float>* x,
                      int64_t tokens, int64_t seq, int64_t heads, bool inverse,
                      const GemmaDecode* decode);
  // A block's keys and values for the sequences [rows.begin, rows.end)
  // (one prefix), [rows, enc + len, kv row]: their encoder rows [lo, end),
  // then their canvas rows of a->k / a->v. FAILED_PRECONDITION when the
  // encode's K/V do not fit the batch.
  absl::Status ComposeBlockKeys(const MoeLayerSpec& layer, const GemmaDecode& d,
                                const GemmaDecodeBlock& blk,
                                const DecodeRows& rows, int64_t batch,
                                int64_t seq, const GemmaLayerActs& a,
                                std::vector<float>* k, std::vector<float>* v);
  // A decode's attention, block by block: a->o and a->lse from a->q, k, v.
  absl::Status DecodeAttentionForward(const MoeLayerSpec& layer,
                                      const GemmaDecode& d, int64_t batch,
                                      int64_t seq, GemmaLayerActs* a);
  // Its backward from do_: dq_, dk_, dv_ (the canvas rows) are written and
  // the encoder rows' K/V gradients added to d.encoder's dk_ext / dv_ext.
  absl::Status DecodeAttentionBackward(const MoeLayerSpec& layer,
                                       const GemmaDecode& d, int64_t batch,
                                       int64_t seq, const GemmaLayerActs& a);
  // The causal pass's attention options (with the packed rows' segments).
  kernels::AttentionOptions CausalOptions(const MoeLayerSpec& layer) const {
    kernels::AttentionOptions o = GemmaAttentionOptions(*arch_, layer, false);
    o.key_begin = segments_;
    return o;
  }
  // x [rows, dim] through an RMSNorm without weight (ones_).
  const float* Ones(int64_t dim);

  const MoeArchitecture* arch_;
  kernels::RopeTable full_rope_, sliding_rope_;
  std::vector<int32_t> positions_;
  const int32_t* segments_ = nullptr;  // SetSegments; causal passes only.
  kernels::AttentionWorkspace ws_;
  std::vector<float> ones_;
  // Backward scratch.
  std::vector<float> g_, g2_, grad_, dq_, dk_, dv_, do_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_GEMMA_LAYER_H_
