#include "worker/model/cuda_block_ops.h"

#include <cstddef>
#include <cstring>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dense_mlp.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_aux_loss.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/cuda_block_ops_kernels.h"

namespace shardd {
namespace step {
namespace {

namespace kc = ::shardd::kernels::cuda;
using device_model::DeviceStepLoss;

// cuBLAS gets its workspace from the allocator once, so it never allocates
// on its own inside the step (32 MiB: NVIDIA's recommendation for Hopper).
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
// Grouped-experts workspace objects kept for reuse; beyond this many, the
// ones no state holds are dropped (each holds a pinned host buffer).
constexpr size_t kMaxCachedExpertWorkspaces = 256;
// Pinned staging buffers kept for uploads; beyond this many in flight, an
// upload waits for the oldest.
constexpr size_t kMaxStaging = 64;

// Device memory of an Act.
class DeviceMemory : public ActMemory {
 public:
  explicit DeviceMemory(DeviceBuffer buffer) : buffer_(std::move(buffer)) {}
  void* data() override { return buffer_.data(); }

 private:
  DeviceBuffer buffer_;
};

int64_t BytesOf(std::initializer_list<const DeviceBuffer*> buffers) {
  int64_t total = 0;
  for (const DeviceBuffer* b : buffers) total += b->bytes();
  return total;
}

// The blocks' saved states on the device.
struct AttentionState : BlockState {
  DeviceAttentionActs attn;  // MHA / GQA
  DeviceMlaActs mla;         // DeepSeek-V3's latent attention
  int64_t bytes() const override {
    return BytesOf({&attn.n,     &attn.q_pre, &attn.k_pre, &attn.q_inv,
                    &attn.k_inv, &attn.q,     &attn.k,     &attn.v,
                    &attn.o,     &attn.lse,   &mla.n,      &mla.qa,
                    &mla.qa_inv, &mla.qa_n,   &mla.c,      &mla.c_inv,
                    &mla.c_n,    &mla.q,      &mla.k,      &mla.v,
                    &mla.o,      &mla.lse});
  }
};
struct RouterState : BlockState {
  kc::RouterDims dims;
  DeviceBuffer saved;  // RouterSavedBytes
  int64_t bytes() const override { return saved.bytes(); }
};
struct MlpState : BlockState {
  DeviceBuffer saved;  // DenseMlpSavedBytes
  int64_t bytes() const override { return saved.bytes(); }
};
struct ExpertsState : BlockState {
  kc::ExpertDims dims;
  DeviceBuffer memory;
  std::shared_ptr<kc::GroupedExpertsWorkspace> workspace;
  int64_t bytes() const override { return memory.bytes(); }
};
// O(E), so not counted as activations (as on the CPU).
struct AuxState : BlockState {
  DeviceBuffer counts;      // int64 [E + 2]: choices, rows, ranks
  DeviceBuffer prob_sums;   // fp32 [E]: what the ranks all-reduce
  DeviceBuffer sums;        // double [E]: local sums, then the reduced ones
  DeviceBuffer value;       // double: the pass's aux loss
  double grad_scale = 0.0;  // coef / denominator (the ranks on the device)
  int64_t bytes() const override { return 0; }
};

template <typename T>
T* P(Act* a) {
  return a->as<T>();
}
template <typename T>
const T* P(const Act& a) {
  return a.as<T>();
}

template <typename T>
constexpr DeviceDType DeviceDTypeOf() {
  return std::is_same<T, float>::value ? DeviceDType::kFloat32
                                       : DeviceDType::kBFloat16;
}

// The architecture's router, as the CPU's RouterForward configures it.
kc::RouterDims RouterDimsOf(const MoeArchitecture& a, const MoeLayerSpec& spec,
                            int64_t t) {
  kc::RouterDims dims{t, a.dim, spec.experts, a.top_k, a.renormalize_topk};
  dims.scoring = a.router_scoring;
  dims.groups = a.router_groups;
  dims.top_groups = a.router_top_groups;
  dims.scale = a.routed_scaling_factor;
  dims.keep_softmax = a.aux_on();
  return dims;
}

// The experts' options without biases.
kc::GroupedExpertsOptions ExpertOptionsOf(const MoeArchitecture& a, bool bf16) {
  kc::GroupedExpertsOptions o;
  switch (a.activation) {
    case kernels::GatedActivation::kGeGLU:
      o.activation = kc::GatedActivation::kGeGLU;
      break;
    case kernels::GatedActivation::kClampedSwiGLU:
      o.activation = kc::GatedActivation::kClampedSwiGLU;
      break;
    default:
      o.activation = kc::GatedActivation::kSwiGLU;
      break;
  }
  o.alpha = a.swiglu_alpha;
  o.limit = a.swiglu_limit;
  o.storage = bf16 ? kc::ExpertStorage::kBFloat16 : kc::ExpertStorage::kFloat32;
  o.gemm_path = kc::ExpertGemmPath::kAuto;
  return o;
}

}  // namespace

CudaBlockOps::CudaBlockOps(const MoeArchitecture* arch, DeviceDType storage,
                           cudaStream_t stream, DeviceAllocator* allocator)
    : arch_(arch), storage_(storage), stream_(stream), allocator_(allocator) {}

CudaBlockOps::~CudaBlockOps() {
  // Pending work may still read the staging and loss buffers below.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (Staging& s : staging_) {
    if (s.host != nullptr) cudaFreeHost(s.host);
    if (s.done != nullptr) cudaEventDestroy(s.done);
  }
  expert_workspaces_.clear();
  attention_.reset();
  mla_.reset();
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (pinned_loss_ != nullptr) cudaFreeHost(pinned_loss_);
}

absl::StatusOr<std::unique_ptr<CudaBlockOps>> CudaBlockOps::Create(
    const MoeArchitecture* arch, DeviceDType storage, cudaStream_t stream,
    DeviceAllocator* allocator) {
  if (arch == nullptr || stream == nullptr || allocator == nullptr) {
    return absl::InvalidArgumentError(
        "CudaBlockOps: arch, stream and allocator must not be null");
  }
  auto ops =
      absl::WrapUnique(new CudaBlockOps(arch, storage, stream, allocator));
  SHARDD_RETURN_IF_ERROR(
      CublasStatus(cublasCreate(&ops->cublas_), "CudaBlockOps: cublasCreate"));
  // The stream first: cublasSetStream drops a workspace set before it.
  SHARDD_RETURN_IF_ERROR(CublasStatus(cublasSetStream(ops->cublas_, stream),
                                      "CudaBlockOps: cublasSetStream"));
  SHARDD_ASSIGN_OR_RETURN(ops->cublas_workspace_,
                          ops->Alloc(kCublasWorkspaceBytes));
  SHARDD_RETURN_IF_ERROR(CublasStatus(
      cublasSetWorkspace(ops->cublas_, ops->cublas_workspace_.data(),
                         static_cast<size_t>(kCublasWorkspaceBytes)),
      "CudaBlockOps: cublasSetWorkspace"));
  SHARDD_ASSIGN_OR_RETURN(ops->step_loss_, ops->Alloc(sizeof(DeviceStepLoss)));
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(&ops->pinned_loss_, sizeof(DeviceStepLoss)),
      "CudaBlockOps: cudaMallocHost");
  ops->attention_ = std::make_unique<DeviceAttentionBlock>(
      arch, allocator, stream, ops->cublas_);
  if (arch->mla) {
    ops->mla_ =
        std::make_unique<DeviceMlaBlock>(arch, allocator, stream, ops->cublas_);
  }
  ops->ResetLoss();
  SHARDD_RETURN_IF_ERROR(ops->reset_error_);
  return ops;
}

