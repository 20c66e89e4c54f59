// MoeModel's block-diffusion step for DiffusionGemma (docs/model-spec.md,
// "DiffusionGemma's block-diffusion training step"): pass 0 the causal
// encode, pass 1 the self-conditioning decode without gradients, pass 2 the
// decode; the decode's attention reads the encode's K/V of the same layer.

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/softcap.h"
#include "worker/model/moe_model_impl.h"

namespace shardd {

using v1::Command;

absl::Status MoeModel::Impl::TakeSelfConditioning(int64_t canvas_length) {
  SHARDD_ASSIGN_OR_RETURN(
      const BlockDiffusionSpec spec,
      ReadBlockDiffusionSpec(*this, canvas_length,
                             options.diffusion.response_length));
  block = spec.block;
  canvas = spec.canvas;
  sc_pre_norm = spec.pre_norm;
  sc_gate = spec.gate;
  sc_up = spec.up;
  sc_down = spec.down;
  sc_inter = spec.inter;
  return absl::OkStatus();
}

absl::Status MoeModel::Impl::DiffusionForward(const Command& c,
                                              ParamSource* params) {
  const int pass = c.pass();
  PassActs& a = Acts(pass, c.microbatch());
  Batch& batch = batches[c.microbatch()];
  const int64_t seq = pass == 0 ? batch.seq : canvas;
  const int64_t t = batch.batch * seq;
  switch (c.part()) {
    case Command::EMBED: {
      if (pass > 0) {
        SHARDD_RETURN_IF_ERROR(
            SelfConditioningForward(pass, &batch, params, &a));
        if (eval && pass == 2) {
          // Only a decode with gradients reads them again.
          MarkActivationPeak();
          sc = SelfConditioningActs();
          if (!hold_self_conditioning) FreeVector(&batch.sc_probs);
        }
        return absl::OkStatus();
      }
      SHARDD_ASSIGN_OR_RETURN(const float* table, params->Param(embed.name));
      a.x.resize(t * dim);
      SHARDD_RETURN_IF_ERROR(kernels::EmbeddingForward(
          table, vocab, dim, batch.inputs.data(), t, a.x.data()));
      for (float& v : a.x) v *= embedding_scale;
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      GemmaDecode decode{batch.seq - canvas, batch.seq, block,
                         &acts[0].layers[l].gemma};
      return gemma_block->ForwardLayer(layers[l], params, a.x.data(),
                                       batch.batch, seq, &a.layers[l].gemma,
                                       pass == 0 ? nullptr : &decode);
    }
    case Command::EXPERTS: {
      GemmaLayerActs& la = a.layers[c.layer()].gemma;
      SHARDD_RETURN_IF_ERROR(gemma_block->ForwardExperts(
          layers[c.layer()], params, t, &la, a.x.data()));
      MarkActivationPeak();
      // The self-conditioning decode has no backward, nor has an evaluated
      // decode: their layer's activations can go at once (the encode's
      // hold the K/V the decodes read; an evaluation's last decode of the
      // layer is done with them).
      if (pass == 1 || (eval && pass == 2)) la = GemmaLayerActs();
      if (eval && pass == 2) acts[0].layers[c.layer()] = LayerActs();
      const int l = c.layer();
      if (c.requires_grad() && (recompute_layer[l] || recompute_experts[l])) {
        // The encode keeps the K/V the decodes read.
        GemmaLayerBlock::KeepCheckpoint(!recompute_layer[l],
                                        /*keep_kv=*/pass == 0, &la);
      }
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNormForward(params, t, &a));
      if (eval && pass != 1) {
        // The weighted terms of DiffusionHeadBackward, one term per
        // micro-batch.
        SHARDD_RETURN_IF_ERROR(
            pass == 0
                ? EvalLoss(params, a.h.data(), t, batch.ar_targets.data(),
                           options.diffusion.encoder_loss_weight,
                           /*new_term=*/false)
                : EvalLoss(params, a.h.data(), t, batch.canvas.clean.data(),
                           options.diffusion.diffusion_loss_weight,
                           /*new_term=*/true));
        MarkActivationPeak();
        FreeHead(&a);
        return absl::OkStatus();
      }
      if (pass != 1) return absl::OkStatus();  // Losses in BACKWARD(HEAD).
      std::vector<float>& probs = batch.sc_probs;
      if (hold_self_conditioning &&
          static_cast<int64_t>(probs.size()) == t * vocab) {
        FreeHead(&a);
        return absl::OkStatus();
      }
      // The self-conditioning decode's soft-capped logits, softmaxed.
      SHARDD_ASSIGN_OR_RETURN(const float* head_w, params->Param(head.name));
      probs.resize(t * vocab);
      SHARDD_RETURN_IF_ERROR(kernels::LinearForward(
          a.h.data(), head_w, t, dim, vocab, probs.data()));
      if (final_logit_softcap > 0) {
        kernels::SoftcapForward(probs.data(), t * vocab, final_logit_softcap);
      }
      for (int64_t r = 0; r < t; ++r) {
        float* row = probs.data() + r * vocab;
        const float top = *std::max_element(row, row + vocab);
        double total = 0.0;
        for (int64_t v = 0; v < vocab; ++v) total += std::exp(row[v] - top);
        for (int64_t v = 0; v < vocab; ++v) {
          row[v] = static_cast<float>(std::exp(row[v] - top) / total);
        }
      }
      // Pass 2 reads the probabilities, not the hidden states.
      MarkActivationPeak();
      FreeHead(&a);
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status MoeModel::Impl::SelfConditioningForward(int pass, Batch* b,
                                                     ParamSource* params,
                                                     PassActs* a) {
  Batch& batch = *b;
  if (pass == 1) {
    SHARDD_RETURN_IF_ERROR(BuildDiffusionCanvas(
        batch.inputs.data(), batch.batch, batch.seq, canvas, vocab, batch.step,
        batch.sequence_indices.data(), options.diffusion, &batch.canvas));
  }
  const int64_t t = batch.batch * canvas;
  SHARDD_ASSIGN_OR_RETURN(const float* table, params->Param(embed.name));
  sc.e.resize(t * dim);
  SHARDD_RETURN_IF_ERROR(kernels::EmbeddingForward(
      table, vocab, dim, batch.canvas.noised.data(), t, sc.e.data()));
  for (float& v : sc.e) v *= embedding_scale;
  const std::vector<float> ones(dim, 1.0f);
  sc.sum = sc.e;
  if (pass == 2) {
    // s = softmax(sc_logits) @ E * scale, for the examples whose coin came
    // up; pre_norm, the gated MLP, added to the embeddings.
    sc.signal.assign(t * dim, 0.0f);
    for (int64_t s = 0; s < batch.batch; ++s) {
      if (!batch.canvas.self_cond[s]) continue;
      SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
          nullptr, table, batch.sc_probs.data() + s * canvas * vocab, canvas, dim,
          vocab, sc.signal.data() + s * canvas * dim, false, nullptr));
    }
    for (float& v : sc.signal) v *= embedding_scale;
    SHARDD_ASSIGN_OR_RETURN(const float* pre_w,
                            params->Param(sc_pre_norm.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wg, params->Param(sc_gate.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wu, params->Param(sc_up.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wd, params->Param(sc_down.name));
    sc.p.resize(t * dim);
    sc.p_inv.resize(t);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(
        sc.signal.data(), pre_w, t, dim, eps, sc.p.data(), sc.p_inv.data()));
    sc.mlp_out.resize(t * dim);
    SHARDD_RETURN_IF_ERROR(kernels::DenseMlpForward(
        {t, dim, sc_inter}, activation, sc.p.data(), wg, wu, wd,
        sc.mlp_out.data(), &sc.mlp));
    for (int64_t i = 0; i < t * dim; ++i) sc.sum[i] += sc.mlp_out[i];
  }
  // Pass 1's zero signal: pre_norm(0) = 0 and the MLP gives 0, so the input
  // is post_norm(e).
  a->x.resize(t * dim);
  sc.sum_inv.resize(t);
  return kernels::RmsNormForward(sc.sum.data(), ones.data(), t, dim, eps,
                                 a->x.data(), sc.sum_inv.data());
}

absl::Status MoeModel::Impl::SelfConditioningBackward(const Batch& batch,
                                                      ParamSource* params,
                                                      PassActs* a) {
  const int64_t t = batch.batch * canvas;
  const std::vector<float> ones(dim, 1.0f);
  std::vector<float> g(t * dim), unused(dim, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      a->dx.data(), sc.sum.data(), ones.data(), sc.sum_inv.data(), t, dim,
      g.data(), unused.data()));
  // The MLP and pre_norm, down to d(signal).
  SHARDD_ASSIGN_OR_RETURN(const float* pre_w, params->Param(sc_pre_norm.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wg, params->Param(sc_gate.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, params->Param(sc_up.name));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, params->Param(sc_down.name));
  std::vector<float> dp(t * dim), ds(t * dim), dpre(dim, 0.0f);
  std::vector<float> dwg(sc_gate.numel(), 0.0f), dwu(sc_up.numel(), 0.0f),
      dwd(sc_down.numel(), 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::DenseMlpBackward(
      {t, dim, sc_inter}, activation, wg, wu, wd, g.data(), dp.data(), false,
      dwg.data(), dwu.data(), dwd.data(), &sc.mlp));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dp.data(), sc.signal.data(), pre_w, sc.p_inv.data(), t, dim, ds.data(),
      dpre.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, sc_pre_norm, dpre.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, sc_gate, dwg.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, sc_up, dwu.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(params, sc_down, dwd.data()));
  if (embed.frozen) return absl::OkStatus();
  // The embeddings: the canvas ids' rows and, through s = probs @ E * scale
  // (probs detached), probs^T d(s) * scale.
  SHARDD_ASSIGN_OR_RETURN(const float* table, params->Param(embed.name));
  float* dtable = Zeroed(&scratch, vocab * dim);
  for (float& v : g) v *= embedding_scale;
  SHARDD_RETURN_IF_ERROR(kernels::EmbeddingBackward(
      g.data(), batch.canvas.noised.data(), t, vocab, dim, dtable, pad_id));
  for (float& v : ds) v *= embedding_scale;
  for (int64_t s = 0; s < batch.batch; ++s) {
    if (!batch.canvas.self_cond[s]) continue;
    SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
        ds.data() + s * canvas * dim, table,
        batch.sc_probs.data() + s * canvas * vocab, canvas, dim, vocab, nullptr,
        false, dtable));
  }
  return AddGrad(params, embed, dtable);
}

