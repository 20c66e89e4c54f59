#ifndef SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_IMPL_H_
#define SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_IMPL_H_

// Internal to the GPU model: the state DeviceMoeModel keeps (buffers per
// micro-batch and pass, per-layer saved activations, cuBLAS, the step loss),
// shared by its set-up and bookkeeping (device_moe_model.cc) and its forward
// and backward passes (device_moe_model_passes.cc). Not for other users.

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
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/router_aux_loss.h"
#include "model/model_util.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/block_diffusion.h"
#include "worker/model/command_order.h"
#include "worker/model/device_attention_block.h"
#include "worker/model/device_mla_block.h"
#include "worker/model/device_moe_model.h"
#include "worker/model/device_moe_model_kernels.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace device_moe_internal {

namespace kc = ::shardd::kernels::cuda;
using device_model::DeviceStepLoss;
using v1::Command;

// cuBLAS gets its workspace from the allocator once, so it never allocates
// on its own inside the step (32 MiB: NVIDIA's recommendation for Hopper).
constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
// Router kernel limits (kernels/cuda/router.h).
constexpr int64_t kMaxRouterExperts = 1024;
constexpr int64_t kMaxRouterTopK = 32;
// kernels/cuda/attention.h's head-dim limit (512 needs a Hopper's shared
// memory; the kernel names the device's limit on others).
constexpr int64_t kMaxAttentionHeadDim = 512;
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

// DiffusionGemma's layer in one (micro-batch, pass), the CPU's
// GemmaLayerActs (worker/model/gemma_layer.h has the math;
// device_moe_model_gemma.cc computes it). Storage type T unless noted.
struct GemmaLayerState {
  DeviceBuffer x_in, in_inv, n;      // input, fp32 [T], normed
  DeviceBuffer q_pre, k_pre, v_pre;  // the projections
  DeviceBuffer q_inv, k_inv, v_inv;  // fp32 per (token, head)
  DeviceBuffer q, k, v, o, lse;      // the attention's
  DeviceBuffer attn, post_inv, m;    // o Wo^T, its norm, mid
  DeviceBuffer pre_inv, dense_in, dense_out, mlp_saved, post1_inv;
  DeviceBuffer r_inv, r_in, router_saved, indices, weights;
  DeviceBuffer pre2_inv, experts_in, experts_out, post2_inv;
  DeviceBuffer sum, post_ff_inv;  // h1 + h2, its norm
  ExpertSlot experts;
  // post_feedforward_layernorm_2, post_feedforward_layernorm,
  // pre_feedforward_layernorm_2 [D] each and layer_scalar, copied by
  // FORWARD(EXPERTS): BACKWARD(EXPERTS) runs where only the experts' unit
  // may be gathered.
  DeviceBuffer layer_w;
  // BACKWARD(EXPERTS) -> BACKWARD(LAYER): d(m), d(h1 + h2), the routing
  // weights' gradient (fp32) and the three norms' weight gradients (fp32
  // [3D], added to the layer unit's buffer by BACKWARD(LAYER)).
  DeviceBuffer dm, dsum, dweights, d_ff_norms;
  // The encode's: the decodes' gradients of its k and v (fp32), added by
  // its BACKWARD(LAYER).
  DeviceBuffer dk_ext, dv_ext;
  std::vector<DeviceBuffer*> Buffers() { return BuffersOf(*this); }
  std::vector<const DeviceBuffer*> Buffers() const { return BuffersOf(*this); }
  int64_t bytes() const {
    int64_t total = experts.memory.bytes();
    for (const DeviceBuffer* b : Buffers()) total += b->bytes();
    return total;
  }

 private:
  template <typename Self>
  static auto BuffersOf(Self& s) -> std::vector<decltype(&s.x_in)> {
    return {&s.x_in,      &s.in_inv,    &s.n,           &s.q_pre,
            &s.k_pre,     &s.v_pre,     &s.q_inv,       &s.k_inv,
            &s.v_inv,     &s.q,         &s.k,           &s.v,
            &s.o,         &s.lse,       &s.attn,        &s.post_inv,
            &s.m,         &s.pre_inv,   &s.dense_in,    &s.dense_out,
            &s.mlp_saved, &s.post1_inv, &s.r_inv,       &s.r_in,
            &s.router_saved, &s.indices, &s.weights,    &s.pre2_inv,
            &s.experts_in, &s.experts_out, &s.post2_inv, &s.sum,
            &s.post_ff_inv, &s.layer_w, &s.dm,          &s.dsum,
            &s.dweights,  &s.d_ff_norms, &s.dk_ext,     &s.dv_ext};
  }
};

// A decode's view of the encode (the same layer's state in pass 0).
struct GemmaDecodeView {
  int64_t prefix = 0;       // Canvas row j sits at position prefix + j.
  int64_t encoder_seq = 0;  // Rows per sequence of encoder->k / v.
  int64_t block = 0;        // Canvas rows per decode block.
  GemmaLayerState* encoder = nullptr;
};