absl::StatusOr<DeviceBuffer> CudaBlockOps::Alloc(int64_t bytes) {
  return DeviceBuffer::Allocate(allocator_, bytes, MemoryKind::kWorkspace,
                                stream_);
}

absl::StatusOr<Act> CudaBlockOps::Allocate(Elem elem, int64_t numel,
                                           bool zero) {
  if (numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation of ", numel, " elements"));
  }
  const int64_t width = elem == Elem::kStorage && bf16() ? 2 : 4;
  const int64_t bytes = numel * width;
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer buffer, Alloc(bytes));
  if (zero && bytes > 0) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(buffer.data(), 0, bytes, stream_), "zeroing an Act");
  }
  return Act(std::make_unique<DeviceMemory>(std::move(buffer)), elem, numel,
             bytes);
}

absl::StatusOr<DeviceBuffer> CudaBlockOps::UploadBuffer(const int32_t* host,
                                                        int64_t n) {
  return UploadBytes(host, n * static_cast<int64_t>(sizeof(int32_t)));
}

absl::StatusOr<DeviceBuffer> CudaBlockOps::UploadBytes(const void* host,
                                                       int64_t bytes) {
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer buffer, Alloc(bytes));
  if (bytes == 0) return buffer;
  const int64_t n = bytes;  // Staging capacity counts bytes.
  // A staging buffer whose last copy is done, large enough if possible.
  Staging* slot = nullptr;
  for (Staging& s : staging_) {
    if (s.pending) {
      const cudaError_t done = cudaEventQuery(s.done);
      if (done == cudaErrorNotReady) continue;
      SHARDD_CUDA_RETURN_IF_ERROR(done, "upload: cudaEventQuery");
      s.pending = false;
    }
    if (slot == nullptr || (slot->capacity < n && s.capacity >= n)) slot = &s;
  }
  if (slot == nullptr && staging_.size() >= kMaxStaging) {
    // Too many in flight: wait for the first slot's copy.
    slot = &staging_.front();
    SHARDD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot->done),
                                "upload: waiting for a staging buffer");
    ++host_syncs_;
    slot->pending = false;
  }
  if (slot == nullptr) {
    staging_.emplace_back();
    slot = &staging_.back();
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming),
        "upload: cudaEventCreate");
  }
  if (slot->capacity < n) {
    if (slot->host != nullptr) cudaFreeHost(slot->host);
    slot->host = nullptr;
    slot->capacity = 0;
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&slot->host), n),
        "upload: cudaMallocHost");
    slot->capacity = n;
  }
  std::memcpy(slot->host, host, bytes);
  SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(buffer.data(), slot->host, bytes,
                                              cudaMemcpyHostToDevice, stream_),
                              "upload: cudaMemcpyAsync");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot->done, stream_),
                              "upload: cudaEventRecord");
  slot->pending = true;
  return buffer;
}

absl::StatusOr<Act> CudaBlockOps::Upload(const int32_t* host, int64_t n) {
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer buffer, UploadBuffer(host, n));
  const int64_t bytes = buffer.bytes();
  return Act(std::make_unique<DeviceMemory>(std::move(buffer)), Elem::kI32, n,
             bytes);
}

absl::Status CudaBlockOps::Copy(const Act& src, Act* dst) {
  if (dst->numel() != src.numel() || dst->bytes() != src.bytes()) {
    return absl::InternalError(
        absl::StrCat("Copy: ", src.numel(), " elements into ", dst->numel()));
  }
  if (src.bytes() == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst->data(), src.data(), src.bytes(),
                      cudaMemcpyDeviceToDevice, stream_),
      "Copy: cudaMemcpyAsync");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::Prepare(int64_t seq) {
  for (const MoeLayerSpec& layer : arch_->layers) {
    if (layer.gemma) return PrepareGemma(seq);
    if (layer.has_attention) return attention_->Prepare(seq);
  }
  return absl::OkStatus();
}

// ---- Elementwise. The launchers round each operation on its own (no
// contraction), so fp32 results equal the CPU's loops bit for bit.

