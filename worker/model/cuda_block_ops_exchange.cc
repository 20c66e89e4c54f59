// CudaBlockOps' side of expert parallelism (worker/model/expert_exchange.h
// describes the exchange): the rows are packed and combined on the device
// by kernels/cuda/expert_permute (the host's per-element rules) and move
// over the expert group's NCCL communicator, ordered with the ops' stream
// on the device (no host wait but ReadChoices'). Rows travel in fp32
// whatever the storage type (the expert tag and the weight must be exact);
// bf16 activations are widened and rounded back around the exchange.
// Not run on a GPU yet.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/expert_permute_element.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/expert_permute.h"
#include "worker/model/cuda_block_ops.h"

namespace shardd {
namespace step {
namespace {

namespace kc = ::shardd::kernels::cuda;

}  // namespace

template <typename T>
absl::StatusOr<const float*> CudaBlockOps::Widened(const T* a, int64_t n,
                                                   DeviceBuffer* widened) {
  if constexpr (std::is_same_v<T, float>) {
    return a;
  } else {
    SHARDD_ASSIGN_OR_RETURN(*widened, Alloc(n * 4));
    SHARDD_RETURN_IF_ERROR(
        kc::CastBf16ToFp32(a, widened->as<float>(), n, stream_));
    return widened->as<const float>();
  }
}

absl::Status CudaBlockOps::ReadChoices(const Act& indices, int64_t n,
                                       std::vector<int32_t>* host) {
  return ReadChoicesRaw(indices.as<int32_t>(), n, host);
}

absl::Status CudaBlockOps::ReadChoicesRaw(const int32_t* indices, int64_t n,
                                          std::vector<int32_t>* host) {
  host->resize(static_cast<size_t>(n));
  if (n == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host->data(), indices, n * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, stream_),
      "expert parallelism: reading the router's choices");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_),
                              "expert parallelism: reading the choices");
  ++host_syncs_;
  return absl::OkStatus();
}

absl::StatusOr<DeviceBuffer> CudaBlockOps::UploadRoute(
    const std::vector<int64_t>& host) {
  return UploadBytes(host.data(),
                     static_cast<int64_t>(host.size() * sizeof(int64_t)));
}

absl::Status CudaBlockOps::ExchangeRows(const ExpertRoute& route, bool reverse,
                                        int64_t width, const float* send,
                                        float* recv) {
  if (ep_group_ == nullptr) {
    return absl::FailedPreconditionError(
        "expert parallelism on the GPU without its NCCL group "
        "(CudaBlockOps::SetExpertGroup)");
  }
  const size_t ep = route.send_counts.size();
  std::vector<int64_t> send_counts(ep), recv_counts(ep);
  for (size_t r = 0; r < ep; ++r) {
    send_counts[r] =
        (reverse ? route.recv_counts[r] : route.send_counts[r]) * width;
    recv_counts[r] =
        (reverse ? route.send_counts[r] : route.recv_counts[r]) * width;
  }
  SHARDD_ASSIGN_OR_RETURN(NcclWork work,
                          ep_group_->AllToAllVAsync(
                              send, send_counts, recv, recv_counts, v1::FLOAT32,
                              NcclWaitFor::Stream(stream_), ep_timeout_));
  return work.StreamWait(stream_);
}

template <typename T>
absl::Status CudaBlockOps::ExchangeDispatchT(ExpertExchange& exchange,
                                             const ExpertRoute& route,
                                             const T* x, const float* weights,
                                             const int32_t* indices, T* x_r,
                                             int32_t* ids_r, float* w_r) {
  const int64_t d = arch_->dim;
  const int64_t width = d + kernels::kDispatchRowExtras;
  const int64_t rows = static_cast<int64_t>(route.order.size());
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer order, UploadRoute(route.order));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer send, Alloc(rows * width * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer recv, Alloc(route.received * width * 4));
  SHARDD_RETURN_IF_ERROR(kc::PackDispatchRows(
      x, weights, indices, order.as<int64_t>(), rows, route.k, d,
      exchange.local_experts(), send.as<float>(), stream_));
  SHARDD_RETURN_IF_ERROR(ExchangeRows(route, /*reverse=*/false, width,
                                      send.as<float>(), recv.as<float>()));
  return kc::UnpackDispatchRows(recv.as<float>(), route.received, d, x_r, ids_r,
                                w_r, stream_);
}

template <typename T>
absl::Status CudaBlockOps::ExchangeCombineT(const ExpertRoute& route,
                                            const T* y_r, T* y) {
  const int64_t d = arch_->dim;
  const int64_t rows = static_cast<int64_t>(route.order.size());
  DeviceBuffer widened;
  SHARDD_ASSIGN_OR_RETURN(const float* send,
                          Widened<T>(y_r, route.received * d, &widened));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer back, Alloc(rows * d * 4));
  SHARDD_RETURN_IF_ERROR(
      ExchangeRows(route, /*reverse=*/true, d, send, back.as<float>()));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer position, UploadRoute(route.position));
  return kc::CombineRows(back.as<float>(), position.as<int64_t>(), route.t,
                         route.k, d, d, y, nullptr, stream_);
}

