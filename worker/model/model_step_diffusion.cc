// ModelStep's block-diffusion step for DiffusionGemma (docs/model-spec.md,
// "DiffusionGemma's block-diffusion training step"): pass 0 the causal
// encode, pass 1 the self-conditioning decode without gradients, pass 2 the
// decode; the decode's attention reads the encode's K/V of the same layer.

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/model/model_step.h"

namespace shardd {
namespace step {

using v1::Command;

GemmaDecodeView ModelStep::DecodeView(int layer, int microbatch,
                                      const BatchSlot& batch) {
  GemmaDecodeView view{batch.seq - block_diffusion_.canvas, batch.seq,
                       block_diffusion_.block,
                       &Slot(0, microbatch).layers[layer].gemma};
  if (!batch.canvas_starts.empty()) {
    view.row_prefix = batch.canvas_starts.data();
  }
  return view;
}

absl::Status ModelStep::DiffusionForward(const Command& c) {
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassSlot& a = Slot(pass, mb);
  BatchSlot& batch = batches_[mb];
  const int64_t canvas = block_diffusion_.canvas;
  const int64_t seq = pass == 0 ? batch.seq : canvas;
  const int64_t t = batch.batch * seq;
  switch (c.part()) {
    case Command::EMBED: {
      SHARDD_RETURN_IF_ERROR(Ensure(&a.x, Elem::kStorage, t * arch_.dim));
      if (pass == 0) {
        SHARDD_RETURN_IF_ERROR(ops_->EmbedForward(batch.inputs, t, &a.x));
        return ops_->Scale(&a.x, arch_.embedding_scale);
      }
      if (pass == 1) {
        // A new canvas for this step's keys.
        CanvasRows rows;
        rows.starts = batch.canvas_starts.data();
        rows.targets = batch.canvas_targets.data();
        rows.pad_id = static_cast<int32_t>(std::max<int64_t>(arch_.pad_id, 0));
        SHARDD_RETURN_IF_ERROR(BuildDiffusionCanvas(
            batch.host_inputs.data(), batch.batch, batch.seq, canvas,
            arch_.vocab, batch.step, batch.sequence_indices.data(),
            shape_.diffusion, &batch.canvas,
            batch.canvas_starts.empty() ? nullptr : &rows));
        SHARDD_ASSIGN_OR_RETURN(
            batch.noised, ops_->Upload(batch.canvas.noised.data(), t));
        SHARDD_ASSIGN_OR_RETURN(batch.scored,
                                ops_->Upload(batch.canvas.targets.data(), t));
      } else if (batch.sc_probs.empty()) {
        return absl::FailedPreconditionError(
            "FORWARD EMBED of pass 2 before pass 1's HEAD");
      }
      SHARDD_RETURN_IF_ERROR(ops_->SelfConditioningForward(
          block_diffusion_, batch.noised,
          pass == 2 ? &batch.sc_probs : nullptr, batch.canvas.self_cond,
          batch.batch, canvas, &batch.sc, &a.x));
      batch.sc.Sync(&ledger_);
      if (eval_ && pass == 2) {
        // Only a decode with gradients reads them again.
        batch.sc.Reset();
        if (!hold_sc_) batch.sc_probs.Reset();
      }
      return absl::OkStatus();
    }
    case Command::LAYER:
    case Command::DISPATCH:
    case Command::EXPERTS:
    case Command::COMBINE: {
      const int l = c.layer();
      const GemmaDecodeView decode = DecodeView(l, mb, batch);
      SHARDD_RETURN_IF_ERROR(GemmaForward(c, batch.batch, seq,
                                          pass == 0 ? nullptr : &decode,
                                          /*keep_without_grad=*/pass == 0,
                                          &a));
      // An evaluation's last decode of the layer is done with the encode's
      // K/V.
      const Command::Part last =
          exchange_ == nullptr ? Command::EXPERTS : Command::COMBINE;
      if (c.part() == last && eval_ && pass == 2) {
        Slot(0, mb).layers[l] = LayerSlot();
      }
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNorm(t, &a));
      if (eval_ && pass != 1) {
        // The weighted terms of the training step's BACKWARD(HEAD)s, one
        // term per micro-batch.
        const bool encode = pass == 0;
        SHARDD_RETURN_IF_ERROR(ops_->HeadLoss(
            a.h, encode ? batch.ar_targets : batch.scored, t,
            DiffusionTerm(batch, encode), 0.0, /*dh=*/nullptr));
        if (!encode) ++loss_terms_;
        a.final_x.Reset();
        a.final_inv.Reset();
        a.h.Reset();
        return absl::OkStatus();
      }
      if (pass != 1) return absl::OkStatus();  // Losses in BACKWARD(HEAD).
      const int64_t n = t * arch_.vocab;
      if (!(hold_sc_ && batch.sc_probs.numel() == n)) {
        // The self-conditioning decode's soft-capped logits, softmaxed.
        SHARDD_RETURN_IF_ERROR(Ensure(&batch.sc_probs, Elem::kF32, n));
        SHARDD_RETURN_IF_ERROR(ops_->HeadSoftmax(a.h, t, &batch.sc_probs));
      }
      // Pass 2 reads the probabilities, not the hidden states.
      a.final_x.Reset();
      a.final_inv.Reset();
      a.h.Reset();
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status ModelStep::DiffusionBackward(const Command& c) {
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassSlot& a = Slot(pass, mb);
  BatchSlot& batch = batches_[mb];
  const int64_t canvas = block_diffusion_.canvas;
  const int64_t seq = pass == 0 ? batch.seq : canvas;
  const int64_t t = batch.batch * seq;
  switch (c.part()) {
    case Command::HEAD: {
      // The diffusion CE over the scored canvas positions, plus the
      // weighted AR CE.
      const bool encode = pass == 0;
      SHARDD_RETURN_IF_ERROR(HeadBackward(
          t, encode ? batch.ar_targets : batch.scored,
          DiffusionTerm(batch, encode), 0.0, &a));
      // One loss term per micro-batch: the decode's backward runs first.
      if (!encode) ++loss_terms_;
      return absl::OkStatus();
    }
    case Command::LAYER:
    case Command::DISPATCH:
    case Command::EXPERTS:
    case Command::COMBINE: {
      const GemmaDecodeView decode = DecodeView(c.layer(), mb, batch);
      return GemmaBackward(c, batch.batch, seq, pass == 0 ? nullptr : &decode,
                           &a);
    }
    case Command::EMBED: {
      if (pass == 0) {
        SHARDD_RETURN_IF_ERROR(ops_->EmbedBackward(&a.dx, batch.inputs, t,
                                                   arch_.embedding_scale));
        a.dx.Reset();
        return absl::OkStatus();
      }
      SHARDD_RETURN_IF_ERROR(ops_->SelfConditioningBackward(
          block_diffusion_, batch.noised, batch.sc_probs,
          batch.canvas.self_cond, batch.batch, canvas, &batch.sc, a.dx));
      batch.sc.Sync(&ledger_);
      batch.sc.Reset();
      if (!hold_sc_) batch.sc_probs.Reset();
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