absl::Status CudaBlockOps::Add(Act* x, const Act& a, const Act* b) {
  const int64_t n = x->numel();
  const cudaError_t e = bf16() ? device_model::LaunchResidualAdd(
                                     P<uint16_t>(*x), P<uint16_t>(a),
                                     b == nullptr ? nullptr : P<uint16_t>(*b),
                                     P<uint16_t>(x), n, stream_)
                               : device_model::LaunchResidualAdd(
                                     P<float>(*x), P<float>(a),
                                     b == nullptr ? nullptr : P<float>(*b),
                                     P<float>(x), n, stream_);
  SHARDD_CUDA_RETURN_IF_ERROR(e, "Add");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::Sum(const Act& x, const Act& a, Act* out) {
  const int64_t n = out->numel();
  const cudaError_t e =
      bf16()
          ? device_model::LaunchResidualAdd(P<uint16_t>(x), P<uint16_t>(a),
                                            nullptr, P<uint16_t>(out), n,
                                            stream_)
          : device_model::LaunchResidualAdd(P<float>(x), P<float>(a), nullptr,
                                            P<float>(out), n, stream_);
  SHARDD_CUDA_RETURN_IF_ERROR(e, "Sum");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::Scale(Act* x, float s) {
  const cudaError_t e =
      bf16() ? device_model::LaunchScale(P<uint16_t>(x), s, x->numel(), stream_)
             : device_model::LaunchScale(P<float>(x), s, x->numel(), stream_);
  SHARDD_CUDA_RETURN_IF_ERROR(e, "Scale");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::AddScaled(Act* x, const Act& h, float s) {
  const cudaError_t e =
      bf16() ? device_model::LaunchAddScaled(P<uint16_t>(x), P<uint16_t>(h), s,
                                             x->numel(), stream_)
             : device_model::LaunchAddScaled(P<float>(x), P<float>(h), s,
                                             x->numel(), stream_);
  SHARDD_CUDA_RETURN_IF_ERROR(e, "AddScaled");
  return absl::OkStatus();
}

// ---- Parameters.

template <typename T>
absl::StatusOr<const T*> CudaBlockOps::Param(const ArchTensor& t,
                                             std::vector<DeviceBuffer>* temps) {
  if (params_ == nullptr) {
    return absl::FailedPreconditionError("CudaBlockOps: no parameters bound");
  }
  SHARDD_ASSIGN_OR_RETURN(const DeviceTensor p,
                          params_->Param(t.name, stream_));
  if (p.numel != t.numel() || (p.data == nullptr && t.numel() > 0)) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", t.name, "': the param source returned ",
                     p.numel, " elements", p.data == nullptr ? " at null" : "",
                     ", expected ", t.numel()));
  }
  if (p.dtype == DeviceDTypeOf<T>()) return static_cast<const T*>(p.data);
  // Stream-ordered: the temporary is freed after the kernels that read it.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer converted,
                          Alloc(t.numel() * static_cast<int64_t>(sizeof(T))));
  if constexpr (std::is_same<T, float>::value) {
    SHARDD_RETURN_IF_ERROR(
        kc::CastBf16ToFp32(static_cast<const uint16_t*>(p.data),
                           converted.as<float>(), t.numel(), stream_));
  } else {
    SHARDD_RETURN_IF_ERROR(kc::CastFp32ToBf16(static_cast<const float*>(p.data),
                                              converted.as<uint16_t>(),
                                              t.numel(), stream_));
  }
  const T* data = converted.as<T>();
  temps->push_back(std::move(converted));
  return data;
}

absl::StatusOr<float*> CudaBlockOps::Grad(const ArchTensor& t) {
  if (t.frozen) return nullptr;
  if (params_ == nullptr) {
    return absl::FailedPreconditionError("CudaBlockOps: no parameters bound");
  }
  SHARDD_ASSIGN_OR_RETURN(float* grad, params_->Grad(t.name, stream_));
  if (grad == nullptr && t.numel() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", t.name, "': the param source returned no gradient"));
  }
  return grad;
}

// ---- Blocks.

absl::Status CudaBlockOps::EmbedForward(const Act& ids, int64_t t, Act* x) {
  std::vector<DeviceBuffer> temps;
  int32_t* bad_ids = &step_loss_.as<DeviceStepLoss>()->bad_ids;
  if (bf16()) {
    SHARDD_ASSIGN_OR_RETURN(const uint16_t* table,
                            Param<uint16_t>(arch_->embed, &temps));
    return kc::EmbeddingForward(table, arch_->vocab, arch_->dim,
                                P<int32_t>(ids), t, P<uint16_t>(x), bad_ids,
                                stream_);
  }
  SHARDD_ASSIGN_OR_RETURN(const float* table,
                          Param<float>(arch_->embed, &temps));
  return kc::EmbeddingForward(table, arch_->vocab, arch_->dim, P<int32_t>(ids),
                              t, P<float>(x), bad_ids, stream_);
}

absl::Status CudaBlockOps::EmbedBackward(Act* dx, const Act& ids, int64_t t,
                                         float scale) {
  SHARDD_ASSIGN_OR_RETURN(float* dtable, Grad(arch_->embed));
  if (dtable == nullptr) return absl::OkStatus();
  if (scale != 1.0f) SHARDD_RETURN_IF_ERROR(Scale(dx, scale));
  const size_t ws_bytes = kc::EmbeddingBackwardWorkspaceBytes(arch_->vocab, t);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  int32_t* bad_ids = &step_loss_.as<DeviceStepLoss>()->bad_ids;
  // The workspace is freed stream-ordered, after the kernel.
  if (bf16()) {
    return kc::EmbeddingBackward(P<uint16_t>(*dx), P<int32_t>(ids), t,
                                 arch_->vocab, arch_->dim, dtable, ws.data(),
                                 ws_bytes, bad_ids, stream_, arch_->pad_id);
  }
  return kc::EmbeddingBackward(P<float>(*dx), P<int32_t>(ids), t, arch_->vocab,
                               arch_->dim, dtable, ws.data(), ws_bytes, bad_ids,
                               stream_, arch_->pad_id);
}

absl::Status CudaBlockOps::NormForward(const ArchTensor& w, const Act& x,
                                       int64_t rows, Act* y, Act* inv) {
  std::vector<DeviceBuffer> temps;
  if (bf16()) {
    SHARDD_ASSIGN_OR_RETURN(const uint16_t* weight, Param<uint16_t>(w, &temps));
    return kc::RmsNormForward(P<uint16_t>(x), weight, rows, arch_->dim,
                              arch_->eps, P<uint16_t>(y), P<float>(inv),
                              stream_);
  }
  SHARDD_ASSIGN_OR_RETURN(const float* weight, Param<float>(w, &temps));
  return kc::RmsNormForward(P<float>(x), weight, rows, arch_->dim, arch_->eps,
                            P<float>(y), P<float>(inv), stream_);
}

absl::Status CudaBlockOps::NormBackward(const ArchTensor& w, const Act& dy,
                                        const Act& x, const Act& inv,
                                        int64_t rows, Act* dx,
                                        bool accumulate) {
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(float* dw, Grad(w));
  const size_t ws_bytes =
      dw == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(rows, arch_->dim);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  if (bf16()) {
    SHARDD_ASSIGN_OR_RETURN(const uint16_t* weight, Param<uint16_t>(w, &temps));
    return kc::RmsNormBackward(P<uint16_t>(dy), P<uint16_t>(x), weight,
                               P<float>(inv), rows, arch_->dim, P<uint16_t>(dx),
                               accumulate, dw, ws.data(), ws_bytes, stream_);
  }
  SHARDD_ASSIGN_OR_RETURN(const float* weight, Param<float>(w, &temps));
  return kc::RmsNormBackward(P<float>(dy), P<float>(x), weight, P<float>(inv),
                             rows, arch_->dim, P<float>(dx), accumulate, dw,
                             ws.data(), ws_bytes, stream_);
}

absl::Status CudaBlockOps::SetRowSegments(const int32_t* segment_starts) {
  segments_ = segment_starts;
  return absl::OkStatus();
}

