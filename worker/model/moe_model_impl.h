#ifndef SHARDD_WORKER_MODEL_MOE_MODEL_IMPL_H_
#define SHARDD_WORKER_MODEL_MOE_MODEL_IMPL_H_

// MoeModel's state (its pimpl): the architecture, the saved activations
// of each pass and layer, the batches and the sublayer blocks. Private to
// moe_model.cc; a header of its own so that the passes stay readable.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/router.h"
#include "proto/worker.pb.h"
#include "worker/model/attention_block.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/command_order.h"
#include "worker/model/gemma_layer.h"
#include "worker/model/mla_block.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/moe_model.h"
#include "worker/model/param_source.h"

namespace shardd {
namespace moe_model_internal {

// Activations of one layer in one pass, kept for its backward.
struct LayerActs {
  std::vector<float> x_in;     // [T, D] residual input
  std::vector<float> inv_rms;  // [T] of input_layernorm
  // Attention layers: the sublayer's activations, the residual after it
  // (the post_attention_layernorm's input) and that norm's inverse RMS.
  AttentionActs attn;
  MlaActs mla;                   // DeepSeek-V3's latent attention instead.
  GemmaLayerActs gemma;          // DiffusionGemma's whole layer instead.
  std::vector<float> x_mid;      // [T, D]
  std::vector<float> post_inv;   // [T]
  std::vector<float> normed;     // [T, D] the MoE / MLP input
  std::vector<int32_t> indices;  // [T, K]
  std::vector<float> weights;    // [T, K]
  std::vector<float> dense_out;  // [T, D]
  kernels::RouterCache router;
  kernels::GroupedExpertsWorkspace experts;
  kernels::DenseMlpWorkspace mlp;
  int64_t bytes() const {
    return static_cast<int64_t>((x_in.capacity() + inv_rms.capacity() +
                                 x_mid.capacity() + post_inv.capacity() +
                                 normed.capacity() + weights.capacity() +
                                 dense_out.capacity()) *
                                    sizeof(float) +
                                attn.bytes() + mla.bytes() + gemma.bytes() +
                                indices.capacity() * sizeof(int32_t) +
                                router.bytes() + experts.bytes() + mlp.bytes());
  }
};

struct PassActs {
  std::vector<LayerActs> layers;
  std::vector<float> x;          // [T, D] current residual stream
  std::vector<float> final_x;    // [T, D] input of the final norm
  std::vector<float> final_inv;  // [T]
  std::vector<float> h;          // [T, D] normed final hidden
  std::vector<float> dx;         // [T, D] gradient of the residual stream
  std::vector<float> dn;         // [T, D] gradient of a layer's normed input
  std::vector<float> dweights;   // [T, K]
  // Load-balancing loss: this pass's statistics (the caller may sum them
  // over ranks), their local sums in double, the gradient scale of its
  // BACKWARD(HEAD), and a layer's logit-gradient staging [T, E].
  MoeModel::RouterAuxStats aux;
  std::vector<double> aux_sums;
  double aux_scale = 0.0;
  std::vector<float> aux_d_logits;
};

struct Batch {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  int64_t batch = 0;  // Sequences
  int64_t seq = 0;    // Tokens per sequence
  int64_t tokens = 0;
  int64_t counted = 0;  // Non-ignored targets.
  // Block diffusion: the noise keys (SetSequenceKeys; by default step 0 and
  // microbatch * batch + row), the encoder's targets (inputs shifted by one,
  // the last position ignored), their count, and the canvas.
  int64_t step = 0;
  std::vector<int64_t> sequence_indices;
  std::vector<int32_t> ar_targets;
  int64_t ar_counted = 0;
  DiffusionCanvas canvas;
  // Pass 1's softmax of the soft-capped logits [B * R, V], detached.
  std::vector<float> sc_probs;
};

// The self-conditioning block's activations (the decode's input, pass 2).
struct SelfConditioningActs {
  std::vector<float> e;             // [T, D] scaled canvas embeddings
  std::vector<float> signal;        // [T, D] probs @ E * scale, 0 without coin
  std::vector<float> p, p_inv;      // pre_norm(signal)
  std::vector<float> mlp_out;       // [T, D]
  std::vector<float> sum, sum_inv;  // e + mlp_out, post_norm's
  kernels::DenseMlpWorkspace mlp;
  int64_t bytes() const {
    return static_cast<int64_t>(
        (e.capacity() + signal.capacity() + p.capacity() + p_inv.capacity() +
         mlp_out.capacity() + sum.capacity() + sum_inv.capacity()) *
            sizeof(float) +
        mlp.bytes());
  }
};

}  // namespace moe_model_internal

using moe_model_internal::Batch;
using moe_model_internal::LayerActs;
using moe_model_internal::PassActs;
using moe_model_internal::SelfConditioningActs;

// The architecture's fields (vocab, dim, layers, ...) are the model's.
struct MoeModel::Impl : MoeArchitecture {
  using Command = v1::Command;
  using Tensor = ArchTensor;
  using LayerSpec = MoeLayerSpec;

  MoeModelOptions options;
  // Activations are kept per pass, so micro-batches do not interleave.
  std::unique_ptr<ModelCommandOrder> order;

