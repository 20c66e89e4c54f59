#include "worker/model/device_moe_model.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <map>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dense_mlp.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/grouped_experts.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/router.h"
#include "model/model_util.h"
#include "worker/model/command_order.h"
#include "worker/model/device_attention_block.h"
#include "worker/model/device_moe_model_kernels.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace {

namespace kc = ::shardd::kernels::cuda;
using device_model::DeviceStepLoss;
using v1::Command;

// cuBLAS gets its workspace from the allocator once, so it never allocates
// on its own inside the step (32 MiB: NVIDIA's recommendation for Hopper).
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
// Router kernel limits (kernels/cuda/router.h).
constexpr int64_t kMaxRouterExperts = 1024;
constexpr int64_t kMaxRouterTopK = 32;
// Grouped-experts workspace objects cached by device address; beyond this
// many, the ones not in use are dropped (each holds a pinned host buffer).
constexpr size_t kMaxCachedExpertWorkspaces = 256;

using TensorInfo = ArchTensor;
using LayerInfo = MoeLayerSpec;

// A grouped-experts call whose backward is pending: its device workspace
// and the workspace object bound to that memory.
struct ExpertSlot {
  DeviceBuffer memory;
  kc::GroupedExpertsWorkspace* workspace = nullptr;
};

// What one layer of one (micro-batch, pass) keeps for its backward (the
// CPU's LayerActs). Buffers are empty when not held.
struct LayerState {
  DeviceBuffer x_in;          // [T, D] residual input
  DeviceBuffer inv_rms;       // [T] fp32
  DeviceBuffer normed;        // [T, D]
  DeviceBuffer indices;       // [T, K] int32
  DeviceBuffer weights;       // [T, K] fp32
  DeviceBuffer router_saved;  // RouterSavedBytes
  DeviceBuffer dense_out;     // [T, D], LAYER forward -> EXPERTS forward
  DeviceBuffer mlp_saved;     // DenseMlpSavedBytes
  ExpertSlot experts;
  // Attention layers: x_in and inv_rms above are the MoE / MLP branch's
  // (x_mid, the post_attention_layernorm's); these are the layer input's.
  DeviceAttentionActs attn;
  DeviceBuffer attn_x_in;  // [T, D]
  DeviceBuffer attn_inv;   // [T] fp32
};

// One (micro-batch, pass): the CPU's PassActs, kept per micro-batch too so
// programs may interleave micro-batches.
struct PassState {
  std::vector<LayerState> layers;
  DeviceBuffer x;          // [T, D] current residual stream
  DeviceBuffer final_x;    // [T, D] input of the final norm
  DeviceBuffer final_inv;  // [T] fp32
  DeviceBuffer h;          // [T, D] normed final hidden
  DeviceBuffer dx;         // [T, D] gradient of the residual stream
  DeviceBuffer dn;         // [T, D] gradient of a layer's normed input
  DeviceBuffer dweights;   // [T, K] fp32
  // Saved state for a backward is kept (the pass has gradients).
  bool saves = false;
  // Who still reads h: the next pass's EMBED, this pass's BACKWARD HEAD.
  bool h_for_next = false;
  bool h_for_backward = false;
};

struct BatchState {
  DeviceBuffer inputs;        // [T] int32
  DeviceBuffer targets;       // [T] int32
  DeviceBuffer positions;     // [T] int32: each token's place in its sequence
  int32_t* pinned = nullptr;  // [3 * pinned_tokens]: inputs, targets, positions
  int64_t pinned_tokens = 0;
  cudaEvent_t staged = nullptr;  // The last copy out of `pinned`.
  bool staged_recorded = false;
  int64_t tokens = 0;
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t counted = 0;  // Non-ignored targets.
};

template <typename T>
constexpr DeviceDType DeviceDTypeOf() {
  return std::is_same<T, float>::value ? DeviceDType::kFloat32
                                       : DeviceDType::kBFloat16;
}

}  // namespace

// The architecture's fields (vocab, dim, layers, ...) are the model's.
struct DeviceMoeModel::Impl : MoeArchitecture {
  DeviceMoeModelOptions options;
  DeviceAllocator* allocator = nullptr;
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer cublas_workspace;
  DeviceBuffer step_loss;                 // DeviceStepLoss
  DeviceStepLoss* pinned_loss = nullptr;  // cudaMallocHost
  bool step_loss_zeroed = false;

  std::vector<BatchState> batches;
  std::vector<PassState> states;  // [microbatch * passes + pass]
  std::unique_ptr<DeviceAttentionBlock> attention;
  bool has_attention = false;
  // Per (pass, micro-batch), as the states.
  std::unique_ptr<ModelCommandOrder> order;
  int loss_terms = 0;
  int64_t host_syncs = 0;

  // GroupedExpertsWorkspace objects by (device address, bytes): the caching
  // allocator hands the same blocks back step after step, so the objects
  // (pinned buffer, event) are created in the first step only.
  std::map<std::pair<void*, size_t>,
           std::unique_ptr<kc::GroupedExpertsWorkspace>>
      expert_workspaces;

