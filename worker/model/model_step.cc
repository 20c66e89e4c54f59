#include "worker/model/model_step.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "program/pass_layout.h"

namespace shardd {
namespace step {

using v1::Command;

ModelStep::ModelStep(const MoeArchitecture* arch, const StepShape& shape,
                     std::unique_ptr<BlockOps> ops)
    : arch_(*arch), shape_(shape), ops_(std::move(ops)) {}

ModelStep::~ModelStep() {
  // Slots first: their Acts and Saved release into ops_' memory and the
  // ledger.
  slots_.clear();
  batches_.clear();
}

absl::StatusOr<BlockDiffusionSpec> ModelStep::CheckShape(
    const MoeArchitecture& arch, const StepShape& shape) {
  SHARDD_RETURN_IF_ERROR(CheckModelStepShape(shape.passes, shape.no_grad_passes,
                                             shape.microbatches));
  if (arch.gemma && shape.passes == 3 && shape.no_grad_passes == 1) {
    return ReadBlockDiffusionSpec(arch, shape.canvas_length,
                                  shape.diffusion.response_length);
  }
  if (arch.gemma && shape.passes != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DiffusionGemma: the model computes the causal pass (1 pass) or "
        "the block-diffusion step (3 passes, 1 without gradients), got ",
        shape.passes, " passes, ", shape.no_grad_passes, " without gradients"));
  }
  return BlockDiffusionSpec();
}

absl::StatusOr<std::unique_ptr<ModelStep>> ModelStep::Create(
    const MoeArchitecture* arch, const StepShape& shape,
    std::unique_ptr<BlockOps> ops) {
  SHARDD_ASSIGN_OR_RETURN(BlockDiffusionSpec block_diffusion,
                          CheckShape(*arch, shape));
  auto step = absl::WrapUnique(new ModelStep(arch, shape, std::move(ops)));
  if (arch->gemma && shape.passes == 3) {
    step->diffusion_ = true;
    step->block_diffusion_ = std::move(block_diffusion);
  }
  const bool per_microbatch = step->ops_->per_microbatch_state();
  step->order_ = std::make_unique<ModelCommandOrder>(
      PassLayout::For(arch->gemma ? kBlockDiffusionArchitecture : "",
                      shape.passes, shape.no_grad_passes),
      shape.microbatches, arch->LayersWithExperts(), per_microbatch);
  step->batches_.resize(shape.microbatches);
  step->slots_.resize(per_microbatch ? static_cast<size_t>(shape.passes) *
                                           shape.microbatches
                                     : shape.passes);
  for (PassSlot& a : step->slots_) a.layers.resize(arch->layers.size());
  step->recompute_layer_.assign(arch->layers.size(), false);
  step->recompute_experts_.assign(arch->layers.size(), false);
  return step;
}

ModelStep::PassSlot& ModelStep::Slot(int pass, int microbatch) {
  return ops_->per_microbatch_state()
             ? slots_[static_cast<size_t>(microbatch) * shape_.passes + pass]
             : slots_[pass];
}

absl::Status ModelStep::Ensure(Act* a, Elem elem, int64_t numel, bool zero) {
  if (!a->empty() && a->numel() == numel && a->elem() == elem) {
    if (zero) {
      SHARDD_ASSIGN_OR_RETURN(Act zeros, ops_->Allocate(elem, numel, true));
      return ops_->Copy(zeros, a);
    }
    return absl::OkStatus();
  }
  a->Reset();
  SHARDD_ASSIGN_OR_RETURN(*a, ops_->Allocate(elem, numel, zero));
  a->Track(&ledger_);
  return absl::OkStatus();
}

absl::StatusOr<Act> ModelStep::Temp(int64_t numel) {
  return ops_->Allocate(Elem::kStorage, numel, /*zero=*/false);
}

absl::Status ModelStep::SetBatch(int microbatch, const int32_t* inputs,
                                 const int32_t* targets, int64_t batch,
                                 int64_t seq) {
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t counted,
      CheckMicroBatch(microbatch, shape_.microbatches, inputs, targets, batch,
                      seq, arch_.vocab));
  SHARDD_RETURN_IF_ERROR(ops_->Prepare(seq));
  if (diffusion_) {
    SHARDD_RETURN_IF_ERROR(
        CheckBlockDiffusionSeq(seq, block_diffusion_.canvas));
  }
  BatchSlot& b = batches_[microbatch];
  b.batch = batch;
  b.seq = seq;
  b.tokens = batch * seq;
  b.segment_starts.clear();
  SHARDD_ASSIGN_OR_RETURN(b.inputs, ops_->Upload(inputs, b.tokens));
  SHARDD_ASSIGN_OR_RETURN(b.targets, ops_->Upload(targets, b.tokens));
  b.counted = counted;
  if (diffusion_) {
    // The encoder's pairs: logits 0..S-2 against tokens 1..S-1.
    b.host_inputs.assign(inputs, inputs + b.tokens);
    std::vector<int32_t> ar(targets, targets + b.tokens);
    b.ar_counted = 0;
    b.canvas_starts.clear();
    b.canvas_targets.clear();
    b.canvas_counted = 0;
    for (int64_t r = 0; r < batch; ++r) {
      ar[r * seq + seq - 1] = -1;
      for (int64_t i = 0; i < seq; ++i) b.ar_counted += ar[r * seq + i] >= 0;
    }
    SHARDD_ASSIGN_OR_RETURN(b.ar_targets, ops_->Upload(ar.data(), b.tokens));
    b.step = 0;
    if (!hold_sc_) b.sc_probs.Reset();
    b.sequence_indices.resize(batch);
    for (int64_t r = 0; r < batch; ++r) {
      b.sequence_indices[r] = microbatch * batch + r;
    }
  }
  return absl::OkStatus();
}