absl::Status MoeModel::Impl::DiffusionHeadBackward(int pass,
                                                   const Batch& batch,
                                                   ParamSource* params,
                                                   PassActs* a) {
  const int64_t t = batch.batch * (pass == 0 ? batch.seq : canvas);
  // Diffusion CE over every canvas position, plus the weighted AR CE; each
  // a mean over this rank's count, which the reduce-scatter's average over
  // ranks of equal counts makes the global mean.
  const int32_t* targets =
      pass == 0 ? batch.ar_targets.data() : batch.canvas.clean.data();
  const int64_t count = pass == 0 ? batch.ar_counted : t;
  const double weight = pass == 0 ? options.diffusion.encoder_loss_weight
                                  : options.diffusion.diffusion_loss_weight;
  const float loss_scale =
      count == 0 ? 0.0f
                 : static_cast<float>(weight / (static_cast<double>(count) *
                                                options.microbatches));
  SHARDD_ASSIGN_OR_RETURN(const float* head_w, params->Param(head.name));
  SHARDD_ASSIGN_OR_RETURN(const float* norm_w, params->Param(final_norm.name));
  std::vector<float> dh(t * dim);
  float* dw = head.frozen ? nullptr : Zeroed(&scratch, vocab * dim);
  kernels::CrossEntropyOptions ce_options;
  ce_options.softcap = final_logit_softcap;
  SHARDD_ASSIGN_OR_RETURN(
      kernels::CrossEntropyResult ce,
      kernels::LmHeadCrossEntropyBackward(a->h.data(), head_w, t, dim, vocab,
                                          targets, loss_scale, dh.data(), dw,
                                          false, ce_options));
  if (dw != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(params, head, dw));
  // One loss term per micro-batch: the decode's backward runs first.
  loss_sum += weight * ce.mean_loss;
  if (pass == 2) ++loss_terms;
  tokens += ce.count;
  a->dx.resize(t * dim);
  float* dnorm = Zeroed(&scratch, dim);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dh.data(), a->final_x.data(), norm_w, a->final_inv.data(), t, dim,
      a->dx.data(), dnorm));
  return AddGrad(params, final_norm, dnorm);
}

