#include "worker/model/moe_model.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/router_aux_loss.h"
#include "model/model_util.h"
#include "program/pass_layout.h"
#include "worker/model/moe_model_impl.h"

namespace shardd {

using v1::Command;
using Tensor = ArchTensor;
using LayerSpec = MoeLayerSpec;

MoeModel::MoeModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeModel::~MoeModel() = default;

absl::StatusOr<std::unique_ptr<MoeModel>> MoeModel::Create(
    const v1::ModelSpec& model, const MoeModelOptions& options) {
  SHARDD_RETURN_IF_ERROR(ValidateModelSpec(model));
  SHARDD_RETURN_IF_ERROR(CheckModelStepShape(
      options.passes, options.no_grad_passes, options.microbatches));
  SHARDD_ASSIGN_OR_RETURN(MoeArchitecture arch, ReadMoeArchitecture(model));
  auto impl = std::make_unique<Impl>();
  impl->options = options;

  static_cast<MoeArchitecture&>(*impl) = std::move(arch);
  impl->batches.resize(options.microbatches);
  impl->acts.resize(options.passes);
  for (PassActs& a : impl->acts) a.layers.resize(impl->layers.size());
  impl->recompute_layer.assign(impl->layers.size(), false);
  impl->recompute_experts.assign(impl->layers.size(), false);
  impl->attention = std::make_unique<AttentionBlock>(impl.get());
  impl->mla = std::make_unique<MlaBlock>(impl.get());
  impl->gemma_block = std::make_unique<GemmaLayerBlock>(impl.get());
  if (impl->gemma && options.passes == 3 && options.no_grad_passes == 1) {
    impl->diffusion = true;
    SHARDD_RETURN_IF_ERROR(
        impl->TakeSelfConditioning(model.dims().canvas_length()));
  } else if (impl->gemma && options.passes != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DiffusionGemma: the CPU model computes the causal pass (1 pass) or "
        "the block-diffusion step (3 passes, 1 without gradients), got ",
        options.passes, " passes, ", options.no_grad_passes,
        " without gradients"));
  }
  if (!options.legacy_step_for_test) {
    auto ops = std::make_unique<step::CpuBlockOps>(impl.get());
    step::CpuBlockOps* raw_ops = ops.get();
    step::StepShape shape;
    shape.passes = options.passes;
    shape.no_grad_passes = options.no_grad_passes;
    shape.microbatches = options.microbatches;
    shape.self_conditioning_scale = options.self_conditioning_scale;
    shape.diffusion = options.diffusion;
    shape.canvas_length = model.dims().canvas_length();
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<step::ModelStep> driver,
        step::ModelStep::Create(impl.get(), shape, std::move(ops)));
    auto model = absl::WrapUnique(new MoeModel(std::move(impl)));
    model->ops_ = raw_ops;
    model->step_ = std::move(driver);
    return model;
  }
  impl->order = std::make_unique<ModelCommandOrder>(
      PassLayout::For(impl->gemma ? kBlockDiffusionArchitecture : "",
                      options.passes, options.no_grad_passes),
      options.microbatches, impl->LayersWithExperts(),
      /*per_microbatch=*/false);
  return absl::WrapUnique(new MoeModel(std::move(impl)));
}