  ~Impl();

  int grad_passes() const {
    return options.model.passes - options.model.no_grad_passes;
  }
  PassState& State(int pass, int mb) {
    return states[static_cast<size_t>(mb) * options.model.passes + pass];
  }
  kc::GroupedExpertsOptions ExpertOptions() const {
    kc::GroupedExpertsOptions o;
    o.activation = activation == kernels::GatedActivation::kGeGLU
                       ? kc::GatedActivation::kGeGLU
                       : kc::GatedActivation::kSwiGLU;
    o.storage = options.activations == DeviceDType::kFloat32
                    ? kc::ExpertStorage::kFloat32
                    : kc::ExpertStorage::kBFloat16;
    o.gemm_path = kc::ExpertGemmPath::kGrouped;
    return o;
  }

  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes) {
    return DeviceBuffer::Allocate(allocator, bytes, MemoryKind::kWorkspace,
                                  stream);
  }
  // Allocates `*buffer` (freeing what it held) with `bytes`.
  absl::Status AllocInto(DeviceBuffer* buffer, int64_t bytes) {
    buffer->Reset();
    SHARDD_ASSIGN_OR_RETURN(*buffer, Alloc(bytes));
    return absl::OkStatus();
  }

  // The parameter in storage type T. A parameter held in the other dtype is
  // cast into a buffer appended to `temps` (freed when the command ends;
  // stream-ordered, so reuse is safe).
  template <typename T>
  absl::StatusOr<const T*> Param(DeviceParamSource* params, const TensorInfo& t,
                                 std::vector<DeviceBuffer>* temps);
  // The fp32 gradient to add to, or nullptr for a frozen parameter.
  absl::StatusOr<float*> Grad(DeviceParamSource* params, const TensorInfo& t);

  // The attention sublayer's parameters in storage type T and, for the
  // backward (`grads`), their fp32 gradients (null when frozen; the
  // gradient buffers exist only between ALLOC_GRAD and REDUCE_SCATTER).
  template <typename T>
  absl::StatusOr<DeviceAttentionParams> AttentionParams(
      const LayerInfo& spec, DeviceParamSource* params,
      std::vector<DeviceBuffer>* temps, bool grads) {
    DeviceAttentionParams ap;
    SHARDD_ASSIGN_OR_RETURN(ap.wq, Param<T>(params, spec.q_proj, temps));
    SHARDD_ASSIGN_OR_RETURN(ap.wk, Param<T>(params, spec.k_proj, temps));
    SHARDD_ASSIGN_OR_RETURN(ap.wv, Param<T>(params, spec.v_proj, temps));
    SHARDD_ASSIGN_OR_RETURN(ap.wo, Param<T>(params, spec.o_proj, temps));
    if (spec.qk_norm) {
      SHARDD_ASSIGN_OR_RETURN(ap.q_norm, Param<T>(params, spec.q_norm, temps));
      SHARDD_ASSIGN_OR_RETURN(ap.k_norm, Param<T>(params, spec.k_norm, temps));
    }
    if (!grads) return ap;
    SHARDD_ASSIGN_OR_RETURN(ap.dwq, Grad(params, spec.q_proj));
    SHARDD_ASSIGN_OR_RETURN(ap.dwk, Grad(params, spec.k_proj));
    SHARDD_ASSIGN_OR_RETURN(ap.dwv, Grad(params, spec.v_proj));
    SHARDD_ASSIGN_OR_RETURN(ap.dwo, Grad(params, spec.o_proj));
    if (spec.qk_norm) {
      SHARDD_ASSIGN_OR_RETURN(ap.dq_norm, Grad(params, spec.q_norm));
      SHARDD_ASSIGN_OR_RETURN(ap.dk_norm, Grad(params, spec.k_norm));
    }
    return ap;
  }

  // *dx += RMSNorm'(dy) for the norm `weight` of input x (saved inv_rms);
  // the weight's gradient is added.
  template <typename T>
  absl::Status NormBackward(const TensorInfo& weight, DeviceParamSource* params,
                            const DeviceBuffer& dy, const DeviceBuffer& x,
                            const DeviceBuffer& inv_rms, int64_t t,
                            DeviceBuffer* dx,
                            std::vector<DeviceBuffer>* temps) {
    SHARDD_ASSIGN_OR_RETURN(const T* w, Param<T>(params, weight, temps));
    SHARDD_ASSIGN_OR_RETURN(float* dw, Grad(params, weight));
    const size_t ws_bytes =
        dw == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(t, dim);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
        dy.as<T>(), x.as<T>(), w, inv_rms.as<float>(), t, dim, dx->as<T>(),
        /*accumulate_dx=*/true, dw, ws.data(), ws_bytes, stream));
    temps->push_back(std::move(ws));
    return absl::OkStatus();
  }

  absl::Status ZeroStepLossOnce();
  absl::StatusOr<ExpertSlot> AcquireExpertSlot(const kc::ExpertDims& dims);
  void ReleaseExpertSlot(ExpertSlot* slot);
  void ReleaseLayer(LayerState* layer);
  void ReleasePass(PassState* pass);
  // Frees h once neither the next pass nor this pass's backward reads it.
  void MaybeReleaseH(PassState* pass) {
    if (!pass->h_for_next && !pass->h_for_backward) pass->h.Reset();
  }

  template <typename T>
  absl::Status Forward(const Command& c, DeviceParamSource* params);
  template <typename T>
  absl::Status Backward(const Command& c, DeviceParamSource* params);
};

