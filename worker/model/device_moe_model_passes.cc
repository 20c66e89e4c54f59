#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "worker/model/device_moe_model_impl.h"

namespace shardd {
namespace device_moe_internal {

template <typename T>
absl::Status ModelState::Forward(const Command& c, DeviceParamSource* params) {
  if (gemma) return GemmaForward<T>(c, params);
  constexpr int64_t kElem = sizeof(T);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassState& a = State(pass, mb);
  const BatchState& batch = batches[mb];
  const int64_t t = batch.tokens;
  const int64_t td = t * dim;
  std::vector<DeviceBuffer> temps;  // Freed (stream-ordered) on return.
  switch (c.part()) {
    case Command::EMBED: {
      PassState* prev = pass > 0 ? &State(pass - 1, mb) : nullptr;
      if (prev != nullptr && prev->h.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD EMBED of pass ", pass, " before pass ",
                         pass - 1, "'s HEAD"));
      }
      ReleasePass(&a);  // A new forward of this pass replaces the old one.
      SHARDD_ASSIGN_OR_RETURN(const T* table, Param<T>(params, embed, &temps));
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.x, td * kElem));
      DeviceStepLoss* acc = step_loss.as<DeviceStepLoss>();
      SHARDD_RETURN_IF_ERROR(
          kc::EmbeddingForward(table, vocab, dim, batch.inputs.as<int32_t>(), t,
                               a.x.as<T>(), &acc->bad_ids, stream));
      if (aux_on()) SHARDD_RETURN_IF_ERROR(AuxStart(&a));
      if (prev != nullptr) {
        // Self-conditioning: the previous pass's output, detached.
        SHARDD_CUDA_RETURN_IF_ERROR(
            device_model::LaunchAddScaled(a.x.as<T>(), prev->h.as<T>(),
                                          options.model.self_conditioning_scale,
                                          td, stream),
            "FORWARD EMBED: self-conditioning add");
        prev->h_for_next = false;
        MaybeReleaseH(prev);
      }
      a.saves = c.requires_grad() || pass >= options.model.no_grad_passes;
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerInfo& spec = layers[l];
      LayerState& la = a.layers[l];
      if (a.x.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD LAYER ", l, " out of order in pass ", pass));
      }
      ReleaseLayer(&la);
      SHARDD_ASSIGN_OR_RETURN(const T* norm_w,
                              Param<T>(params, spec.norm, &temps));
      // The residual stream becomes the layer's saved input; the layer's
      // output goes to a new buffer (no copy).
      la.x_in = std::move(a.x);
      a.x = DeviceBuffer();
      SHARDD_RETURN_IF_ERROR(AllocInto(&la.inv_rms, t * sizeof(float)));
      SHARDD_RETURN_IF_ERROR(AllocInto(&la.normed, td * kElem));
      SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(
          la.x_in.as<T>(), norm_w, t, dim, eps, la.normed.as<T>(),
          la.inv_rms.as<float>(), stream));
      if (spec.has_attention) {
        // x_mid = x + attention(input_layernorm(x)); from here on x_in and
        // inv_rms are x_mid and its post_attention_layernorm's (the MoE /
        // MLP branch reads that norm's output).
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer y, Alloc(td * kElem));
        if (spec.mla) {
          SHARDD_ASSIGN_OR_RETURN(
              const DeviceMlaParams mp,
              MlaParams<T>(spec, params, &temps, /*grads=*/false));
          SHARDD_RETURN_IF_ERROR(mla_attention->Forward<T>(
              spec, mp, std::move(la.normed), batch.batch, batch.seq,
              batch.positions.as<int32_t>(), attention->RopeTable(), &la.mla,
              y.as<T>()));
        } else {
          SHARDD_ASSIGN_OR_RETURN(
              const DeviceAttentionParams ap,
              AttentionParams<T>(spec, params, &temps, /*grads=*/false));
          SHARDD_RETURN_IF_ERROR(attention->Forward<T>(
              spec, ap, std::move(la.normed), batch.batch, batch.seq,
              batch.positions.as<int32_t>(), &la.attn, y.as<T>()));
        }
        la.attn_x_in = std::move(la.x_in);
        la.attn_inv = std::move(la.inv_rms);
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.x_in, td * kElem));
        SHARDD_CUDA_RETURN_IF_ERROR(device_model::LaunchResidualAdd(
                                        la.attn_x_in.as<T>(), y.as<T>(),
                                        nullptr, la.x_in.as<T>(), td, stream),
                                    "FORWARD LAYER: attention residual");
        temps.push_back(std::move(y));
        SHARDD_ASSIGN_OR_RETURN(const T* post_w,
                                Param<T>(params, spec.post_norm, &temps));
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.inv_rms, t * sizeof(float)));
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.normed, td * kElem));
        SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(
            la.x_in.as<T>(), post_w, t, dim, eps, la.normed.as<T>(),
            la.inv_rms.as<float>(), stream));
      }
      if (spec.has_mlp) {
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.dense_out, td * kElem));
        SHARDD_RETURN_IF_ERROR(MlpForward<T>(
            {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter},
            params, la.normed.as<T>(), t, la.dense_out.as<T>(),
            &la.mlp_saved));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const T* gw,
                                Param<T>(params, spec.gate, &temps));
        const T* gb = nullptr;
        if (spec.router_bias) {
          SHARDD_ASSIGN_OR_RETURN(gb, Param<T>(params, spec.gate_bias, &temps));
        }
        // DeepSeek-V3's frozen correction bias steers the choice only (fp32,
        // as the router kernel reads it).
        const float* selection = nullptr;
        if (spec.selection_bias) {
          SHARDD_ASSIGN_OR_RETURN(
              selection,
              Param<float>(params, spec.gate_selection_bias, &temps));
        }
        const kc::RouterDims dims = RouterDimsOf(spec, t);
        const size_t saved_bytes = kc::RouterSavedBytes(dims);
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.indices, t * top_k * 4));
        SHARDD_RETURN_IF_ERROR(
            AllocInto(&la.weights, t * top_k * sizeof(float)));
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.router_saved, saved_bytes));
        SHARDD_RETURN_IF_ERROR(kc::RouterForward(
            dims, la.normed.as<T>(), gw, gb, selection,
            la.indices.as<int32_t>(), la.weights.as<float>(),
            la.router_saved.data(), saved_bytes, cublas, stream));
        if (aux_on()) SHARDD_RETURN_IF_ERROR(AuxAccumulate(&a, la, dims));
      } else {
        // Dense layer: the residual add happens here.
        SHARDD_RETURN_IF_ERROR(AllocInto(&a.x, td * kElem));
        SHARDD_CUDA_RETURN_IF_ERROR(device_model::LaunchResidualAdd(
                                        la.x_in.as<T>(), la.dense_out.as<T>(),
                                        nullptr, a.x.as<T>(), td, stream),
                                    "FORWARD LAYER: residual add");
        la.dense_out.Reset();
        if (!a.saves) ReleaseLayer(&la);
      }
      return absl::OkStatus();
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerInfo& spec = layers[l];
      LayerState& la = a.layers[l];
      if (la.normed.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD EXPERTS ", l, " must follow FORWARD LAYER ", l));
      }
      SHARDD_ASSIGN_OR_RETURN(const T* w_gu,
                              Param<T>(params, spec.w_gu, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(params, spec.w_d, &temps));
      SHARDD_ASSIGN_OR_RETURN(const kc::GroupedExpertsOptions expert_options,
                              ExpertOptionsOf<T>(spec, params, &temps));
      const kc::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      ReleaseExpertSlot(&la.experts);
      SHARDD_ASSIGN_OR_RETURN(la.experts, AcquireExpertSlot(dims));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer y, Alloc(td * kElem));
      const int64_t syncs_before = la.experts.workspace->host_syncs();
      const absl::Status forward = kc::GroupedExpertsForward(
          dims, expert_options, la.normed.data(), la.indices.as<int32_t>(),
          la.weights.as<float>(), /*token_mask=*/nullptr, w_gu, w_d, y.data(),
          la.experts.workspace, cublas, stream);
      host_syncs += la.experts.workspace->host_syncs() - syncs_before;
      SHARDD_RETURN_IF_ERROR(forward);
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.x, td * kElem));
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchResidualAdd(
              la.x_in.as<T>(), y.as<T>(),
              la.dense_out.empty() ? nullptr : la.dense_out.as<T>(),
              a.x.as<T>(), td, stream),
          "FORWARD EXPERTS: residual add");
      temps.push_back(std::move(y));
      la.dense_out.Reset();
      if (!a.saves) ReleaseLayer(&la);
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNormForward<T>(&a, params, pass, t));
      if (aux_on()) SHARDD_RETURN_IF_ERROR(AuxFinishForward(&a));
      // As on the CPU, the loss of a pass with gradients is computed by its
      // BACKWARD HEAD; a pass without only produces h for the next pass.
      if (!a.saves) {
        a.final_x.Reset();
        a.final_inv.Reset();
      }
      a.h_for_next = pass + 1 < options.model.passes;
      a.h_for_backward = a.saves;
      MaybeReleaseH(&a);
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

