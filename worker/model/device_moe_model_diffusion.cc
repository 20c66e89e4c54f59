// DiffusionGemma's step on the GPU: the causal pass (1 pass) and the
// block-diffusion step (3 passes; worker/model/moe_model_diffusion.cc is
// the CPU's, docs/model-spec.md the definition): pass 0 the causal encode,
// pass 1 the self-conditioning decode without gradients, pass 2 the
// decode, whose attention reads the encode's K/V of the same layer and
// whose backward adds their gradients to the encode's. The layer itself is
// device_moe_model_gemma.cc's.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "worker/model/device_linear.h"
#include "worker/model/device_moe_model_impl.h"

namespace shardd {
namespace device_moe_internal {

absl::Status ModelState::UploadCanvas(int microbatch) {
  BatchState& b = batches[microbatch];
  if (!b.canvas_dirty) return absl::OkStatus();
  const int64_t r = block_diffusion.canvas, rows = b.batch * r;
  SHARDD_RETURN_IF_ERROR(BuildDiffusionCanvas(
      b.host_inputs.data(), b.batch, b.seq, r, vocab, b.step,
      b.sequence_indices.data(), options.model.diffusion, &b.canvas));
  const int64_t ints = 3 * rows + b.tokens;
  if (b.canvas_staged == nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&b.canvas_staged, cudaEventDisableTiming),
        "canvas: cudaEventCreate");
  }
  // The last upload out of the staging buffer (normally long done).
  if (b.canvas_recorded) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.canvas_staged),
                                "canvas: waiting for the staging buffer");
    b.canvas_recorded = false;
  }
  if (b.canvas_pinned_ints < ints) {
    if (b.canvas_pinned != nullptr) cudaFreeHost(b.canvas_pinned);
    b.canvas_pinned = nullptr;
    b.canvas_pinned_ints = 0;
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&b.canvas_pinned),
                       ints * sizeof(int32_t)),
        "canvas: cudaMallocHost");
    b.canvas_pinned_ints = ints;
  }
  int32_t* noised = b.canvas_pinned;
  int32_t* clean = noised + rows;
  int32_t* positions = clean + rows;
  int32_t* ar_targets = positions + rows;
  std::memcpy(noised, b.canvas.noised.data(), rows * sizeof(int32_t));
  std::memcpy(clean, b.canvas.clean.data(), rows * sizeof(int32_t));
  for (int64_t i = 0; i < rows; ++i) {
    positions[i] = static_cast<int32_t>(b.seq - r + i % r);
  }
  // The encoder's pairs: logits 0..S-2 against tokens 1..S-1.
  std::memcpy(ar_targets, b.host_targets.data(), b.tokens * sizeof(int32_t));
  for (int64_t s = 0; s < b.batch; ++s) ar_targets[s * b.seq + b.seq - 1] = -1;
  const int64_t bytes = rows * static_cast<int64_t>(sizeof(int32_t));
  if (b.noised.bytes() != bytes) {
    SHARDD_RETURN_IF_ERROR(AllocInto(&b.noised, bytes));
    SHARDD_RETURN_IF_ERROR(AllocInto(&b.clean, bytes));
    SHARDD_RETURN_IF_ERROR(AllocInto(&b.canvas_positions, bytes));
  }
  if (b.ar_targets.bytes() != b.tokens * 4) {
    SHARDD_RETURN_IF_ERROR(AllocInto(&b.ar_targets, b.tokens * 4));
  }
  const std::pair<DeviceBuffer*, const int32_t*> copies[] = {
      {&b.noised, noised},
      {&b.clean, clean},
      {&b.canvas_positions, positions},
      {&b.ar_targets, ar_targets}};
  for (const auto& [dst, src] : copies) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst->data(), src, dst->bytes(),
                                                cudaMemcpyHostToDevice, stream),
                                "canvas: copying to the device");
  }
  SHARDD_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.canvas_staged, stream),
                              "canvas: cudaEventRecord");
  b.canvas_recorded = true;
  b.canvas_dirty = false;
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::SelfConditioningForward(int pass, int microbatch,
                                                 DeviceParamSource* params,
                                                 PassState* a) {
  constexpr int64_t kElem = sizeof(T);
  const kc::DType dt = kc::DTypeOf<T>::value;
  const BatchState& b = batches[microbatch];
  const int64_t r = block_diffusion.canvas, t = b.batch * r, d = dim;
  std::vector<DeviceBuffer> temps;
  SelfConditioningState& sc = a->sc;
  sc.Reset();
  SHARDD_ASSIGN_OR_RETURN(const T* table, Param<T>(params, embed, &temps));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer e, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(kc::EmbeddingForward(
      table, vocab, d, b.noised.as<int32_t>(), t, e.as<T>(),
      &step_loss.as<DeviceStepLoss>()->bad_ids, stream));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchScale(e.as<T>(), embedding_scale, t * d, stream),
      "self-conditioning: embedding scale");
  DeviceBuffer sum;
  if (pass == 2) {
    // s = softmax(sc_logits) @ E * scale for the sequences whose coin came
    // up; pre_norm, the gated MLP, added to the embeddings.
    if (b.sc_probs.bytes() != t * vocab * kElem) {
      return absl::FailedPreconditionError(
          "FORWARD EMBED of pass 2 before pass 1's HEAD");
    }
    SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas, stream, "sc"));
    SHARDD_ASSIGN_OR_RETURN(sc.signal, Alloc(t * d * kElem));
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(sc.signal.data(), 0, sc.signal.bytes(), stream),
        "self-conditioning: zeroing");
    for (int64_t s = 0; s < b.batch; ++s) {
      if (!b.canvas.self_cond[s]) continue;
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas, r, d, vocab, b.sc_probs.as<T>() + s * r * vocab, vocab, false,
          table, d, false, 0.0f, sc.signal.as<T>() + s * r * d, dt, d,
          "self-conditioning signal"));
    }
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchScale(sc.signal.as<T>(), embedding_scale, t * d,
                                  stream),
        "self-conditioning: signal scale");
    const BlockDiffusionSpec& bd = block_diffusion;
    SHARDD_ASSIGN_OR_RETURN(const T* pre_w,
                            Param<T>(params, bd.pre_norm, &temps));
    SHARDD_RETURN_IF_ERROR(AllocInto(&sc.p, t * d * kElem));
    SHARDD_RETURN_IF_ERROR(AllocInto(&sc.p_inv, t * 4));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(sc.signal.as<T>(), pre_w, t, d,
                                              eps, sc.p.as<T>(),
                                              sc.p_inv.as<float>(), stream));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer mlp_out, Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(MlpForward<T>({&bd.gate, &bd.up, &bd.down, bd.inter},
                                         params, sc.p.as<T>(), t,
                                         mlp_out.as<T>(), &sc.mlp_saved));
    SHARDD_ASSIGN_OR_RETURN(sum, Alloc(t * d * kElem));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(e.as<T>(), mlp_out.as<T>(), nullptr,
                                        sum.as<T>(), t * d, stream),
        "self-conditioning: e + mlp");
    temps.push_back(std::move(mlp_out));
    temps.push_back(std::move(e));
  } else {
    // Pass 1's zero signal: pre_norm(0) = 0 and the MLP gives 0, so the
    // input is post_norm(e).
    sum = std::move(e);
  }
  SHARDD_RETURN_IF_ERROR(AllocInto(&a->x, t * d * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(&sc.sum_inv, t * 4));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(sum.as<T>(), ones.as<T>(), t, d,
                                            eps, a->x.as<T>(),
                                            sc.sum_inv.as<float>(), stream));
  if (pass == 2) {
    sc.sum = std::move(sum);
  } else {
    temps.push_back(std::move(sum));
    sc.Reset();
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::SelfConditioningBackward(int microbatch,
                                                  DeviceParamSource* params,
                                                  PassState* a) {
  constexpr int64_t kElem = sizeof(T);
  const BatchState& b = batches[microbatch];
  const int64_t r = block_diffusion.canvas, t = b.batch * r, d = dim;
  const BlockDiffusionSpec& bd = block_diffusion;
  SelfConditioningState& sc = a->sc;
  if (sc.sum.empty() || a->dx.empty()) {
    return absl::FailedPreconditionError(
        "BACKWARD EMBED of pass 2 without its forward");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas, stream, "sc"));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer g, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
      a->dx.as<T>(), sc.sum.as<T>(), ones.as<T>(), sc.sum_inv.as<float>(), t, d,
      g.as<T>(), /*accumulate_dx=*/false, nullptr, nullptr, 0, stream));
  // The MLP and pre_norm, down to d(signal).
  SHARDD_ASSIGN_OR_RETURN(const T* pre_w,
                          Param<T>(params, bd.pre_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dpre, Grad(params, bd.pre_norm));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dp, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(MlpBackward<T>({&bd.gate, &bd.up, &bd.down, bd.inter},
                                        params, sc.p.as<T>(), t, g.as<T>(),
                                        sc.mlp_saved, dp.as<T>(),
                                        /*accumulate_dx=*/false));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ds, Alloc(t * d * kElem));
  const size_t norm_ws =
      dpre == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(t, d);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer nws, Alloc(norm_ws));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
      dp.as<T>(), sc.signal.as<T>(), pre_w, sc.p_inv.as<float>(), t, d,
      ds.as<T>(), /*accumulate_dx=*/false, dpre, nws.data(), norm_ws, stream));
  SHARDD_ASSIGN_OR_RETURN(float* dtable, Grad(params, embed));
  if (dtable != nullptr) {
    // The embeddings: the canvas ids' rows and, through s = probs @ E *
    // scale (probs detached), probs^T d(s) * scale.
    SHARDD_RETURN_IF_ERROR(
        EmbedBackward<T>(g.as<T>(), b.noised.as<int32_t>(), t, dtable));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchScale(ds.as<T>(), embedding_scale, t * d, stream),
        "self-conditioning: signal scale");
    for (int64_t s = 0; s < b.batch; ++s) {
      if (!b.canvas.self_cond[s]) continue;
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas, vocab, d, r, b.sc_probs.as<T>() + s * r * vocab, vocab, true,
          ds.as<T>() + s * r * d, d, false, 1.0f, dtable, kc::DType::kFloat32,
          d, "self-conditioning embedding gradient"));
    }
  }
  for (DeviceBuffer* buf : {&g, &dp, &ds, &nws}) {
    temps.push_back(std::move(*buf));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaForward(const Command& c,
                                      DeviceParamSource* params) {
  constexpr int64_t kElem = sizeof(T);
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassState& a = State(pass, mb);
  BatchState& batch = batches[mb];
  const int64_t seq = pass == 0 ? batch.seq : block_diffusion.canvas;
  const int64_t t = batch.batch * seq, td = t * dim;
  const int32_t* positions = pass == 0 ? batch.positions.as<int32_t>()
                                       : batch.canvas_positions.as<int32_t>();
  std::vector<DeviceBuffer> temps;
  switch (c.part()) {
    case Command::EMBED: {
      ReleasePass(&a);
      // Only the self-conditioning decode builds no graph.
      a.saves = !(diffusion && pass == 1);
      if (diffusion) SHARDD_RETURN_IF_ERROR(UploadCanvas(mb));
      if (pass > 0) return SelfConditioningForward<T>(pass, mb, params, &a);
      SHARDD_ASSIGN_OR_RETURN(const T* table, Param<T>(params, embed, &temps));
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.x, td * kElem));
      SHARDD_RETURN_IF_ERROR(kc::EmbeddingForward(
          table, vocab, dim, batch.inputs.as<int32_t>(), t, a.x.as<T>(),
          &step_loss.as<DeviceStepLoss>()->bad_ids, stream));
      if (embedding_scale > 0) {
        SHARDD_CUDA_RETURN_IF_ERROR(
            device_model::LaunchScale(a.x.as<T>(), embedding_scale, td, stream),
            "FORWARD EMBED: embedding scale");
      }
      return absl::OkStatus();
    }
    case Command::LAYER: {
      const int l = c.layer();
      GemmaLayerState& g = a.layers[l].gemma;
      if (a.x.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD LAYER ", l, " out of order in pass ", pass));
      }
      ReleaseGemmaLayer(&g);
      g.x_in = std::move(a.x);
      a.x = DeviceBuffer();
      const GemmaDecodeView decode{batch.seq - block_diffusion.canvas,
                                   batch.seq, block_diffusion.block,
                                   &State(0, mb).layers[l].gemma};
      return GemmaLayerForward<T>(layers[l], params, batch.batch, seq,
                                  positions, pass == 0 ? nullptr : &decode, &g);
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      GemmaLayerState& g = a.layers[l].gemma;
      if (g.experts_in.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD EXPERTS ", l, " must follow FORWARD LAYER ", l));
      }
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.x, td * kElem));
      SHARDD_RETURN_IF_ERROR(GemmaExpertsForward<T>(layers[l], params, t,
                                                    a.saves, &g, a.x.as<T>()));
      // The self-conditioning decode has no backward.
      if (!a.saves) ReleaseGemmaLayer(&g);
      return absl::OkStatus();
    }
    case Command::HEAD: {
      SHARDD_RETURN_IF_ERROR(FinalNormForward<T>(&a, params, pass, t));
      if (a.saves) {
        a.h_for_backward = true;  // Losses in BACKWARD(HEAD).
        return absl::OkStatus();
      }
      // The self-conditioning decode's soft-capped logits, softmaxed; pass
      // 2 reads the probabilities, not the hidden states.
      SHARDD_ASSIGN_OR_RETURN(const T* head_w, Param<T>(params, head, &temps));
      kc::CudaCrossEntropyOptions ce_options;
      ce_options.softcap = final_logit_softcap;
      const kc::CrossEntropyDims dims{t, dim, vocab};
      const size_t ws_bytes = kc::LmHeadSoftmaxWorkspaceBytes(
          dims, kc::DTypeOf<T>::value, ce_options);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
      SHARDD_RETURN_IF_ERROR(AllocInto(&batch.sc_probs, t * vocab * kElem));
      SHARDD_RETURN_IF_ERROR(
          kc::LmHeadSoftmax(dims, a.h.as<T>(), head_w, batch.sc_probs.as<T>(),
                            ws.data(), ws_bytes, ce_options, cublas, stream));
      temps.push_back(std::move(ws));
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

template <typename T>
absl::Status ModelState::GemmaBackward(const Command& c,
                                       DeviceParamSource* params) {
  const int pass = c.pass();
  const int mb = c.microbatch();
  PassState& a = State(pass, mb);
  BatchState& batch = batches[mb];
  const int64_t seq = pass == 0 ? batch.seq : block_diffusion.canvas;
  const int64_t t = batch.batch * seq;
  const int32_t* positions = pass == 0 ? batch.positions.as<int32_t>()
                                       : batch.canvas_positions.as<int32_t>();
  std::vector<DeviceBuffer> temps;
  switch (c.part()) {
    case Command::HEAD: {
      if (!diffusion) {
        const double scale = batch.counted == 0
                                 ? 0.0
                                 : 1.0 / (static_cast<double>(batch.counted) *
                                          options.model.microbatches);
        return HeadBackward<T>(&a, params, t, batch.targets.as<int32_t>(),
                               scale, 1.0, /*new_term=*/true);
      }
      // Diffusion CE over every canvas position, plus the weighted AR CE;
      // each a mean over this rank's count. One loss term per micro-batch:
      // the decode's backward runs first.
      const DiffusionTrainingOptions& o = options.model.diffusion;
      const int64_t count = pass == 0 ? batch.ar_counted : t;
      const double weight =
          pass == 0 ? o.encoder_loss_weight : o.diffusion_loss_weight;
      const double scale = count == 0 ? 0.0
                                      : weight / (static_cast<double>(count) *
                                                  options.model.microbatches);
      return HeadBackward<T>(&a, params, t,
                             pass == 0 ? batch.ar_targets.as<int32_t>()
                                       : batch.clean.as<int32_t>(),
                             scale, weight, /*new_term=*/pass == 2);
    }
    case Command::EXPERTS: {
      const int l = c.layer();
      if (a.dx.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EXPERTS ", l, " out of order in pass ", pass));
      }
      return GemmaExpertsBackward<T>(layers[l], params, t, a.dx.as<T>(),
                                     &a.layers[l].gemma);
    }
    case Command::LAYER: {
      const int l = c.layer();
      GemmaLayerState& g = a.layers[l].gemma;
      const GemmaDecodeView decode{batch.seq - block_diffusion.canvas,
                                   batch.seq, block_diffusion.block,
                                   &State(0, mb).layers[l].gemma};
      SHARDD_RETURN_IF_ERROR(
          GemmaLayerBackward<T>(layers[l], params, batch.batch, seq, positions,
                                pass == 0 ? nullptr : &decode, &g, &a.dx));
      // A decode's K/V gradients stay in the encode's state until its
      // backward.
      ReleaseGemmaLayer(&g);
      return absl::OkStatus();
    }
    case Command::EMBED: {
      if (a.dx.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EMBED of pass ", pass, " before every layer's backward"));
      }
      if (pass > 0) {
        SHARDD_RETURN_IF_ERROR(SelfConditioningBackward<T>(mb, params, &a));
        a.sc.Reset();
        batch.sc_probs.Reset();
        a.dx.Reset();
        return absl::OkStatus();
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

template absl::Status ModelState::GemmaForward<float>(const Command&,
                                                      DeviceParamSource*);
template absl::Status ModelState::GemmaForward<uint16_t>(const Command&,
                                                         DeviceParamSource*);
template absl::Status ModelState::GemmaBackward<float>(const Command&,
                                                       DeviceParamSource*);
template absl::Status ModelState::GemmaBackward<uint16_t>(const Command&,
                                                          DeviceParamSource*);

}  // namespace device_moe_internal
}  // namespace shardd