absl::Status ModelStep::SetSequenceKeys(int microbatch, int64_t step,
                                        const int64_t* sequence_indices) {
  if (microbatch < 0 || microbatch >= shape_.microbatches ||
      batches_[microbatch].tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetSequenceKeys: micro-batch ", microbatch, " has no batch"));
  }
  if (!diffusion_) return absl::OkStatus();  // Only the canvas reads them.
  BatchSlot& b = batches_[microbatch];
  b.step = step;
  b.sequence_indices.assign(sequence_indices, sequence_indices + b.batch);
  return absl::OkStatus();
}

absl::Status ModelStep::SetRecompute(std::vector<bool> layers,
                                     std::vector<bool> experts) {
  const size_t n = arch_.layers.size();
  if (layers.size() != n || experts.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("recompute: needs one flag per layer (", n, "), got ",
                     layers.size(), " and ", experts.size()));
  }
  recompute_layer_ = std::move(layers);
  recompute_experts_ = std::move(experts);
  return absl::OkStatus();
}

void ModelStep::ResetStep() {
  ops_->ResetLoss();
  loss_terms_ = 0;
  order_->Reset();
}

Saved* ModelStep::aux_stats(int pass, int microbatch) {
  if (!arch_.aux_on() || pass < 0 || pass >= shape_.passes || microbatch < 0 ||
      microbatch >= shape_.microbatches) {
    return nullptr;
  }
  return &Slot(pass, microbatch).aux;
}

absl::Status ModelStep::Run(const Command& command) {
  SHARDD_RETURN_IF_ERROR(order_->Check(command, "MoeModel"));
  if (batches_[command.microbatch()].tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro-batch ", command.microbatch(),
                     " has no tokens (SetBatch missing)"));
  }
  ledger_.BeginCommand();
  SHARDD_RETURN_IF_ERROR(command.op() == Command::FORWARD ? Forward(command)
                                                          : Backward(command));
  order_->Commit(command);
  return absl::OkStatus();
}

void ModelStep::KeepCheckpoint(const MoeLayerSpec& spec, LayerSlot* la) {
  LayerSlot keep;
  keep.x_in = std::move(la->x_in);
  if (spec.has_moe) {
    keep.normed = std::move(la->normed);
    keep.indices = std::move(la->indices);
    keep.weights = std::move(la->weights);
    keep.dense_out = std::move(la->dense_out);
  }
  *la = std::move(keep);
}

absl::Status ModelStep::LayerForward(const MoeLayerSpec& spec,
                                     const BatchSlot& batch, LayerSlot* la,
                                     PassSlot* a) {
  const int64_t t = batch.tokens;
  const int64_t td = t * arch_.dim;
  SHARDD_RETURN_IF_ERROR(Ensure(&la->inv_rms, Elem::kF32, t));
  SHARDD_RETURN_IF_ERROR(Ensure(&la->normed, Elem::kStorage, td));
  SHARDD_RETURN_IF_ERROR(
      ops_->NormForward(spec.norm, la->x_in, t, &la->normed, &la->inv_rms));
  if (spec.has_attention) {
    // x_mid = x + attention(input_layernorm(x)); the MoE / MLP branch
    // reads post_attention_layernorm(x_mid).
    SHARDD_ASSIGN_OR_RETURN(Act y, Temp(td));
    SHARDD_RETURN_IF_ERROR(ops_->AttentionForward(
        spec, la->normed, batch.batch, batch.seq, &la->attention, &y));
    la->attention.Sync(&ledger_);
    SHARDD_RETURN_IF_ERROR(Ensure(&la->x_mid, Elem::kStorage, td));
    SHARDD_RETURN_IF_ERROR(ops_->Sum(la->x_in, y, &la->x_mid));
    if (a != nullptr) SHARDD_RETURN_IF_ERROR(ops_->Copy(la->x_mid, &a->x));
    SHARDD_RETURN_IF_ERROR(Ensure(&la->post_inv, Elem::kF32, t));
    SHARDD_RETURN_IF_ERROR(ops_->NormForward(spec.post_norm, la->x_mid, t,
                                             &la->normed, &la->post_inv));
  }
  if (spec.has_mlp) {
    // Beside experts the output waits for EXPERTS (a recompute does not
    // need it); a dense layer adds it to the stream here.
    Act temp;
    Act* y = &temp;
    if (spec.has_moe && a != nullptr) {
      SHARDD_RETURN_IF_ERROR(Ensure(&la->dense_out, Elem::kStorage, td));
      y = &la->dense_out;
    } else {
      SHARDD_ASSIGN_OR_RETURN(temp, Temp(td));
    }
    const MlpTensors mlp{&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down,
                         spec.mlp_inter};
    SHARDD_RETURN_IF_ERROR(ops_->MlpForward(mlp, la->normed, t, &la->mlp, y));
    la->mlp.Sync(&ledger_);
    if (!spec.has_moe && a != nullptr) {
      SHARDD_RETURN_IF_ERROR(ops_->Add(&a->x, *y, nullptr));
    }
  }
  if (spec.has_moe) {
    SHARDD_RETURN_IF_ERROR(Ensure(&la->indices, Elem::kI32, t * arch_.top_k));
    SHARDD_RETURN_IF_ERROR(Ensure(&la->weights, Elem::kF32, t * arch_.top_k));
    SHARDD_RETURN_IF_ERROR(ops_->RouterForward(
        spec, la->normed, t, &la->indices, &la->weights, &la->router));
    la->router.Sync(&ledger_);
    if (arch_.aux_on() && a != nullptr) {
      SHARDD_RETURN_IF_ERROR(
          ops_->AuxAccumulate(la->router, la->indices, t, &a->aux));
    }
  }
  return absl::OkStatus();
}