absl::Status MoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                const int32_t* targets, int64_t batch,
                                int64_t seq) {
  if (step_ != nullptr) {
    return step_->SetBatch(microbatch, inputs, targets, batch, seq);
  }
  Impl& m = *impl_;
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t counted,
      CheckMicroBatch(microbatch, m.options.microbatches, inputs, targets,
                      batch, seq, m.vocab));
  Batch& b = m.batches[microbatch];
  for (const LayerSpec& layer : m.layers) {
    if (layer.has_attention) {
      SHARDD_RETURN_IF_ERROR(layer.gemma ? m.gemma_block->Prepare(seq)
                             : layer.mla ? m.mla->Prepare(seq)
                                         : m.attention->Prepare(seq));
      break;
    }
  }
  b.batch = batch;
  b.seq = seq;
  b.tokens = batch * seq;
  b.inputs.assign(inputs, inputs + b.tokens);
  b.targets.assign(targets, targets + b.tokens);
  b.counted = counted;
  if (m.diffusion) {
    SHARDD_RETURN_IF_ERROR(CheckBlockDiffusionSeq(seq, m.canvas));
    // The encoder's pairs: logits 0..S-2 against tokens 1..S-1.
    b.ar_targets = b.targets;
    b.ar_counted = 0;
    for (int64_t r = 0; r < batch; ++r) {
      b.ar_targets[r * seq + seq - 1] = -1;
      for (int64_t i = 0; i < seq; ++i) b.ar_counted += b.ar_targets[r * seq + i] >= 0;
    }
    b.step = 0;
    if (!m.hold_self_conditioning) b.sc_probs.clear();
    b.sequence_indices.resize(batch);
    for (int64_t r = 0; r < batch; ++r) b.sequence_indices[r] = microbatch * batch + r;
  }
  return absl::OkStatus();
}

absl::Status MoeModel::SetSequenceKeys(int microbatch, int64_t step,
                                       const int64_t* sequence_indices) {
  if (step_ != nullptr) {
    return step_->SetSequenceKeys(microbatch, step, sequence_indices);
  }
  Impl& m = *impl_;
  if (microbatch < 0 || microbatch >= m.options.microbatches ||
      m.batches[microbatch].tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetSequenceKeys: micro-batch ", microbatch, " has no batch"));
  }
  Batch& b = m.batches[microbatch];
  b.step = step;
  b.sequence_indices.assign(sequence_indices, sequence_indices + b.batch);
  return absl::OkStatus();
}

absl::Status MoeModel::Run(const v1::Command& command, ParamSource* params) {
  if (step_ != nullptr) {
    ops_->Bind(params);
    const absl::Status status = step_->Run(command);
    ops_->Bind(nullptr);
    return status;
  }
  Impl& m = *impl_;
  SHARDD_RETURN_IF_ERROR(m.order->Check(command, "MoeModel"));
  if (m.batches[command.microbatch()].tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro-batch ", command.microbatch(),
                     " has no tokens (SetBatch missing)"));
  }
  m.activation_peak = m.ActivationBytes();
  SHARDD_RETURN_IF_ERROR(command.op() == v1::Command::FORWARD
                             ? m.Forward(command, params)
                             : m.Backward(command, params));
  m.MarkActivationPeak();
  m.order->Commit(command);
  return absl::OkStatus();
}

absl::Status MoeModel::Impl::FinalNormForward(ParamSource* params, int64_t t,
                                              PassActs* a) {
  SHARDD_ASSIGN_OR_RETURN(const float* norm_w, params->Param(final_norm.name));
  // The stream becomes the norm's input; nothing reads it again.
  a->final_x = std::move(a->x);
  a->final_inv.resize(t);
  a->h.resize(t * dim);
  return kernels::RmsNormForward(a->final_x.data(), norm_w, t, dim, eps,
                                 a->h.data(), a->final_inv.data());
}

absl::Status MoeModel::Impl::EvalLoss(ParamSource* params, const float* h,
                                      int64_t t, const int32_t* targets,
                                      double weight, bool new_term) {
  SHARDD_ASSIGN_OR_RETURN(const float* head_w, params->Param(head.name));
  kernels::CrossEntropyOptions ce_options;
  ce_options.softcap = final_logit_softcap;
  SHARDD_ASSIGN_OR_RETURN(kernels::CrossEntropyResult ce,
                          kernels::LmHeadCrossEntropyForward(
                              h, head_w, t, dim, vocab, targets, ce_options));
  // Accounted as the training step's BACKWARD(HEAD) accounts its loss.
  loss_sum += weight * ce.mean_loss;
  if (new_term) ++loss_terms;
  tokens += ce.count;
  return absl::OkStatus();
}

