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
#include "worker/model/cuda_block_ops.h"
#include "worker/model/device_attention_block.h"
#include "worker/model/device_moe_model_impl.h"
#include "worker/model/device_moe_model_kernels.h"
#include "worker/model/model_step.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace device_moe_internal {

ModelState::~ModelState() {
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
    if (b.canvas_pinned != nullptr) cudaFreeHost(b.canvas_pinned);
    if (b.canvas_staged != nullptr) cudaEventDestroy(b.canvas_staged);
  }
  expert_workspaces.clear();
  if (cublas != nullptr) cublasDestroy(cublas);
  cublas_workspace.Reset();
  step_loss.Reset();
  if (pinned_loss != nullptr) cudaFreeHost(pinned_loss);
  if (own_stream && stream != nullptr) cudaStreamDestroy(stream);
}

absl::StatusOr<float*> ModelState::Grad(DeviceParamSource* params,
                                        const TensorInfo& t) {
  if (t.frozen) return nullptr;
  SHARDD_ASSIGN_OR_RETURN(float* grad, params->Grad(t.name, stream));
  if (grad == nullptr && t.numel() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "parameter '", t.name, "': the param source returned no gradient"));
  }
  return grad;
}

absl::Status ModelState::ZeroStepLossOnce() {
  if (step_loss_zeroed) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(step_loss.data(), 0, sizeof(DeviceStepLoss), stream),
      "DeviceMoeModel: zeroing the step loss");
  step_loss_zeroed = true;
  return absl::OkStatus();
}

absl::StatusOr<ExpertSlot> ModelState::AcquireExpertSlot(
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
          if (!l.gemma.experts.memory.empty()) {
            in_use.insert(l.gemma.experts.memory.data());
          }
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

void ModelState::ReleaseExpertSlot(ExpertSlot* slot) {
  slot->memory.Reset();
  slot->workspace = nullptr;
}

void ModelState::ReleaseLayer(LayerState* l) { ReleaseGemmaLayer(&l->gemma); }

void ModelState::ReleasePass(PassState* s) {
  for (LayerState& l : s->layers) ReleaseLayer(&l);
  s->x.Reset();
  s->final_x.Reset();
  s->final_inv.Reset();
  s->h.Reset();
  s->dx.Reset();
  s->dn.Reset();
  s->dweights.Reset();
  s->sc.Reset();
  s->h_for_next = s->h_for_backward = false;
}

}  // namespace device_moe_internal

namespace kc = ::shardd::kernels::cuda;
using device_model::DeviceStepLoss;
using device_moe_internal::BatchState;
using device_moe_internal::kCublasWorkspaceBytes;
using device_moe_internal::kMaxAttentionHeadDim;
using device_moe_internal::kMaxRouterExperts;
using device_moe_internal::kMaxRouterTopK;
using device_moe_internal::LayerState;
using device_moe_internal::PassState;

// The step driver on the GPU (every architecture but DiffusionGemma).
struct DeviceMoeModel::Driven {
  std::unique_ptr<MoeArchitecture> arch;  // Outlives the step.
  int device = 0;
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  std::unique_ptr<step::ModelStep> step;
  step::CudaBlockOps* ops = nullptr;  // Owned by step.
  ~Driven() {
    step.reset();  // Waits for the stream's work on its buffers.
    if (own_stream && stream != nullptr) cudaStreamDestroy(stream);
  }
};

DeviceMoeModel::DeviceMoeModel(std::unique_ptr<Impl> impl,
                               std::unique_ptr<Driven> driven)
    : impl_(std::move(impl)), driven_(std::move(driven)) {}
DeviceMoeModel::~DeviceMoeModel() = default;