absl::Status ModelStep::ExpertsForward(const MoeLayerSpec& spec, int64_t t,
                                       LayerSlot* la, Act* y) {
  if (exchange_ != nullptr) return ParallelExpertsForward(spec, t, la, y);
  SHARDD_RETURN_IF_ERROR(ops_->ExpertsForward(spec, la->normed, la->indices,
                                              la->weights, t, arch_.top_k,
                                              &la->experts, y));
  la->experts.Sync(&ledger_);
  return absl::OkStatus();
}

absl::Status ModelStep::ExpertsBackward(const MoeLayerSpec& spec, int64_t t,
                                        LayerSlot* la, PassSlot* a) {
  SHARDD_RETURN_IF_ERROR(Ensure(&a->dn, Elem::kStorage, t * arch_.dim));
  SHARDD_RETURN_IF_ERROR(Ensure(&a->dweights, Elem::kF32, t * arch_.top_k));
  SHARDD_RETURN_IF_ERROR(ops_->ExpertsBackward(
      spec, a->dx, t, arch_.top_k, &la->experts, &a->dn, &a->dweights));
  la->experts.Sync(&ledger_);
  return absl::OkStatus();
}

absl::Status ModelStep::SetExpertExchange(ExpertExchange* exchange,
                                          double capacity_factor) {
  local_specs_.clear();
  exchange_ = nullptr;
  order_->SetExchanged(false);
  if (exchange == nullptr) return absl::OkStatus();
  for (const MoeLayerSpec& spec : arch_.layers) {
    MoeLayerSpec local = spec;
    if (spec.has_moe) {
      if (spec.experts != exchange->experts()) {
        return absl::InvalidArgumentError(
            absl::StrCat("expert parallelism: a layer has ", spec.experts,
                         " experts, the exchange ", exchange->experts()));
      }
      // This rank's block: dim 0 of the stacked tensors.
      local.experts = exchange->local_experts();
      for (ArchTensor* w : {&local.w_gu, &local.w_d, &local.b_gu, &local.b_d}) {
        if (!w->shape.empty()) w->shape[0] /= exchange->ep();
      }
    }
    local_specs_.push_back(std::move(local));
  }
  exchange_ = exchange;
  order_->SetExchanged(true);
  capacity_factor_ = capacity_factor;
  return absl::OkStatus();
}

RoutedExchange ModelStep::RoutedFor(int64_t t) const {
  RoutedExchange ep;
  ep.exchange = exchange_;
  if (capacity_factor_ > 0) {
    ep.max_received_rows =
        static_cast<int64_t>(std::ceil(capacity_factor_ * t * arch_.top_k));
  }
  return ep;
}

absl::StatusOr<ExpertsPhase> ModelStep::PhaseOf(const Command& c) const {
  if (exchange_ == nullptr) {
    if (c.part() == Command::EXPERTS) return ExpertsPhase::kAll;
    return absl::FailedPreconditionError(
        absl::StrCat(Command::Part_Name(c.part()), " of layer ", c.layer(),
                     " without expert parallelism (the plan's experts units "
                     "have no ep)"));
  }
  switch (c.part()) {
    case Command::DISPATCH:
      return ExpertsPhase::kDispatch;
    case Command::COMBINE:
      return ExpertsPhase::kCombine;
    default:
      return ExpertsPhase::kCompute;
  }
}

absl::Status ModelStep::ParallelExpertsForward(const MoeLayerSpec& spec,
                                               int64_t t, LayerSlot* la,
                                               Act* y) {
  SHARDD_RETURN_IF_ERROR(DispatchRows(t, la));
  SHARDD_RETURN_IF_ERROR(LocalExpertsForward(spec, t, la));
  return CombineRows(t, la, y);
}