void MoeModel::Impl::KeepCheckpoint(const LayerSpec& spec, LayerActs* la) {
  LayerActs keep;
  keep.x_in = std::move(la->x_in);
  if (spec.has_moe) {
    keep.normed = std::move(la->normed);
    keep.indices = std::move(la->indices);
    keep.weights = std::move(la->weights);
    keep.dense_out = std::move(la->dense_out);
  }
  *la = std::move(keep);
}

absl::Status MoeModel::Impl::LayerForward(const LayerSpec& spec,
                                          ParamSource* params,
                                          const Batch& batch, LayerActs* la,
                                          PassActs* a) {
  const int64_t t = batch.tokens;
  la->inv_rms.resize(t);
  la->normed.resize(t * dim);
  SHARDD_ASSIGN_OR_RETURN(const float* norm_w, params->Param(spec.norm.name));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(la->x_in.data(), norm_w, t,
                                                 dim, eps, la->normed.data(),
                                                 la->inv_rms.data()));
  if (spec.has_attention) {
    // x_mid = x + attention(input_layernorm(x)); the MoE / MLP branch
    // reads post_attention_layernorm(x_mid).
    scratch_td.resize(t * dim);
    SHARDD_RETURN_IF_ERROR(
        spec.mla
            ? mla->Forward(spec, params, la->normed.data(), batch.batch,
                           batch.seq, &la->mla, scratch_td.data())
            : attention->Forward(spec, params, la->normed.data(), batch.batch,
                                 batch.seq, &la->attn, scratch_td.data()));
    la->x_mid.resize(t * dim);
    for (int64_t i = 0; i < t * dim; ++i) {
      la->x_mid[i] = la->x_in[i] + scratch_td[i];
    }
    if (a != nullptr) a->x = la->x_mid;
    SHARDD_ASSIGN_OR_RETURN(const float* post_w,
                            params->Param(spec.post_norm.name));
    la->post_inv.resize(t);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(la->x_mid.data(), post_w, t,
                                                   dim, eps, la->normed.data(),
                                                   la->post_inv.data()));
  }
  if (spec.has_mlp) {
    SHARDD_ASSIGN_OR_RETURN(const float* wg, params->Param(spec.mlp_gate.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wu, params->Param(spec.mlp_up.name));
    SHARDD_ASSIGN_OR_RETURN(const float* wd, params->Param(spec.mlp_down.name));
    // Beside experts the output waits for EXPERTS (a recompute does not
    // need it); a dense layer adds it to the stream here.
    float* y;
    if (spec.has_moe && a != nullptr) {
      la->dense_out.resize(t * dim);
      y = la->dense_out.data();
    } else {
      scratch2.resize(t * dim);
      y = scratch2.data();
    }
    kernels::DenseMlpDims dims{t, dim, spec.mlp_inter};
    SHARDD_RETURN_IF_ERROR(kernels::DenseMlpForward(
        dims, activation, la->normed.data(), wg, wu, wd, y, &la->mlp));
    if (!spec.has_moe && a != nullptr) {
      for (int64_t i = 0; i < t * dim; ++i) a->x[i] += y[i];
    }
  }
  if (spec.has_moe) {
    SHARDD_ASSIGN_OR_RETURN(const float* gw, params->Param(spec.gate.name));
    const float* gb = nullptr;
    if (spec.router_bias) {
      SHARDD_ASSIGN_OR_RETURN(gb, params->Param(spec.gate_bias.name));
    }
    // DeepSeek-V3's frozen correction bias steers the choice only.
    const float* selection = nullptr;
    if (spec.selection_bias) {
      SHARDD_ASSIGN_OR_RETURN(selection,
                              params->Param(spec.gate_selection_bias.name));
    }
    la->indices.resize(t * top_k);
    la->weights.resize(t * top_k);
    SHARDD_RETURN_IF_ERROR(kernels::RouterForward(
        RouterDimsOf(spec, t), la->normed.data(), gw, gb, selection,
        la->indices.data(), la->weights.data(), &la->router));
    if (aux_on() && a != nullptr) {
      // HF's top-k of softmax(logits) is the router's choice for both
      // softmax scorings (the softmax keeps the logits' order).
      SHARDD_RETURN_IF_ERROR(kernels::RouterAuxLossAccumulate(
          kernels::RouterSoftmax(la->router), la->indices.data(), t,
          aux_experts, top_k, a->aux.counts.data(), a->aux_sums.data()));
      a->aux.counts[aux_experts] += t;
    }
  }
  return absl::OkStatus();
}