absl::Status CudaBlockOps::Geometry(int64_t batch, int64_t seq,
                                    const int32_t** positions) {
  const int64_t t = batch * seq;
  const bool packed = segments_ != nullptr;
  const bool same =
      !positions_.empty() && uploaded_batch_ == batch && uploaded_seq_ == seq &&
      uploaded_packed_ == packed &&
      (!packed || std::memcmp(uploaded_segments_.data(), segments_,
                              t * sizeof(int32_t)) == 0);
  if (!same) {
    // Each token's place in its example (RoPE restarts per example).
    std::vector<int32_t> host;
    FillPositions(segments_, t, seq, 0, &host);
    SHARDD_ASSIGN_OR_RETURN(positions_, UploadBuffer(host.data(), t));
    if (packed) {
      uploaded_segments_.assign(segments_, segments_ + t);
      SHARDD_ASSIGN_OR_RETURN(key_begin_, UploadBuffer(segments_, t));
    } else {
      uploaded_segments_.clear();
      key_begin_.Reset();
    }
    uploaded_batch_ = batch;
    uploaded_seq_ = seq;
    uploaded_packed_ = packed;
  }
  const int32_t* key_begin = packed ? key_begin_.as<int32_t>() : nullptr;
  attention_->SetSegments(key_begin);
  if (mla_ != nullptr) mla_->SetSegments(key_begin);
  *positions = positions_.as<int32_t>();
  return absl::OkStatus();
}

namespace {

// One parameter of a block's bundle: whether the layer has it, and where
// its storage-type pointer and fp32 gradient go.
struct ParamEntry {
  bool present;
  const ArchTensor& tensor;
  const void** param;
  float** grad;
};

// Fills the bundle's pointers: each present parameter in storage type T
// and, for the backward (`grads`), its fp32 gradient.
template <typename T, typename ParamFn, typename GradFn, size_t N>
absl::Status FillParams(const ParamEntry (&entries)[N], bool grads,
                        ParamFn param, GradFn grad) {
  for (const ParamEntry& e : entries) {
    if (!e.present) continue;
    SHARDD_ASSIGN_OR_RETURN(const T* p, param(e.tensor, T{}));
    *e.param = p;
    if (grads) {
      SHARDD_ASSIGN_OR_RETURN(*e.grad, grad(e.tensor));
    }
  }
  return absl::OkStatus();
}

// The attention sublayer's parameters in storage type T and, for the
// backward, their fp32 gradients.
template <typename T, typename ParamFn, typename GradFn>
absl::StatusOr<DeviceAttentionParams> AttentionParamsOf(
    const MoeLayerSpec& spec, bool grads, ParamFn param, GradFn grad) {
  DeviceAttentionParams ap;
  const ParamEntry entries[] = {
      {true, spec.q_proj, &ap.wq, &ap.dwq},
      {true, spec.k_proj, &ap.wk, &ap.dwk},
      {true, spec.v_proj, &ap.wv, &ap.dwv},
      {true, spec.o_proj, &ap.wo, &ap.dwo},
      {spec.qk_norm, spec.q_norm, &ap.q_norm, &ap.dq_norm},
      {spec.qk_norm, spec.k_norm, &ap.k_norm, &ap.dk_norm},
      {spec.attention_bias, spec.q_bias, &ap.bq, &ap.dbq},
      {spec.attention_bias, spec.k_bias, &ap.bk, &ap.dbk},
      {spec.attention_bias, spec.v_bias, &ap.bv, &ap.dbv},
      {spec.attention_bias, spec.o_bias, &ap.bo, &ap.dbo},
  };
  SHARDD_RETURN_IF_ERROR(FillParams<T>(entries, grads, param, grad));
  if (spec.has_sinks) {
    // The attention kernel reads the sinks in fp32 whatever the storage.
    SHARDD_ASSIGN_OR_RETURN(ap.sinks, param(spec.sinks, float{}));
    if (grads) {
      SHARDD_ASSIGN_OR_RETURN(ap.dsinks, grad(spec.sinks));
    }
  }
  return ap;
}

// The latent attention's, as AttentionParamsOf.
template <typename T, typename ParamFn, typename GradFn>
absl::StatusOr<DeviceMlaParams> MlaParamsOf(const MoeArchitecture& a,
                                            const MoeLayerSpec& spec,
                                            bool grads, ParamFn param,
                                            GradFn grad) {
  DeviceMlaParams mp;
  const bool lora = a.q_lora_rank > 0;
  const ParamEntry entries[] = {
      {!lora, spec.q_proj, &mp.wq, &mp.dwq},
      {lora, spec.q_a_proj, &mp.wqa, &mp.dwqa},
      {lora, spec.q_a_norm, &mp.q_a_norm, &mp.dq_a_norm},
      {lora, spec.q_b_proj, &mp.wqb, &mp.dwqb},
      {true, spec.kv_a_proj, &mp.wkva, &mp.dwkva},
      {true, spec.kv_a_norm, &mp.kv_a_norm, &mp.dkv_a_norm},
      {true, spec.kv_b_proj, &mp.wkvb, &mp.dwkvb},
      {true, spec.o_proj, &mp.wo, &mp.dwo},
      {lora && spec.attention_bias, spec.q_a_bias, &mp.bqa, &mp.dbqa},
      {spec.attention_bias, spec.kv_a_bias, &mp.bkva, &mp.dbkva},
      {spec.attention_bias, spec.o_bias, &mp.bo, &mp.dbo},
  };
  SHARDD_RETURN_IF_ERROR(FillParams<T>(entries, grads, param, grad));
  return mp;
}

}  // namespace

template <typename T>
absl::Status CudaBlockOps::AttentionForwardT(const MoeLayerSpec& layer,
                                             const Act& n, int64_t batch,
                                             int64_t seq, Saved* state,
                                             Act* y) {
  std::vector<DeviceBuffer> temps;
  auto param = [&](const ArchTensor& t, auto tag) {
    return Param<decltype(tag)>(t, &temps);
  };
  auto grad = [&](const ArchTensor& t) { return Grad(t); };
  const int32_t* positions = nullptr;
  SHARDD_RETURN_IF_ERROR(Geometry(batch, seq, &positions));
  // The block keeps its own copy of the normed input (the step reuses n).
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer n_copy, Alloc(n.bytes()));
  if (n.bytes() > 0) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(n_copy.data(), n.data(), n.bytes(),
                        cudaMemcpyDeviceToDevice, stream_),
        "attention: copying its input");
  }
  AttentionState* s = state->Get<AttentionState>();
  s->attn.Reset();
  s->mla.Reset();
  if (layer.mla) {
    SHARDD_ASSIGN_OR_RETURN(
        const DeviceMlaParams mp,
        (MlaParamsOf<T>(*arch_, layer, /*grads=*/false, param, grad)));
    return mla_->Forward<T>(layer, mp, std::move(n_copy), batch, seq, positions,
                            attention_->RopeTable(), &s->mla, P<T>(y));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const DeviceAttentionParams ap,
      (AttentionParamsOf<T>(layer, /*grads=*/false, param, grad)));
  return attention_->Forward<T>(layer, ap, std::move(n_copy), batch, seq,
                                positions, &s->attn, P<T>(y));
}

