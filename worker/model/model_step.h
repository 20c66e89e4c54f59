#ifndef SHARDD_WORKER_MODEL_MODEL_STEP_H_
#define SHARDD_WORKER_MODEL_MODEL_STEP_H_

// The training step of a native MoE model, once for every device
// (docs/step_driver.md): what each FORWARD and BACKWARD command of a step
// program computes, which activations it keeps for the backward, when it
// frees them, what a recomputed layer keeps and recomputes, how an
// evaluation scores, the load-balancing loss's bookkeeping and the
// activation ledger. The arithmetic and memory are a BlockOps's
// (block_ops.h). The math is MoeModel's (moe_model.h).
//
// DiffusionGemma runs its causal pass (1 pass) or its block-diffusion step
// (3 passes, the second without gradients; model_step_diffusion.cc): pass 0
// the causal encode, pass 1 the self-conditioning decode, pass 2 the decode
// over the encode's K/V.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/block_ops.h"
#include "worker/model/command_order.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace step {

struct StepShape {
  int passes = 1;
  int no_grad_passes = 0;
  int microbatches = 1;
  // Pass p > 0 embeds its tokens plus this times pass p-1's output.
  float self_conditioning_scale = 0.5f;
  // DiffusionGemma's block-diffusion step (3 passes, 1 without gradients):
  // its training knobs and dims.canvas_length.
  DiffusionTrainingOptions diffusion;
  int64_t canvas_length = 0;
};

class ModelStep {
 public:
  // `arch` outlives the step; `ops` computes on `arch` too.
  // Errors: INVALID_ARGUMENT for a step shape CheckModelStepShape refuses,
  // DiffusionGemma with a shape other than 1 or 3 (1 without gradients)
  // passes, and ReadBlockDiffusionSpec's errors.
  static absl::StatusOr<std::unique_ptr<ModelStep>> Create(
      const MoeArchitecture* arch, const StepShape& shape,
      std::unique_ptr<BlockOps> ops);
  // Create's checks of the step shape alone, for a caller that refuses a
  // shape before it sets up a device: DiffusionGemma's block-diffusion
  // spec for its 3-pass step, else an empty spec. Errors as Create's.
  static absl::StatusOr<BlockDiffusionSpec> CheckShape(
      const MoeArchitecture& arch, const StepShape& shape);
  ~ModelStep();

  BlockOps* ops() { return ops_.get(); }

  // As MoeModel::SetRowSegments.
  absl::Status SetRowSegments(int microbatch, const int32_t* segment_starts);
  // As MoeModel::SetBatch.
  absl::Status SetBatch(int microbatch, const int32_t* inputs,
                        const int32_t* targets, int64_t batch, int64_t seq);
  // As MoeModel::SetSequenceKeys (FAILED_PRECONDITION without the
  // micro-batch's SetBatch).
  absl::Status SetSequenceKeys(int microbatch, int64_t step,
                               const int64_t* sequence_indices);
  // As MoeModel::SetCanvasRows.
  absl::Status SetCanvasRows(int microbatch, const int32_t* starts,
                             const int32_t* targets);
  // As MoeModel::HoldSelfConditioningForTest.
  void HoldSelfConditioningForTest(bool hold) { hold_sc_ = hold; }
  // As MoeModel::SetRecompute.
  absl::Status SetRecompute(std::vector<bool> layers,
                            std::vector<bool> experts);
  void SetEvaluation(bool eval) { eval_ = eval; }
  // A loss over a masked batch (SFT, docs/sft_data.md): the step's
  // counted targets over the whole global batch and the data-parallel
  // ranks sharing it. The training loss becomes the mean over those
  // tokens: each rank's head gradient is scaled by ranks / global_counted
  // (the ranks' average then gives the global mean) and its reported loss
  // is its own token mean (the coordinator weighs ranks by tokens).
  // global_counted 0: the mean of the micro-batches' means, as before.
  // DiffusionGemma's SFT rows (SetCanvasRows) add the global batch's
  // counted canvas targets: each of its two terms is then the mean over
  // its own global count, and the reported loss is weighted so that the
  // coordinator's token-weighted mean of the ranks is the global loss.
  void SetGlobalLossTokens(int64_t global_counted, int ranks,
                           int64_t global_canvas = 0) {
    global_counted_ = global_counted;
    loss_ranks_ = ranks;
    global_canvas_ = global_canvas;
  }
  // Expert parallelism (docs/expert_parallel.md): the bound parameters
  // hold this rank's block of every MoE layer's experts, and EXPERTS
  // exchanges the routed rows through `exchange` (not owned; null turns
  // it off), each rank's experts accepting at most `capacity_factor` x
  // t * top_k rows (0: no bound).
  // Both devices run it (BlockOps' Exchange* ops). Errors:
  // INVALID_ARGUMENT for a MoE layer whose experts the exchange's group
  // does not divide.
  absl::Status SetExpertExchange(ExpertExchange* exchange,
                                 double capacity_factor);
  // Forgets the step's loss and command order (activations stay).
  void ResetStep();
  // As MoeModel::Run, on the parameters the ops are bound to.
  absl::Status Run(const v1::Command& command);