absl::Status MoeModel::Impl::ExpertsForward(const LayerSpec& spec,
                                            ParamSource* params, int64_t t,
                                            LayerActs* la) {
  SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(spec.w_gu.name));
  SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(spec.w_d.name));
  SHARDD_ASSIGN_OR_RETURN(const kernels::ExpertOptions options,
                          ExpertOptionsOf(spec, params));
  kernels::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
  scratch2.resize(t * dim);
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsForward(
      dims, activation, options, la->normed.data(), la->indices.data(),
      la->weights.data(), nullptr, w_gu, w_d, scratch2.data(), &la->experts));
  // The per-row outputs are the kernel's scratch; backward does not read
  // them.
  FreeVector(&la->experts.o);
  return absl::OkStatus();
}

absl::Status MoeModel::Impl::Forward(const Command& c, ParamSource* params) {
  if (diffusion) return DiffusionForward(c, params);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassActs& a = Acts(pass, mb);
  const Batch& batch = batches[mb];
  const int64_t t = batch.tokens;
  switch (c.part()) {
    case Command::EMBED: {
      SHARDD_ASSIGN_OR_RETURN(const float* table, params->Param(embed.name));
      a.x.resize(t * dim);
      SHARDD_RETURN_IF_ERROR(kernels::EmbeddingForward(
          table, vocab, dim, batch.inputs.data(), t, a.x.data()));
      if (embedding_scale > 0) {
        for (float& v : a.x) v *= embedding_scale;
      }
      if (aux_on()) {
        a.aux.counts.assign(aux_experts + 2, 0);
        a.aux.counts[aux_experts + 1] = 1;  // This rank.
        a.aux.prob_sums.assign(aux_experts, 0.0f);
        a.aux_sums.assign(aux_experts, 0.0);
      }
      if (pass > 0) {
        // Self-conditioning: the previous pass's output, detached.
        PassActs& prev = Acts(pass - 1, mb);
        const float scale = options.self_conditioning_scale;
        for (int64_t i = 0; i < t * dim; ++i) a.x[i] += scale * prev.h[i];
        // A pass without gradients kept it only for this.
        if (!RequiresGrad(pass - 1)) {
          MarkActivationPeak();
          FreeVector(&prev.h);
        }
      }
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (spec.gemma) {
        return gemma_block->ForwardLayer(spec, params, a.x.data(), batch.batch,
                                         batch.seq, &la.gemma);
      }
      la.x_in = a.x;
      SHARDD_RETURN_IF_ERROR(LayerForward(spec, params, batch, &la, &a));
      MarkActivationPeak();
      if (!c.requires_grad()) {
        // Nothing reads it again once the layer's last forward is done.
        if (!spec.has_moe) la = LayerActs();
      } else if (recompute_layer[l]) {
        KeepCheckpoint(spec, &la);
      }
      return absl::OkStatus();
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (spec.gemma) {
        SHARDD_RETURN_IF_ERROR(gemma_block->ForwardExperts(
            spec, params, t, &la.gemma, a.x.data()));
        MarkActivationPeak();
        if (!c.requires_grad()) {
          la = LayerActs();
        } else if (recompute_layer[l] || recompute_experts[l]) {
          GemmaLayerBlock::KeepCheckpoint(!recompute_layer[l],
                                          /*keep_kv=*/false, &la.gemma);
        }
        return absl::OkStatus();
      }
      SHARDD_RETURN_IF_ERROR(ExpertsForward(spec, params, t, &la));
      const std::vector<float>& y = scratch2;
      if (la.dense_out.empty()) {
        for (int64_t i = 0; i < t * dim; ++i) a.x[i] += y[i];
      } else {
        for (int64_t i = 0; i < t * dim; ++i) {
          a.x[i] += y[i] + la.dense_out[i];
        }
      }
      MarkActivationPeak();
      FreeVector(&la.dense_out);
      if (!c.requires_grad()) {
        la = LayerActs();
      } else if (recompute_layer[l] || recompute_experts[l]) {
        la.experts = kernels::GroupedExpertsWorkspace();
      }
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNormForward(params, t, &a));
      if (!c.requires_grad()) {
        // An evaluation scores the passes a training step takes its loss
        // from.
        if (eval && pass >= options.no_grad_passes) {
          SHARDD_RETURN_IF_ERROR(EvalLoss(params, a.h.data(), t,
                                          batch.targets.data(), 1.0,
                                          /*new_term=*/true));
        }
        MarkActivationPeak();
        FreeVector(&a.final_x);
        FreeVector(&a.final_inv);
        // The next pass's embedding reads the output.
        if (pass + 1 == options.passes) FreeVector(&a.h);
        return absl::OkStatus();
      }
      if (aux_on()) {
        // fp32 for the all-reduce; the counts stay exact.
        for (int64_t e = 0; e < aux_experts; ++e) {
          a.aux.prob_sums[e] = static_cast<float>(a.aux_sums[e]);
        }
      }
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

absl::Status MoeModel::Impl::Backward(const Command& c, ParamSource* params) {
  if (diffusion) return DiffusionBackward(c, params);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassActs& a = Acts(pass, mb);
  const Batch& batch = batches[mb];
  const int64_t t = batch.tokens;
  switch (c.part()) {
    case Command::HEAD: {
      SHARDD_ASSIGN_OR_RETURN(const float* head_w, params->Param(head.name));
      SHARDD_ASSIGN_OR_RETURN(const float* norm_w,
                              params->Param(final_norm.name));
      const float loss_scale =
          batch.counted == 0
              ? 0.0f
              : static_cast<float>(1.0 /
                                   (static_cast<double>(batch.counted) *
                                    options.microbatches * grad_passes()));
      std::vector<float> dh(t * dim);
      float* dw = head.frozen ? nullptr : Zeroed(&scratch, vocab * dim);
      kernels::CrossEntropyOptions ce_options;
      ce_options.softcap = final_logit_softcap;
      SHARDD_ASSIGN_OR_RETURN(
          kernels::CrossEntropyResult ce,
          kernels::LmHeadCrossEntropyBackward(
              a.h.data(), head_w, t, dim, vocab, batch.targets.data(),
              loss_scale, dh.data(), dw, false, ce_options));
      if (dw != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(params, head, dw));
      double aux = 0.0;
      if (aux_on()) {
        // The statistics are the micro-batch's now (summed over its ranks);
        // each rank's gradient is multiplied by the number of ranks, whose
        // average the reduce-scatter forms.
        const int64_t* counts = a.aux.counts.data();
        const std::vector<double> sums(a.aux.prob_sums.begin(),
                                       a.aux.prob_sums.end());
        aux = kernels::RouterAuxLossValue(counts, sums.data(),
                                          counts[aux_experts], aux_experts);
        a.aux_scale = router_aux_loss_coef *
                      static_cast<double>(counts[aux_experts + 1]) /
                      (static_cast<double>(options.microbatches) *
                       grad_passes());
      }
      loss_sum += ce.mean_loss + router_aux_loss_coef * aux;
      ++loss_terms;
      tokens += ce.count;
      a.dx.resize(t * dim);
      // The kernel always writes dweight; a frozen norm's is dropped.
      float* dnorm = Zeroed(&scratch, dim);
      SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
          dh.data(), a.final_x.data(), norm_w, a.final_inv.data(), t, dim,
          a.dx.data(), dnorm));
      if (dnorm != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, final_norm, dnorm));
      MarkActivationPeak();
      FreeHead(&a);
      return absl::OkStatus();
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (spec.gemma) {
        if (recompute_layer[l] || recompute_experts[l]) {
          SHARDD_RETURN_IF_ERROR(
              gemma_block->RecomputeExperts(spec, params, t, &la.gemma));
        }
        SHARDD_RETURN_IF_ERROR(gemma_block->BackwardExperts(
            spec, params, t, a.dx.data(), &la.gemma));
        MarkActivationPeak();
        la.gemma.experts = kernels::GroupedExpertsWorkspace();
        return absl::OkStatus();
      }
      if (recompute_layer[l] || recompute_experts[l]) {
        SHARDD_RETURN_IF_ERROR(ExpertsForward(spec, params, t, &la));
      }
      SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(spec.w_gu.name));
      SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(spec.w_d.name));
      SHARDD_ASSIGN_OR_RETURN(const kernels::ExpertOptions options,
                              ExpertOptionsOf(spec, params));
      kernels::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      a.dn.resize(t * dim);
      a.dweights.resize(t * top_k);
      const bool frozen = spec.w_gu.frozen && spec.w_d.frozen;
      float* dw_gu = frozen ? nullptr : Zeroed(&scratch, spec.w_gu.numel());
      float* dw_d = frozen ? nullptr : Zeroed(&scratch2, spec.w_d.numel());
      std::vector<float> db_gu(spec.expert_bias ? spec.b_gu.numel() : 0, 0.0f);
      std::vector<float> db_d(spec.expert_bias ? spec.b_d.numel() : 0, 0.0f);
      kernels::ExpertBiasGrads bias_grads;
      if (spec.expert_bias) bias_grads = {db_gu.data(), db_d.data()};
      SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsBackward(
          dims, activation, options, w_gu, w_d, a.dx.data(), a.dn.data(),
          /*accumulate_dx=*/false, a.dweights.data(), dw_gu, dw_d, bias_grads,
          &la.experts));
      if (dw_gu != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.w_gu, dw_gu));
      if (dw_d != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.w_d, dw_d));
      if (spec.expert_bias) {
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.b_gu, db_gu.data()));
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.b_d, db_d.data()));
      }
      MarkActivationPeak();
      la.experts = kernels::GroupedExpertsWorkspace();
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (spec.gemma) {
        if (recompute_layer[l]) {
          SHARDD_RETURN_IF_ERROR(gemma_block->RecomputeLayer(
              spec, params, batch.batch, batch.seq, &la.gemma));
        }
        SHARDD_RETURN_IF_ERROR(gemma_block->BackwardLayer(
            spec, params, batch.batch, batch.seq, &la.gemma, a.dx.data()));
        MarkActivationPeak();
        la = LayerActs();
        return absl::OkStatus();
      }
      if (recompute_layer[l]) {
        // The checkpoint holds the input (and the experts' inputs, which
        // the forward writes again with the same values).
        SHARDD_RETURN_IF_ERROR(LayerForward(spec, params, batch, &la, nullptr));
      }
      if (!spec.has_moe) a.dn.assign(t * dim, 0.0f);
      // a.dx is the gradient of the layer's output; a.dn collects the
      // gradient of its normed input.
      if (spec.has_mlp) {
        SHARDD_ASSIGN_OR_RETURN(const float* wg,
                                params->Param(spec.mlp_gate.name));
        SHARDD_ASSIGN_OR_RETURN(const float* wu,
                                params->Param(spec.mlp_up.name));
        SHARDD_ASSIGN_OR_RETURN(const float* wd,
                                params->Param(spec.mlp_down.name));
        kernels::DenseMlpDims dims{t, dim, spec.mlp_inter};
        const int64_t n_in = spec.mlp_inter * dim;
        std::vector<float> dwg(spec.mlp_gate.frozen ? 0 : n_in, 0.0f);
        std::vector<float> dwu(spec.mlp_up.frozen ? 0 : n_in, 0.0f);
        std::vector<float> dwd(spec.mlp_down.frozen ? 0 : n_in, 0.0f);
        SHARDD_RETURN_IF_ERROR(kernels::DenseMlpBackward(
            dims, activation, wg, wu, wd, a.dx.data(), a.dn.data(),
            /*accumulate_dx=*/true, dwg.empty() ? nullptr : dwg.data(),
            dwu.empty() ? nullptr : dwu.data(),
            dwd.empty() ? nullptr : dwd.data(), &la.mlp));
        if (!dwg.empty())
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.mlp_gate, dwg.data()));
        if (!dwu.empty())
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.mlp_up, dwu.data()));
        if (!dwd.empty())
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.mlp_down, dwd.data()));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const float* gw, params->Param(spec.gate.name));
        float* dgw =
            spec.gate.frozen ? nullptr : Zeroed(&scratch, spec.gate.numel());
        std::vector<float> dgb(spec.router_bias ? spec.experts : 0, 0.0f);
        const float* aux_d_logits = nullptr;
        if (aux_on()) {
          a.aux_d_logits.resize(t * aux_experts);
          SHARDD_RETURN_IF_ERROR(kernels::RouterAuxLossBackward(
              kernels::RouterSoftmax(la.router), t, aux_experts,
              a.aux.counts.data(), a.aux.counts[aux_experts], a.aux_scale,
              a.aux_d_logits.data()));
          aux_d_logits = a.aux_d_logits.data();
        }
        SHARDD_RETURN_IF_ERROR(kernels::RouterBackward(
            RouterDimsOf(spec, t), la.normed.data(), gw, a.dweights.data(),
            aux_d_logits, a.dn.data(), /*accumulate_dx=*/true, dgw,
            spec.router_bias ? dgb.data() : nullptr, &la.router));
        if (dgw != nullptr)
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.gate, dgw));
        if (spec.router_bias) {
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.gate_bias, dgb.data()));
        }
      }
      SHARDD_ASSIGN_OR_RETURN(const float* norm_w,
                              params->Param(spec.norm.name));
      if (spec.has_attention) {
        // a.dn is the gradient of post_attention_layernorm's output; a.dx
        // becomes the gradient of x_mid, which is also the attention
        // sublayer's output gradient.
        SHARDD_ASSIGN_OR_RETURN(const float* post_w,
                                params->Param(spec.post_norm.name));
        float* dpost = Zeroed(&scratch, dim);
        SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
            a.dn.data(), la.x_mid.data(), post_w, la.post_inv.data(), t, dim,
            a.dx.data(), dpost, /*accumulate_dx=*/true));
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.post_norm, dpost));
        // a.dn becomes the gradient of input_layernorm's output.
        SHARDD_RETURN_IF_ERROR(
            spec.mla ? mla->Backward(spec, params, la.mla, batch.batch,
                                     batch.seq, a.dx.data(), a.dn.data())
                     : attention->Backward(spec, params, la.attn, batch.batch,
                                           batch.seq, a.dx.data(),
                                           a.dn.data()));
      }
      float* dnorm = Zeroed(&scratch, dim);  // Dropped by AddGrad if frozen.
      // Residual: d(x_in) = d(x_out) + RMSNorm'(d normed).
      SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
          a.dn.data(), la.x_in.data(), norm_w, la.inv_rms.data(), t, dim,
          a.dx.data(), dnorm, /*accumulate_dx=*/true));
      if (dnorm != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.norm, dnorm));
      MarkActivationPeak();
      la = LayerActs();
      FreeVector(&a.dn);
      FreeVector(&a.dweights);
      FreeVector(&a.aux_d_logits);
      return absl::OkStatus();
    }
    case Command::EMBED:
      return EmbedBackward(params, batch.inputs.data(), t,
                           embedding_scale > 0 ? embedding_scale : 1.0f, &a);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status MoeModel::Impl::EmbedBackward(ParamSource* params,
                                           const int32_t* ids, int64_t t,
                                           float scale, PassActs* a) {
  if (!embed.frozen) {
    if (scale != 1.0f) {
      for (float& v : a->dx) v *= scale;
    }
    float* dtable = Zeroed(&scratch, vocab * dim);
    SHARDD_RETURN_IF_ERROR(kernels::EmbeddingBackward(a->dx.data(), ids, t,
                                                      vocab, dim, dtable,
                                                      pad_id));
    SHARDD_RETURN_IF_ERROR(AddGrad(params, embed, dtable));
  }
  FreeVector(&a->dx);
  return absl::OkStatus();
}