namespace {

// The device named in `options`, made current. Errors: FAILED_PRECONDITION
// for a negative index or an unusable device.
absl::Status UseDevice(const DeviceMoeModelOptions& options) {
  if (options.device < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device: must be a CUDA device index >= 0, got ", options.device));
  }
  SHARDD_RETURN_IF_ERROR(CheckCudaDevice(options.device));
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device),
                              "DeviceMoeModel: cudaSetDevice");
  return absl::OkStatus();
}

}  // namespace

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

  // DiffusionGemma: its causal pass or its block-diffusion step, as the CPU
  // model; head dims the GPU attention cannot take are refused by name.
  if (arch.gemma) {
    if (shape.passes == 3 && shape.no_grad_passes == 1) {
      impl->diffusion = true;
      SHARDD_ASSIGN_OR_RETURN(
          impl->block_diffusion,
          ReadBlockDiffusionSpec(arch, model.dims().canvas_length(),
                                 shape.diffusion.response_length));
    } else if (shape.passes != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DiffusionGemma: the GPU model computes the causal pass (1 pass) "
          "or the block-diffusion step (3 passes, 1 without gradients), got ",
          shape.passes, " passes, ", shape.no_grad_passes,
          " without gradients"));
    }
    for (const MoeLayerSpec& layer : arch.layers) {
      if (layer.layer_head_dim > kMaxAttentionHeadDim) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.layers.", &layer - arch.layers.data(),
            ".self_attn: the GPU attention takes head dims up to ",
            kMaxAttentionHeadDim, ", this layer's is ", layer.layer_head_dim,
            " (dims.attention global_head_dim / head_dim); train it on CPU "
            "workers"));
      }
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
  // The device, after every spec check.
  SHARDD_RETURN_IF_ERROR(UseDevice(options));
  if (!arch.gemma) {
    auto driven = std::make_unique<Driven>();
    driven->arch = std::make_unique<MoeArchitecture>(std::move(arch));
    driven->device = options.device;
    if (options.stream != nullptr) {
      driven->stream = static_cast<cudaStream_t>(options.stream);
    } else {
      SHARDD_CUDA_RETURN_IF_ERROR(
          cudaStreamCreateWithFlags(&driven->stream, cudaStreamNonBlocking),
          "DeviceMoeModel: cudaStreamCreate");
      driven->own_stream = true;
    }
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<step::CudaBlockOps> ops,
        step::CudaBlockOps::Create(driven->arch.get(), options.activations,
                                   driven->stream, allocator));
    driven->ops = ops.get();
    step::StepShape step_shape;
    step_shape.passes = shape.passes;
    step_shape.no_grad_passes = shape.no_grad_passes;
    step_shape.microbatches = shape.microbatches;
    step_shape.self_conditioning_scale = shape.self_conditioning_scale;
    step_shape.diffusion = shape.diffusion;
    step_shape.canvas_length = model.dims().canvas_length();
    SHARDD_ASSIGN_OR_RETURN(
        driven->step, step::ModelStep::Create(driven->arch.get(), step_shape,
                                              std::move(ops)));
    return absl::WrapUnique(new DeviceMoeModel(nullptr, std::move(driven)));
  }
  static_cast<MoeArchitecture&>(*impl) = std::move(arch);
  Impl& m = *impl;
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
  // DiffusionGemma's pass 1 builds no graph (program/pass_layout.h).
  m.order = std::make_unique<ModelCommandOrder>(
      PassLayout::For(m.gemma ? kBlockDiffusionArchitecture : "",
                      options.model.passes, options.model.no_grad_passes),
      options.model.microbatches, m.LayersWithExperts(),
      /*per_microbatch=*/true);
  return absl::WrapUnique(new DeviceMoeModel(std::move(impl), nullptr));
}