absl::Status ModelStep::DispatchRows(int64_t t, LayerSlot* la) {
  const int k = arch_.top_k;
  const int64_t d = arch_.dim;
  // The route is the host's (the counts go first): the choices come back.
  std::vector<int32_t> choices;
  SHARDD_RETURN_IF_ERROR(ops_->ReadChoices(la->indices, t * k, &choices));
  SHARDD_RETURN_IF_ERROR(exchange_->Route(choices.data(), t, k,
                                          RoutedFor(t).max_received_rows,
                                          &la->route));
  // At least one element: an Act of 0 holds no memory.
  const int64_t r = std::max<int64_t>(1, la->route.received);
  SHARDD_RETURN_IF_ERROR(Ensure(&la->x_r, Elem::kStorage, r * d));
  SHARDD_RETURN_IF_ERROR(Ensure(&la->ids_r, Elem::kI32, r));
  SHARDD_RETURN_IF_ERROR(Ensure(&la->w_r, Elem::kF32, r));
  return ops_->ExchangeDispatch(*exchange_, la->route, la->normed, la->weights,
                                la->indices, &la->x_r, &la->ids_r, &la->w_r);
}

absl::Status ModelStep::LocalExpertsForward(const MoeLayerSpec& spec, int64_t t,
                                            LayerSlot* la) {
  const int64_t r = la->route.received;
  if (la->route.t != t || la->x_r.empty()) {
    return absl::FailedPreconditionError(
        "EXPERTS of an expert-parallel layer before its DISPATCH");
  }
  SHARDD_RETURN_IF_ERROR(
      Ensure(&la->y_r, Elem::kStorage, std::max<int64_t>(1, r) * arch_.dim));
  SHARDD_RETURN_IF_ERROR(ops_->ExpertsForward(LocalSpec(spec), la->x_r,
                                              la->ids_r, la->w_r, r, /*k=*/1,
                                              &la->experts, &la->y_r));
  la->experts.Sync(&ledger_);
  la->x_r.Reset();
  la->ids_r.Reset();
  la->w_r.Reset();
  return absl::OkStatus();
}

absl::Status ModelStep::CombineRows(int64_t t, LayerSlot* la, Act* y) {
  if (la->route.t != t || la->y_r.empty()) {
    return absl::FailedPreconditionError(
        "COMBINE of an expert-parallel layer before its EXPERTS");
  }
  SHARDD_RETURN_IF_ERROR(
      ops_->ExchangeCombine(*exchange_, la->route, la->y_r, y));
  la->y_r.Reset();
  return absl::OkStatus();
}

absl::Status ModelStep::ParallelExpertsBackward(const MoeLayerSpec& spec,
                                                int64_t t, ExpertsPhase phase,
                                                LayerSlot* la, PassSlot* a) {
  const int64_t d = arch_.dim;
  const int64_t r = la->route.received;
  const int64_t rows = std::max<int64_t>(1, r);
  if (la->route.t != t) {
    return absl::FailedPreconditionError(
        "the backward of an expert-parallel layer without its forward's "
        "route");
  }
  switch (phase) {
    case ExpertsPhase::kCombine:
      SHARDD_RETURN_IF_ERROR(Ensure(&la->dy_r, Elem::kStorage, rows * d));
      return ops_->ExchangeDispatchGrad(*exchange_, la->route, a->dx,
                                        &la->dy_r);
    case ExpertsPhase::kCompute:
      if (la->dy_r.empty()) {
        return absl::FailedPreconditionError(
            "BACKWARD EXPERTS of an expert-parallel layer before its "
            "BACKWARD COMBINE");
      }
      SHARDD_RETURN_IF_ERROR(Ensure(&la->dx_r, Elem::kStorage, rows * d));
      SHARDD_RETURN_IF_ERROR(Ensure(&la->dw_r, Elem::kF32, rows));
      SHARDD_RETURN_IF_ERROR(ops_->ExpertsBackward(LocalSpec(spec), la->dy_r, r,
                                                   /*k=*/1, &la->experts,
                                                   &la->dx_r, &la->dw_r));
      la->experts.Sync(&ledger_);
      la->experts.Reset();
      la->dy_r.Reset();
      return absl::OkStatus();
    case ExpertsPhase::kDispatch:
      if (la->dx_r.empty()) {
        return absl::FailedPreconditionError(
            "BACKWARD DISPATCH of an expert-parallel layer before its "
            "BACKWARD EXPERTS");
      }
      SHARDD_RETURN_IF_ERROR(Ensure(&a->dn, Elem::kStorage, t * d));
      SHARDD_RETURN_IF_ERROR(Ensure(&a->dweights, Elem::kF32, t * arch_.top_k));
      SHARDD_RETURN_IF_ERROR(ops_->ExchangeCombineGrad(
          *exchange_, la->route, la->dx_r, la->dw_r, &a->dn, &a->dweights));
      la->dx_r.Reset();
      la->dw_r.Reset();
      la->route = ExpertRoute();
      return absl::OkStatus();
    case ExpertsPhase::kAll:
      break;
  }
  return absl::InternalError("ParallelExpertsBackward of the whole EXPERTS");
}

absl::Status ModelStep::FinalNorm(int64_t t, PassSlot* a) {
  // The stream becomes the final norm's input; nothing reads it again.
  a->final_x = std::move(a->x);
  SHARDD_RETURN_IF_ERROR(Ensure(&a->final_inv, Elem::kF32, t));
  SHARDD_RETURN_IF_ERROR(Ensure(&a->h, Elem::kStorage, t * arch_.dim));
  return ops_->NormForward(arch_.final_norm, a->final_x, t, &a->h,
                           &a->final_inv);
}