  double step_loss() const { return ops_->loss(loss_terms_); }
  int64_t step_tokens() const { return ops_->loss_tokens(); }
  // The loss terms the step's loss is the mean of (ops()->loss's argument).
  int loss_terms() const { return loss_terms_; }
  // The load-balancing statistics of (pass, micro-batch); null when the
  // loss is off or out of range.
  Saved* aux_stats(int pass, int microbatch);
  int64_t activation_bytes() const { return ledger_.live(); }
  int64_t command_activation_peak() const { return ledger_.command_peak(); }

 private:
  // What one layer of one pass keeps for its backward.
  struct LayerSlot {
    Act x_in;      // [T, D] residual input
    Act inv_rms;   // [T] fp32, input_layernorm's
    Act x_mid;     // [T, D] after attention (post_attention_layernorm's input)
    Act post_inv;  // [T] fp32
    Act normed;    // [T, D] the MoE / MLP input
    Act indices;   // [T, K] int32
    Act weights;   // [T, K] fp32
    Act dense_out;  // [T, D] the dense branch beside experts, LAYER->EXPERTS
    Saved attention, router, experts, mlp;
    // Expert parallelism: where the routed rows went (DISPATCH's forward
    // to its backward), and the rows between the commands: received with
    // their local experts and weights, their outputs, and backward the
    // output gradients, then the input and weight gradients.
    ExpertRoute route;
    Act x_r, ids_r, w_r, y_r, dy_r, dx_r, dw_r;
    Saved gemma;  // DiffusionGemma's whole layer instead.
  };
  struct PassSlot {
    std::vector<LayerSlot> layers;
    Act x;             // [T, D] the residual stream
    Act final_x;       // [T, D] the final norm's input
    Act final_inv;     // [T] fp32
    Act h;             // [T, D] the final hidden
    Act dx;            // [T, D] the residual stream's gradient
    Act dn;            // [T, D] a layer's normed input's gradient
    Act dweights;      // [T, K] fp32
    Act aux_d_logits;  // [T, E] fp32, a layer's load-balancing gradient
    Saved aux;         // The pass's load-balancing statistics.
  };
  struct BatchSlot {
    Act inputs, targets;  // [T] int32
    int64_t batch = 0, seq = 0, tokens = 0;
    int64_t counted = 0;  // Non-ignored targets.
    // Packed rows (SetRowSegments): each token's example start in its row.
    std::vector<int32_t> segment_starts;
    // Block diffusion: the noise keys (SetSequenceKeys; by default step 0
    // and microbatch * batch + row), the inputs on the host, the encoder's
    // targets (inputs shifted by one, the last position ignored) and their
    // count, the canvas (host and uploaded ids), the self-conditioning
    // block's state and pass 1's softmax [B * R, V] (detached).
    int64_t step = 0;
    std::vector<int64_t> sequence_indices;
    std::vector<int32_t> host_inputs;
    Act ar_targets;
    int64_t ar_counted = 0;
    // SFT rows (SetCanvasRows): each row's response start [B] and canvas
    // targets [B, R] (-1: not scored), and the scored count; empty: the
    // last R tokens of every row, all scored.
    std::vector<int32_t> canvas_starts, canvas_targets;
    int64_t canvas_counted = 0;
    DiffusionCanvas canvas;
    Act noised, scored;  // The noised canvas and the diffusion targets.
    Saved sc;
    Act sc_probs;
  };

