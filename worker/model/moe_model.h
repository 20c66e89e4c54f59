#ifndef SHARDD_WORKER_MODEL_MOE_MODEL_H_
#define SHARDD_WORKER_MODEL_MOE_MODEL_H_

// The CPU training model: computes the parts of a step program (EMBED, LAYER,
// EXPERTS, HEAD; proto/worker.proto) for a native MoE spec:
//
//   x0 = embed(tokens)                                   (pass 0)
//   x0 = embed(tokens) + c * stopgrad(h_final of pass p-1) (pass p > 0: the
//        self-conditioning coupling of DiffusionGemma's multi-pass step;
//        c = self_conditioning_scale)
//   per layer l:  n = RMSNorm(x; input_layernorm)
//     LAYER:      r = router(n) -> (indices, weights); d = dense_mlp(n) if any
//     EXPERTS:    x = x + grouped_experts(n; indices, weights) + d
//   HEAD:         h = RMSNorm(x; model.norm); loss = CE(h @ W_head^T, targets)
//
// A layer without experts (a dense layer) is x = x + dense_mlp(n), computed
// entirely by LAYER. Passes are independent in backward (the coupling is
// detached), so a pass's backward needs only its own activations.
//
// Loss: each pass with gradients contributes its mean token cross-entropy;
// the step loss is the mean over those passes and over micro-batches. Every
// rank computes the gradient of its local mean, scaled by
// 1 / (microbatches * grad_passes), and the reduce-scatter averages over
// ranks, which is the gradient of the global mean when every rank holds the
// same number of tokens (the batch sampler guarantees it).
//
// Load-balancing loss (dims.router_aux_loss_coef = c > 0): each pass with
// gradients adds c * aux, Hugging Face's load_balancing_loss_func over the
// softmax router probabilities of every MoE layer of the micro-batch
// (kernels/cpu/router_aux_loss.h), so a pass's loss is CE + c * aux. aux is
// not a mean over tokens: for it to be the micro-batch's, not this rank's,
// the caller sums the pass's RouterAuxStats over every data-parallel rank
// of the micro-batch between its FORWARD(HEAD) and its BACKWARD(HEAD)
// (CpuBackend does); the counts also carry the number of ranks whose
// average the reduce-scatter forms, so each rank's gradient is scaled to
// make that average the micro-batch's gradient.
//
// DiffusionGemma (gemma_layer.h) with 3 passes, 1 without gradients, runs
// the block-diffusion step instead (docs/model-spec.md, block_diffusion.h,
// model_step_diffusion.cc): pass 0 the causal encode, pass 1 the
// self-conditioning decode, pass 2 the decode over the encode's K/V; loss =
// diffusion CE on the canvas + the encoder's AR CE per micro-batch, the
// step loss their mean over micro-batches.
//
// Parameters are read and gradients written through ParamSource (the
// worker's ShardStore, or a plain map in tests and the unsharded reference),
// so the model never sees the sharding.
//
// What a step computes, keeps, frees and recomputes is ModelStep's
// (model_step.h), shared with the GPU; MoeModel binds it to the CPU's
// arithmetic (cpu_block_ops.h).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/worker.pb.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/cpu_block_ops.h"
#include "worker/model/model_step.h"
#include "worker/model/param_source.h"

namespace shardd {

struct MoeModelOptions {
  int passes = 1;
  int no_grad_passes = 0;
  int microbatches = 1;
  float self_conditioning_scale = 0.5f;
  // DiffusionGemma's block-diffusion step: noise, self-conditioning coin
  // and loss weights (TrainConfig.diffusion).
  DiffusionTrainingOptions diffusion;
};

// The driver's step shape for `options` (either device's model):
// `canvas_length` is dims.canvas_length.
step::StepShape StepShapeOf(const MoeModelOptions& options,
                            int64_t canvas_length);

class MoeModel {
 public:
  // A pass's load-balancing statistics, summed over its MoE layers' rows.
  using RouterAuxStats = step::HostRouterAuxStats;

  // Checks that the spec is one the CPU path computes: model.embed_tokens
  // (MODULE_EMBEDDING), model.layers.N each with input_layernorm and either a
  // moe (gate.weight [E, D], experts.gate_and_up_projs [E, D, 2I],
  // experts.down_projs [E, I, D], optional mlp with gate_proj/up_proj/
  // down_proj) or only an mlp; model.norm; lm_head.weight (own or tied to the
  // embedding). dims.top_k and dims.activation must be set for MoE layers.
  // Errors: INVALID_ARGUMENT naming the first module or parameter the CPU
  // path cannot compute (e.g. attention) and what it expects.
  static absl::StatusOr<std::unique_ptr<MoeModel>> Create(
      const v1::ModelSpec& model, const MoeModelOptions& options);

  // Installs micro-batch `microbatch`'s tokens: inputs and targets are
  // [batch, seq] row-major (targets may hold -1 = ignore). Must be called
  // before that micro-batch's first FORWARD(EMBED). The arrays are copied.
  // Errors: INVALID_ARGUMENT (microbatch out of range, batch or seq < 1, a
  // token id outside [0, vocab)).
  absl::Status SetBatch(int microbatch, const int32_t* inputs,
                        const int32_t* targets, int64_t batch, int64_t seq);