absl::Status ModelStep::HeadBackward(int64_t t, const Act& targets,
                                     const LossTerm& term, double extra_loss,
                                     PassSlot* a) {
  SHARDD_ASSIGN_OR_RETURN(Act dh, Temp(t * arch_.dim));
  SHARDD_RETURN_IF_ERROR(
      ops_->HeadLoss(a->h, targets, t, term, extra_loss, &dh));
  SHARDD_RETURN_IF_ERROR(Ensure(&a->dx, Elem::kStorage, t * arch_.dim));
  SHARDD_RETURN_IF_ERROR(ops_->NormBackward(arch_.final_norm, dh, a->final_x,
                                            a->final_inv, t, &a->dx,
                                            /*accumulate=*/false));
  a->final_x.Reset();
  a->final_inv.Reset();
  a->h.Reset();
  return absl::OkStatus();
}

absl::Status ModelStep::GemmaForward(const Command& c, int64_t batch,
                                     int64_t seq, const GemmaDecodeView* decode,
                                     bool keep_without_grad, PassSlot* a) {
  const int l = c.layer();
  const MoeLayerSpec& spec = arch_.layers[l];
  LayerSlot& la = a->layers[l];
  if (c.part() == Command::LAYER) {
    SHARDD_RETURN_IF_ERROR(
        ops_->GemmaLayerForward(spec, &a->x, batch, seq, decode, &la.gemma));
    la.gemma.Sync(&ledger_);
    return absl::OkStatus();
  }
  // EXPERTS, or under expert parallelism DISPATCH, EXPERTS or COMBINE.
  SHARDD_ASSIGN_OR_RETURN(const ExpertsPhase phase, PhaseOf(c));
  const RoutedExchange ep = RoutedFor(batch * seq);
  SHARDD_RETURN_IF_ERROR(
      ops_->GemmaExpertsForward(ExpertSpec(spec), batch * seq, &la.gemma, &a->x,
                                exchange_ == nullptr ? nullptr : &ep, phase));
  la.gemma.Sync(&ledger_);
  if (phase != ExpertsPhase::kAll && phase != ExpertsPhase::kCombine) {
    return absl::OkStatus();
  }
  if (!c.requires_grad()) {
    if (!keep_without_grad) la = LayerSlot();
  } else if (recompute_layer_[l] || recompute_experts_[l]) {
    // An encode keeps the K/V its decodes read.
    ops_->GemmaTrim(!recompute_layer_[l] ? GemmaKeep::kAllButExperts
                    : keep_without_grad  ? GemmaKeep::kCheckpointAndKv
                                         : GemmaKeep::kCheckpoint,
                    &la.gemma);
    la.gemma.Sync(&ledger_);
  }
  return absl::OkStatus();
}

absl::Status ModelStep::GemmaBackward(const Command& c, int64_t batch,
                                      int64_t seq,
                                      const GemmaDecodeView* decode,
                                      PassSlot* a) {
  const int l = c.layer();
  const MoeLayerSpec& spec = arch_.layers[l];
  LayerSlot& la = a->layers[l];
  const int64_t t = batch * seq;
  if (c.part() != Command::LAYER) {
    SHARDD_ASSIGN_OR_RETURN(const ExpertsPhase phase, PhaseOf(c));
    const RoutedExchange ep = RoutedFor(t);
    const RoutedExchange* epp = exchange_ == nullptr ? nullptr : &ep;
    if ((phase == ExpertsPhase::kAll || phase == ExpertsPhase::kCombine) &&
        (recompute_layer_[l] || recompute_experts_[l])) {
      SHARDD_RETURN_IF_ERROR(ops_->GemmaExpertsForward(
          ExpertSpec(spec), t, &la.gemma, nullptr, epp, ExpertsPhase::kAll));
      la.gemma.Sync(&ledger_);
    }
    SHARDD_RETURN_IF_ERROR(ops_->GemmaExpertsBackward(
        ExpertSpec(spec), t, a->dx, &la.gemma, epp, phase));
    la.gemma.Sync(&ledger_);
    if (phase == ExpertsPhase::kAll || phase == ExpertsPhase::kCompute) {
      ops_->GemmaTrim(GemmaKeep::kAllButExpertsWorkspace, &la.gemma);
      la.gemma.Sync(&ledger_);
    }
    return absl::OkStatus();
  }
  if (recompute_layer_[l]) {
    SHARDD_RETURN_IF_ERROR(
        ops_->GemmaLayerForward(spec, nullptr, batch, seq, decode, &la.gemma));
    la.gemma.Sync(&ledger_);
  }
  SHARDD_RETURN_IF_ERROR(
      ops_->GemmaLayerBackward(spec, batch, seq, decode, &la.gemma, &a->dx));
  la.gemma.Sync(&ledger_);
  // A decode's K/V gradients stay in the encode's state until its backward.
  if (decode != nullptr) decode->encoder->Sync(&ledger_);
  la = LayerSlot();
  return absl::OkStatus();
}