  ModelStep(const MoeArchitecture* arch, const StepShape& shape,
            std::unique_ptr<BlockOps> ops);

  PassSlot& Slot(int pass, int microbatch);
  bool RequiresGrad(int pass) const {
    return !eval_ && pass >= shape_.no_grad_passes;
  }
  int grad_passes() const { return shape_.passes - shape_.no_grad_passes; }
  // *a holds `numel` elements of `elem`, counted in the ledger (kept when
  // it already does; zeroed when `zero`).
  absl::Status Ensure(Act* a, Elem elem, int64_t numel, bool zero = false);
  // An uncounted buffer for the command's intermediate values.
  absl::StatusOr<Act> Temp(int64_t numel);
  // What a recomputed layer keeps: its input and the experts' inputs.
  static void KeepCheckpoint(const MoeLayerSpec& spec, LayerSlot* la);

  absl::Status Forward(const v1::Command& c);
  absl::Status Backward(const v1::Command& c);
  // LAYER's forward from la->x_in. With the pass `a` (a forward) it also
  // advances a->x and the load-balancing statistics; without (a recompute)
  // it leaves them and keeps no dense output.
  absl::Status LayerForward(const MoeLayerSpec& spec, const BatchSlot& batch,
                            LayerSlot* la, PassSlot* a);
  // EXPERTS' forward into *y [T, D].
  absl::Status ExpertsForward(const MoeLayerSpec& spec, int64_t t,
                              LayerSlot* la, Act* y);
  // BACKWARD(EXPERTS)'s gradients a->dn and a->dweights from a->dx.
  absl::Status ExpertsBackward(const MoeLayerSpec& spec, int64_t t,
                               LayerSlot* la, PassSlot* a);
  // With expert parallelism: the exchange, and the experts over the rows
  // this rank's experts receive.
  absl::Status ParallelExpertsForward(const MoeLayerSpec& spec, int64_t t,
                                      LayerSlot* la, Act* y);
  // Which share of the experts a command runs: kAll for EXPERTS without
  // expert parallelism, else DISPATCH's, EXPERTS' or COMBINE's.
  // FAILED_PRECONDITION for DISPATCH / COMBINE without it.
  absl::StatusOr<ExpertsPhase> PhaseOf(const v1::Command& c) const;
  // FORWARD DISPATCH: routes la->indices and fills la->x_r / ids_r / w_r.
  absl::Status DispatchRows(int64_t t, LayerSlot* la);
  // FORWARD EXPERTS: the local experts over the received rows into y_r.
  absl::Status LocalExpertsForward(const MoeLayerSpec& spec, int64_t t,
                                   LayerSlot* la);
  // FORWARD COMBINE: y [t, D] from y_r.
  absl::Status CombineRows(int64_t t, LayerSlot* la, Act* y);
  // BACKWARD COMBINE (dy_r from a->dx), EXPERTS (dx_r, dw_r) and DISPATCH
  // (a->dn, a->dweights).
  absl::Status ParallelExpertsBackward(const MoeLayerSpec& spec, int64_t t,
                                       ExpertsPhase phase, LayerSlot* la,
                                       PassSlot* a);
  // `spec`'s layer (an element of arch_.layers) over its local experts.
  const MoeLayerSpec& LocalSpec(const MoeLayerSpec& spec) const {
    return local_specs_[&spec - arch_.layers.data()];
  }
  // The spec EXPERTS runs with: the local one under expert parallelism.
  const MoeLayerSpec& ExpertSpec(const MoeLayerSpec& spec) const {
    return exchange_ == nullptr ? spec : LocalSpec(spec);
  }
  // The exchange over t tokens, with the capacity factor's bound on the
  // rows received.
  RoutedExchange RoutedFor(int64_t t) const;
  // A micro-batch's weight in the reported loss (the mean of the terms):
  // 1, or under SetGlobalLossTokens its share of this rank's counted
  // targets times the micro-batches, so the loss is this rank's token
  // mean (training and evaluation alike).
  double LossWeight(const BatchSlot& batch) const;
  // The ops' attention sees `batch`'s packed rows (or none).
  absl::Status UseSegments(const BatchSlot& batch);