absl::Status MoeModel::Impl::DiffusionBackward(const Command& c,
                                               ParamSource* params) {
  const int pass = c.pass();
  PassActs& a = Acts(pass, c.microbatch());
  const Batch& batch = batches[c.microbatch()];
  const int64_t seq = pass == 0 ? batch.seq : canvas;
  const int64_t t = batch.batch * seq;
  switch (c.part()) {
    case Command::HEAD:
      SHARDD_RETURN_IF_ERROR(DiffusionHeadBackward(pass, batch, params, &a));
      MarkActivationPeak();
      FreeHead(&a);
      return absl::OkStatus();
    case Command::EXPERTS: {
      const int l = c.layer();
      GemmaLayerActs& la = a.layers[l].gemma;
      if (recompute_layer[l] || recompute_experts[l]) {
        SHARDD_RETURN_IF_ERROR(
            gemma_block->RecomputeExperts(layers[l], params, t, &la));
      }
      SHARDD_RETURN_IF_ERROR(gemma_block->BackwardExperts(
          layers[c.layer()], params, t, a.dx.data(), &la));
      MarkActivationPeak();
      la.experts = kernels::GroupedExpertsWorkspace();
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      GemmaDecode decode{batch.seq - canvas, batch.seq, block,
                         &acts[0].layers[l].gemma};
      if (recompute_layer[l]) {
        SHARDD_RETURN_IF_ERROR(gemma_block->RecomputeLayer(
            layers[l], params, batch.batch, seq, &a.layers[l].gemma,
            pass == 0 ? nullptr : &decode));
      }
      SHARDD_RETURN_IF_ERROR(gemma_block->BackwardLayer(
          layers[l], params, batch.batch, seq, &a.layers[l].gemma, a.dx.data(),
          pass == 0 ? nullptr : &decode));
      // A decode's K/V gradients stay in the encode's state until its
      // backward.
      MarkActivationPeak();
      a.layers[l] = LayerActs();
      return absl::OkStatus();
    }
    case Command::EMBED: {
      if (pass > 0) {
        SHARDD_RETURN_IF_ERROR(SelfConditioningBackward(batch, params, &a));
        MarkActivationPeak();
        sc = SelfConditioningActs();
        if (!hold_self_conditioning) {
          FreeVector(&batches[c.microbatch()].sc_probs);
        }
        FreeVector(&a.dx);
        return absl::OkStatus();
      }
      return EmbedBackward(params, batch.inputs.data(), t, embedding_scale,
                           &a);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

}  // namespace shardd