// The self-conditioning block of a decode with gradients (pass 2).
struct SelfConditioningState {
  DeviceBuffer signal, p, p_inv, mlp_saved, sum, sum_inv;
  int64_t bytes() const {
    return signal.bytes() + p.bytes() + p_inv.bytes() + mlp_saved.bytes() +
           sum.bytes() + sum_inv.bytes();
  }
  void Reset() {
    for (DeviceBuffer* b : {&signal, &p, &p_inv, &mlp_saved, &sum, &sum_inv}) {
      b->Reset();
    }
  }
};

// What one layer of one (micro-batch, pass) keeps for its backward.
struct LayerState {
  GemmaLayerState gemma;  // DiffusionGemma's whole layer.
};

struct PassState {
  std::vector<LayerState> layers;
  DeviceBuffer x;          // [T, D] current residual stream
  DeviceBuffer final_x;    // [T, D] input of the final norm
  DeviceBuffer final_inv;  // [T] fp32
  DeviceBuffer h;          // [T, D] normed final hidden
  DeviceBuffer dx;         // [T, D] gradient of the residual stream
  DeviceBuffer dn;         // [T, D] gradient of a layer's normed input
  DeviceBuffer dweights;   // [T, K] fp32
  SelfConditioningState sc;  // DiffusionGemma's pass 2.
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
  // DiffusionGemma's block-diffusion step (device_moe_model_diffusion.cc):
  // the canvas's noise keys, the canvas built on the host from them
  // (uploaded before the micro-batch's first command when `canvas_dirty`),
  // and on the device the noised and clean canvas ids and positions [B * R],
  // the encoder's targets [B * S] and pass 1's probabilities [B * R, V].
  int64_t step = 0;
  std::vector<int64_t> sequence_indices;
  std::vector<int32_t> host_inputs, host_targets;
  DiffusionCanvas canvas;
  bool canvas_dirty = false;
  int64_t ar_counted = 0;
  DeviceBuffer noised, clean, canvas_positions, ar_targets, sc_probs;
  int32_t* canvas_pinned = nullptr;  // [3 * B * R + B * S]
  int64_t canvas_pinned_ints = 0;
  cudaEvent_t canvas_staged = nullptr;
  bool canvas_recorded = false;
};

template <typename T>
constexpr DeviceDType DeviceDTypeOf() {
  return std::is_same<T, float>::value ? DeviceDType::kFloat32
                                       : DeviceDType::kBFloat16;
}

// The architecture's fields (vocab, dim, layers, ...) are the model's.
struct ModelState : MoeArchitecture {
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
  bool has_attention = false;
  // Per (pass, micro-batch), as the states.
  std::unique_ptr<ModelCommandOrder> order;
  int loss_terms = 0;
  int64_t host_syncs = 0;
  // DiffusionGemma: its 3-pass step (else the causal pass), its geometry,
  // ones [max(D, head dims)] for the weightless norms, and the full and
  // sliding layers' RoPE tables.
  bool diffusion = false;
  BlockDiffusionSpec block_diffusion;
  DeviceBuffer ones;
  DeviceBuffer rope_cos[2], rope_sin[2];
  int64_t gemma_rope_positions = 0;

  // GroupedExpertsWorkspace objects by (device address, bytes): the caching
  // allocator hands the same blocks back step after step, so the objects
  // (pinned buffer, event) are created in the first step only.
  std::map<std::pair<void*, size_t>,
           std::unique_ptr<kc::GroupedExpertsWorkspace>>
      expert_workspaces;

  ~ModelState();