template <typename T>
absl::Status CudaBlockOps::AttentionBackwardT(const MoeLayerSpec& layer,
                                              const Saved& state, int64_t batch,
                                              int64_t seq, const Act& dy,
                                              Act* dn) {
  const AttentionState* s = state.Peek<AttentionState>();
  if (s == nullptr) {
    return absl::FailedPreconditionError(
        "attention backward without its forward");
  }
  std::vector<DeviceBuffer> temps;
  auto param = [&](const ArchTensor& t, auto tag) {
    return Param<decltype(tag)>(t, &temps);
  };
  auto grad = [&](const ArchTensor& t) { return Grad(t); };
  const int32_t* positions = nullptr;
  SHARDD_RETURN_IF_ERROR(Geometry(batch, seq, &positions));
  if (layer.mla) {
    SHARDD_ASSIGN_OR_RETURN(
        const DeviceMlaParams mp,
        (MlaParamsOf<T>(*arch_, layer, /*grads=*/true, param, grad)));
    return mla_->Backward<T>(layer, mp, s->mla, batch, seq, positions,
                             attention_->RopeTable(), P<T>(dy), P<T>(dn));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const DeviceAttentionParams ap,
      (AttentionParamsOf<T>(layer, /*grads=*/true, param, grad)));
  return attention_->Backward<T>(layer, ap, s->attn, batch, seq, positions,
                                 P<T>(dy), P<T>(dn));
}

absl::Status CudaBlockOps::AttentionForward(const MoeLayerSpec& layer,
                                            const Act& n, int64_t batch,
                                            int64_t seq, Saved* state, Act* y) {
  return bf16() ? AttentionForwardT<uint16_t>(layer, n, batch, seq, state, y)
                : AttentionForwardT<float>(layer, n, batch, seq, state, y);
}

absl::Status CudaBlockOps::AttentionBackward(const MoeLayerSpec& layer,
                                             const Saved& state, int64_t batch,
                                             int64_t seq, const Act& dy,
                                             Act* dn) {
  return bf16() ? AttentionBackwardT<uint16_t>(layer, state, batch, seq, dy, dn)
                : AttentionBackwardT<float>(layer, state, batch, seq, dy, dn);
}