DeviceMoeModel::Impl::~Impl() {
  if (stream != nullptr || own_stream) {
    // Pending work may still read the buffers and pinned memory below.
    const cudaError_t error = cudaStreamSynchronize(stream);
    if (error != cudaSuccess) {
      SHARDD_LOG(ERROR) << "DeviceMoeModel: cudaStreamSynchronize at "
                           "destruction: "
                        << cudaGetErrorString(error);
    }
  }
  for (PassState& s : states) ReleasePass(&s);
  for (BatchState& b : batches) {
    b.inputs.Reset();
    b.targets.Reset();
    if (b.pinned != nullptr) cudaFreeHost(b.pinned);
    if (b.staged != nullptr) cudaEventDestroy(b.staged);
  }
  expert_workspaces.clear();
  if (cublas != nullptr) cublasDestroy(cublas);
  cublas_workspace.Reset();
  step_loss.Reset();
  if (pinned_loss != nullptr) cudaFreeHost(pinned_loss);
  if (own_stream && stream != nullptr) cudaStreamDestroy(stream);
}

template <typename T>
absl::StatusOr<const T*> DeviceMoeModel::Impl::Param(
    DeviceParamSource* params, const TensorInfo& t,
    std::vector<DeviceBuffer>* temps) {
  SHARDD_ASSIGN_OR_RETURN(const DeviceTensor p, params->Param(t.name, stream));
  if (p.numel != t.numel() || (p.data == nullptr && t.numel() > 0)) {
    return absl::FailedPreconditionError(
        absl::StrCat("parameter '", t.name, "': the param source returned ",
                     p.numel, " elements", p.data == nullptr ? " at null" : "",
                     ", expected ", t.numel()));
  }
  if (p.dtype == DeviceDTypeOf<T>()) return static_cast<const T*>(p.data);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer converted,
                          Alloc(t.numel() * static_cast<int64_t>(sizeof(T))));
  if constexpr (std::is_same<T, float>::value) {
    SHARDD_RETURN_IF_ERROR(
        kc::CastBf16ToFp32(static_cast<const uint16_t*>(p.data),
                           converted.as<float>(), t.numel(), stream));
  } else {
    SHARDD_RETURN_IF_ERROR(kc::CastFp32ToBf16(static_cast<const float*>(p.data),
                                              converted.as<uint16_t>(),
                                              t.numel(), stream));
  }
  const T* data = converted.as<T>();
  temps->push_back(std::move(converted));
  return data;
}

absl::StatusOr<float*> DeviceMoeModel::Impl::Grad(DeviceParamSource* params,
                                                  const TensorInfo& t) {
  if (t.frozen) return nullptr;
  SHARDD_ASSIGN_OR_RETURN(float* grad, params->Grad(t.name, stream));
  if (grad == nullptr && t.numel() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", t.name, "': the param source returned no gradient"));
  }
  return grad;
}

absl::Status DeviceMoeModel::Impl::ZeroStepLossOnce() {
  if (step_loss_zeroed) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(step_loss.data(), 0, sizeof(DeviceStepLoss), stream),
      "DeviceMoeModel: zeroing the step loss");
  step_loss_zeroed = true;
  return absl::OkStatus();
}

absl::StatusOr<ExpertSlot> DeviceMoeModel::Impl::AcquireExpertSlot(
    const kc::ExpertDims& dims) {
  SHARDD_ASSIGN_OR_RETURN(
      const size_t bytes,
      kc::GroupedExpertsWorkspaceBytes(dims, ExpertOptions().storage));
  ExpertSlot slot;
  SHARDD_ASSIGN_OR_RETURN(slot.memory, Alloc(static_cast<int64_t>(bytes)));
  const std::pair<void*, size_t> key(slot.memory.data(), bytes);
  auto it = expert_workspaces.find(key);
  if (it == expert_workspaces.end()) {
    if (expert_workspaces.size() >= kMaxCachedExpertWorkspaces) {
      // Drop the objects whose memory is not held by a pending backward.
      std::set<void*> in_use;
      for (const PassState& s : states) {
        for (const LayerState& l : s.layers) {
          if (!l.experts.memory.empty()) in_use.insert(l.experts.memory.data());
        }
      }
      for (auto e = expert_workspaces.begin(); e != expert_workspaces.end();) {
        e = in_use.count(e->first.first) > 0 ? std::next(e)
                                             : expert_workspaces.erase(e);
      }
    }
    SHARDD_ASSIGN_OR_RETURN(std::unique_ptr<kc::GroupedExpertsWorkspace> ws,
                            kc::GroupedExpertsWorkspace::Create(
                                slot.memory.data(), bytes, dims.experts));
    it = expert_workspaces.emplace(key, std::move(ws)).first;
  }
  slot.workspace = it->second.get();
  return slot;
}