absl::Status ModelStep::SetCanvasRows(int microbatch, const int32_t* starts,
                                      const int32_t* targets) {
  if (microbatch < 0 || microbatch >= shape_.microbatches ||
      batches_[microbatch].tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetCanvasRows: micro-batch ", microbatch, " has no SetBatch"));
  }
  if (!diffusion_) {
    return absl::FailedPreconditionError(
        "SetCanvasRows: only DiffusionGemma's block-diffusion step has a "
        "canvas");
  }
  BatchSlot& b = batches_[microbatch];
  const int64_t canvas = block_diffusion_.canvas;
  for (int64_t r = 0; r < b.batch; ++r) {
    if (starts[r] < 0 || starts[r] >= b.seq) {
      return absl::InvalidArgumentError(
          absl::StrCat("canvas_starts[", r, "]: ", starts[r],
                       " is outside the row [0, ", b.seq, ")"));
    }
  }
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t counted,
      CountTargets(targets, b.batch * canvas, arch_.vocab, "canvas_targets"));
  b.canvas_starts.assign(starts, starts + b.batch);
  b.canvas_targets.assign(targets, targets + b.batch * canvas);
  b.canvas_counted = counted;
  return absl::OkStatus();
}

LossTerm ModelStep::DiffusionTerm(const BatchSlot& batch, bool encode) const {
  const double w = encode ? shape_.diffusion.encoder_loss_weight
                          : shape_.diffusion.diffusion_loss_weight;
  const int m = shape_.microbatches;
  LossTerm term;
  term.weight = w;
  if (global_canvas_ <= 0) {
    // Each a mean over this rank's count, which the reduce-scatter's
    // average over ranks of equal counts makes the global mean.
    const int64_t count =
        encode ? batch.ar_counted : batch.batch * block_diffusion_.canvas;
    term.grad_scale =
        count == 0 ? 0.0f
                   : static_cast<float>(w / (static_cast<double>(count) * m));
    return term;
  }
  // SFT rows: the mean over the term's global count. The rank reports
  // sum_terms(w x its CE sum / global count) x N / T (N both terms' global
  // counts, T this rank's), so that the ranks' mean weighted by T is the
  // global loss.
  const int64_t global = encode ? global_counted_ : global_canvas_;
  int64_t local = 0;
  for (int i = 0; i < m; ++i) {
    local += batches_[i].ar_counted + batches_[i].canvas_counted;
  }
  const int64_t mine = encode ? batch.ar_counted : batch.canvas_counted;
  term.grad_scale =
      global == 0
          ? 0.0f
          : static_cast<float>(w * loss_ranks_ / static_cast<double>(global));
  term.weight =
      global == 0 || local == 0
          ? 0.0
          : w * m * static_cast<double>(mine) *
                static_cast<double>(global_counted_ + global_canvas_) /
                (static_cast<double>(global) * static_cast<double>(local));
  return term;
}

double ModelStep::LossWeight(const BatchSlot& batch) const {
  if (global_counted_ <= 0) return 1.0;
  int64_t local = 0;
  for (int m = 0; m < shape_.microbatches; ++m) local += batches_[m].counted;
  return local == 0
             ? 0.0
             : static_cast<double>(batch.counted) * shape_.microbatches / local;
}

absl::Status ModelStep::SetRowSegments(int microbatch,
                                       const int32_t* segment_starts) {
  if (microbatch < 0 || microbatch >= shape_.microbatches ||
      batches_[microbatch].tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetRowSegments: micro-batch ", microbatch, " has no SetBatch"));
  }
  if (diffusion_) {
    return absl::FailedPreconditionError(
        "packed rows: DiffusionGemma's block-diffusion step takes one "
        "sequence per row");
  }
  BatchSlot& b = batches_[microbatch];
  if (segment_starts == nullptr) {
    b.segment_starts.clear();
    return absl::OkStatus();
  }
  // Each row's positions are cut into examples: a start is 0 at the row's
  // first position, then either the previous position's or the position
  // itself.
  for (int64_t i = 0; i < b.tokens; ++i) {
    const int64_t j = i % b.seq;
    const int32_t s = segment_starts[i];
    const bool ok = j == 0 ? s == 0 : (s == segment_starts[i - 1] || s == j);
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment_starts[", i, "]: ", s, " at row position ", j,
          "; must be 0 at a row's start, then the previous position's start "
          "or the position itself"));
    }
  }
  b.segment_starts.assign(segment_starts, segment_starts + b.tokens);
  return absl::OkStatus();
}

absl::Status ModelStep::UseSegments(const BatchSlot& batch) {
  return ops_->SetRowSegments(
      batch.segment_starts.empty() ? nullptr : batch.segment_starts.data());
}