absl::Status DeviceMoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                      const int32_t* targets, int64_t batch,
                                      int64_t seq) {
  if (driven_ != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(driven_->device),
                                "SetBatch: cudaSetDevice");
    return driven_->step->SetBatch(microbatch, inputs, targets, batch, seq);
  }
  Impl& m = *impl_;
  // The host arrays are checked here, as the CPU model does; the device
  // counters in ReadStepLoss only back this up.
  SHARDD_ASSIGN_OR_RETURN(
      const int64_t counted,
      CheckMicroBatch(microbatch, m.options.model.microbatches, inputs, targets,
                      batch, seq, m.vocab));
  if (m.diffusion) {
    SHARDD_RETURN_IF_ERROR(
        CheckBlockDiffusionSeq(seq, m.block_diffusion.canvas));
  }
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
    SHARDD_RETURN_IF_ERROR(m.PrepareGemma(seq));
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
  if (m.diffusion) {
    // The canvas is built from these (and the keys SetSequenceKeys may
    // replace) before the micro-batch's first command.
    b.host_inputs.assign(inputs, inputs + tokens);
    b.host_targets.assign(targets, targets + tokens);
    b.ar_counted = 0;
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t i = 0; i + 1 < seq; ++i) {
        b.ar_counted += targets[r * seq + i] >= 0;
      }
    }
    b.step = 0;
    b.sequence_indices.resize(batch);
    for (int64_t r = 0; r < batch; ++r) {
      b.sequence_indices[r] = microbatch * batch + r;
    }
    b.canvas_dirty = true;
  }
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::SetSequenceKeys(int microbatch, int64_t step,
                                             const int64_t* sequence_indices) {
  if (driven_ != nullptr) {
    return driven_->step->SetSequenceKeys(microbatch, step, sequence_indices);
  }
  Impl& m = *impl_;
  if (microbatch < 0 || microbatch >= m.options.model.microbatches ||
      m.batches[microbatch].tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetSequenceKeys: micro-batch ", microbatch, " has no batch"));
  }
  if (!m.diffusion) return absl::OkStatus();
  BatchState& b = m.batches[microbatch];
  b.step = step;
  b.sequence_indices.assign(sequence_indices, sequence_indices + b.batch);
  b.canvas_dirty = true;
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::Run(const v1::Command& command,
                                 DeviceParamSource* params) {
  if (params == nullptr) {
    return absl::InvalidArgumentError("params: must not be null");
  }
  if (driven_ != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(driven_->device),
                                "Run: cudaSetDevice");
    driven_->ops->Bind(params);
    const absl::Status run = driven_->step->Run(command);
    driven_->ops->Bind(nullptr);
    return run;
  }
  Impl& m = *impl_;
  SHARDD_RETURN_IF_ERROR(m.order->Check(command, "DeviceMoeModel"));
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
    SHARDD_RETURN_IF_ERROR(fp32 ? m.GemmaForward<float>(command, params)
                                : m.GemmaForward<uint16_t>(command, params));
  } else {
    SHARDD_RETURN_IF_ERROR(fp32 ? m.GemmaBackward<float>(command, params)
                                : m.GemmaBackward<uint16_t>(command, params));
  }
  m.order->Commit(command);
  return absl::OkStatus();
}

void DeviceMoeModel::ResetStep() {
  if (driven_ != nullptr) {
    // Activations stay allocated for the next step (the driver reuses them).
    driven_->step->ResetStep();
    return;
  }
  Impl& m = *impl_;
  // Stream-ordered frees: the allocator hands the blocks only to later work
  // on the same stream.
  for (PassState& s : m.states) m.ReleasePass(&s);
  m.order->Reset();
  m.loss_terms = 0;
  m.step_loss_zeroed = false;
}

absl::StatusOr<DeviceMoeModel::StepLoss> DeviceMoeModel::ReadStepLoss() {
  if (driven_ != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(driven_->device),
                                "ReadStepLoss: cudaSetDevice");
    SHARDD_ASSIGN_OR_RETURN(
        const step::CudaBlockOps::StepLoss loss,
        driven_->ops->ReadStepLoss(driven_->step->loss_terms()));
    return StepLoss{loss.loss, loss.tokens};
  }
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
  if (driven_ != nullptr) return driven_->step->activation_bytes();
  int64_t bytes = 0;
  for (const PassState& s : impl_->states) {
    for (const LayerState& l : s.layers) bytes += l.gemma.bytes();
    bytes += s.sc.bytes();
    bytes += s.x.bytes() + s.final_x.bytes() + s.final_inv.bytes() +
             s.h.bytes() + s.dx.bytes() + s.dn.bytes() + s.dweights.bytes();
  }
  for (const BatchState& b : impl_->batches) bytes += b.sc_probs.bytes();
  return bytes;
}

bool DeviceMoeModel::router_aux_loss() const {
  return driven_ != nullptr ? driven_->arch->aux_on() : impl_->aux_on();
}