void DeviceMoeModel::Impl::ReleaseExpertSlot(ExpertSlot* slot) {
  slot->memory.Reset();
  slot->workspace = nullptr;
}

void DeviceMoeModel::Impl::ReleaseLayer(LayerState* l) {
  l->x_in.Reset();
  l->inv_rms.Reset();
  l->normed.Reset();
  l->indices.Reset();
  l->weights.Reset();
  l->router_saved.Reset();
  l->dense_out.Reset();
  l->mlp_saved.Reset();
  l->attn.Reset();
  l->attn_x_in.Reset();
  l->attn_inv.Reset();
  ReleaseExpertSlot(&l->experts);
}

void DeviceMoeModel::Impl::ReleasePass(PassState* s) {
  for (LayerState& l : s->layers) ReleaseLayer(&l);
  s->x.Reset();
  s->final_x.Reset();
  s->final_inv.Reset();
  s->h.Reset();
  s->dx.Reset();
  s->dn.Reset();
  s->dweights.Reset();
  s->h_for_next = s->h_for_backward = false;
}

DeviceMoeModel::DeviceMoeModel(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
DeviceMoeModel::~DeviceMoeModel() = default;

absl::StatusOr<std::unique_ptr<DeviceMoeModel>> DeviceMoeModel::Create(
    const v1::ModelSpec& model, const DeviceMoeModelOptions& options,
    DeviceAllocator* allocator) {
  // The CPU model's checks (spec, step shape, architecture) with its
  // messages; nothing here touches the device yet.
  SHARDD_RETURN_IF_ERROR(ValidateModelSpec(model));
  const MoeModelOptions& shape = options.model;
  SHARDD_RETURN_IF_ERROR(CheckModelStepShape(shape.passes, shape.no_grad_passes,
                                             shape.microbatches));
  SHARDD_ASSIGN_OR_RETURN(MoeArchitecture arch, ReadMoeArchitecture(model));

  if (allocator == nullptr) {
    return absl::InvalidArgumentError("allocator: must not be null");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->allocator = allocator;

  // GPT-OSS's parts are computed on the CPU only so far; refused by name
  // rather than computed without them.
  if (arch.activation == kernels::GatedActivation::kClampedSwiGLU) {
    return absl::InvalidArgumentError(
        "dims.activation: the GPU model does not compute the clamped "
        "swiglu_oai activation (GPT-OSS) yet; train it on CPU workers");
  }
  // DeepSeek-V3's parts likewise.
  if (arch.mla) {
    return absl::InvalidArgumentError(
        "dims.attention.mla: the GPU model does not compute multi-head latent "
        "attention (DeepSeek-V3) yet; train it on CPU workers");
  }
  if (arch.router_scoring == kernels::RouterScoring::kSigmoidGroupLimited) {
    return absl::InvalidArgumentError(
        "dims.router_scoring: the GPU router does not compute the sigmoid "
        "group-limited router with its e_score_correction_bias (DeepSeek-V3) "
        "yet; train it on CPU workers");
  }
  if (arch.router_scoring != kernels::RouterScoring::kSoftmaxThenTopK) {
    return absl::InvalidArgumentError(
        "dims.router_scoring: the GPU router does not compute top-k then "
        "softmax (GPT-OSS) yet; train it on CPU workers");
  }
  if (arch.router_aux_loss_coef > 0) {
    return absl::InvalidArgumentError(
        "dims.router_aux_loss_coef: the GPU model does not compute the router "
        "load-balancing loss (output_router_logits) yet; train it on CPU "
        "workers or set output_router_logits false");
  }
  for (const MoeLayerSpec& layer : arch.layers) {
    const std::string p =
        absl::StrCat("model.layers.", &layer - arch.layers.data(), ".");
    const char* missing = layer.attention_bias ? "self_attn.q_proj.bias"
                          : layer.has_sinks    ? "self_attn.sinks"
                          : layer.router_bias  ? "moe.gate.bias"
                          : layer.expert_bias  ? "moe.experts.gate_up_proj_bias"
                                               : nullptr;
    if (missing != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          p, missing,
          ": the GPU model does not compute attention biases, attention "
          "sinks, router biases or expert biases (GPT-OSS) yet; train it on "
          "CPU workers"));
    }
  }

  const int64_t d = arch.dim;
  for (const MoeLayerSpec& layer : arch.layers) {
    if (!layer.has_moe) continue;
    const std::string p =
        absl::StrCat("model.layers.", &layer - arch.layers.data(), ".");
    // What the CUDA kernels cannot compute (the CPU path can).
    if (layer.experts > kMaxRouterExperts) {
      return absl::InvalidArgumentError(
          absl::StrCat(p, "moe.gate.weight: the GPU router supports at most ",
                       kMaxRouterExperts, " experts, got ", layer.experts));
    }
    if (arch.top_k > kMaxRouterTopK) {
      return absl::InvalidArgumentError(
          absl::StrCat("dims.top_k: the GPU router supports at most ",
                       kMaxRouterTopK, ", got ", arch.top_k));
    }
    kc::ExpertDims dims{0, d, layer.moe_inter, layer.experts, arch.top_k};
    absl::Status valid = kc::ValidateExpertDims(dims);
    if (!valid.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(p,
                       "moe.experts: the GPU grouped experts cannot run "
                       "these shapes: ",
                       valid.message()));
    }
  }
  static_cast<MoeArchitecture&>(*impl) = std::move(arch);

  // The device, after every spec check.
  if (options.device < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device: must be a CUDA device index >= 0, got ", options.device));
  }
  SHARDD_RETURN_IF_ERROR(CheckCudaDevice(options.device));
  Impl& m = *impl;
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device),
                              "DeviceMoeModel: cudaSetDevice");
  if (options.stream != nullptr) {
    m.stream = static_cast<cudaStream_t>(options.stream);
  } else {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking),
        "DeviceMoeModel: cudaStreamCreate");
    m.own_stream = true;
  }
  SHARDD_RETURN_IF_ERROR(
      CublasStatus(cublasCreate(&m.cublas), "DeviceMoeModel: cublasCreate"));
  // The stream first: cublasSetStream drops a workspace set before it.
  SHARDD_RETURN_IF_ERROR(CublasStatus(cublasSetStream(m.cublas, m.stream),
                                      "DeviceMoeModel: cublasSetStream"));
  SHARDD_ASSIGN_OR_RETURN(m.cublas_workspace, m.Alloc(kCublasWorkspaceBytes));
  SHARDD_RETURN_IF_ERROR(CublasStatus(
      cublasSetWorkspace(m.cublas, m.cublas_workspace.data(),
                         static_cast<size_t>(kCublasWorkspaceBytes)),
      "DeviceMoeModel: cublasSetWorkspace"));
  SHARDD_ASSIGN_OR_RETURN(m.step_loss, m.Alloc(sizeof(DeviceStepLoss)));
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&m.pinned_loss),
                     sizeof(DeviceStepLoss)),
      "DeviceMoeModel: cudaMallocHost");
  m.batches.resize(options.model.microbatches);
  m.states.resize(static_cast<size_t>(options.model.microbatches) *
                  options.model.passes);
  for (PassState& s : m.states) s.layers.resize(m.layers.size());
  for (const MoeLayerSpec& layer : m.layers) {
    m.has_attention = m.has_attention || layer.has_attention;
  }
  m.attention =
      std::make_unique<DeviceAttentionBlock>(&m, allocator, m.stream, m.cublas);
  m.order = std::make_unique<ModelCommandOrder>(
      options.model.passes, options.model.no_grad_passes,
      options.model.microbatches, m.LayersWithExperts(),
      /*per_microbatch=*/true);
  return absl::WrapUnique(new DeviceMoeModel(std::move(impl)));
}