template <typename T>
absl::Status CudaBlockOps::MlpForwardRaw(const MlpTensors& mlp, const T* x,
                                         int64_t t, T* y, DeviceBuffer* saved) {
  std::vector<DeviceBuffer> temps;
  const kc::DenseMlpDims dims{t, arch_->dim, mlp.inter};
  const kc::DType dtype = kc::DTypeOf<T>::value;
  const size_t saved_bytes = kc::DenseMlpSavedBytes(dims, dtype);
  const size_t ws_bytes = kc::DenseMlpForwardWorkspaceBytes(dims, dtype);
  saved->Reset();
  SHARDD_ASSIGN_OR_RETURN(*saved, Alloc(saved_bytes));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  SHARDD_ASSIGN_OR_RETURN(const T* wg, Param<T>(*mlp.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wu, Param<T>(*mlp.up, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wd, Param<T>(*mlp.down, &temps));
  return kc::DenseMlpForward(dims, arch_->activation, x, wg, wu, wd, y,
                             /*accumulate_y=*/false, saved->data(), saved_bytes,
                             ws.data(), ws_bytes, cublas_, stream_);
}

template <typename T>
absl::Status CudaBlockOps::MlpBackwardRaw(const MlpTensors& mlp, const T* x,
                                          int64_t t, const T* dy,
                                          const DeviceBuffer& saved, T* dx,
                                          bool accumulate) {
  if (saved.empty()) {
    return absl::FailedPreconditionError("MLP backward without its forward");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(float* dwg, Grad(*mlp.gate));
  SHARDD_ASSIGN_OR_RETURN(float* dwu, Grad(*mlp.up));
  SHARDD_ASSIGN_OR_RETURN(float* dwd, Grad(*mlp.down));
  const kc::DenseMlpDims dims{t, arch_->dim, mlp.inter};
  const size_t ws_bytes =
      kc::DenseMlpBackwardWorkspaceBytes(dims, kc::DTypeOf<T>::value);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  SHARDD_ASSIGN_OR_RETURN(const T* wg, Param<T>(*mlp.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wu, Param<T>(*mlp.up, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wd, Param<T>(*mlp.down, &temps));
  return kc::DenseMlpBackward(dims, arch_->activation, x, wg, wu, wd, dy,
                              saved.data(), static_cast<size_t>(saved.bytes()),
                              dx, accumulate, dwg, dwu, dwd, ws.data(),
                              ws_bytes, cublas_, stream_);
}

absl::Status CudaBlockOps::MlpForward(const MlpTensors& mlp, const Act& x,
                                      int64_t t, Saved* state, Act* y) {
  MlpState* s = state->Get<MlpState>();
  return bf16() ? MlpForwardRaw<uint16_t>(mlp, P<uint16_t>(x), t,
                                          P<uint16_t>(y), &s->saved)
                : MlpForwardRaw<float>(mlp, P<float>(x), t, P<float>(y),
                                       &s->saved);
}

absl::Status CudaBlockOps::MlpBackward(const MlpTensors& mlp, const Act& x,
                                       int64_t t, const Act& dy, Saved* state,
                                       Act* dx, bool accumulate) {
  const MlpState* s = state->Peek<MlpState>();
  if (s == nullptr) {
    return absl::FailedPreconditionError("MLP backward without its forward");
  }
  return bf16()
             ? MlpBackwardRaw<uint16_t>(mlp, P<uint16_t>(x), t, P<uint16_t>(dy),
                                        s->saved, P<uint16_t>(dx), accumulate)
             : MlpBackwardRaw<float>(mlp, P<float>(x), t, P<float>(dy),
                                     s->saved, P<float>(dx), accumulate);
}

absl::Status CudaBlockOps::RouterForward(const MoeLayerSpec& layer,
                                         const Act& x, int64_t t, Act* indices,
                                         Act* weights, Saved* state) {
  std::vector<DeviceBuffer> temps;
  RouterState* s = state->Get<RouterState>();
  s->dims = RouterDimsOf(*arch_, layer, t);
  const size_t saved_bytes = kc::RouterSavedBytes(s->dims);
  s->saved.Reset();
  SHARDD_ASSIGN_OR_RETURN(s->saved, Alloc(saved_bytes));
  // DeepSeek-V3's frozen correction bias steers the choice only (fp32, as
  // the router kernel reads it).
  const float* selection = nullptr;
  if (layer.selection_bias) {
    SHARDD_ASSIGN_OR_RETURN(selection,
                            Param<float>(layer.gate_selection_bias, &temps));
  }
  if (bf16()) {
    SHARDD_ASSIGN_OR_RETURN(const uint16_t* gw,
                            Param<uint16_t>(layer.gate, &temps));
    const uint16_t* gb = nullptr;
    if (layer.router_bias) {
      SHARDD_ASSIGN_OR_RETURN(gb, Param<uint16_t>(layer.gate_bias, &temps));
    }
    return kc::RouterForward(s->dims, P<uint16_t>(x), gw, gb, selection,
                             P<int32_t>(indices), P<float>(weights),
                             s->saved.data(), saved_bytes, cublas_, stream_);
  }
  SHARDD_ASSIGN_OR_RETURN(const float* gw, Param<float>(layer.gate, &temps));
  const float* gb = nullptr;
  if (layer.router_bias) {
    SHARDD_ASSIGN_OR_RETURN(gb, Param<float>(layer.gate_bias, &temps));
  }
  return kc::RouterForward(s->dims, P<float>(x), gw, gb, selection,
                           P<int32_t>(indices), P<float>(weights),
                           s->saved.data(), saved_bytes, cublas_, stream_);
}

absl::Status CudaBlockOps::RouterBackward(const MoeLayerSpec& layer,
                                          const Act& x, int64_t t,
                                          const Act& d_weights,
                                          const Act* extra_d_logits,
                                          Saved* state, Act* dx) {
  const RouterState* s = state->Peek<RouterState>();
  if (s == nullptr || s->saved.empty() || s->dims.tokens != t) {
    return absl::FailedPreconditionError("router backward without its forward");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(float* dgw, Grad(layer.gate));
  float* dgb = nullptr;
  if (layer.router_bias) {
    SHARDD_ASSIGN_OR_RETURN(dgb, Grad(layer.gate_bias));
  }
  const kc::DType dtype = bf16() ? kc::DType::kBFloat16 : kc::DType::kFloat32;
  const size_t ws_bytes = kc::RouterBackwardWorkspaceBytes(s->dims, dtype);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  const float* extra =
      extra_d_logits == nullptr ? nullptr : P<float>(*extra_d_logits);
  const size_t saved_bytes = static_cast<size_t>(s->saved.bytes());
  if (bf16()) {
    SHARDD_ASSIGN_OR_RETURN(const uint16_t* gw,
                            Param<uint16_t>(layer.gate, &temps));
    return kc::RouterBackward(s->dims, P<uint16_t>(x), gw, P<float>(d_weights),
                              extra, s->saved.data(), saved_bytes,
                              P<uint16_t>(dx), /*accumulate_dx=*/true, dgw, dgb,
                              ws.data(), ws_bytes, cublas_, stream_);
  }
  SHARDD_ASSIGN_OR_RETURN(const float* gw, Param<float>(layer.gate, &temps));
  return kc::RouterBackward(s->dims, P<float>(x), gw, P<float>(d_weights),
                            extra, s->saved.data(), saved_bytes, P<float>(dx),
                            /*accumulate_dx=*/true, dgw, dgb, ws.data(),
                            ws_bytes, cublas_, stream_);
}

kc::GroupedExpertsOptions CudaBlockOps::ExpertOptions() const {
  return ExpertOptionsOf(*arch_, bf16());
}

absl::StatusOr<CudaBlockOps::ExpertSlot> CudaBlockOps::AcquireExpertSlot(
    const kc::ExpertDims& dims) {
  const kc::GroupedExpertsOptions options = ExpertOptionsOf(*arch_, bf16());
  SHARDD_ASSIGN_OR_RETURN(const size_t bytes, kc::GroupedExpertsWorkspaceBytes(
                                                  dims, options.storage));
  ExpertSlot slot;
  SHARDD_ASSIGN_OR_RETURN(slot.memory, Alloc(static_cast<int64_t>(bytes)));
  const std::pair<void*, size_t> key(slot.memory.data(), bytes);
  auto it = expert_workspaces_.find(key);
  if (it == expert_workspaces_.end()) {
    if (expert_workspaces_.size() >= kMaxCachedExpertWorkspaces) {
      // Drop the objects no pending backward holds.
      for (auto e = expert_workspaces_.begin();
           e != expert_workspaces_.end();) {
        e = e->second.use_count() > 1 ? std::next(e)
                                      : expert_workspaces_.erase(e);
      }
    }
    SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<kc::GroupedExpertsWorkspace> ws,
                            kc::GroupedExpertsWorkspace::Create(
                                slot.memory.data(), bytes, dims.experts));
    it = expert_workspaces_
             .emplace(key, std::shared_ptr<kc::GroupedExpertsWorkspace>(
                               std::move(ws)))
             .first;
  }
  slot.workspace = it->second;
  return slot;
}

template <typename T>
absl::Status CudaBlockOps::ExpertsForwardT(const MoeLayerSpec& layer,
                                           const Act& x, const Act& indices,
                                           const Act& weights, int64_t t, int k,
                                           Saved* state, Act* y) {
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* w_gu, Param<T>(layer.w_gu, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(layer.w_d, &temps));
  kc::GroupedExpertsOptions options = ExpertOptionsOf(*arch_, bf16());
  if (layer.expert_bias) {
    SHARDD_ASSIGN_OR_RETURN(options.gate_up_bias, Param<T>(layer.b_gu, &temps));
    SHARDD_ASSIGN_OR_RETURN(options.down_bias, Param<T>(layer.b_d, &temps));
  }
  ExpertsState* s = state->Get<ExpertsState>();
  s->memory.Reset();
  s->workspace.reset();
  s->dims = kc::ExpertDims{t, arch_->dim, layer.moe_inter, layer.experts, k};
  SHARDD_ASSIGN_OR_RETURN(ExpertSlot slot, AcquireExpertSlot(s->dims));
  s->memory = std::move(slot.memory);
  s->workspace = std::move(slot.workspace);
  const int64_t syncs_before = s->workspace->host_syncs();
  const absl::Status forward = kc::GroupedExpertsForward(
      s->dims, options, x.data(), P<int32_t>(indices), P<float>(weights),
      /*token_mask=*/nullptr, w_gu, w_d, y->data(), s->workspace.get(), cublas_,
      stream_);
  host_syncs_ += s->workspace->host_syncs() - syncs_before;
  return forward;
}

absl::Status CudaBlockOps::ExpertsForward(const MoeLayerSpec& layer,
                                          const Act& x, const Act& indices,
                                          const Act& weights, int64_t t, int k,
                                          Saved* state, Act* y) {
  return bf16() ? ExpertsForwardT<uint16_t>(layer, x, indices, weights, t, k,
                                            state, y)
                : ExpertsForwardT<float>(layer, x, indices, weights, t, k,
                                         state, y);
}

template <typename T>
absl::Status CudaBlockOps::ExpertsBackwardT(const MoeLayerSpec& layer,
                                            const Act& dy, int64_t t, int k,
                                            Saved* state, Act* dx,
                                            Act* d_weights) {
  ExpertsState* s = state->Peek<ExpertsState>();
  if (s == nullptr || s->workspace == nullptr || s->dims.tokens != t ||
      s->dims.top_k != k) {
    return absl::FailedPreconditionError(
        "grouped experts' backward without their forward");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* w_gu, Param<T>(layer.w_gu, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(layer.w_d, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dw_gu, Grad(layer.w_gu));
  SHARDD_ASSIGN_OR_RETURN(float* dw_d, Grad(layer.w_d));
  kc::GroupedExpertsOptions options = ExpertOptionsOf(*arch_, bf16());
  kc::ExpertBiasGrads bias_grads;
  if (layer.expert_bias) {
    SHARDD_ASSIGN_OR_RETURN(options.gate_up_bias, Param<T>(layer.b_gu, &temps));
    SHARDD_ASSIGN_OR_RETURN(options.down_bias, Param<T>(layer.b_d, &temps));
    SHARDD_ASSIGN_OR_RETURN(bias_grads.gate_up, Grad(layer.b_gu));
    SHARDD_ASSIGN_OR_RETURN(bias_grads.down, Grad(layer.b_d));
  }
  return kc::GroupedExpertsBackward(
      s->dims, options, w_gu, w_d, dy.data(), dx->data(),
      /*accumulate_dx=*/false, P<float>(d_weights), dw_gu, dw_d, bias_grads,
      s->workspace.get(), cublas_, stream_);
}

absl::Status CudaBlockOps::ExpertsBackward(const MoeLayerSpec& layer,
                                           const Act& dy, int64_t t, int k,
                                           Saved* state, Act* dx,
                                           Act* d_weights) {
  return bf16()
             ? ExpertsBackwardT<uint16_t>(layer, dy, t, k, state, dx, d_weights)
             : ExpertsBackwardT<float>(layer, dy, t, k, state, dx, d_weights);
}

template <typename T>
absl::Status CudaBlockOps::HeadLossT(const Act& h, const Act& targets,
                                     int64_t t, const LossTerm& term, Act* dh) {
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* head_w, Param<T>(arch_->head, &temps));
  const kc::CrossEntropyDims dims{t, arch_->dim, arch_->vocab};
  kc::CudaCrossEntropyOptions options;  // ignore_index -1
  options.softcap = arch_->final_logit_softcap;
  const size_t ws_bytes = kc::CrossEntropyWorkspaceBytes(
      dims, kc::DTypeOf<T>::value, options, /*with_grad=*/dh != nullptr);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer result,
                          Alloc(sizeof(kc::CrossEntropyDeviceResult)));
  auto* r = result.as<kc::CrossEntropyDeviceResult>();
  if (dh == nullptr) {
    SHARDD_RETURN_IF_ERROR(kc::LmHeadCrossEntropyForward(
        dims, P<T>(h), head_w, P<int32_t>(targets), r, ws.data(), ws_bytes,
        options, cublas_, stream_));
  } else {
    SHARDD_ASSIGN_OR_RETURN(float* dhead, Grad(arch_->head));
    SHARDD_RETURN_IF_ERROR(kc::LmHeadCrossEntropyBackward(
        dims, P<T>(h), head_w, P<int32_t>(targets), term.grad_scale, P<T>(dh),
        dhead, /*accumulate_dhidden=*/false, r, ws.data(), ws_bytes, options,
        cublas_, stream_));
  }
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
          term.weight, step_loss_.as<DeviceStepLoss>(), stream_),
      "head: accumulating the loss");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::HeadLoss(const Act& h, const Act& targets, int64_t t,
                                    const LossTerm& term, double extra_loss,
                                    Act* dh) {
  host_extra_loss_ += extra_loss;
  return bf16() ? HeadLossT<uint16_t>(h, targets, t, term, dh)
                : HeadLossT<float>(h, targets, t, term, dh);
}

// ---- The load-balancing loss (kernels/cuda/router_aux_loss.h).

absl::Status CudaBlockOps::AuxStart(Saved* aux) {
  const int64_t e = arch_->aux_experts;
  AuxState* s = aux->Get<AuxState>();
  if (s->counts.empty()) {
    SHARDD_ASSIGN_OR_RETURN(s->counts, Alloc((e + 2) * 8));
    SHARDD_ASSIGN_OR_RETURN(s->prob_sums, Alloc(e * 4));
    SHARDD_ASSIGN_OR_RETURN(s->sums, Alloc(e * 8));
    SHARDD_ASSIGN_OR_RETURN(s->value, Alloc(8));
  }
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(s->counts.data(), 0, s->counts.bytes(), stream_),
      "zeroing the load-balancing counts");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(s->sums.data(), 0, s->sums.bytes(), stream_),
      "zeroing the load-balancing sums");
  // This rank, for the caller's sum over ranks.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAddCount(s->counts.as<int64_t>() + e + 1, 1, stream_),
      "counting this rank");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::AuxAccumulate(const Saved& router,
                                         const Act& indices, int64_t rows,
                                         Saved* aux) {
  const RouterState* r = router.Peek<RouterState>();
  AuxState* s = aux->Peek<AuxState>();
  const float* probs =
      r == nullptr ? nullptr : kc::RouterSoftmax(r->dims, r->saved.data());
  if (probs == nullptr || s == nullptr || s->counts.empty()) {
    return absl::FailedPreconditionError(
        "load-balancing statistics without a router forward that kept its "
        "softmax");
  }
  const int64_t e = arch_->aux_experts;
  // HF's top-k of softmax(logits) is the router's choice for both softmax
  // scorings (the softmax keeps the logits' order), as on the CPU; the
  // router's indices are in range by construction.
  SHARDD_RETURN_IF_ERROR(kc::RouterAuxLossAccumulate(
      probs, P<int32_t>(indices), rows, e, arch_->top_k,
      s->counts.as<int64_t>(), s->sums.as<double>(),
      /*invalid_indices=*/nullptr, stream_));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchAddCount(s->counts.as<int64_t>() + e, rows, stream_),
      "counting the load-balancing rows");
  return absl::OkStatus();
}

absl::Status CudaBlockOps::AuxFinishForward(Saved* aux) {
  AuxState* s = aux->Peek<AuxState>();
  if (s == nullptr || s->counts.empty()) {
    return absl::FailedPreconditionError("load-balancing statistics missing");
  }
  // fp32 for the all-reduce, as the CPU's prob_sums; the counts stay exact.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchDoubleToFloat(s->sums.as<double>(),
                                        s->prob_sums.as<float>(),
                                        arch_->aux_experts, stream_),
      "rounding the load-balancing sums");
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBlockOps::AuxLoss(Saved* aux, double coef,
                                             double denominator) {
  AuxState* s = aux->Peek<AuxState>();
  if (s == nullptr || s->counts.empty()) {
    return absl::FailedPreconditionError("load-balancing statistics missing");
  }
  const int64_t e = arch_->aux_experts;
  // The (possibly all-reduced) fp32 sums widened, as the CPU's double copy.
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchFloatToDouble(s->prob_sums.as<float>(),
                                        s->sums.as<double>(), e, stream_),
      "widening the load-balancing sums");
  const int64_t* counts = s->counts.as<int64_t>();
  SHARDD_RETURN_IF_ERROR(
      kc::RouterAuxLossValue(counts, s->sums.as<double>(), counts + e, e,
                             s->value.as<double>(), stream_));
  SHARDD_CUDA_RETURN_IF_ERROR(device_model::LaunchAccumulateAuxLoss(
                                  s->value.as<double>(), coef,
                                  step_loss_.as<DeviceStepLoss>(), stream_),
                              "accumulating the load-balancing loss");
  // The ranks (counts[E + 1]) join on the device in AuxLogitGrad.
  s->grad_scale = coef / denominator;
  return 0.0;
}