template <typename T>
absl::Status CudaBlockOps::ExchangeDispatchGradT(const ExpertRoute& route,
                                                 const T* dy, T* dy_r) {
  const int64_t d = arch_->dim;
  const int64_t rows = static_cast<int64_t>(route.order.size());
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer order, UploadRoute(route.order));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer send, Alloc(rows * d * 4));
  SHARDD_RETURN_IF_ERROR(kc::PackGradRows(
      dy, order.as<int64_t>(), rows, route.k, d, send.as<float>(), stream_));
  if constexpr (std::is_same_v<T, float>) {
    return ExchangeRows(route, /*reverse=*/false, d, send.as<float>(), dy_r);
  } else {
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer recv, Alloc(route.received * d * 4));
    SHARDD_RETURN_IF_ERROR(ExchangeRows(route, /*reverse=*/false, d,
                                        send.as<float>(), recv.as<float>()));
    return kc::CastFp32ToBf16(recv.as<float>(), dy_r, route.received * d,
                              stream_);
  }
}

template <typename T>
absl::Status CudaBlockOps::ExchangeCombineGradT(const ExpertRoute& route,
                                                const T* dx_r,
                                                const float* dw_r, T* dx,
                                                float* d_weights) {
  const int64_t d = arch_->dim;
  const int64_t width = d + kernels::kCombineGradRowExtras;
  const int64_t rows = static_cast<int64_t>(route.order.size());
  DeviceBuffer widened;
  SHARDD_ASSIGN_OR_RETURN(const float* dx_rows,
                          Widened<T>(dx_r, route.received * d, &widened));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer send, Alloc(route.received * width * 4));
  SHARDD_RETURN_IF_ERROR(kc::PackCombineGradRows(dx_rows, dw_r, route.received,
                                                 d, send.as<float>(), stream_));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer back, Alloc(rows * width * 4));
  SHARDD_RETURN_IF_ERROR(ExchangeRows(route, /*reverse=*/true, width,
                                      send.as<float>(), back.as<float>()));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer position, UploadRoute(route.position));
  return kc::CombineRows(back.as<float>(), position.as<int64_t>(), route.t,
                         route.k, width, d, dx, d_weights, stream_);
}

absl::Status CudaBlockOps::ExchangeDispatch(ExpertExchange& exchange,
                                            const ExpertRoute& route,
                                            const Act& x, const Act& weights,
                                            const Act& indices, Act* x_r,
                                            Act* ids_r, Act* w_r) {
  const float* w = weights.as<float>();
  const int32_t* ids = indices.as<int32_t>();
  return bf16()
             ? ExchangeDispatchT<uint16_t>(
                   exchange, route, x.as<uint16_t>(), w, ids,
                   x_r->as<uint16_t>(), ids_r->as<int32_t>(), w_r->as<float>())
             : ExchangeDispatchT<float>(exchange, route, x.as<float>(), w, ids,
                                        x_r->as<float>(), ids_r->as<int32_t>(),
                                        w_r->as<float>());
}

absl::Status CudaBlockOps::ExchangeCombine(ExpertExchange&,
                                           const ExpertRoute& route,
                                           const Act& y_r, Act* y) {
  return bf16()
             ? ExchangeCombineT<uint16_t>(route, y_r.as<uint16_t>(),
                                          y->as<uint16_t>())
             : ExchangeCombineT<float>(route, y_r.as<float>(), y->as<float>());
}

absl::Status CudaBlockOps::ExchangeDispatchGrad(ExpertExchange&,
                                                const ExpertRoute& route,
                                                const Act& dy, Act* dy_r) {
  return bf16() ? ExchangeDispatchGradT<uint16_t>(route, dy.as<uint16_t>(),
                                                  dy_r->as<uint16_t>())
                : ExchangeDispatchGradT<float>(route, dy.as<float>(),
                                               dy_r->as<float>());
}

absl::Status CudaBlockOps::ExchangeCombineGrad(ExpertExchange&,
                                               const ExpertRoute& route,
                                               const Act& dx_r, const Act& dw_r,
                                               Act* dx, Act* d_weights) {
  const float* dw = dw_r.as<float>();
  float* d_w = d_weights->as<float>();
  return bf16() ? ExchangeCombineGradT<uint16_t>(route, dx_r.as<uint16_t>(), dw,
                                                 dx->as<uint16_t>(), d_w)
                : ExchangeCombineGradT<float>(route, dx_r.as<float>(), dw,
                                              dx->as<float>(), d_w);
}

// DiffusionGemma's state (cuda_block_ops_gemma.cc) calls both forms.
template absl::Status CudaBlockOps::ExchangeDispatchT<float>(
    ExpertExchange&, const ExpertRoute&, const float*, const float*,
    const int32_t*, float*, int32_t*, float*);
template absl::Status CudaBlockOps::ExchangeDispatchT<uint16_t>(
    ExpertExchange&, const ExpertRoute&, const uint16_t*, const float*,
    const int32_t*, uint16_t*, int32_t*, float*);
template absl::Status CudaBlockOps::ExchangeCombineT<float>(const ExpertRoute&,
                                                            const float*,
                                                            float*);
template absl::Status CudaBlockOps::ExchangeCombineT<uint16_t>(
    const ExpertRoute&, const uint16_t*, uint16_t*);
template absl::Status CudaBlockOps::ExchangeDispatchGradT<float>(
    const ExpertRoute&, const float*, float*);
template absl::Status CudaBlockOps::ExchangeDispatchGradT<uint16_t>(
    const ExpertRoute&, const uint16_t*, uint16_t*);
template absl::Status CudaBlockOps::ExchangeCombineGradT<float>(
    const ExpertRoute&, const float*, const float*, float*, float*);
template absl::Status CudaBlockOps::ExchangeCombineGradT<uint16_t>(
    const ExpertRoute&, const uint16_t*, const float*, uint16_t*, float*);

}  // namespace step
}  // namespace shardd