absl::Status DeviceMoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                      const int32_t* targets, int64_t batch,
                                      int64_t seq) {
  Impl& m = *impl_;
  // The host arrays are checked here, as the CPU model does; the device
  // counters in ReadStepLoss only back this up.
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t counted,
      CheckMicroBatch(microbatch, m.options.model.microbatches, inputs, targets,
                      batch, seq, m.vocab));
  const int64_t tokens = batch * seq;
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.options.device),
                              "SetBatch: cudaSetDevice");
  BatchState& b = m.batches[microbatch];
  if (b.staged == nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&b.staged, cudaEventDisableTiming),
        "SetBatch: cudaEventCreate");
  }
  // The previous copy out of the staging buffer must be done before it is
  // overwritten; it normally finished long ago (a step ends with
  // ReadStepLoss), so this rarely waits.
  if (b.staged_recorded) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.staged),
                                "SetBatch: waiting for the staging buffer");
    b.staged_recorded = false;
  }
  if (b.pinned_tokens < tokens) {
    if (b.pinned != nullptr) cudaFreeHost(b.pinned);
    b.pinned = nullptr;
    b.pinned_tokens = 0;
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&b.pinned),
                       3 * tokens * sizeof(int32_t)),
        "SetBatch: cudaMallocHost");
    b.pinned_tokens = tokens;
  }
  const int64_t bytes = tokens * static_cast<int64_t>(sizeof(int32_t));
  if (b.inputs.bytes() != bytes) {
    SHARDD_RETURN_IF_ERROR(m.AllocInto(&b.inputs, bytes));
    SHARDD_RETURN_IF_ERROR(m.AllocInto(&b.targets, bytes));
    if (m.has_attention) {
      SHARDD_RETURN_IF_ERROR(m.AllocInto(&b.positions, bytes));
    }
  }
  if (m.has_attention) {
    SHARDD_RETURN_IF_ERROR(m.attention->Prepare(seq));
    for (int64_t i = 0; i < tokens; ++i) {
      b.pinned[2 * tokens + i] = static_cast<int32_t>(i % seq);
    }
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(b.positions.data(), b.pinned + 2 * tokens, bytes,
                        cudaMemcpyHostToDevice, m.stream),
        "SetBatch: copying positions");
  }
  std::memcpy(b.pinned, inputs, bytes);
  std::memcpy(b.pinned + tokens, targets, bytes);
  SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.inputs.data(), b.pinned, bytes,
                                              cudaMemcpyHostToDevice, m.stream),
                              "SetBatch: copying inputs");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(b.targets.data(), b.pinned + tokens, bytes,
                      cudaMemcpyHostToDevice, m.stream),
      "SetBatch: copying targets");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.staged, m.stream),
                              "SetBatch: cudaEventRecord");
  b.staged_recorded = true;
  b.tokens = tokens;
  b.batch = batch;
  b.seq = seq;
  b.counted = counted;
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::Run(const v1::Command& command,
                                 DeviceParamSource* params) {
  Impl& m = *impl_;
  SHARDD_RETURN_IF_ERROR(m.order->Check(command, "DeviceMoeModel"));
  if (params == nullptr) {
    return absl::InvalidArgumentError("params: must not be null");
  }
  if (m.batches[command.microbatch()].tokens == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("micro-batch ", command.microbatch(),
                     " has no tokens (SetBatch missing)"));
  }
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.options.device),
                              "Run: cudaSetDevice");
  SHARDD_RETURN_IF_ERROR(m.ZeroStepLossOnce());
  const bool fp32 = m.options.activations == DeviceDType::kFloat32;
  if (command.op() == v1::Command::FORWARD) {
    SHARDD_RETURN_IF_ERROR(fp32 ? m.Forward<float>(command, params)
                                : m.Forward<uint16_t>(command, params));
  } else {
    SHARDD_RETURN_IF_ERROR(fp32 ? m.Backward<float>(command, params)
                                : m.Backward<uint16_t>(command, params));
  }
  m.order->Commit(command);
  return absl::OkStatus();
}