void MoeModel::SetEvaluation(bool eval) {
  impl_->eval = eval;
  if (step_ != nullptr) step_->SetEvaluation(eval);
}

void MoeModel::ResetStep() {
  if (step_ != nullptr) return step_->ResetStep();
  Impl& m = *impl_;
  m.loss_sum = 0.0;
  m.loss_terms = 0;
  m.tokens = 0;
  m.order->Reset();
}

double MoeModel::step_loss() const {
  if (step_ != nullptr) return step_->step_loss();
  return impl_->loss_terms == 0 ? 0.0 : impl_->loss_sum / impl_->loss_terms;
}

int64_t MoeModel::step_tokens() const {
  return step_ != nullptr ? step_->step_tokens() : impl_->tokens;
}

int64_t MoeModel::Impl::ActivationBytes() const {
  int64_t bytes = 0;
  for (const PassActs& a : acts) {
    for (const LayerActs& la : a.layers) bytes += la.bytes();
    bytes += static_cast<int64_t>((a.x.capacity() + a.final_x.capacity() +
                                   a.final_inv.capacity() + a.h.capacity() +
                                   a.dx.capacity() + a.dn.capacity() +
                                   a.dweights.capacity() +
                                   a.aux_d_logits.capacity()) *
                                  sizeof(float));
  }
  bytes += sc.bytes();
  for (const Batch& b : batches) {
    bytes += static_cast<int64_t>(b.sc_probs.capacity() * sizeof(float));
  }
  return bytes;
}