  std::vector<Batch> batches;
  std::vector<PassActs> acts;  // One per pass.
  std::vector<float> scratch;  // Parameter-gradient staging.
  std::vector<float> scratch2;
  std::vector<float> scratch_td;  // [T, D] activation staging
  std::unique_ptr<AttentionBlock> attention;
  std::unique_ptr<MlaBlock> mla;
  std::unique_ptr<GemmaLayerBlock> gemma_block;
  // DiffusionGemma's block-diffusion step (3 passes): the canvas rows per
  // sequence (the response), the block length (canvas_length) and
  // model.self_conditioning's tensors.
  bool diffusion = false;
  int64_t canvas = 0;
  int64_t block = 0;
  Tensor sc_pre_norm, sc_gate, sc_up, sc_down;
  int64_t sc_inter = 0;
  SelfConditioningActs sc;
  bool hold_self_conditioning = false;  // HoldSelfConditioningForTest
  bool eval = false;                    // SetEvaluation
  // SetRecompute: per layer, whether the whole layer or only its experts
  // recompute their forward in backward.
  std::vector<bool> recompute_layer, recompute_experts;
  // The most activation bytes seen during the current command.
  int64_t activation_peak = 0;
  double loss_sum = 0.0;  // Sum of per-(pass, micro-batch) mean losses.
  int loss_terms = 0;
  int64_t tokens = 0;

  int grad_passes() const { return options.passes - options.no_grad_passes; }

  // Micro-batches run forward and backward one after the other, so
  // activations are kept per pass and reused by the next micro-batch.
  PassActs& Acts(int pass, int /*mb*/) { return acts[pass]; }

  // A zeroed staging buffer for one parameter gradient.
  float* Zeroed(std::vector<float>* buffer, int64_t n) {
    if (static_cast<int64_t>(buffer->size()) < n) buffer->resize(n);
    kernels::FillZero(buffer->data(), n * static_cast<int64_t>(sizeof(float)));
    return buffer->data();
  }

  absl::Status AddGrad(ParamSource* params, const Tensor& t,
                       const float* values) {
    if (t.frozen) return absl::OkStatus();
    return params->AccumulateGrad(t.name, values);
  }

  // The clamped activation's constants and the layer's expert biases.
  absl::StatusOr<kernels::ExpertOptions> ExpertOptionsOf(
      const LayerSpec& spec, ParamSource* params) const {
    kernels::ExpertOptions options = MoeArchitecture::ExpertOptions();
    if (spec.expert_bias) {
      SHARDD_ASSIGN_OR_RETURN(options.gate_up_bias,
                              params->Param(spec.b_gu.name));
      SHARDD_ASSIGN_OR_RETURN(options.down_bias, params->Param(spec.b_d.name));
    }
    return options;
  }

  bool RequiresGrad(int pass) const {
    return !eval && pass >= options.no_grad_passes;
  }

  // Bytes of every saved activation (see MoeModel::activation_bytes).
  int64_t ActivationBytes() const;
  // Call before freeing activations inside a command.
  void MarkActivationPeak() {
    activation_peak = std::max(activation_peak, ActivationBytes());
  }
  template <typename T>
  static void FreeVector(T* v) {
    T().swap(*v);
  }
  // BACKWARD(EMBED) of tokens `ids` [t] embedded times `scale`: the
  // embedding's gradient from a->dx, then a->dx is freed.
  absl::Status EmbedBackward(ParamSource* params, const int32_t* ids, int64_t t,
                             float scale, PassActs* a);
  // Frees FORWARD(HEAD)'s final norm input, inverse RMS and output.
  static void FreeHead(PassActs* a) {
    FreeVector(&a->final_x);
    FreeVector(&a->final_inv);
    FreeVector(&a->h);
  }
  // What a recomputed layer keeps from its forward: its input, and the
  // experts' inputs (normed, choices, weights, the dense branch's output).
  static void KeepCheckpoint(const LayerSpec& spec, LayerActs* la);

  // LAYER's forward from la->x_in (non-Gemma layers): the norms, attention,
  // dense branch and router into `la`. With the pass's activations `a`
  // (the forward) it also advances a->x and the auxiliary statistics; null
  // (a recompute in backward) it leaves them and keeps no dense output.
  absl::Status LayerForward(const LayerSpec& spec, ParamSource* params,
                            const Batch& batch, LayerActs* la, PassActs* a);
  // EXPERTS' forward into la->experts, the routed output in scratch2.
  absl::Status ExpertsForward(const LayerSpec& spec, ParamSource* params,
                              int64_t t, LayerActs* la);

  absl::Status Forward(const Command& c, ParamSource* params);
  absl::Status Backward(const Command& c, ParamSource* params);
  // FORWARD(HEAD)'s final norm of a.x (t tokens): a.final_x, final_inv, h.
  absl::Status FinalNormForward(ParamSource* params, int64_t t, PassActs* a);
  // Evaluation: the cross-entropy of hidden `h` [t, dim] against `targets`,
  // added to the step's loss with `weight` (a new loss term when
  // `new_term`), without gradients.
  absl::Status EvalLoss(ParamSource* params, const float* h, int64_t t,
                        const int32_t* targets, double weight, bool new_term);
  // The block-diffusion step's commands (moe_model_diffusion.cc).
  absl::Status DiffusionForward(const Command& c, ParamSource* params);
  absl::Status DiffusionBackward(const Command& c, ParamSource* params);
  absl::Status SelfConditioningForward(int pass, Batch* batch,
                                       ParamSource* params, PassActs* a);
  absl::Status SelfConditioningBackward(const Batch& batch, ParamSource* params,
                                        PassActs* a);
  absl::Status DiffusionHeadBackward(int pass, const Batch& batch,
                                     ParamSource* params, PassActs* a);
  // Reads model.self_conditioning from `unused` (they train in pass 2).
  absl::Status TakeSelfConditioning(int64_t canvas_length);
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MOE_MODEL_IMPL_H_
