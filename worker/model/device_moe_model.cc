#include "worker/model/device_moe_model.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/grouped_experts.h"
#include "model/model_util.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/cuda_block_ops.h"
#include "worker/model/model_step.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace {

namespace kc = ::shardd::kernels::cuda;

// Router kernel limits (kernels/cuda/router.h).
constexpr int64_t kMaxRouterExperts = 1024;
constexpr int64_t kMaxRouterTopK = 32;
// kernels/cuda/attention.h's head-dim limit (512 needs a Hopper's shared
// memory; the kernel names the device's limit on others).
constexpr int64_t kMaxAttentionHeadDim = 512;

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

// The step driver over the device's block ops.
struct DeviceMoeModel::Impl {
  std::unique_ptr<MoeArchitecture> arch;  // Outlives the step.
  int device = 0;
  cudaStream_t stream = nullptr;
  bool own_stream = false;
  std::unique_ptr<step::ModelStep> step;
  step::CudaBlockOps* ops = nullptr;  // Owned by step.
  ~Impl() {
    cudaSetDevice(device);  // Teardown: an error here changes nothing.
    step.reset();           // Waits for the stream's work on its buffers.
    if (own_stream && stream != nullptr) cudaStreamDestroy(stream);
  }
};

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
  // Head dims the GPU attention cannot take are refused by name.
  for (const MoeLayerSpec& layer : arch.layers) {
    if (layer.gemma && layer.layer_head_dim > kMaxAttentionHeadDim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.layers.", &layer - arch.layers.data(),
          ".self_attn: the GPU attention takes head dims up to ",
          kMaxAttentionHeadDim, ", this layer's is ", layer.layer_head_dim,
          " (dims.attention global_head_dim / head_dim); train it on CPU "
          "workers"));
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
  const step::StepShape step_shape =
      StepShapeOf(shape, model.dims().canvas_length());
  // The step shape as the driver checks it (DiffusionGemma's steps).
  SHARDD_RETURN_IF_ERROR(
      step::ModelStep::CheckShape(arch, step_shape).status());
  // The device, after every spec check.
  SHARDD_RETURN_IF_ERROR(UseDevice(options));
  auto impl = std::make_unique<Impl>();
  impl->arch = std::make_unique<MoeArchitecture>(std::move(arch));
  impl->device = options.device;
  if (options.stream != nullptr) {
    impl->stream = static_cast<cudaStream_t>(options.stream);
  } else {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking),
        "DeviceMoeModel: cudaStreamCreate");
    impl->own_stream = true;
  }
  SHARDD_ASSIGN_OR_RETURN(
      std::unique_ptr<step::CudaBlockOps> ops,
      step::CudaBlockOps::Create(impl->arch.get(), options.activations,
                                 impl->stream, allocator));
  impl->ops = ops.get();
  SHARDD_ASSIGN_OR_RETURN(
      impl->step,
      step::ModelStep::Create(impl->arch.get(), step_shape, std::move(ops)));
  return absl::WrapUnique(new DeviceMoeModel(std::move(impl)));
}

absl::Status DeviceMoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                      const int32_t* targets, int64_t batch,
                                      int64_t seq) {
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device),
                              "SetBatch: cudaSetDevice");
  return impl_->step->SetBatch(microbatch, inputs, targets, batch, seq);
}

absl::Status DeviceMoeModel::SetSequenceKeys(int microbatch, int64_t step,
                                             const int64_t* sequence_indices) {
  return impl_->step->SetSequenceKeys(microbatch, step, sequence_indices);
}

absl::Status DeviceMoeModel::SetRowSegments(int microbatch,
                                            const int32_t* segment_starts) {
  return impl_->step->SetRowSegments(microbatch, segment_starts);
}

absl::Status DeviceMoeModel::SetGlobalLossTokens(int64_t global_counted,
                                                 int ranks,
                                                 int64_t global_canvas) {
  impl_->step->SetGlobalLossTokens(global_counted, ranks, global_canvas);
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::SetCanvasRows(int microbatch,
                                           const int32_t* starts,
                                           const int32_t* targets) {
  return impl_->step->SetCanvasRows(microbatch, starts, targets);
}

absl::Status DeviceMoeModel::SetRecompute(std::vector<bool> layers,
                                          std::vector<bool> experts) {
  return impl_->step->SetRecompute(std::move(layers), std::move(experts));
}

absl::Status DeviceMoeModel::SetExpertExchange(ExpertExchange* exchange,
                                               double capacity_factor,
                                               NcclCommunicator* ep_group,
                                               absl::Duration timeout) {
  impl_->ops->SetExpertGroup(exchange == nullptr ? nullptr : ep_group,
                             timeout);
  return impl_->step->SetExpertExchange(exchange, capacity_factor);
}

absl::Status DeviceMoeModel::SetEvaluation(bool eval) {
  impl_->step->SetEvaluation(eval);
  return absl::OkStatus();
}

absl::Status DeviceMoeModel::Run(const v1::Command& command,
                                 DeviceParamSource* params) {
  if (params == nullptr) {
    return absl::InvalidArgumentError("params: must not be null");
  }
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device),
                              "Run: cudaSetDevice");
  impl_->ops->Bind(params);
  const absl::Status run = impl_->step->Run(command);
  impl_->ops->Bind(nullptr);
  return run;
}

void DeviceMoeModel::ResetStep() {
  // The step loss is zeroed on the device (an error surfaces at
  // ReadStepLoss); activations stay allocated for the next step (the
  // driver reuses them).
  cudaSetDevice(impl_->device);
  impl_->step->ResetStep();
}

absl::StatusOr<DeviceMoeModel::StepLoss> DeviceMoeModel::ReadStepLoss() {
  SHARDD_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device),
                              "ReadStepLoss: cudaSetDevice");
  SHARDD_ASSIGN_OR_RETURN(const step::CudaBlockOps::StepLoss loss,
                          impl_->ops->ReadStepLoss(impl_->step->loss_terms()));
  return StepLoss{loss.loss, loss.tokens};
}

int64_t DeviceMoeModel::activation_bytes() const {
  return impl_->step->activation_bytes();
}

int64_t DeviceMoeModel::command_activation_peak() const {
  return impl_->step->command_activation_peak();
}

bool DeviceMoeModel::router_aux_loss() const { return impl_->arch->aux_on(); }

DeviceMoeModel::RouterAuxStats DeviceMoeModel::router_aux_stats(
    int pass, int microbatch) {
  const step::DeviceAuxStats stats =
      impl_->ops->AuxStatsOf(impl_->step->aux_stats(pass, microbatch));
  RouterAuxStats out;
  out.counts = stats.counts;
  out.num_counts = stats.num_counts;
  out.prob_sums = stats.prob_sums;
  out.num_prob_sums = stats.num_prob_sums;
  return out;
}

int64_t DeviceMoeModel::host_synchronizations() const {
  return impl_->ops->host_synchronizations();
}

void* DeviceMoeModel::stream() const { return impl_->stream; }

int DeviceMoeModel::num_layers() const {
  return static_cast<int>(impl_->arch->layers.size());
}

int64_t DeviceMoeModel::vocab_size() const { return impl_->arch->vocab; }

}  // namespace shardd