template <typename T>
absl::Status DeviceMoeModel::Impl::Forward(const Command& c,
                                           DeviceParamSource* params) {
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
        SHARDD_ASSIGN_OR_RETURN(
            const DeviceAttentionParams ap,
            AttentionParams<T>(spec, params, &temps, /*grads=*/false));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer y, Alloc(td * kElem));
        SHARDD_RETURN_IF_ERROR(attention->Forward<T>(
            spec, ap, std::move(la.normed), batch.batch, batch.seq,
            batch.positions.as<int32_t>(), &la.attn, y.as<T>()));
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
        SHARDD_ASSIGN_OR_RETURN(const T* wg,
                                Param<T>(params, spec.mlp_gate, &temps));
        SHARDD_ASSIGN_OR_RETURN(const T* wu,
                                Param<T>(params, spec.mlp_up, &temps));
        SHARDD_ASSIGN_OR_RETURN(const T* wd,
                                Param<T>(params, spec.mlp_down, &temps));
        const kc::DenseMlpDims dims{t, dim, spec.mlp_inter};
        const kc::DType dtype = kc::DTypeOf<T>::value;
        const size_t saved_bytes = kc::DenseMlpSavedBytes(dims, dtype);
        const size_t ws_bytes = kc::DenseMlpForwardWorkspaceBytes(dims, dtype);
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.dense_out, td * kElem));
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.mlp_saved, saved_bytes));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
        SHARDD_RETURN_IF_ERROR(kc::DenseMlpForward(
            dims, activation, la.normed.as<T>(), wg, wu, wd,
            la.dense_out.as<T>(), /*accumulate_y=*/false, la.mlp_saved.data(),
            saved_bytes, ws.data(), ws_bytes, cublas, stream));
        temps.push_back(std::move(ws));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const T* gw,
                                Param<T>(params, spec.gate, &temps));
        const kc::RouterDims dims{t, dim, spec.experts, top_k,
                                  renormalize_topk};
        const size_t saved_bytes = kc::RouterSavedBytes(dims);
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.indices, t * top_k * 4));
        SHARDD_RETURN_IF_ERROR(
            AllocInto(&la.weights, t * top_k * sizeof(float)));
        SHARDD_RETURN_IF_ERROR(AllocInto(&la.router_saved, saved_bytes));
        SHARDD_RETURN_IF_ERROR(kc::RouterForward(
            dims, la.normed.as<T>(), gw, la.indices.as<int32_t>(),
            la.weights.as<float>(), la.router_saved.data(), saved_bytes, cublas,
            stream));
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
      const kc::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      ReleaseExpertSlot(&la.experts);
      SHARDD_ASSIGN_OR_RETURN(la.experts, AcquireExpertSlot(dims));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer y, Alloc(td * kElem));
      const int64_t syncs_before = la.experts.workspace->host_syncs();
      const absl::Status forward = kc::GroupedExpertsForward(
          dims, ExpertOptions(), la.normed.data(), la.indices.as<int32_t>(),
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
      if (a.x.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD HEAD before the last layer in pass ", pass));
      }
      SHARDD_ASSIGN_OR_RETURN(const T* norm_w,
                              Param<T>(params, final_norm, &temps));
      a.final_x = std::move(a.x);
      a.x = DeviceBuffer();
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.final_inv, t * sizeof(float)));
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.h, td * kElem));
      SHARDD_RETURN_IF_ERROR(
          kc::RmsNormForward(a.final_x.as<T>(), norm_w, t, dim, eps,
                             a.h.as<T>(), a.final_inv.as<float>(), stream));
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
absl::Status DeviceMoeModel::Impl::Backward(const Command& c,
                                            DeviceParamSource* params) {
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
      if (a.final_x.empty() || a.h.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD HEAD of pass ", pass, " without its forward"));
      }
      SHARDD_ASSIGN_OR_RETURN(const T* head_w, Param<T>(params, head, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* norm_w,
                              Param<T>(params, final_norm, &temps));
      SHARDD_ASSIGN_OR_RETURN(float* dhead, Grad(params, head));
      SHARDD_ASSIGN_OR_RETURN(float* dnorm, Grad(params, final_norm));
      // The CPU model's scale: the gradient of this pass's mean loss,
      // averaged over micro-batches and grad passes.
      const float loss_scale =
          batch.counted == 0
              ? 0.0f
              : static_cast<float>(1.0 / (static_cast<double>(batch.counted) *
                                          options.model.microbatches *
                                          grad_passes()));
      const kc::CrossEntropyDims dims{t, dim, vocab};
      const kc::CudaCrossEntropyOptions ce_options;  // ignore_index -1
      const size_t ws_bytes = kc::CrossEntropyWorkspaceBytes(
          dims, kc::DTypeOf<T>::value, ce_options, /*with_grad=*/true);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer result,
                              Alloc(sizeof(kc::CrossEntropyDeviceResult)));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dh, Alloc(td * kElem));
      auto* r = result.as<kc::CrossEntropyDeviceResult>();
      SHARDD_RETURN_IF_ERROR(kc::LmHeadCrossEntropyBackward(
          dims, a.h.as<T>(), head_w, batch.targets.as<int32_t>(), loss_scale,
          dh.as<T>(), dhead, /*accumulate_dhidden=*/false, r, ws.data(),
          ws_bytes, ce_options, cublas, stream));
      // Device pointers to the result's fields (address arithmetic only).
      const char* base = static_cast<const char*>(result.data());
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchAccumulateStepLoss(
              reinterpret_cast<const double*>(
                  base + offsetof(kc::CrossEntropyDeviceResult, mean_loss)),
              reinterpret_cast<const int64_t*>(
                  base + offsetof(kc::CrossEntropyDeviceResult, count)),
              reinterpret_cast<const int64_t*>(
                  base +
                  offsetof(kc::CrossEntropyDeviceResult, invalid_targets)),
              step_loss.as<DeviceStepLoss>(), stream),
          "BACKWARD HEAD: accumulating the loss");
      ++loss_terms;
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.dx, td * kElem));
      const size_t norm_ws_bytes =
          dnorm == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(t, dim);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer norm_ws, Alloc(norm_ws_bytes));
      SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
          dh.as<T>(), a.final_x.as<T>(), norm_w, a.final_inv.as<float>(), t,
          dim, a.dx.as<T>(), /*accumulate_dx=*/false, dnorm, norm_ws.data(),
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
      const kc::ExpertDims dims{t, dim, spec.moe_inter, spec.experts, top_k};
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.dn, td * kElem));
      SHARDD_RETURN_IF_ERROR(AllocInto(&a.dweights, t * top_k * sizeof(float)));
      SHARDD_RETURN_IF_ERROR(kc::GroupedExpertsBackward(
          dims, ExpertOptions(), w_gu, w_d, a.dx.data(), a.dn.data(),
          /*accumulate_dx=*/false, a.dweights.as<float>(), dw_gu, dw_d,
          la.experts.workspace, cublas, stream));
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
        SHARDD_ASSIGN_OR_RETURN(const T* wg,
                                Param<T>(params, spec.mlp_gate, &temps));
        SHARDD_ASSIGN_OR_RETURN(const T* wu,
                                Param<T>(params, spec.mlp_up, &temps));
        SHARDD_ASSIGN_OR_RETURN(const T* wd,
                                Param<T>(params, spec.mlp_down, &temps));
        SHARDD_ASSIGN_OR_RETURN(float* dwg, Grad(params, spec.mlp_gate));
        SHARDD_ASSIGN_OR_RETURN(float* dwu, Grad(params, spec.mlp_up));
        SHARDD_ASSIGN_OR_RETURN(float* dwd, Grad(params, spec.mlp_down));
        const kc::DenseMlpDims dims{t, dim, spec.mlp_inter};
        const size_t ws_bytes =
            kc::DenseMlpBackwardWorkspaceBytes(dims, kc::DTypeOf<T>::value);
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
        SHARDD_RETURN_IF_ERROR(kc::DenseMlpBackward(
            dims, activation, la.normed.as<T>(), wg, wu, wd, a.dx.as<T>(),
            la.mlp_saved.data(), static_cast<size_t>(la.mlp_saved.bytes()),
            a.dn.as<T>(), /*accumulate_dx=*/spec.has_moe, dwg, dwu, dwd,
            ws.data(), ws_bytes, cublas, stream));
        temps.push_back(std::move(ws));
      }
      if (spec.has_moe) {
        SHARDD_ASSIGN_OR_RETURN(const T* gw,
                                Param<T>(params, spec.gate, &temps));
        SHARDD_ASSIGN_OR_RETURN(float* dgw, Grad(params, spec.gate));
        const kc::RouterDims dims{t, dim, spec.experts, top_k,
                                  renormalize_topk};
        const size_t ws_bytes =
            kc::RouterBackwardWorkspaceBytes(dims, kc::DTypeOf<T>::value);
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
        SHARDD_RETURN_IF_ERROR(kc::RouterBackward(
            dims, la.normed.as<T>(), gw, a.dweights.as<float>(),
            la.router_saved.data(),
            static_cast<size_t>(la.router_saved.bytes()), a.dn.as<T>(),
            /*accumulate_dx=*/true, dgw, ws.data(), ws_bytes, cublas, stream));
        temps.push_back(std::move(ws));
      }
      // Residual: d(x_in) = d(x_out) + RMSNorm'(d normed); with attention
      // first through post_attention_layernorm (x_in is x_mid), then the
      // attention, then input_layernorm.
      const TensorInfo& branch_norm =
          spec.has_attention ? spec.post_norm : spec.norm;
      SHARDD_RETURN_IF_ERROR(NormBackward<T>(branch_norm, params, a.dn, la.x_in,
                                             la.inv_rms, t, &a.dx, &temps));
      if (spec.has_attention) {
        SHARDD_ASSIGN_OR_RETURN(
            const DeviceAttentionParams ap,
            AttentionParams<T>(spec, params, &temps, /*grads=*/true));
        SHARDD_RETURN_IF_ERROR(attention->Backward<T>(
            spec, ap, la.attn, batch.batch, batch.seq,
            batch.positions.as<int32_t>(), a.dx.as<T>(), a.dn.as<T>()));
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
        const size_t ws_bytes = kc::EmbeddingBackwardWorkspaceBytes(vocab, t);
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, Alloc(ws_bytes));
        SHARDD_RETURN_IF_ERROR(kc::EmbeddingBackward(
            a.dx.as<T>(), batch.inputs.as<int32_t>(), t, vocab, dim, dtable,
            ws.data(), ws_bytes, &step_loss.as<DeviceStepLoss>()->bad_ids,
            stream));
        temps.push_back(std::move(ws));
      }
      a.dx.Reset();
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