absl::Status CudaBlockOps::AuxLogitGrad(const Saved& router, int64_t rows,
                                        const Saved& aux, Act* d_logits) {
  const RouterState* r = router.Peek<RouterState>();
  const AuxState* s = aux.Peek<AuxState>();
  const float* probs =
      r == nullptr ? nullptr : kc::RouterSoftmax(r->dims, r->saved.data());
  if (probs == nullptr || s == nullptr || s->counts.empty()) {
    return absl::FailedPreconditionError(
        "load-balancing gradient without its forward");
  }
  const int64_t e = arch_->aux_experts;
  const int64_t* counts = s->counts.as<int64_t>();
  SHARDD_RETURN_IF_ERROR(
      kc::RouterAuxLossBackward(probs, rows, e, counts, counts + e,
                                s->grad_scale, P<float>(d_logits), stream_));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchScaleByCount(P<float>(d_logits), rows * e,
                                       counts + e + 1, stream_),
      "scaling the load-balancing gradient by the ranks");
  return absl::OkStatus();
}

DeviceAuxStats CudaBlockOps::AuxStatsOf(Saved* aux) const {
  DeviceAuxStats out;
  AuxState* s = aux == nullptr ? nullptr : aux->Peek<AuxState>();
  if (s == nullptr || s->counts.empty()) return out;
  out.counts = s->counts.as<int64_t>();
  out.num_counts = arch_->aux_experts + 2;
  out.prob_sums = s->prob_sums.as<float>();
  out.num_prob_sums = arch_->aux_experts;
  return out;
}