template <typename T>
absl::Status ModelState::Backward(const Command& c, DeviceParamSource* params) {
  if (gemma) return GemmaBackward<T>(c, params);
  constexpr int64_t kElem = sizeof(T);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassState& a = State(pass, mb);
  const BatchState& batch = batches[mb];
  const int64_t t = batch.tokens;
  const int64_t td = t * dim;
  std::vector<DeviceBuffer> temps;  // Freed (stream-ordered) on return.
  switch (c.part()) {
    case Command::HEAD: {
      // The CPU model's scale: the gradient of this pass's mean loss,
      // averaged over micro-batches and grad passes.
      const double loss_scale =
          batch.counted == 0
              ? 0.0
              : 1.0 / (static_cast<double>(batch.counted) *
                       options.model.microbatches * grad_passes());
      return HeadBackward<T>(&a, params, t, batch.targets.as<int32_t>(),
                             loss_scale, /*weight=*/1.0, /*new_term=*/true);
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      const LayerInfo& spec = layers[l];
      LayerState& la = a.layers[l];
      if (la.experts.workspace == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EXPERTS ", l, " out of order in pass ", pass));
      }
      SHARDD_ASSIGN_OR_RETURN(const T* w_gu,
                              Param<T>(params, spec.w_gu, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(params, spec.w_d, &temps));
      SHARDD_ASSIGN_OR_RETURN(float* dw_gu, Grad(params, spec.w_gu));
      SHARDD_ASSIGN_OR_RETURN(float* dw_d, Grad(params, spec.w_d));
      SHARDD_ASSIGN_OR_RETURN(const kc::GroupedExpertsOptions expert_options,
                              ExpertOptionsOf<T>(spec, params, &temps));
      kc::ExpertBiasGrads bias_grads;
      if (spec.expert_bias) {
        SHARDD_ASSIGN_OR_RETURN(bias_grads.gate_up, Grad(params, spec.b_gu));
        SHARDD_ASSIGN_OR_RETURN(bias_grads.down, Grad(params, spec.b_d));
      }
      const kc::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.dn, td * kElem));
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.dweights, t * top_k * sizeof(float)));
      SHARDD_RETURN_IF_ERROR(kc::GroupedExpertsBackward(
          dims, expert_options, w_gu, w_d, a.dx.data(), a.dn.data(),
          /*accumulate_dx=*/false, a.dweights.as<float>(), dw_gu, dw_d,
          bias_grads, la.experts.workspace, cublas, stream));
      ReleaseExpertSlot(&la.experts);
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      const LayerInfo& spec = layers[l];
      LayerState& la = a.layers[l];
      if (la.x_in.empty() ||
          (spec.has_moe && (a.dn.empty() || a.dweights.empty()))) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD LAYER ", l, " out of order in pass ", pass,
            spec.has_moe ? " (BACKWARD EXPERTS comes first)" : ""));
      }
      // a.dx is the gradient of the layer's output; a.dn collects the
      // gradient of its normed input (written by BACKWARD EXPERTS in a MoE
      // layer, by the dense MLP first in a dense one).
      if (!spec.has_moe) SHARDD_RETURN_IF_ERROR(AllocInto(&a.dn, td * kElem));
      if (spec.has_mlp) {
        SHARDD_RETURN_IF_ERROR(MlpBackward<T>(
            {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter},
            params, la.normed.as<T>(), t, a.dx.as<T>(), la.mlp_saved,
            a.dn.as<T>(), /*accumulate_dx=*/spec.has_moe));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const T* gw,
                                Param<T>(params, spec.gate, &temps));
        SHARDD_ASSIGN_OR_RETURN(float* dgw, Grad(params, spec.gate));
        float* dgb = nullptr;
        if (spec.router_bias) {
          SHARDD_ASSIGN_OR_RETURN(dgb, Grad(params, spec.gate_bias));
        }
        const kc::RouterDims dims = RouterDimsOf(spec, t);
        // The load-balancing loss's logit gradient joins the router's.
        DeviceBuffer aux_d_logits;
        if (aux_on()) {
          SHARDD_ASSIGN_OR_RETURN(aux_d_logits,
                                  Alloc(t * aux_experts * sizeof(float)));
          SHARDD_RETURN_IF_ERROR(
              AuxLogitGrad(a, la, dims, aux_d_logits.as<float>()));
        }
        const size_t ws_bytes =
            kc::RouterBackwardWorkspaceBytes(dims, kc::DTypeOf<T>::value);
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
        SHARDD_RETURN_IF_ERROR(kc::RouterBackward(
            dims, la.normed.as<T>(), gw, a.dweights.as<float>(),
            aux_d_logits.empty() ? nullptr : aux_d_logits.as<float>(),
            la.router_saved.data(),
            static_cast<size_t>(la.router_saved.bytes()), a.dn.as<T>(),
            /*accumulate_dx=*/true, dgw, dgb, ws.data(), ws_bytes, cublas,
            stream));
        temps.push_back(std::move(ws));
        temps.push_back(std::move(aux_d_logits));
      }
      // Residual: d(x_in) = d(x_out) + RMSNorm'(d normed); with attention
      // first through post_attention_layernorm (x_in is x_mid), then the
      // attention, then input_layernorm.
      const TensorInfo& branch_norm =
          spec.has_attention ? spec.post_norm : spec.norm;
      SHARDD_RETURN_IF_ERROR(NormBackward<T>(branch_norm, params, a.dn, la.x_in,
                                             la.inv_rms, t, &a.dx, &temps));
      if (spec.has_attention) {
        if (spec.mla) {
          SHARDD_ASSIGN_OR_RETURN(
              const DeviceMlaParams mp,
              MlaParams<T>(spec, params, &temps, /*grads=*/true));
          SHARDD_RETURN_IF_ERROR(mla_attention->Backward<T>(
              spec, mp, la.mla, batch.batch, batch.seq,
              batch.positions.as<int32_t>(), attention->RopeTable(),
              a.dx.as<T>(), a.dn.as<T>()));
        } else {
          SHARDD_ASSIGN_OR_RETURN(
              const DeviceAttentionParams ap,
              AttentionParams<T>(spec, params, &temps, /*grads=*/true));
          SHARDD_RETURN_IF_ERROR(attention->Backward<T>(
              spec, ap, la.attn, batch.batch, batch.seq,
              batch.positions.as<int32_t>(), a.dx.as<T>(), a.dn.as<T>()));
        }
        SHARDD_RETURN_IF_ERROR(NormBackward<T>(spec.norm, params, a.dn,
                                               la.attn_x_in, la.attn_inv, t,
                                               &a.dx, &temps));
      }
      ReleaseLayer(&la);
      a.dn.Reset();
      a.dweights.Reset();
      return absl::OkStatus();
    }
    case Command::EMBED: {
      if (a.dx.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EMBED of pass ", pass, " before every layer's backward"));
      }
      SHARDD_ASSIGN_OR_RETURN(float* dtable, Grad(params, embed));
      if (dtable != nullptr) {
        SHARDD_RETURN_IF_ERROR(EmbedBackward<T>(
            a.dx.as<T>(), batch.inputs.as<int32_t>(), t, dtable));
      }
      a.dx.Reset();
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

template <typename T>
absl::Status ModelState::MlpForward(const MlpTensors& mlp,
                                    DeviceParamSource* params, const T* x,
                                    int64_t t, T* y, DeviceBuffer* saved) {
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* wg, Param<T>(params, *mlp.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wu, Param<T>(params, *mlp.up, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wd, Param<T>(params, *mlp.down, &temps));
  const kc::DenseMlpDims dims{t, dim, mlp.inter};
  const kc::DType dtype = kc::DTypeOf<T>::value;
  const size_t saved_bytes = kc::DenseMlpSavedBytes(dims, dtype);
  const size_t ws_bytes = kc::DenseMlpForwardWorkspaceBytes(dims, dtype);
  SHARDD_RETURN_IF_ERROR(AllocInto(saved, saved_bytes));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  return kc::DenseMlpForward(dims, activation, x, wg, wu, wd, y,
                             /*accumulate_y=*/false, saved->data(),
                             saved_bytes, ws.data(), ws_bytes, cublas, stream);
}

template <typename T>
absl::Status ModelState::MlpBackward(const MlpTensors& mlp,
                                     DeviceParamSource* params, const T* x,
                                     int64_t t, const T* dy,
                                     const DeviceBuffer& saved, T* dx,
                                     bool accumulate_dx) {
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* wg, Param<T>(params, *mlp.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wu, Param<T>(params, *mlp.up, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wd, Param<T>(params, *mlp.down, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dwg, Grad(params, *mlp.gate));
  SHARDD_ASSIGN_OR_RETURN(float* dwu, Grad(params, *mlp.up));
  SHARDD_ASSIGN_OR_RETURN(float* dwd, Grad(params, *mlp.down));
  const kc::DenseMlpDims dims{t, dim, mlp.inter};
  const size_t ws_bytes =
      kc::DenseMlpBackwardWorkspaceBytes(dims, kc::DTypeOf<T>::value);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  return kc::DenseMlpBackward(dims, activation, x, wg, wu, wd, dy,
                              saved.data(), static_cast<size_t>(saved.bytes()),
                              dx, accumulate_dx, dwg, dwu, dwd, ws.data(),
                              ws_bytes, cublas, stream);
}

template <typename T>
absl::Status ModelState::EmbedBackward(T* dx, const int32_t* ids, int64_t t,
                                       float* dtable) {
  if (embedding_scale > 0) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchScale(dx, embedding_scale, t * dim, stream),
        "BACKWARD EMBED: embedding scale");
  }
  const size_t ws_bytes = kc::EmbeddingBackwardWorkspaceBytes(vocab, t);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  // The workspace is freed stream-ordered, after the kernel.
  return kc::EmbeddingBackward(dx, ids, t, vocab, dim, dtable, ws.data(),
                               ws_bytes,
                               &step_loss.as<DeviceStepLoss>()->bad_ids,
                               stream, pad_id);
}

template <typename T>
absl::Status ModelState::FinalNormForward(PassState* a,
                                          DeviceParamSource* params, int pass,
                                          int64_t t) {
  if (a->x.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("FORWARD HEAD before the last layer in pass ", pass));
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* norm_w,
                          Param<T>(params, final_norm, &temps));
  a->final_x = std::move(a->x);
  a->x = DeviceBuffer();
  SHARDD_RETURN_IF_ERROR(AllocInto(&a->final_inv, t * sizeof(float)));
  SHARDD_RETURN_IF_ERROR(AllocInto(&a->h, t * dim * sizeof(T)));
  return kc::RmsNormForward(a->final_x.as<T>(), norm_w, t, dim, eps,
                            a->h.as<T>(), a->final_inv.as<float>(), stream);
}

template <typename T>
absl::Status ModelState::HeadBackward(PassState* pass_state,
                                      DeviceParamSource* params, int64_t t,
                                      const int32_t* targets, double loss_scale,
                                      double weight, bool new_term) {
  constexpr int64_t kElem = sizeof(T);
  PassState& a = *pass_state;
  const int64_t td = t * dim;
  std::vector<DeviceBuffer> temps;  // Freed (stream-ordered) on return.
  if (a.final_x.empty() || a.h.empty()) {
    return absl::FailedPreconditionError(
        "BACKWARD HEAD of a pass without its forward");
  }
  SHARDD_ASSIGN_OR_RETURN(const T* head_w, Param<T>(params, head, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* norm_w,
                          Param<T>(params, final_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dhead, Grad(params, head));
  SHARDD_ASSIGN_OR_RETURN(float* dnorm, Grad(params, final_norm));
  const kc::CrossEntropyDims dims{t, dim, vocab};
  kc::CudaCrossEntropyOptions ce_options;  // ignore_index -1
  ce_options.softcap = final_logit_softcap;
  const size_t ws_bytes = kc::CrossEntropyWorkspaceBytes(
      dims, kc::DTypeOf<T>::value, ce_options, /*with_grad=*/true);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer result,
                          Alloc(sizeof(kc::CrossEntropyDeviceResult)));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dh, Alloc(td * kElem));
  auto* r = result.as<kc::CrossEntropyDeviceResult>();
  SHARDD_RETURN_IF_ERROR(kc::LmHeadCrossEntropyBackward(
      dims, a.h.as<T>(), head_w, targets, static_cast<float>(loss_scale),
      dh.as<T>(), dhead, /*accumulate_dhidden=*/false, r, ws.data(), ws_bytes,
      ce_options, cublas, stream));
  // Device pointers to the result's fields (address arithmetic only).
  const char* base = static_cast<const char*>(result.data());
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAccumulateStepLoss(
          reinterpret_cast<const double*>(
              base + offsetof(kc::CrossEntropyDeviceResult, mean_loss)),
          reinterpret_cast<const int64_t*>(
              base + offsetof(kc::CrossEntropyDeviceResult, count)),
          reinterpret_cast<const int64_t*>(
              base + offsetof(kc::CrossEntropyDeviceResult, invalid_targets)),
          weight, step_loss.as<DeviceStepLoss>(), stream),
      "BACKWARD HEAD: accumulating the loss");
  // A pass's loss is CE + coef * aux (one term of the step's mean).
  if (aux_on()) SHARDD_RETURN_IF_ERROR(AuxLoss(&a));
  if (new_term) ++loss_terms;
  SHARDD_RETURN_IF_ERROR(AllocInto(&a.dx, td * kElem));
  const size_t norm_ws_bytes =
      dnorm == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(t, dim);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer norm_ws, Alloc(norm_ws_bytes));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
      dh.as<T>(), a.final_x.as<T>(), norm_w, a.final_inv.as<float>(), t, dim,
      a.dx.as<T>(), /*accumulate_dx=*/false, dnorm, norm_ws.data(),
      norm_ws_bytes, stream));
  temps.push_back(std::move(ws));
  temps.push_back(std::move(result));
  temps.push_back(std::move(dh));
  temps.push_back(std::move(norm_ws));
  a.final_x.Reset();
  a.final_inv.Reset();
  a.h_for_backward = false;
  MaybeReleaseH(&a);
  return absl::OkStatus();
}

template absl::Status ModelState::Forward<float>(const Command& c,
                                                 DeviceParamSource* params);
template absl::Status ModelState::Forward<uint16_t>(const Command& c,
                                                    DeviceParamSource* params);
template absl::Status ModelState::Backward<float>(const Command& c,
                                                  DeviceParamSource* params);
template absl::Status ModelState::Backward<uint16_t>(const Command& c,
                                                     DeviceParamSource* params);
// device_moe_model_diffusion.cc's passes use these too.
template absl::Status ModelState::EmbedBackward<float>(float* dx,
                                                       const int32_t* ids,
                                                       int64_t t,
                                                       float* dtable);
template absl::Status ModelState::EmbedBackward<uint16_t>(uint16_t* dx,
                                                          const int32_t* ids,
                                                          int64_t t,
                                                          float* dtable);

}  // namespace device_moe_internal
}  // namespace shardd