void DeviceMoeModel::ResetStep() {
  Impl& m = *impl_;
  // Stream-ordered frees: the allocator hands the blocks only to later work
  // on the same stream.
  for (PassState& s : m.states) m.ReleasePass(&s);
  m.order->Reset();
  m.loss_terms = 0;
  m.step_loss_zeroed = false;
}

absl::StatusOr<DeviceMoeModel::StepLoss> DeviceMoeModel::ReadStepLoss() {
  Impl& m = *impl_;
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.options.device),
                              "ReadStepLoss: cudaSetDevice");
  SHARDD_RETURN_IF_ERROR(m.ZeroStepLossOnce());
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m.pinned_loss, m.step_loss.data(), sizeof(DeviceStepLoss),
                      cudaMemcpyDeviceToHost, m.stream),
      "ReadStepLoss: copying the loss");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream),
                              "ReadStepLoss: waiting for the compute stream");
  const DeviceStepLoss loss = *m.pinned_loss;
  if (loss.bad_ids > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss.bad_ids, " token ids outside [0, ", m.vocab,
                     ") reached the embedding on the device"));
  }
  if (loss.invalid_targets > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(loss.invalid_targets, " targets outside [0, ", m.vocab,
                     ") (and not -1) reached the cross-entropy on the device"));
  }
  StepLoss out;
  out.loss = m.loss_terms == 0 ? 0.0 : loss.loss_sum / m.loss_terms;
  out.tokens = loss.tokens;
  return out;
}

int64_t DeviceMoeModel::activation_bytes() const {
  int64_t bytes = 0;
  for (const PassState& s : impl_->states) {
    for (const LayerState& l : s.layers) {
      bytes += l.x_in.bytes() + l.inv_rms.bytes() + l.normed.bytes() +
               l.indices.bytes() + l.weights.bytes() + l.router_saved.bytes() +
               l.dense_out.bytes() + l.mlp_saved.bytes() +
               l.experts.memory.bytes();
    }
    bytes += s.x.bytes() + s.final_x.bytes() + s.final_inv.bytes() +
             s.h.bytes() + s.dx.bytes() + s.dn.bytes() + s.dweights.bytes();
  }
  return bytes;
}

int64_t DeviceMoeModel::host_synchronizations() const {
  return impl_->host_syncs;
}

void* DeviceMoeModel::stream() const { return impl_->stream; }

int DeviceMoeModel::num_layers() const {
  return static_cast<int>(impl_->layers.size());
}

int64_t DeviceMoeModel::vocab_size() const { return impl_->vocab; }

}  // namespace shardd