  absl::Status LayerBackward(const MoeLayerSpec& spec, int layer,
                             const BatchSlot& batch, PassSlot* a);
  // LAYER or EXPERTS of a DiffusionGemma layer over `batch` sequences of
  // `seq` rows (a decode's canvas, with `decode`). Without a graph its state
  // goes after EXPERTS unless `keep_without_grad` (an encode whose K/V the
  // decodes read); a recomputed encode keeps them too.
  absl::Status GemmaForward(const v1::Command& c, int64_t batch, int64_t seq,
                            const GemmaDecodeView* decode,
                            bool keep_without_grad, PassSlot* a);
  absl::Status GemmaBackward(const v1::Command& c, int64_t batch, int64_t seq,
                             const GemmaDecodeView* decode, PassSlot* a);
  // The block-diffusion step's commands (model_step_diffusion.cc).
  absl::Status DiffusionForward(const v1::Command& c);
  absl::Status DiffusionBackward(const v1::Command& c);
  // A decode's view of layer l's encode in micro-batch mb.
  GemmaDecodeView DecodeView(int layer, int microbatch,
                             const BatchSlot& batch);
  // The loss term of micro-batch `batch`'s encode (the autoregressive CE)
  // or decode (the diffusion CE): its weight in the reported loss and the
  // gradient of each scored token.
  LossTerm DiffusionTerm(const BatchSlot& batch, bool encode) const;
  // FORWARD(HEAD)'s final norm: a->x becomes a->final_x, with final_inv
  // and h.
  absl::Status FinalNorm(int64_t t, PassSlot* a);
  // BACKWARD(HEAD)'s loss and a->dx: the cross-entropy against `targets`
  // with `term`, plus `extra_loss`, then the final norm's backward; frees
  // the head's activations.
  absl::Status HeadBackward(int64_t t, const Act& targets,
                            const LossTerm& term, double extra_loss,
                            PassSlot* a);

  const MoeArchitecture& arch_;
  StepShape shape_;
  // Declared before every Act and Saved, so it outlives them.
  ActivationLedger ledger_;
  std::unique_ptr<BlockOps> ops_;
  std::unique_ptr<ModelCommandOrder> order_;
  std::vector<BatchSlot> batches_;
  std::vector<PassSlot> slots_;
  std::vector<bool> recompute_layer_, recompute_experts_;
  bool eval_ = false;
  int loss_terms_ = 0;
  int64_t global_counted_ = 0;  // SetGlobalLossTokens.
  int64_t global_canvas_ = 0;
  int loss_ranks_ = 1;
  bool diffusion_ = false;
  BlockDiffusionSpec block_diffusion_;
  bool hold_sc_ = false;
  ExpertExchange* exchange_ = nullptr;
  double capacity_factor_ = 0;
  // Each layer's spec over its local experts (expert parallelism).
  std::vector<MoeLayerSpec> local_specs_;
};

}  // namespace step
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MODEL_STEP_H_
