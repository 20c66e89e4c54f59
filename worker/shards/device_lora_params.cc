#include "worker/shards/device_lora_params.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/shards/device_lora_merge.h"

namespace shardd {
namespace {

// The elements of an adapted weight: E [in, out] blocks or one [out, in].
int64_t WeightNumel(const LoraTarget& t) {
  return std::max<int64_t>(t.experts, 1) * t.in * t.out;
}

}  // namespace

absl::StatusOr<DeviceBuffer> DeviceLoraParams::Alloc(int64_t bytes) {
  return DeviceBuffer::Allocate(allocator_, bytes, MemoryKind::kWorkspace,
                                stream_);
}

absl::StatusOr<const float*> DeviceLoraParams::Fp32Of(const std::string& name) {
  auto it = fp32_.find(name);
  if (it != fp32_.end()) return it->second;
  SHARDD_ASSIGN_OR_RETURN(const DeviceTensor t, inner_->Param(name, stream_));
  const float* out = static_cast<const float*>(t.data);
  if (t.dtype == DeviceDType::kBFloat16) {
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, Alloc(t.numel * 4));
    SHARDD_RETURN_IF_ERROR(
        kernels::cuda::CastBf16ToFp32(static_cast<const uint16_t*>(t.data),
                                      cast.as<float>(), t.numel, stream_));
    out = cast.as<float>();
    temps_.push_back(std::move(cast));
  }
  fp32_[name] = out;
  return out;
}

absl::StatusOr<DeviceTensor> DeviceLoraParams::Param(const std::string& name,
                                                     void* stream) {
  auto target = targets_->find(name);
  if (target == targets_->end()) return inner_->Param(name, stream);
  auto done = merged_.find(name);
  if (done != merged_.end()) return done->second;
  const LoraTarget& t = target->second;
  SHARDD_ASSIGN_OR_RETURN(const DeviceTensor w, inner_->Param(name, stream));
  if (w.numel != WeightNumel(t)) {
    return absl::InternalError(absl::StrCat(
        "parameter '", name, "': ", w.numel,
        " elements do not hold its LoRA geometry (", WeightNumel(t), ")"));
  }
  SHARDD_ASSIGN_OR_RETURN(const float* a, Fp32Of(t.a));
  SHARDD_ASSIGN_OR_RETURN(const float* b, Fp32Of(t.b));
  // W in fp32 (a copy: the gathered W stays as it is), W += s B A.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w32, Alloc(w.numel * 4));
  if (w.dtype == DeviceDType::kBFloat16) {
    SHARDD_RETURN_IF_ERROR(
        kernels::cuda::CastBf16ToFp32(static_cast<const uint16_t*>(w.data),
                                      w32.as<float>(), w.numel, stream_));
  } else if (w.numel > 0) {
    SHARDD_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(w32.data(), w.data, w.numel * 4,
                                   cudaMemcpyDeviceToDevice, stream_),
                   "LoRA: copying the base weight"));
  }
  SHARDD_RETURN_IF_ERROR(DeviceLoraMergeInto(cublas_, stream_, t, t.experts, a,
                                             b, w32.as<float>()));
  DeviceTensor out = w;
  if (w.dtype == DeviceDType::kBFloat16) {
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, Alloc(w.numel * 2));
    SHARDD_RETURN_IF_ERROR(kernels::cuda::CastFp32ToBf16(
        w32.as<float>(), cast.as<uint16_t>(), w.numel, stream_));
    out.data = cast.data();
    temps_.push_back(std::move(cast));
  } else {
    out.data = w32.data();
  }
  temps_.push_back(std::move(w32));
  merged_[name] = out;
  return out;
}

absl::StatusOr<float*> DeviceLoraParams::Grad(const std::string& name,
                                              void* stream) {
  auto target = targets_->find(name);
  if (target == targets_->end()) return inner_->Grad(name, stream);
  DeviceBuffer& g = scratch_[name];
  if (g.empty()) {
    const int64_t bytes = WeightNumel(target->second) * 4;
    SHARDD_ASSIGN_OR_RETURN(g, Alloc(bytes));
    if (bytes > 0) {
      SHARDD_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(g.data(), 0, bytes, stream_),
                     "LoRA: zeroing a base weight's gradient"));
    }
  }
  return g.as<float>();
}

absl::Status DeviceLoraParams::Finish() {
  const float one = 1.0f;
  for (auto& [name, g] : scratch_) {
    const LoraTarget& t = targets_->at(name);
    SHARDD_ASSIGN_OR_RETURN(const float* a, Fp32Of(t.a));
    SHARDD_ASSIGN_OR_RETURN(const float* b, Fp32Of(t.b));
    const int64_t count = std::max<int64_t>(t.experts, 1) * t.rank;
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer da, Alloc(count * t.in * 4));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer db, Alloc(count * t.out * 4));
    SHARDD_RETURN_IF_ERROR(DeviceLoraSplitGrad(cublas_, stream_, t, t.experts,
                                               a, b, g.as<float>(),
                                               da.as<float>(), db.as<float>()));
    // The adapters' gradients gain the splits (their units' buffers).
    const std::pair<const std::string*, const DeviceBuffer*> adds[] = {
        {&t.a, &da}, {&t.b, &db}};
    for (const auto& [adapter, split] : adds) {
      SHARDD_ASSIGN_OR_RETURN(float* grad, inner_->Grad(*adapter, stream_));
      const int64_t n = split->bytes() / 4;
      if (grad == nullptr || n == 0) continue;
      SHARDD_RETURN_IF_ERROR(
          CublasStatus(cublasSaxpy(cublas_, static_cast<int>(n), &one,
                                   split->as<float>(), 1, grad, 1),
                       "LoRA: adding an adapter's gradient"));
    }
    temps_.push_back(std::move(da));
    temps_.push_back(std::move(db));
    temps_.push_back(std::move(g));
  }
  scratch_.clear();
  return absl::OkStatus();
}

}  // namespace shardd