// ---- The step's loss.

void CudaBlockOps::ResetLoss() {
  loss_sum_ = 0.0;
  tokens_ = 0;
  host_extra_loss_ = 0.0;
  const cudaError_t e =
      cudaMemsetAsync(step_loss_.data(), 0, sizeof(DeviceStepLoss), stream_);
  if (e != cudaSuccess && reset_error_.ok()) {
    reset_error_ = CudaStatus(e, "zeroing the step loss");
  }
}

double CudaBlockOps::loss(int terms) const {
  return terms == 0 ? 0.0 : loss_sum_ / terms;
}

absl::StatusOr<CudaBlockOps::StepLoss> CudaBlockOps::ReadStepLoss(int terms) {
  if (!reset_error_.ok()) {
    const absl::Status error = reset_error_;
    reset_error_ = absl::OkStatus();
    return error;
  }
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned_loss_, step_loss_.data(), sizeof(DeviceStepLoss),
                      cudaMemcpyDeviceToHost, stream_),
      "ReadStepLoss: copying the loss");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_),
                              "ReadStepLoss: waiting for the compute stream");
  const DeviceStepLoss loss = *static_cast<DeviceStepLoss*>(pinned_loss_);
  if (loss.bad_ids > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss.bad_ids, " token ids outside [0, ", arch_->vocab,
                     ") reached the embedding on the device"));
  }
  if (loss.invalid_targets > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        loss.invalid_targets, " targets outside [0, ", arch_->vocab,
        ") (and not -1) reached the cross-entropy on the device"));
  }
  loss_sum_ = loss.loss_sum + host_extra_loss_;
  tokens_ = loss.tokens;
  StepLoss out;
  out.loss = this->loss(terms);
  out.tokens = tokens_;
  return out;
}

// cuda_block_ops_gemma.cc's uses.
template absl::StatusOr<const float*> CudaBlockOps::Param<float>(
    const ArchTensor&, std::vector<DeviceBuffer>*);
template absl::StatusOr<const uint16_t*> CudaBlockOps::Param<uint16_t>(
    const ArchTensor&, std::vector<DeviceBuffer>*);
template absl::Status CudaBlockOps::MlpForwardRaw<float>(const MlpTensors&,
                                                         const float*, int64_t,
                                                         float*, DeviceBuffer*);
template absl::Status CudaBlockOps::MlpForwardRaw<uint16_t>(const MlpTensors&,
                                                            const uint16_t*,
                                                            int64_t, uint16_t*,
                                                            DeviceBuffer*);
template absl::Status CudaBlockOps::MlpBackwardRaw<float>(const MlpTensors&,
                                                          const float*, int64_t,
                                                          const float*,
                                                          const DeviceBuffer&,
                                                          float*, bool);
template absl::Status CudaBlockOps::MlpBackwardRaw<uint16_t>(
    const MlpTensors&, const uint16_t*, int64_t, const uint16_t*,
    const DeviceBuffer&, uint16_t*, bool);

}  // namespace step
}  // namespace shardd
