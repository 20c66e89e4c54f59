// DeviceMoeModel's load-balancing loss: the CPU model's bookkeeping
// (worker/model/moe_model.h, "Load-balancing loss") on the device, with the
// sums of kernels/cuda/router_aux_loss.h. Everything is enqueued on the
// model's stream; the statistics never visit the host, so the caller can
// all-reduce them with NCCL between FORWARD(HEAD) and BACKWARD(HEAD).

#include <cstdint>

#include "worker/model/device_moe_model_impl.h"

namespace shardd {
namespace device_moe_internal {

absl::Status ModelState::AuxStart(PassState* pass) {
  const int64_t e = aux_experts;
  AuxState& aux = pass->aux;
  SHARDD_RETURN_IF_ERROR(AllocInto(&aux.counts, (e + 2) * 8));
  SHARDD_RETURN_IF_ERROR(AllocInto(&aux.prob_sums, e * 4));
  SHARDD_RETURN_IF_ERROR(AllocInto(&aux.sums, e * 8));
  SHARDD_RETURN_IF_ERROR(AllocInto(&aux.value, 8));
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(aux.counts.data(), 0, aux.counts.bytes(), stream),
      "FORWARD EMBED: zeroing the load-balancing counts");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(aux.sums.data(), 0, aux.sums.bytes(), stream),
      "FORWARD EMBED: zeroing the load-balancing sums");
  // This rank, for the caller's sum over ranks.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAddCount(aux.counts.as<int64_t>() + e + 1, 1, stream),
      "FORWARD EMBED: counting this rank");
  return absl::OkStatus();
}

absl::Status ModelState::AuxAccumulate(PassState* pass, const LayerState& layer,
                                       const kc::RouterDims& dims) {
  const int64_t e = aux_experts;
  AuxState& aux = pass->aux;
  // HF's top-k of softmax(logits) is the router's choice for both softmax
  // scorings (the softmax keeps the logits' order), as on the CPU.
  const float* probs = kc::RouterSoftmax(dims, layer.router_saved.data());
  if (probs == nullptr) {
    return absl::InternalError(
        "FORWARD LAYER: the router kept no softmax for the load-balancing "
        "loss");
  }
  // The router's indices are in range by construction: no counter.
  SHARDD_RETURN_IF_ERROR(kc::RouterAuxLossAccumulate(
      probs, layer.indices.as<int32_t>(), dims.tokens, e, top_k,
      aux.counts.as<int64_t>(), aux.sums.as<double>(),
      /*invalid_indices=*/nullptr, stream));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAddCount(aux.counts.as<int64_t>() + e, dims.tokens,
                                   stream),
      "FORWARD LAYER: counting the load-balancing rows");
  return absl::OkStatus();
}

absl::Status ModelState::AuxFinishForward(PassState* pass) {
  // fp32 for the all-reduce, as the CPU's prob_sums; the counts stay exact.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchDoubleToFloat(pass->aux.sums.as<double>(),
                                        pass->aux.prob_sums.as<float>(),
                                        aux_experts, stream),
      "FORWARD HEAD: rounding the load-balancing sums");
  return absl::OkStatus();
}

absl::Status ModelState::AuxLoss(PassState* pass) {
  const int64_t e = aux_experts;
  AuxState& aux = pass->aux;
  if (aux.counts.empty()) {
    return absl::FailedPreconditionError(
        "BACKWARD HEAD: the pass has no load-balancing statistics");
  }
  // The (possibly all-reduced) fp32 sums widened, as the CPU's double copy;
  // the local double sums are no longer needed.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchFloatToDouble(aux.prob_sums.as<float>(),
                                        aux.sums.as<double>(), e, stream),
      "BACKWARD HEAD: widening the load-balancing sums");
  const int64_t* counts = aux.counts.as<int64_t>();
  SHARDD_RETURN_IF_ERROR(
      kc::RouterAuxLossValue(counts, aux.sums.as<double>(), counts + e, e,
                             aux.value.as<double>(), stream));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAccumulateAuxLoss(
          aux.value.as<double>(), router_aux_loss_coef,
          step_loss.as<DeviceStepLoss>(), stream),
      "BACKWARD HEAD: accumulating the load-balancing loss");
  return absl::OkStatus();
}

absl::Status ModelState::AuxLogitGrad(const PassState& pass,
                                      const LayerState& layer,
                                      const kc::RouterDims& dims,
                                      float* d_logits) {
  const int64_t e = aux_experts;
  const AuxState& aux = pass.aux;
  const float* probs = kc::RouterSoftmax(dims, layer.router_saved.data());
  if (aux.counts.empty() || probs == nullptr) {
    return absl::FailedPreconditionError(
        "BACKWARD LAYER: no load-balancing statistics or kept softmax");
  }
  // The CPU's scale is coef * ranks / (microbatches * grad_passes), the
  // ranks summed on the device: the gradient of the micro-batch's loss once
  // the reduce-scatter averages over them.
  const double scale =
      router_aux_loss_coef /
      (static_cast<double>(options.model.microbatches) * grad_passes());
  const int64_t* counts = aux.counts.as<int64_t>();
  SHARDD_RETURN_IF_ERROR(kc::RouterAuxLossBackward(
      probs, dims.tokens, e, counts, counts + e, scale, d_logits, stream));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchScaleByCount(d_logits, dims.tokens * e,
                                       counts + e + 1, stream),
      "BACKWARD LAYER: scaling the load-balancing gradient by the ranks");
  return absl::OkStatus();
}

}  // namespace device_moe_internal
}  // namespace shardd