int64_t MoeModel::activation_bytes() const {
  return step_ != nullptr ? step_->activation_bytes()
                          : impl_->ActivationBytes();
}

int64_t MoeModel::command_activation_peak() const {
  return step_ != nullptr ? step_->command_activation_peak()
                          : impl_->activation_peak;
}

absl::Status MoeModel::SetRecompute(std::vector<bool> layers,
                                    std::vector<bool> experts) {
  if (step_ != nullptr) {
    return step_->SetRecompute(std::move(layers), std::move(experts));
  }
  Impl& m = *impl_;
  const size_t n = m.layers.size();
  if (layers.size() != n || experts.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("recompute: needs one flag per layer (", n, "), got ",
                     layers.size(), " and ", experts.size()));
  }
  m.recompute_layer = std::move(layers);
  m.recompute_experts = std::move(experts);
  return absl::OkStatus();
}

void MoeModel::HoldSelfConditioningForTest(bool hold) {
  impl_->hold_self_conditioning = hold;
  if (step_ != nullptr) step_->HoldSelfConditioningForTest(hold);
}

bool MoeModel::router_aux_loss() const { return impl_->aux_on(); }

MoeModel::RouterAuxStats* MoeModel::router_aux_stats(int pass) {
  if (step_ != nullptr) {
    step::Saved* aux = step_->aux_stats(pass, 0);
    return aux == nullptr ? nullptr : &aux->Get<step::CpuAuxState>()->stats;
  }
  if (!impl_->aux_on() || pass < 0 ||
      pass >= static_cast<int>(impl_->acts.size())) {
    return nullptr;
  }
  return &impl_->acts[pass].aux;
}

int MoeModel::num_layers() const {
  return static_cast<int>(impl_->layers.size());
}

int64_t MoeModel::vocab_size() const { return impl_->vocab; }

}  // namespace shardd