absl::Status ModelStep::Forward(const Command& c) {
  if (diffusion_) return DiffusionForward(c);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassSlot& a = Slot(pass, mb);
  const BatchSlot& batch = batches_[mb];
  SHARDD_RETURN_IF_ERROR(UseSegments(batch));
  const int64_t t = batch.tokens;
  const int64_t td = t * arch_.dim;
  switch (c.part()) {
    case Command::EMBED: {
      PassSlot* prev = pass > 0 ? &Slot(pass - 1, mb) : nullptr;
      if (prev != nullptr && prev->h.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD EMBED of pass ", pass, ": pass ", pass - 1,
                         "'s output is gone (its backward ran first)"));
      }
      SHARDD_RETURN_IF_ERROR(Ensure(&a.x, Elem::kStorage, td));
      SHARDD_RETURN_IF_ERROR(ops_->EmbedForward(batch.inputs, t, &a.x));
      if (arch_.embedding_scale > 0) {
        SHARDD_RETURN_IF_ERROR(ops_->Scale(&a.x, arch_.embedding_scale));
      }
      if (arch_.aux_on()) SHARDD_RETURN_IF_ERROR(ops_->AuxStart(&a.aux));
      if (prev != nullptr) {
        // Self-conditioning: the previous pass's output, detached.
        SHARDD_RETURN_IF_ERROR(
            ops_->AddScaled(&a.x, prev->h, shape_.self_conditioning_scale));
        // A pass without gradients kept it only for this.
        if (!RequiresGrad(pass - 1)) prev->h.Reset();
      }
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const MoeLayerSpec& spec = arch_.layers[l];
      if (spec.gemma) {
        return GemmaForward(c, batch.batch, batch.seq, nullptr,
                            /*keep_without_grad=*/false, &a);
      }
      LayerSlot& la = a.layers[l];
      SHARDD_RETURN_IF_ERROR(Ensure(&la.x_in, Elem::kStorage, td));
      SHARDD_RETURN_IF_ERROR(ops_->Copy(a.x, &la.x_in));
      SHARDD_RETURN_IF_ERROR(LayerForward(spec, batch, &la, &a));
      if (!c.requires_grad()) {
        // Nothing reads it again once the layer's last forward is done.
        if (!spec.has_moe) la = LayerSlot();
      } else if (recompute_layer_[l]) {
        KeepCheckpoint(spec, &la);
      }
      return absl::OkStatus();
    }
    case Command::DISPATCH:
    case Command::EXPERTS:
    case Command::COMBINE: {
      const int l = c.layer();
      const MoeLayerSpec& spec = arch_.layers[l];
      if (spec.gemma) {
        return GemmaForward(c, batch.batch, batch.seq, nullptr,
                            /*keep_without_grad=*/false, &a);
      }
      LayerSlot& la = a.layers[l];
      SHARDD_ASSIGN_OR_RETURN(const ExpertsPhase phase, PhaseOf(c));
      if (phase == ExpertsPhase::kDispatch) return DispatchRows(t, &la);
      if (phase == ExpertsPhase::kCompute) {
        return LocalExpertsForward(spec, t, &la);
      }
      SHARDD_ASSIGN_OR_RETURN(Act y, Temp(td));
      if (phase == ExpertsPhase::kAll) {
        SHARDD_RETURN_IF_ERROR(ExpertsForward(spec, t, &la, &y));
      } else {
        SHARDD_RETURN_IF_ERROR(CombineRows(t, &la, &y));
      }
      SHARDD_RETURN_IF_ERROR(
          ops_->Add(&a.x, y, la.dense_out.empty() ? nullptr : &la.dense_out));
      la.dense_out.Reset();
      if (!c.requires_grad()) {
        la = LayerSlot();
      } else if (recompute_layer_[l] || recompute_experts_[l]) {
        la.experts.Reset();
      }
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNorm(t, &a));
      if (!c.requires_grad()) {
        // An evaluation scores the passes a training step takes its loss
        // from.
        if (eval_ && pass >= shape_.no_grad_passes) {
          SHARDD_RETURN_IF_ERROR(ops_->HeadLoss(
              a.h, batch.targets, t, LossTerm{0.0f, LossWeight(batch)}, 0.0,
              /*dh=*/nullptr));
          ++loss_terms_;
        }
        a.final_x.Reset();
        a.final_inv.Reset();
        // The next pass's embedding reads the output.
        if (pass + 1 == shape_.passes) a.h.Reset();
        return absl::OkStatus();
      }
      if (arch_.aux_on())
        SHARDD_RETURN_IF_ERROR(ops_->AuxFinishForward(&a.aux));
      // The loss of a pass with gradients is computed by its BACKWARD HEAD
      // (one sweep over the logits for both); passes without gradients only
      // produce h for the next pass.
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status ModelStep::LayerBackward(const MoeLayerSpec& spec, int l,
                                      const BatchSlot& batch, PassSlot* a) {
  LayerSlot& la = a->layers[l];
  const int64_t t = batch.tokens;
  const int64_t td = t * arch_.dim;
  if (recompute_layer_[l]) {
    // The checkpoint holds the input (and the experts' inputs, which the
    // forward writes again with the same values).
    SHARDD_RETURN_IF_ERROR(LayerForward(spec, batch, &la, nullptr));
  }
  // a->dx is the gradient of the layer's output; a->dn collects the
  // gradient of its normed input (EXPERTS' backward started it).
  if (!spec.has_moe) {
    SHARDD_RETURN_IF_ERROR(Ensure(&a->dn, Elem::kStorage, td, /*zero=*/true));
  }
  if (spec.has_mlp) {
    const MlpTensors mlp{&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down,
                         spec.mlp_inter};
    SHARDD_RETURN_IF_ERROR(ops_->MlpBackward(mlp, la.normed, t, a->dx, &la.mlp,
                                             &a->dn, /*accumulate=*/true));
    la.mlp.Sync(&ledger_);
  }
  if (spec.has_moe) {
    const Act* extra_d_logits = nullptr;
    if (arch_.aux_on()) {
      SHARDD_RETURN_IF_ERROR(
          Ensure(&a->aux_d_logits, Elem::kF32, t * arch_.aux_experts));
      SHARDD_RETURN_IF_ERROR(
          ops_->AuxLogitGrad(la.router, t, a->aux, &a->aux_d_logits));
      extra_d_logits = &a->aux_d_logits;
    }
    SHARDD_RETURN_IF_ERROR(ops_->RouterBackward(
        spec, la.normed, t, a->dweights, extra_d_logits, &la.router, &a->dn));
    la.router.Sync(&ledger_);
  }
  if (spec.has_attention) {
    // a->dn is the gradient of post_attention_layernorm's output; a->dx
    // becomes the gradient of x_mid, which is also the attention
    // sublayer's output gradient; then a->dn becomes the gradient of
    // input_layernorm's output.
    SHARDD_RETURN_IF_ERROR(ops_->NormBackward(spec.post_norm, a->dn, la.x_mid,
                                              la.post_inv, t, &a->dx,
                                              /*accumulate=*/true));
    SHARDD_RETURN_IF_ERROR(ops_->AttentionBackward(
        spec, la.attention, batch.batch, batch.seq, a->dx, &a->dn));
  }
  // Residual: d(x_in) = d(x_out) + RMSNorm'(d normed).
  SHARDD_RETURN_IF_ERROR(ops_->NormBackward(spec.norm, a->dn, la.x_in,
                                            la.inv_rms, t, &a->dx,
                                            /*accumulate=*/true));
  la = LayerSlot();
  a->dn.Reset();
  a->dweights.Reset();
  a->aux_d_logits.Reset();
  return absl::OkStatus();
}