  int grad_passes() const {
    return options.model.passes - options.model.no_grad_passes;
  }
  PassState& State(int pass, int mb) {
    return states[static_cast<size_t>(mb) * options.model.passes + pass];
  }
  // The experts' options (DiffusionGemma's experts have no biases).
  kc::GroupedExpertsOptions ExpertOptions() const {
    kc::GroupedExpertsOptions o;
    switch (activation) {
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
    o.alpha = swiglu_alpha;
    o.limit = swiglu_limit;
    o.storage = options.activations == DeviceDType::kFloat32
                    ? kc::ExpertStorage::kFloat32
                    : kc::ExpertStorage::kBFloat16;
    o.gemm_path = kc::ExpertGemmPath::kAuto;
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

  absl::Status ZeroStepLossOnce();
  absl::StatusOr<ExpertSlot> AcquireExpertSlot(const kc::ExpertDims& dims);
  void ReleaseExpertSlot(ExpertSlot* slot);
  void ReleaseLayer(LayerState* layer);
  void ReleasePass(PassState* pass);
  // Frees h once neither the next pass nor this pass's backward reads it.
  void MaybeReleaseH(PassState* pass) {
    if (!pass->h_for_next && !pass->h_for_backward) pass->h.Reset();
  }

  // DiffusionGemma (device_moe_model_gemma.cc: the layer;
  // device_moe_model_diffusion.cc: the step's other parts and the 3 passes).
  absl::Status PrepareGemma(int64_t seq);
  kc::DeviceRopeTable GemmaRope(const LayerInfo& spec) const;
  absl::Status UploadCanvas(int microbatch);
  void ReleaseGemmaLayer(GemmaLayerState* g);
  template <typename T>
  absl::Status GemmaForward(const Command& c, DeviceParamSource* params);
  template <typename T>
  absl::Status GemmaBackward(const Command& c, DeviceParamSource* params);
  template <typename T>
  absl::Status GemmaLayerForward(const LayerInfo& spec,
                                 DeviceParamSource* params, int64_t batch,
                                 int64_t seq, const int32_t* positions,
                                 const GemmaDecodeView* decode,
                                 GemmaLayerState* g);
  template <typename T>
  absl::Status GemmaExpertsForward(const LayerInfo& spec,
                                   DeviceParamSource* params, int64_t t,
                                   bool saves, GemmaLayerState* g, T* x);
  template <typename T>
  absl::Status GemmaExpertsBackward(const LayerInfo& spec,
                                    DeviceParamSource* params, int64_t t,
                                    const T* dx, GemmaLayerState* g);
  template <typename T>
  absl::Status GemmaLayerBackward(const LayerInfo& spec,
                                  DeviceParamSource* params, int64_t batch,
                                  int64_t seq, const int32_t* positions,
                                  const GemmaDecodeView* decode,
                                  GemmaLayerState* g, DeviceBuffer* dx);
  // A decode block's keys and values [batch, enc + len, kv row] into *k and
  // *v: its encoder rows [lo, end) of d.encoder's, then its canvas rows of
  // g's. FAILED_PRECONDITION when the encode's K/V do not fit the batch.
  template <typename T>
  absl::Status ComposeDecodeKeys(const LayerInfo& spec,
                                 const GemmaDecodeView& d,
                                 const GemmaDecodeBlock& blk, int64_t batch,
                                 int64_t seq, const GemmaLayerState& g,
                                 DeviceBuffer* k, DeviceBuffer* v);
  template <typename T>
  absl::Status GemmaDecodeAttentionForward(const LayerInfo& spec,
                                           const GemmaDecodeView& d,
                                           int64_t batch, int64_t seq,
                                           GemmaLayerState* g);
  template <typename T>
  absl::Status GemmaDecodeAttentionBackward(
      const LayerInfo& spec, const GemmaDecodeView& d, int64_t batch,
      int64_t seq, const GemmaLayerState& g, const DeviceBuffer& d_o,
      DeviceBuffer* dq, DeviceBuffer* dk, DeviceBuffer* dv);
  template <typename T>
  absl::Status SelfConditioningForward(int pass, int microbatch,
                                       DeviceParamSource* params, PassState* a);
  template <typename T>
  absl::Status SelfConditioningBackward(int microbatch,
                                        DeviceParamSource* params,
                                        PassState* a);
  // A gated MLP (gate_proj, up_proj [inter, D], down_proj [D, inter]) over
  // x [t, D]: the forward writes y [t, D] and fills *saved for the
  // backward; the backward writes (or with `accumulate_dx` adds to) dx and
  // adds the weights' gradients (none for a frozen weight).
  struct MlpTensors {
    const TensorInfo* gate;
    const TensorInfo* up;
    const TensorInfo* down;
    int64_t inter;
  };
  template <typename T>
  absl::Status MlpForward(const MlpTensors& mlp, DeviceParamSource* params,
                          const T* x, int64_t t, T* y, DeviceBuffer* saved);
  template <typename T>
  absl::Status MlpBackward(const MlpTensors& mlp, DeviceParamSource* params,
                           const T* x, int64_t t, const T* dy,
                           const DeviceBuffer& saved, T* dx,
                           bool accumulate_dx);
  // dtable += the rows of dx [t, D] at `ids` (device int32 [t]); dx is
  // first scaled in place by embedding_scale when that is set
  // (DiffusionGemma). Out-of-range ids are counted in the step's bad_ids.
  template <typename T>
  absl::Status EmbedBackward(T* dx, const int32_t* ids, int64_t t,
                             float* dtable);
  // FORWARD(HEAD)'s final norm: a->x becomes a->final_x, with a->final_inv
  // and a->h. FAILED_PRECONDITION before the pass's last layer.
  template <typename T>
  absl::Status FinalNormForward(PassState* a, DeviceParamSource* params,
                                int pass, int64_t t);
  // BACKWARD(HEAD) of a pass of t rows: the (soft-capped, when the model
  // says) cross-entropy against `targets` with gradient scale `loss_scale`,
  // its mean times `weight` added to the step's loss (a new term of the
  // step's mean when `new_term`), and a->dx.
  template <typename T>
  absl::Status HeadBackward(PassState* a, DeviceParamSource* params, int64_t t,
                            const int32_t* targets, double loss_scale,
                            double weight, bool new_term);
};

template <typename T>
absl::StatusOr<const T*> ModelState::Param(DeviceParamSource* params,
                                           const TensorInfo& t,
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

}  // namespace device_moe_internal

// DeviceMoeModel's private state.
struct DeviceMoeModel::Impl : device_moe_internal::ModelState {};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_IMPL_H_
