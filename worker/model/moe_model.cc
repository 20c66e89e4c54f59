#include "worker/model/moe_model.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/router.h"
#include "model/model_util.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace {

using v1::Command;

using Tensor = ArchTensor;
using LayerSpec = MoeLayerSpec;

// Activations of one layer in one pass, kept for its backward.
struct LayerActs {
  std::vector<float> x_in;       // [T, D] residual input
  std::vector<float> inv_rms;    // [T]
  std::vector<float> normed;     // [T, D]
  std::vector<int32_t> indices;  // [T, K]
  std::vector<float> weights;    // [T, K]
  std::vector<float> dense_out;  // [T, D]
  kernels::RouterCache router;
  kernels::GroupedExpertsWorkspace experts;
  kernels::DenseMlpWorkspace mlp;
  bool layer_done = false;
  bool experts_done = false;
  int64_t bytes() const {
    return static_cast<int64_t>((x_in.capacity() + inv_rms.capacity() +
                                 normed.capacity() + weights.capacity() +
                                 dense_out.capacity()) *
                                    sizeof(float) +
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
  bool embedded = false;
  bool head_done = false;
  bool head_backward_done = false;
  int next_backward_layer = -1;
};

struct Batch {
  std::vector<int32_t> inputs;
  std::vector<int32_t> targets;
  int64_t tokens = 0;
  int64_t counted = 0;  // Non-ignored targets.
};

}  // namespace

// The architecture's fields (vocab, dim, layers, ...) are the model's.
struct MoeModel::Impl : MoeArchitecture {
  MoeModelOptions options;

  std::vector<Batch> batches;
  std::vector<PassActs> acts;  // One per pass.
  std::vector<float> scratch;  // Parameter-gradient staging.
  std::vector<float> scratch2;
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
    std::fill(buffer->begin(), buffer->begin() + n, 0.0f);
    return buffer->data();
  }

  absl::Status AddGrad(ParamSource* params, const Tensor& t,
                       const float* values) {
    if (t.frozen) return absl::OkStatus();
    return params->AccumulateGrad(t.name, values);
  }

  absl::Status Forward(const Command& c, ParamSource* params);
  absl::Status Backward(const Command& c, ParamSource* params);
};

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
  return absl::WrapUnique(new MoeModel(std::move(impl)));
}

absl::Status MoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                const int32_t* targets, int64_t batch,
                                int64_t seq) {
  Impl& m = *impl_;
  if (microbatch < 0 || microbatch >= m.options.microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch: must be in [0, ", m.options.microbatches,
                     "), got ", microbatch));
  }
  if (batch < 1 || seq < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch and seq: must be >= 1, got ", batch, " and ", seq));
  }
  Batch& b = m.batches[microbatch];
  b.tokens = batch * seq;
  b.inputs.assign(inputs, inputs + b.tokens);
  b.targets.assign(targets, targets + b.tokens);
  b.counted = 0;
  for (int64_t i = 0; i < b.tokens; ++i) {
    if (b.inputs[i] < 0 || b.inputs[i] >= m.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "]: token id ", b.inputs[i],
                       " outside [0, ", m.vocab, ")"));
    }
    if (b.targets[i] != -1 && (b.targets[i] < 0 || b.targets[i] >= m.vocab)) {
      return absl::InvalidArgumentError(
          absl::StrCat("targets[", i, "]: token id ", b.targets[i],
                       " outside [0, ", m.vocab, ") (or -1 to ignore)"));
    }
    if (b.targets[i] != -1) ++b.counted;
  }
  return absl::OkStatus();
}

absl::Status MoeModel::Run(const v1::Command& command, ParamSource* params) {
  Impl& m = *impl_;
  const int pass = command.pass();
  const int mb = command.microbatch();
  if (pass < 0 || pass >= m.options.passes || mb < 0 ||
      mb >= m.options.microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("command pass ", pass, " / microbatch ", mb,
                     " outside the step's ", m.options.passes, " passes and ",
                     m.options.microbatches, " micro-batches"));
  }
  if ((command.part() == v1::Command::LAYER ||
       command.part() == v1::Command::EXPERTS) &&
      (command.layer() < 0 ||
       command.layer() >= static_cast<int>(m.layers.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("command layer ", command.layer(), " outside [0, ",
                     m.layers.size(), ")"));
  }
  if (m.batches[mb].tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro-batch ", mb, " has no tokens (SetBatch missing)"));
  }
  switch (command.op()) {
    case v1::Command::FORWARD:
      return m.Forward(command, params);
    case v1::Command::BACKWARD:
      if (pass < m.options.no_grad_passes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD of pass ", pass, ", which has no gradients"));
      }
      return m.Backward(command, params);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("MoeModel runs FORWARD and BACKWARD, got op ",
                       v1::Command::Op_Name(command.op())));
  }
}

