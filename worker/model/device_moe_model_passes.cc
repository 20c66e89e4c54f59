// DiffusionGemma's own GPU step (until migration step 7 of
// docs/step_driver.md): the blocks its layers and passes share (the gated
// MLP, the embedding's backward, the final norm and the head).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "worker/model/device_moe_model_impl.h"

namespace shardd {
namespace device_moe_internal {

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

#define SHARDD_INSTANTIATE_BLOCKS(T)                                        \
  template absl::Status ModelState::MlpForward<T>(                          \
      const MlpTensors&, DeviceParamSource*, const T*, int64_t, T*,         \
      DeviceBuffer*);                                                       \
  template absl::Status ModelState::MlpBackward<T>(                         \
      const MlpTensors&, DeviceParamSource*, const T*, int64_t, const T*,   \
      const DeviceBuffer&, T*, bool);                                       \
  template absl::Status ModelState::FinalNormForward<T>(                    \
      PassState*, DeviceParamSource*, int, int64_t);                        \
  template absl::Status ModelState::HeadBackward<T>(                        \
      PassState*, DeviceParamSource*, int64_t, const int32_t*, double,      \
      double, bool);
SHARDD_INSTANTIATE_BLOCKS(float)
SHARDD_INSTANTIATE_BLOCKS(uint16_t)
#undef SHARDD_INSTANTIATE_BLOCKS
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