  // Packed rows (docs/sft_data.md) for micro-batch `microbatch`, after its
  // SetBatch: segment_starts [batch, seq] (copied) gives each token's
  // example start within its row (0 at a row's start, then the previous
  // position's start or the position itself); RoPE positions restart there
  // and attention stays inside the example. Null: one sequence per row.
  // Errors: FAILED_PRECONDITION (no SetBatch; DiffusionGemma's
  // block-diffusion step), INVALID_ARGUMENT naming the bad index.
  absl::Status SetRowSegments(int microbatch, const int32_t* segment_starts);

  // DiffusionGemma's 3-pass step: the keys of micro-batch `microbatch`'s
  // canvas noise (block_diffusion.h), the optimizer step and each row's
  // global sequence index [batch], so that every data-parallel layout draws
  // the same canvases. Call after SetBatch (which defaults to step 0 and
  // microbatch * batch + row); other models ignore them.
  // Errors: FAILED_PRECONDITION without the micro-batch's SetBatch.
  absl::Status SetSequenceKeys(int microbatch, int64_t step,
                               const int64_t* sequence_indices);
  // DiffusionGemma's SFT rows (docs/sft_data.md), after SetBatch: starts
  // [batch] each row's response start and targets [batch, R] its canvas's
  // scored tokens (-1: not scored); the decode then runs each row's canvas
  // at positions start + j, its encoder keys up to start + the block's
  // first row. Errors: FAILED_PRECONDITION without SetBatch or for another
  // model, INVALID_ARGUMENT for a start outside the row or a target
  // outside [-1, vocab).
  absl::Status SetCanvasRows(int microbatch, const int32_t* starts,
                             const int32_t* targets);

  // Tests only: keeps each micro-batch's self-conditioning distribution
  // (pass 1's softmax, detached in the gradient) from the next step that
  // computes it on, so that finite differences of the step's loss see the
  // function the gradient is of.
  void HoldSelfConditioningForTest(bool hold);

  // Runs one FORWARD or BACKWARD command. `command.part`, `layer`, `pass`,
  // `microbatch` and `requires_grad` say what to compute.
  // Errors: INVALID_ARGUMENT (part/layer/pass out of range),
  // FAILED_PRECONDITION (out of order: e.g. a backward whose forward has not
  // run, EXPERTS before LAYER), and ParamSource's errors.
  absl::Status Run(const v1::Command& command, ParamSource* params);

  // Until changed: whether the steps evaluate (an eval program, every
  // FORWARD without a graph): FORWARD(HEAD) of each pass a training step
  // takes its loss from computes that loss (the cross-entropy with the
  // step's weights, without the router's auxiliary loss) into step_loss and
  // step_tokens, and a layer's activations are dropped once its forward is
  // done (DiffusionGemma's encode keeps the K/V its decodes read).
  void SetEvaluation(bool eval);
  // As ModelStep::SetGlobalLossTokens.
  void SetGlobalLossTokens(int64_t global_counted, int ranks,
                           int64_t global_canvas = 0);

  // Expert parallelism: as ModelStep::SetExpertExchange (the parameter
  // source then serves this rank's block [E / ep, ...] of every expert
  // tensor, and gradients come back the same shape).
  absl::Status SetExpertExchange(ExpertExchange* exchange,
                                 double capacity_factor);

  // Forgets every activation and the step's loss (call at a step's start).
  void ResetStep();

  // Mean loss over the grad passes and micro-batches run since ResetStep (or
  // over the scored passes of an evaluation), and the number of target
  // tokens it covers.
  double step_loss() const;
  int64_t step_tokens() const;

  // Whether the load-balancing loss is on (dims.router_aux_loss_coef > 0).
  bool router_aux_loss() const;

  // Pass `pass`'s statistics once its FORWARD(HEAD) has run, for the caller
  // to replace by their sums over the micro-batch's data-parallel ranks (in
  // place: add, never resize) before that pass's BACKWARD(HEAD) reads them.
  // Null when the loss is off or `pass` is out of range.
  RouterAuxStats* router_aux_stats(int pass);

  // Which layers recompute their forward in their backward (activation
  // checkpointing): `layers[l]` the whole layer (its forward keeps only its
  // input and the experts' inputs), `experts[l]` only its grouped experts
  // (their forward keeps nothing). One flag per layer; all false by
  // default. Errors: INVALID_ARGUMENT for a wrong count.
  absl::Status SetRecompute(std::vector<bool> layers,
                            std::vector<bool> experts);

  // Bytes of the activations held now: what forwards keep for their
  // backwards, the residual stream and its gradient (the plan's
  // ActivationModel, planner/activation_model.h, for non-Gemma models).
  // A layer's are freed when its backward ends.
  int64_t activation_bytes() const;
  // The most activation_bytes() held during the last Run (a recompute,
  // or a backward's gradient buffers, before they are freed).
  int64_t command_activation_peak() const;

  int num_layers() const;
  int64_t vocab_size() const;

 private:
  MoeModel() = default;

  // The step runs on the step driver (model_step.h) over the CPU's block
  // ops; the architecture outlives both.
  std::unique_ptr<MoeArchitecture> arch_;
  std::unique_ptr<step::ModelStep> step_;
  step::CpuBlockOps* ops_ = nullptr;  // Owned by step_.
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MOE_MODEL_H_