absl::Status MoeModel::Impl::Forward(const Command& c, ParamSource* params) {
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
      if (pass > 0) {
        // Self-conditioning: the previous pass's output, detached.
        const PassActs& prev = Acts(pass - 1, mb);
        if (!prev.head_done) {
          return absl::FailedPreconditionError(
              absl::StrCat("FORWARD EMBED of pass ", pass, " before pass ",
                           pass - 1, "'s HEAD"));
        }
        const float scale = options.self_conditioning_scale;
        for (int64_t i = 0; i < t * dim; ++i) a.x[i] += scale * prev.h[i];
      }
      a.embedded = true;
      a.head_done = false;
      a.head_backward_done = false;
      a.next_backward_layer = static_cast<int>(layers.size()) - 1;
      for (LayerActs& la : a.layers) la.layer_done = la.experts_done = false;
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (!a.embedded || (l > 0 && !(a.layers[l - 1].layer_done &&
                                     (a.layers[l - 1].experts_done ||
                                      !layers[l - 1].has_moe)))) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD LAYER ", l, " out of order in pass ", pass));
      }
      la.x_in = a.x;
      la.inv_rms.resize(t);
      la.normed.resize(t * dim);
      SHARDD_ASSIGN_OR_RETURN(const float* norm_w,
                              params->Param(spec.norm.name));
      SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(la.x_in.data(), norm_w, t,
                                                     dim, eps, la.normed.data(),
                                                     la.inv_rms.data()));
      la.dense_out.assign(t * dim, 0.0f);
      if (spec.has_mlp) {
        SHARDD_ASSIGN_OR_RETURN(const float* wg,
                                params->Param(spec.mlp_gate.name));
        SHARDD_ASSIGN_OR_RETURN(const float* wu,
                                params->Param(spec.mlp_up.name));
        SHARDD_ASSIGN_OR_RETURN(const float* wd,
                                params->Param(spec.mlp_down.name));
        kernels::DenseMlpDims dims{t, dim, spec.mlp_inter};
        SHARDD_RETURN_IF_ERROR(
            kernels::DenseMlpForward(dims, activation, la.normed.data(), wg, wu,
                                     wd, la.dense_out.data(), &la.mlp));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const float* gw, params->Param(spec.gate.name));
        la.indices.resize(t * top_k);
        la.weights.resize(t * top_k);
        kernels::RouterDims dims{t, dim, spec.experts, top_k};
        SHARDD_RETURN_IF_ERROR(kernels::RouterForward(
            dims, la.normed.data(), gw, la.indices.data(), la.weights.data(),
            &la.router));
      } else {
        // Dense layer: the residual add happens here.
        for (int64_t i = 0; i < t * dim; ++i) a.x[i] += la.dense_out[i];
      }
      la.layer_done = true;
      return absl::OkStatus();
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (!spec.has_moe) {
        return absl::InvalidArgumentError(
            absl::StrCat("FORWARD EXPERTS of layer ", l, ", which has none"));
      }
      if (!la.layer_done || la.experts_done) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD EXPERTS ", l, " must follow FORWARD LAYER ", l));
      }
      SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(spec.w_gu.name));
      SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(spec.w_d.name));
      kernels::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      std::vector<float>& y = scratch2;
      y.resize(t * dim);
      SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsForward(
          dims, activation, la.normed.data(), la.indices.data(),
          la.weights.data(), nullptr, w_gu, w_d, y.data(), &la.experts));
      for (int64_t i = 0; i < t * dim; ++i) {
        a.x[i] += y[i] + la.dense_out[i];
      }
      la.experts_done = true;
      return absl::OkStatus();
    }
    case Command::HEAD: {
      const LayerSpec& last = layers.back();
      const LayerActs& ll = a.layers.back();
      if (!ll.layer_done || (last.has_moe && !ll.experts_done)) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD HEAD before the last layer in pass ", pass));
      }
      SHARDD_ASSIGN_OR_RETURN(const float* norm_w,
                              params->Param(final_norm.name));
      a.final_x = a.x;
      a.final_inv.resize(t);
      a.h.resize(t * dim);
      SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(a.final_x.data(), norm_w,
                                                     t, dim, eps, a.h.data(),
                                                     a.final_inv.data()));
      // The loss of a pass with gradients is computed by its BACKWARD HEAD
      // (one sweep over the logits for both); passes without gradients only
      // produce h for the next pass.
      a.head_done = true;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status MoeModel::Impl::Backward(const Command& c, ParamSource* params) {
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassActs& a = Acts(pass, mb);
  const Batch& batch = batches[mb];
  const int64_t t = batch.tokens;
  switch (c.part()) {
    case Command::HEAD: {
      if (!a.head_done || a.head_backward_done) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD HEAD of pass ", pass, " without its forward"));
      }
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
      SHARDD_ASSIGN_OR_RETURN(
          kernels::CrossEntropyResult ce,
          kernels::LmHeadCrossEntropyBackward(a.h.data(), head_w, t, dim, vocab,
                                              batch.targets.data(), loss_scale,
                                              dh.data(), dw));
      if (dw != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(params, head, dw));
      loss_sum += ce.mean_loss;
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
      a.head_backward_done = true;
      a.next_backward_layer = static_cast<int>(layers.size()) - 1;
      return absl::OkStatus();
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (!spec.has_moe || !a.head_backward_done ||
          a.next_backward_layer != l || !la.experts_done) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EXPERTS ", l, " out of order in pass ", pass));
      }
      SHARDD_ASSIGN_OR_RETURN(const float* w_gu, params->Param(spec.w_gu.name));
      SHARDD_ASSIGN_OR_RETURN(const float* w_d, params->Param(spec.w_d.name));
      kernels::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      a.dn.resize(t * dim);
      a.dweights.resize(t * top_k);
      const bool frozen = spec.w_gu.frozen && spec.w_d.frozen;
      float* dw_gu = frozen ? nullptr : Zeroed(&scratch, spec.w_gu.numel());
      float* dw_d = frozen ? nullptr : Zeroed(&scratch2, spec.w_d.numel());
      SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsBackward(
          dims, activation, w_gu, w_d, a.dx.data(), a.dn.data(),
          /*accumulate_dx=*/false, a.dweights.data(), dw_gu, dw_d,
          &la.experts));
      if (dw_gu != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.w_gu, dw_gu));
      if (dw_d != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.w_d, dw_d));
      la.experts_done = false;  // Consumed: LAYER backward comes next.
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerSpec& spec = layers[l];
      LayerActs& la = a.layers[l];
      if (!a.head_backward_done || a.next_backward_layer != l ||
          !la.layer_done || (spec.has_moe && la.experts_done)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD LAYER ", l, " out of order in pass ", pass,
            spec.has_moe ? " (BACKWARD EXPERTS comes first)" : ""));
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
        kernels::RouterDims dims{t, dim, spec.experts, top_k};
        float* dgw =
            spec.gate.frozen ? nullptr : Zeroed(&scratch, spec.gate.numel());
        SHARDD_RETURN_IF_ERROR(kernels::RouterBackward(
            dims, la.normed.data(), gw, a.dweights.data(), a.dn.data(),
            /*accumulate_dx=*/true, dgw, &la.router));
        if (dgw != nullptr)
          SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.gate, dgw));
      }
      SHARDD_ASSIGN_OR_RETURN(const float* norm_w,
                              params->Param(spec.norm.name));
      float* dnorm = Zeroed(&scratch, dim);  // Dropped by AddGrad if frozen.
      // Residual: d(x_in) = d(x_out) + RMSNorm'(d normed).
      SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
          a.dn.data(), la.x_in.data(), norm_w, la.inv_rms.data(), t, dim,
          a.dx.data(), dnorm, /*accumulate_dx=*/true));
      if (dnorm != nullptr)
        SHARDD_RETURN_IF_ERROR(AddGrad(params, spec.norm, dnorm));
      la.layer_done = false;
      a.next_backward_layer = l - 1;
      return absl::OkStatus();
    }
    case Command::EMBED: {
      if (!a.head_backward_done || a.next_backward_layer != -1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EMBED of pass ", pass, " before every layer's backward"));
      }
      if (!embed.frozen) {
        float* dtable = Zeroed(&scratch, vocab * dim);
        SHARDD_RETURN_IF_ERROR(kernels::EmbeddingBackward(
            a.dx.data(), batch.inputs.data(), t, vocab, dim, dtable));
        SHARDD_RETURN_IF_ERROR(AddGrad(params, embed, dtable));
      }
      a.head_backward_done = false;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

void MoeModel::ResetStep() {
  Impl& m = *impl_;
  m.loss_sum = 0.0;
  m.loss_terms = 0;
  m.tokens = 0;
  for (PassActs& a : m.acts) {
    a.embedded = a.head_done = a.head_backward_done = false;
    for (LayerActs& la : a.layers) la.layer_done = la.experts_done = false;
  }
}

double MoeModel::step_loss() const {
  return impl_->loss_terms == 0 ? 0.0 : impl_->loss_sum / impl_->loss_terms;
}

int64_t MoeModel::step_tokens() const { return impl_->tokens; }

int64_t MoeModel::activation_bytes() const {
  int64_t bytes = 0;
  for (const PassActs& a : impl_->acts) {
    for (const LayerActs& la : a.layers) bytes += la.bytes();
    bytes += static_cast<int64_t>((a.x.capacity() + a.final_x.capacity() +
                                   a.final_inv.capacity() + a.h.capacity() +
                                   a.dx.capacity() + a.dn.capacity() +
                                   a.dweights.capacity()) *
                                  sizeof(float));
  }
  return bytes;
}

int MoeModel::num_layers() const {
  return static_cast<int>(impl_->layers.size());
}

int64_t MoeModel::vocab_size() const { return impl_->vocab; }

}  // namespace shardd