int64_t DeviceMoeModel::command_activation_peak() const {
  return driven_ != nullptr ? driven_->step->command_activation_peak()
                            : activation_bytes();
}

absl::Status DeviceMoeModel::SetRowSegments(int microbatch,
                                            const int32_t* segment_starts) {
  if (driven_ != nullptr) {
    return driven_->step->SetRowSegments(microbatch, segment_starts);
  }
  if (segment_starts == nullptr) return absl::OkStatus();
  return absl::UnimplementedError(
      "packed rows: DiffusionGemma on a GPU does not run them yet (its "
      "layers move onto the step driver in migration step 7 of "
      "docs/step_driver.md); train it on CPU workers");
}

absl::Status DeviceMoeModel::SetGlobalLossTokens(int64_t global_counted,
                                                 int ranks,
                                                 int64_t global_canvas) {
  if (driven_ != nullptr) {
    driven_->step->SetGlobalLossTokens(global_counted, ranks, global_canvas);
    return absl::OkStatus();
  }
  if (global_counted <= 0 && global_canvas <= 0) return absl::OkStatus();
  return absl::UnimplementedError(
      "SFT rows (a loss mask): DiffusionGemma on a GPU does not run them yet "
      "(migration step 7 of docs/step_driver.md); train it on CPU workers");
}

absl::Status DeviceMoeModel::SetCanvasRows(int microbatch,
                                           const int32_t* starts,
                                           const int32_t* targets) {
  if (driven_ != nullptr) {
    return driven_->step->SetCanvasRows(microbatch, starts, targets);
  }
  return absl::UnimplementedError(
      "SFT canvas rows: DiffusionGemma on a GPU does not run them yet "
      "(migration step 7 of docs/step_driver.md); train it on CPU workers");
}

absl::Status DeviceMoeModel::SetRecompute(std::vector<bool> layers,
                                          std::vector<bool> experts) {
  if (driven_ != nullptr) {
    return driven_->step->SetRecompute(std::move(layers), std::move(experts));
  }
  for (size_t l = 0; l < layers.size() || l < experts.size(); ++l) {
    if ((l < layers.size() && layers[l]) ||
        (l < experts.size() && experts[l])) {
      return absl::UnimplementedError(
          "activation_checkpointing: DiffusionGemma on a GPU does not "
          "recompute yet (migration step 7 of docs/step_driver.md); train "
          "with none or on CPU workers");
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::SetEvaluation(bool eval) {
  if (driven_ != nullptr) {
    driven_->step->SetEvaluation(eval);
    return absl::OkStatus();
  }
  if (!eval) return absl::OkStatus();
  return absl::UnimplementedError(
      "program.eval: DiffusionGemma on a GPU does not evaluate yet "
      "(migration step 7 of docs/step_driver.md); evaluate on CPU workers");
}

DeviceMoeModel::RouterAuxStats DeviceMoeModel::router_aux_stats(
    int pass, int microbatch) {
  if (driven_ != nullptr) {
    const step::DeviceAuxStats stats =
        driven_->ops->AuxStatsOf(driven_->step->aux_stats(pass, microbatch));
    RouterAuxStats out;
    out.counts = stats.counts;
    out.num_counts = stats.num_counts;
    out.prob_sums = stats.prob_sums;
    out.num_prob_sums = stats.num_prob_sums;
    return out;
  }
  // DiffusionGemma's layers feed no load-balancing loss.
  return RouterAuxStats();
}

int64_t DeviceMoeModel::host_synchronizations() const {
  if (driven_ != nullptr) return driven_->ops->host_synchronizations();
  return impl_->host_syncs;
}

void* DeviceMoeModel::stream() const {
  return driven_ != nullptr ? driven_->stream : impl_->stream;
}

int DeviceMoeModel::num_layers() const {
  if (driven_ != nullptr) {
    return static_cast<int>(driven_->arch->layers.size());
  }
  return static_cast<int>(impl_->layers.size());
}

int64_t DeviceMoeModel::vocab_size() const {
  return driven_ != nullptr ? driven_->arch->vocab : impl_->vocab;
}

}  // namespace shardd
