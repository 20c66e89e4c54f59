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
// DiffusionGemma's layers and its block-diffusion step are not on the
// driver yet (MoeModel keeps them); Create refuses them.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "worker/model/block_ops.h"
#include "worker/model/command_order.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace step {

struct StepShape {
  int passes = 1;
  int no_grad_passes = 0;
  int microbatches = 1;
  // Pass p > 0 embeds its tokens plus this times pass p-1's output.
  float self_conditioning_scale = 0.5f;
};

class ModelStep {
 public:
  // `arch` outlives the step; `ops` computes on `arch` too.
  // Errors: INVALID_ARGUMENT for a DiffusionGemma architecture or a step
  // shape CheckModelStepShape refuses.
  static absl::StatusOr<std::unique_ptr<ModelStep>> Create(
      const MoeArchitecture* arch, const StepShape& shape,
      std::unique_ptr<BlockOps> ops);
  ~ModelStep();

  BlockOps* ops() { return ops_.get(); }

  // As MoeModel::SetBatch.
  absl::Status SetBatch(int microbatch, const int32_t* inputs,
                        const int32_t* targets, int64_t batch, int64_t seq);
  // As MoeModel::SetRecompute.
  absl::Status SetRecompute(std::vector<bool> layers,
                            std::vector<bool> experts);
  void SetEvaluation(bool eval) { eval_ = eval; }
  // Forgets the step's loss and command order (activations stay).
  void ResetStep();
  // As MoeModel::Run, on the parameters the ops are bound to.
  absl::Status Run(const v1::Command& command);

  double step_loss() const { return ops_->loss(loss_terms_); }
  int64_t step_tokens() const { return ops_->loss_tokens(); }
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
  absl::Status LayerBackward(const MoeLayerSpec& spec, int layer,
                             const BatchSlot& batch, PassSlot* a);

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
};

}  // namespace step
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MODEL_STEP_H_