absl::Status ModelStep::Backward(const Command& c) {
  if (diffusion_) return DiffusionBackward(c);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassSlot& a = Slot(pass, mb);
  const BatchSlot& batch = batches_[mb];
  SHARDD_RETURN_IF_ERROR(UseSegments(batch));
  const int64_t t = batch.tokens;
  const int64_t td = t * arch_.dim;
  switch (c.part()) {
    case Command::HEAD: {
      LossTerm term;
      term.grad_scale =
          batch.counted == 0
              ? 0.0f
              : static_cast<float>(1.0 / (static_cast<double>(batch.counted) *
                                          shape_.microbatches * grad_passes()));
      if (global_counted_ > 0) {
        // The mean over the global batch's counted tokens.
        term.grad_scale = static_cast<float>(
            loss_ranks_ /
            (static_cast<double>(global_counted_) * grad_passes()));
        term.weight = LossWeight(batch);
      }
      double aux = 0.0;
      if (arch_.aux_on()) {
        SHARDD_ASSIGN_OR_RETURN(
            aux, ops_->AuxLoss(
                     &a.aux, arch_.router_aux_loss_coef,
                     static_cast<double>(shape_.microbatches) * grad_passes()));
      }
      SHARDD_RETURN_IF_ERROR(HeadBackward(
          t, batch.targets, term, arch_.router_aux_loss_coef * aux, &a));
      ++loss_terms_;
      return absl::OkStatus();
    }
    case Command::DISPATCH:
    case Command::EXPERTS:
    case Command::COMBINE: {
      const int l = c.layer();
      const MoeLayerSpec& spec = arch_.layers[l];
      if (spec.gemma) {
        return GemmaBackward(c, batch.batch, batch.seq, nullptr, &a);
      }
      LayerSlot& la = a.layers[l];
      SHARDD_ASSIGN_OR_RETURN(const ExpertsPhase phase, PhaseOf(c));
      // The experts' forward again first (under expert parallelism in
      // BACKWARD COMBINE: dispatched and combined again).
      if ((phase == ExpertsPhase::kAll || phase == ExpertsPhase::kCombine) &&
          (recompute_layer_[l] || recompute_experts_[l])) {
        SHARDD_ASSIGN_OR_RETURN(Act y, Temp(td));
        SHARDD_RETURN_IF_ERROR(ExpertsForward(spec, t, &la, &y));
      }
      if (phase != ExpertsPhase::kAll) {
        return ParallelExpertsBackward(spec, t, phase, &la, &a);
      }
      SHARDD_RETURN_IF_ERROR(ExpertsBackward(spec, t, &la, &a));
      la.experts.Reset();
      return absl::OkStatus();
    }
    case Command::LAYER:
      if (arch_.layers[c.layer()].gemma) {
        return GemmaBackward(c, batch.batch, batch.seq, nullptr, &a);
      }
      return LayerBackward(arch_.layers[c.layer()], c.layer(), batch, &a);
    case Command::EMBED: {
      SHARDD_RETURN_IF_ERROR(ops_->EmbedBackward(
          &a.dx, batch.inputs, t,
          arch_.embedding_scale > 0 ? arch_.embedding_scale : 1.0f));
      a.dx.Reset();
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

}  // namespace step
}  // namespace shardd
