#include "worker/model/cpu_block_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/cross_entropy_element.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/router_aux_loss.h"
#include "kernels/cpu/softcap.h"
#include "kernels/cpu/uninit_vector.h"

namespace shardd {
namespace step {
namespace {

// Host memory of an Act: 4-byte elements, left uninitialised unless zeroed.
class HostMemory : public ActMemory {
 public:
  explicit HostMemory(int64_t numel) { data_.resize(numel); }
  void* data() override { return data_.data(); }

 private:
  kernels::UninitVector<float> data_;
};

// The blocks' saved states on the CPU.
struct AttentionState : BlockState {
  AttentionActs attn;  // MHA / GQA
  MlaActs mla;         // DeepSeek-V3's latent attention
  int64_t bytes() const override { return attn.bytes() + mla.bytes(); }
};
struct RouterState : BlockState {
  kernels::RouterCache cache;
  int64_t bytes() const override {
    return static_cast<int64_t>(cache.bytes());
  }
};
struct ExpertsState : BlockState {
  kernels::GroupedExpertsWorkspace ws;
  int64_t bytes() const override { return static_cast<int64_t>(ws.bytes()); }
};
struct MlpState : BlockState {
  kernels::DenseMlpWorkspace ws;
  int64_t bytes() const override { return static_cast<int64_t>(ws.bytes()); }
};

struct GemmaState : BlockState {
  GemmaLayerActs acts;
  int64_t bytes() const override { return acts.bytes(); }
};
// The self-conditioning block's activations (a decode's input).
struct SelfConditioningState : BlockState {
  std::vector<float> e;             // [T, D] scaled canvas embeddings
  std::vector<float> signal;        // [T, D] probs @ E * scale, 0 without coin
  std::vector<float> p, p_inv;      // pre_norm(signal)
  std::vector<float> mlp_out;       // [T, D]
  std::vector<float> sum, sum_inv;  // e + mlp_out, post_norm's
  kernels::DenseMlpWorkspace mlp;
  int64_t bytes() const override {
    return static_cast<int64_t>(
        (e.capacity() + signal.capacity() + p.capacity() + p_inv.capacity() +
         mlp_out.capacity() + sum.capacity() + sum_inv.capacity()) *
            sizeof(float) +
        mlp.bytes());
  }
};

float* F(Act* a) { return a->as<float>(); }
const float* F(const Act& a) { return a.as<float>(); }

// out[i] = fn(i) over n elements on the compute pool (each element
// independent, so the result does not depend on the split).
template <typename Fn>
void Elementwise(int64_t n, Fn fn) {
  kernels::ParallelFor(n, kernels::kElementGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) fn(i);
  });
}

}  // namespace

CpuBlockOps::CpuBlockOps(const MoeArchitecture* arch)
    : arch_(arch),
      attention_(std::make_unique<AttentionBlock>(arch)),
      mla_(std::make_unique<MlaBlock>(arch)),
      gemma_(std::make_unique<GemmaLayerBlock>(arch)) {}

CpuBlockOps::~CpuBlockOps() = default;

absl::Status CpuBlockOps::Prepare(int64_t seq) {
  for (const MoeLayerSpec& layer : arch_->layers) {
    if (layer.has_attention) {
      return layer.gemma ? gemma_->Prepare(seq)
             : layer.mla ? mla_->Prepare(seq)
                         : attention_->Prepare(seq);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Act> CpuBlockOps::Allocate(Elem elem, int64_t numel,
                                          bool zero) {
  if (numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation of ", numel, " elements"));
  }
  Act act(std::make_unique<HostMemory>(numel), elem, numel,
          numel * static_cast<int64_t>(sizeof(float)));
  if (zero) kernels::FillZero(act.data(), act.bytes());
  return act;
}

absl::StatusOr<Act> CpuBlockOps::Upload(const int32_t* host, int64_t n) {
  SHARDD_ASSIGN_OR_RETURN(Act act, Allocate(Elem::kI32, n, /*zero=*/false));
  if (n > 0) std::memcpy(act.data(), host, n * sizeof(int32_t));
  return act;
}

absl::Status CpuBlockOps::Copy(const Act& src, Act* dst) {
  if (dst->numel() != src.numel()) {
    return absl::InternalError(absl::StrCat("Copy: ", src.numel(),
                                            " elements into ", dst->numel()));
  }
  if (src.bytes() > 0) std::memcpy(dst->data(), src.data(), src.bytes());
  return absl::OkStatus();
}

absl::Status CpuBlockOps::Add(Act* x, const Act& a, const Act* b) {
  float* xd = F(x);
  const float* ad = F(a);
  if (b == nullptr) {
    Elementwise(x->numel(), [&](int64_t i) { xd[i] += ad[i]; });
  } else {
    const float* bd = F(*b);
    Elementwise(x->numel(), [&](int64_t i) { xd[i] += ad[i] + bd[i]; });
  }
  return absl::OkStatus();
}

absl::Status CpuBlockOps::Sum(const Act& x, const Act& a, Act* out) {
  const float* xd = F(x);
  const float* ad = F(a);
  float* od = F(out);
  Elementwise(out->numel(), [&](int64_t i) { od[i] = xd[i] + ad[i]; });
  return absl::OkStatus();
}

absl::Status CpuBlockOps::Scale(Act* x, float s) {
  float* xd = F(x);
  Elementwise(x->numel(), [&](int64_t i) { xd[i] *= s; });
  return absl::OkStatus();
}

absl::Status CpuBlockOps::AddScaled(Act* x, const Act& h, float s) {
  float* xd = F(x);
  const float* hd = F(h);
  Elementwise(x->numel(), [&](int64_t i) { xd[i] += s * hd[i]; });
  return absl::OkStatus();
}

absl::StatusOr<const float*> CpuBlockOps::Param(const ArchTensor& t) {
  if (params_ == nullptr) {
    return absl::FailedPreconditionError("CpuBlockOps: no parameters bound");
  }
  return params_->Param(t.name);
}

float* CpuBlockOps::Zeroed(std::vector<float>* buffer, int64_t n) {
  if (static_cast<int64_t>(buffer->size()) < n) buffer->resize(n);
  kernels::FillZero(buffer->data(), n * static_cast<int64_t>(sizeof(float)));
  return buffer->data();
}

absl::Status CpuBlockOps::AddGrad(const ArchTensor& t, const float* values) {
  if (t.frozen) return absl::OkStatus();
  return params_->AccumulateGrad(t.name, values);
}

absl::Status CpuBlockOps::EmbedForward(const Act& ids, int64_t t, Act* x) {
  SHARDD_ASSIGN_OR_RETURN(const float* table, Param(arch_->embed));
  return kernels::EmbeddingForward(table, arch_->vocab, arch_->dim,
                                   ids.as<int32_t>(), t, F(x));
}

absl::Status CpuBlockOps::EmbedBackward(Act* dx, const Act& ids, int64_t t,
                                        float scale) {
  const ArchTensor& embed = arch_->embed;
  if (embed.frozen) return absl::OkStatus();
  if (scale != 1.0f) SHARDD_RETURN_IF_ERROR(Scale(dx, scale));
  float* dtable = Zeroed(&scratch_, arch_->vocab * arch_->dim);
  SHARDD_RETURN_IF_ERROR(kernels::EmbeddingBackward(
      F(*dx), ids.as<int32_t>(), t, arch_->vocab, arch_->dim, dtable,
      arch_->pad_id));
  return AddGrad(embed, dtable);
}

absl::Status CpuBlockOps::NormForward(const ArchTensor& w, const Act& x,
                                      int64_t rows, Act* y, Act* inv) {
  SHARDD_ASSIGN_OR_RETURN(const float* weight, Param(w));
  return kernels::RmsNormForward(F(x), weight, rows, arch_->dim, arch_->eps,
                                 F(y), F(inv));
}

absl::Status CpuBlockOps::NormBackward(const ArchTensor& w, const Act& dy,
                                       const Act& x, const Act& inv,
                                       int64_t rows, Act* dx,
                                       bool accumulate) {
  SHARDD_ASSIGN_OR_RETURN(const float* weight, Param(w));
  // The kernel always writes dweight; a frozen norm's is dropped.
  float* dweight = Zeroed(&scratch_, arch_->dim);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(F(dy), F(x), weight, F(inv),
                                                  rows, arch_->dim, F(dx),
                                                  dweight, accumulate));
  return AddGrad(w, dweight);
}

absl::Status CpuBlockOps::AttentionForward(const MoeLayerSpec& layer,
                                           const Act& n, int64_t batch,
                                           int64_t seq, Saved* state, Act* y) {
  AttentionState* s = state->Get<AttentionState>();
  return layer.mla ? mla_->Forward(layer, params_, F(n), batch, seq, &s->mla,
                                   F(y))
                   : attention_->Forward(layer, params_, F(n), batch, seq,
                                         &s->attn, F(y));
}

absl::Status CpuBlockOps::AttentionBackward(const MoeLayerSpec& layer,
                                            const Saved& state, int64_t batch,
                                            int64_t seq, const Act& dy,
                                            Act* dn) {
  const AttentionState* s = state.Peek<AttentionState>();
  if (s == nullptr) {
    return absl::FailedPreconditionError(
        "attention backward without its forward");
  }
  return layer.mla ? mla_->Backward(layer, params_, s->mla, batch, seq, F(dy),
                                    F(dn))
                   : attention_->Backward(layer, params_, s->attn, batch, seq,
                                          F(dy), F(dn));
}

absl::Status CpuBlockOps::MlpForward(const MlpTensors& mlp, const Act& x,
                                     int64_t t, Saved* state, Act* y) {
  SHARDD_ASSIGN_OR_RETURN(const float* wg, Param(*mlp.gate));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, Param(*mlp.up));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, Param(*mlp.down));
  const kernels::DenseMlpDims dims{t, arch_->dim, mlp.inter};
  return kernels::DenseMlpForward(dims, arch_->activation, F(x), wg, wu, wd,
                                  F(y), &state->Get<MlpState>()->ws);
}

absl::Status CpuBlockOps::MlpBackward(const MlpTensors& mlp, const Act& x,
                                      int64_t t, const Act& dy, Saved* state,
                                      Act* dx, bool accumulate) {
  (void)x;  // The forward kept its own copy.
  SHARDD_ASSIGN_OR_RETURN(const float* wg, Param(*mlp.gate));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, Param(*mlp.up));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, Param(*mlp.down));
  const kernels::DenseMlpDims dims{t, arch_->dim, mlp.inter};
  const int64_t n = mlp.inter * arch_->dim;
  std::vector<float> dwg(mlp.gate->frozen ? 0 : n, 0.0f);
  std::vector<float> dwu(mlp.up->frozen ? 0 : n, 0.0f);
  std::vector<float> dwd(mlp.down->frozen ? 0 : n, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::DenseMlpBackward(
      dims, arch_->activation, wg, wu, wd, F(dy), F(dx), accumulate,
      dwg.empty() ? nullptr : dwg.data(), dwu.empty() ? nullptr : dwu.data(),
      dwd.empty() ? nullptr : dwd.data(), &state->Get<MlpState>()->ws));
  if (!dwg.empty()) SHARDD_RETURN_IF_ERROR(AddGrad(*mlp.gate, dwg.data()));
  if (!dwu.empty()) SHARDD_RETURN_IF_ERROR(AddGrad(*mlp.up, dwu.data()));
  if (!dwd.empty()) SHARDD_RETURN_IF_ERROR(AddGrad(*mlp.down, dwd.data()));
  return absl::OkStatus();
}

absl::Status CpuBlockOps::RouterForward(const MoeLayerSpec& layer,
                                        const Act& x, int64_t t, Act* indices,
                                        Act* weights, Saved* state) {
  SHARDD_ASSIGN_OR_RETURN(const float* gw, Param(layer.gate));
  const float* gb = nullptr;
  if (layer.router_bias) {
    SHARDD_ASSIGN_OR_RETURN(gb, Param(layer.gate_bias));
  }
  // DeepSeek-V3's frozen correction bias steers the choice only.
  const float* selection = nullptr;
  if (layer.selection_bias) {
    SHARDD_ASSIGN_OR_RETURN(selection, Param(layer.gate_selection_bias));
  }
  return kernels::RouterForward(arch_->RouterDimsOf(layer, t), F(x), gw, gb,
                                selection, indices->as<int32_t>(), F(weights),
                                &state->Get<RouterState>()->cache);
}

absl::Status CpuBlockOps::RouterBackward(const MoeLayerSpec& layer,
                                         const Act& x, int64_t t,
                                         const Act& d_weights,
                                         const Act* extra_d_logits,
                                         Saved* state, Act* dx) {
  SHARDD_ASSIGN_OR_RETURN(const float* gw, Param(layer.gate));
  float* dgw =
      layer.gate.frozen ? nullptr : Zeroed(&scratch_, layer.gate.numel());
  std::vector<float> dgb(layer.router_bias ? layer.experts : 0, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RouterBackward(
      arch_->RouterDimsOf(layer, t), F(x), gw, F(d_weights),
      extra_d_logits == nullptr ? nullptr : F(*extra_d_logits), F(dx),
      /*accumulate_dx=*/true, dgw, layer.router_bias ? dgb.data() : nullptr,
      &state->Get<RouterState>()->cache));
  if (dgw != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(layer.gate, dgw));
  if (layer.router_bias) {
    SHARDD_RETURN_IF_ERROR(AddGrad(layer.gate_bias, dgb.data()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CpuBlockOps::ExpertWeights> CpuBlockOps::ExpertsOf(
    const MoeLayerSpec& layer) {
  ExpertWeights e;
  SHARDD_ASSIGN_OR_RETURN(e.w_gu, Param(layer.w_gu));
  SHARDD_ASSIGN_OR_RETURN(e.w_d, Param(layer.w_d));
  e.options = arch_->ExpertOptions();
  if (layer.expert_bias) {
    SHARDD_ASSIGN_OR_RETURN(e.options.gate_up_bias, Param(layer.b_gu));
    SHARDD_ASSIGN_OR_RETURN(e.options.down_bias, Param(layer.b_d));
  }
  return e;
}

absl::Status CpuBlockOps::ExpertsForward(const MoeLayerSpec& layer,
                                         const Act& x, const Act& indices,
                                         const Act& weights, int64_t t,
                                         int k, Saved* state, Act* y) {
  SHARDD_ASSIGN_OR_RETURN(const ExpertWeights e, ExpertsOf(layer));
  const float* w_gu = e.w_gu;
  const float* w_d = e.w_d;
  const kernels::ExpertOptions& options = e.options;
  const kernels::ExpertDims dims{t, arch_->dim, layer.moe_inter, layer.experts,
                                 k};
  kernels::GroupedExpertsWorkspace& ws = state->Get<ExpertsState>()->ws;
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsForward(
      dims, arch_->activation, options, F(x), indices.as<int32_t>(),
      F(weights), nullptr, w_gu, w_d, F(y), &ws));
  // The per-row outputs are the kernel's scratch; backward does not read
  // them.
  kernels::UninitVector<float>().swap(ws.o);
  return absl::OkStatus();
}

absl::Status CpuBlockOps::ReadChoices(const Act& indices, int64_t n,
                                      std::vector<int32_t>* host) {
  host->assign(indices.as<int32_t>(), indices.as<int32_t>() + n);
  return absl::OkStatus();
}

absl::Status CpuBlockOps::ExchangeDispatch(ExpertExchange& exchange,
                                           const ExpertRoute& route,
                                           const Act& x, const Act& weights,
                                           const Act& indices, Act* x_r,
                                           Act* ids_r, Act* w_r) {
  return exchange.Dispatch(route, x.as<float>(), weights.as<float>(),
                           indices.as<int32_t>(), arch_->dim, x_r->as<float>(),
                           ids_r->as<int32_t>(), w_r->as<float>());
}

absl::Status CpuBlockOps::ExchangeCombine(ExpertExchange& exchange,
                                          const ExpertRoute& route,
                                          const Act& y_r, Act* y) {
  return exchange.Combine(route, y_r.as<float>(), arch_->dim, y->as<float>());
}

absl::Status CpuBlockOps::ExchangeDispatchGrad(ExpertExchange& exchange,
                                               const ExpertRoute& route,
                                               const Act& dy, Act* dy_r) {
  return exchange.DispatchGrad(route, dy.as<float>(), arch_->dim,
                               dy_r->as<float>());
}

absl::Status CpuBlockOps::ExchangeCombineGrad(ExpertExchange& exchange,
                                              const ExpertRoute& route,
                                              const Act& dx_r, const Act& dw_r,
                                              Act* dx, Act* d_weights) {
  return exchange.CombineGrad(route, dx_r.as<float>(), dw_r.as<float>(),
                              arch_->dim, dx->as<float>(),
                              d_weights->as<float>());
}

absl::Status CpuBlockOps::ExpertsBackward(const MoeLayerSpec& layer,
                                          const Act& dy, int64_t t, int k,
                                          Saved* state, Act* dx,
                                          Act* d_weights) {
  SHARDD_ASSIGN_OR_RETURN(const ExpertWeights e, ExpertsOf(layer));
  const float* w_gu = e.w_gu;
  const float* w_d = e.w_d;
  const kernels::ExpertOptions& options = e.options;
  const kernels::ExpertDims dims{t, arch_->dim, layer.moe_inter, layer.experts,
                                 k};
  const bool frozen = layer.w_gu.frozen && layer.w_d.frozen;
  float* dw_gu = frozen ? nullptr : Zeroed(&scratch_, layer.w_gu.numel());
  float* dw_d = frozen ? nullptr : Zeroed(&scratch2_, layer.w_d.numel());
  std::vector<float> db_gu(layer.expert_bias ? layer.b_gu.numel() : 0, 0.0f);
  std::vector<float> db_d(layer.expert_bias ? layer.b_d.numel() : 0, 0.0f);
  kernels::ExpertBiasGrads bias_grads;
  if (layer.expert_bias) bias_grads = {db_gu.data(), db_d.data()};
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsBackward(
      dims, arch_->activation, options, w_gu, w_d, F(dy), F(dx),
      /*accumulate_dx=*/false, F(d_weights), dw_gu, dw_d, bias_grads,
      &state->Get<ExpertsState>()->ws));
  if (dw_gu != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(layer.w_gu, dw_gu));
  if (dw_d != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(layer.w_d, dw_d));
  if (layer.expert_bias) {
    SHARDD_RETURN_IF_ERROR(AddGrad(layer.b_gu, db_gu.data()));
    SHARDD_RETURN_IF_ERROR(AddGrad(layer.b_d, db_d.data()));
  }
  return absl::OkStatus();
}

absl::Status CpuBlockOps::HeadLoss(const Act& h, const Act& targets,
                                   int64_t t, const LossTerm& term,
                                   double extra_loss, Act* dh) {
  const ArchTensor& head = arch_->head;
  SHARDD_ASSIGN_OR_RETURN(const float* head_w, Param(head));
  kernels::CrossEntropyOptions options;
  options.softcap = arch_->final_logit_softcap;
  kernels::CrossEntropyResult ce;
  if (dh == nullptr) {
    SHARDD_ASSIGN_OR_RETURN(
        ce, kernels::LmHeadCrossEntropyForward(F(h), head_w, t, arch_->dim,
                                               arch_->vocab,
                                               targets.as<int32_t>(), options));
  } else {
    float* dw =
        head.frozen ? nullptr : Zeroed(&scratch_, arch_->vocab * arch_->dim);
    SHARDD_ASSIGN_OR_RETURN(
        ce, kernels::LmHeadCrossEntropyBackward(
                F(h), head_w, t, arch_->dim, arch_->vocab,
                targets.as<int32_t>(), term.grad_scale, F(dh), dw,
                /*accumulate_dhidden=*/false, options));
    if (dw != nullptr) SHARDD_RETURN_IF_ERROR(AddGrad(head, dw));
  }
  loss_sum_ += term.weight * ce.mean_loss + extra_loss;
  tokens_ += ce.count;
  return absl::OkStatus();
}

namespace {

// The CPU's GemmaDecode for a decode view (its encoder's state).
absl::StatusOr<GemmaDecode> DecodeOf(const GemmaDecodeView* view) {
  GemmaDecode d;
  if (view == nullptr) return d;
  GemmaState* encoder =
      view->encoder == nullptr ? nullptr : view->encoder->Peek<GemmaState>();
  if (encoder == nullptr) {
    return absl::FailedPreconditionError(
        "a DiffusionGemma decode before its layer's encode");
  }
  d.prefix = view->prefix;
  d.encoder_seq = view->encoder_seq;
  d.block = view->block;
  d.encoder = &encoder->acts;
  d.row_prefix = view->row_prefix;
  return d;
}

}  // namespace

absl::Status CpuBlockOps::SetRowSegments(const int32_t* segment_starts) {
  attention_->SetSegments(segment_starts);
  if (mla_ != nullptr) mla_->SetSegments(segment_starts);
  gemma_->SetSegments(segment_starts);
  return absl::OkStatus();
}

absl::Status CpuBlockOps::GemmaLayerForward(const MoeLayerSpec& spec,
                                            const Act* x, int64_t batch,
                                            int64_t seq,
                                            const GemmaDecodeView* decode,
                                            Saved* layer) {
  SHARDD_ASSIGN_OR_RETURN(const GemmaDecode d, DecodeOf(decode));
  GemmaLayerActs* acts = &layer->Get<GemmaState>()->acts;
  const GemmaDecode* dp = decode == nullptr ? nullptr : &d;
  if (x == nullptr) {
    return gemma_->RecomputeLayer(spec, params_, batch, seq, acts, dp);
  }
  return gemma_->ForwardLayer(spec, params_, F(*x), batch, seq, acts, dp);
}

absl::Status CpuBlockOps::GemmaExpertsForward(const MoeLayerSpec& spec,
                                              int64_t t, Saved* layer,
                                              Act* x,
                                              const RoutedExchange* ep,
                                              ExpertsPhase phase) {
  GemmaLayerActs* acts = &layer->Get<GemmaState>()->acts;
  if (x == nullptr && phase == ExpertsPhase::kAll) {
    return gemma_->RecomputeExperts(spec, params_, t, acts, ep);
  }
  return gemma_->ForwardExperts(spec, params_, t, acts,
                                x == nullptr ? nullptr : F(x), ep, phase);
}

absl::Status CpuBlockOps::GemmaExpertsBackward(const MoeLayerSpec& spec,
                                               int64_t t, const Act& dx,
                                               Saved* layer,
                                               const RoutedExchange* ep,
                                               ExpertsPhase phase) {
  return gemma_->BackwardExperts(spec, params_, t, F(dx),
                                 &layer->Get<GemmaState>()->acts, ep, phase);
}

absl::Status CpuBlockOps::GemmaLayerBackward(const MoeLayerSpec& spec,
                                             int64_t batch, int64_t seq,
                                             const GemmaDecodeView* decode,
                                             Saved* layer, Act* dx) {
  SHARDD_ASSIGN_OR_RETURN(const GemmaDecode d, DecodeOf(decode));
  return gemma_->BackwardLayer(spec, params_, batch, seq,
                               &layer->Get<GemmaState>()->acts, F(dx),
                               decode == nullptr ? nullptr : &d);
}

void CpuBlockOps::GemmaTrim(GemmaKeep keep, Saved* layer) {
  GemmaState* state = layer->Peek<GemmaState>();
  if (state == nullptr) return;
  GemmaLayerActs* acts = &state->acts;
  switch (keep) {
    case GemmaKeep::kAllButExpertsWorkspace:
      acts->experts = kernels::GroupedExpertsWorkspace();
      return;
    case GemmaKeep::kAllButExperts:
      GemmaLayerBlock::KeepCheckpoint(/*experts_only=*/true,
                                      /*keep_kv=*/false, acts);
      return;
    case GemmaKeep::kCheckpoint:
    case GemmaKeep::kCheckpointAndKv:
      GemmaLayerBlock::KeepCheckpoint(
          /*experts_only=*/false, keep == GemmaKeep::kCheckpointAndKv, acts);
      return;
  }
}

absl::Status CpuBlockOps::SelfConditioningForward(
    const BlockDiffusionSpec& spec, const Act& noised, const Act* probs,
    const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
    Saved* state, Act* x) {
  const int64_t dim = arch_->dim, vocab = arch_->vocab, t = batch * canvas;
  const float scale = arch_->embedding_scale;
  SelfConditioningState& sc = *state->Get<SelfConditioningState>();
  SHARDD_ASSIGN_OR_RETURN(const float* table, Param(arch_->embed));
  sc.e.resize(t * dim);
  SHARDD_RETURN_IF_ERROR(kernels::EmbeddingForward(
      table, vocab, dim, noised.as<int32_t>(), t, sc.e.data()));
  for (float& v : sc.e) v *= scale;
  const std::vector<float> ones(dim, 1.0f);
  sc.sum = sc.e;
  if (probs != nullptr) {
    // s = softmax(sc_logits) @ E * scale, for the examples whose coin came
    // up; pre_norm, the gated MLP, added to the embeddings.
    sc.signal.assign(t * dim, 0.0f);
    for (int64_t s = 0; s < batch; ++s) {
      if (!coin[s]) continue;
      SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
          nullptr, table, F(*probs) + s * canvas * vocab, canvas, dim, vocab,
          sc.signal.data() + s * canvas * dim, false, nullptr));
    }
    for (float& v : sc.signal) v *= scale;
    SHARDD_ASSIGN_OR_RETURN(const float* pre_w, Param(spec.pre_norm));
    SHARDD_ASSIGN_OR_RETURN(const float* wg, Param(spec.gate));
    SHARDD_ASSIGN_OR_RETURN(const float* wu, Param(spec.up));
    SHARDD_ASSIGN_OR_RETURN(const float* wd, Param(spec.down));
    sc.p.resize(t * dim);
    sc.p_inv.resize(t);
    SHARDD_RETURN_IF_ERROR(kernels::RmsNormForward(sc.signal.data(), pre_w, t,
                                                   dim, arch_->eps, sc.p.data(),
                                                   sc.p_inv.data()));
    sc.mlp_out.resize(t * dim);
    SHARDD_RETURN_IF_ERROR(kernels::DenseMlpForward(
        {t, dim, spec.inter}, arch_->activation, sc.p.data(), wg, wu, wd,
        sc.mlp_out.data(), &sc.mlp));
    for (int64_t i = 0; i < t * dim; ++i) sc.sum[i] += sc.mlp_out[i];
  }
  // Without a signal: pre_norm(0) = 0 and the MLP gives 0, so the input is
  // post_norm(e).
  sc.sum_inv.resize(t);
  return kernels::RmsNormForward(sc.sum.data(), ones.data(), t, dim,
                                 arch_->eps, F(x), sc.sum_inv.data());
}

absl::Status CpuBlockOps::SelfConditioningBackward(
    const BlockDiffusionSpec& spec, const Act& noised, const Act& probs,
    const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
    Saved* state, const Act& dx) {
  const int64_t dim = arch_->dim, vocab = arch_->vocab, t = batch * canvas;
  const float scale = arch_->embedding_scale;
  SelfConditioningState* scp = state->Peek<SelfConditioningState>();
  if (scp == nullptr) {
    return absl::FailedPreconditionError(
        "self-conditioning backward without its forward");
  }
  SelfConditioningState& sc = *scp;
  const std::vector<float> ones(dim, 1.0f);
  std::vector<float> g(t * dim), unused(dim, 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      F(dx), sc.sum.data(), ones.data(), sc.sum_inv.data(), t, dim, g.data(),
      unused.data()));
  // The MLP and pre_norm, down to d(signal).
  SHARDD_ASSIGN_OR_RETURN(const float* pre_w, Param(spec.pre_norm));
  SHARDD_ASSIGN_OR_RETURN(const float* wg, Param(spec.gate));
  SHARDD_ASSIGN_OR_RETURN(const float* wu, Param(spec.up));
  SHARDD_ASSIGN_OR_RETURN(const float* wd, Param(spec.down));
  std::vector<float> dp(t * dim), ds(t * dim), dpre(dim, 0.0f);
  std::vector<float> dwg(spec.gate.numel(), 0.0f), dwu(spec.up.numel(), 0.0f),
      dwd(spec.down.numel(), 0.0f);
  SHARDD_RETURN_IF_ERROR(kernels::DenseMlpBackward(
      {t, dim, spec.inter}, arch_->activation, wg, wu, wd, g.data(), dp.data(),
      false, dwg.data(), dwu.data(), dwd.data(), &sc.mlp));
  SHARDD_RETURN_IF_ERROR(kernels::RmsNormBackward(
      dp.data(), sc.signal.data(), pre_w, sc.p_inv.data(), t, dim, ds.data(),
      dpre.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(spec.pre_norm, dpre.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(spec.gate, dwg.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(spec.up, dwu.data()));
  SHARDD_RETURN_IF_ERROR(AddGrad(spec.down, dwd.data()));
  const ArchTensor& embed = arch_->embed;
  if (embed.frozen) return absl::OkStatus();
  // The embeddings: the canvas ids' rows and, through s = probs @ E * scale
  // (probs detached), probs^T d(s) * scale.
  SHARDD_ASSIGN_OR_RETURN(const float* table, Param(embed));
  float* dtable = Zeroed(&scratch_, vocab * dim);
  for (float& v : g) v *= scale;
  SHARDD_RETURN_IF_ERROR(kernels::EmbeddingBackward(
      g.data(), noised.as<int32_t>(), t, vocab, dim, dtable, arch_->pad_id));
  for (float& v : ds) v *= scale;
  for (int64_t s = 0; s < batch; ++s) {
    if (!coin[s]) continue;
    SHARDD_RETURN_IF_ERROR(kernels::LinearBackward(
        ds.data() + s * canvas * dim, table, F(probs) + s * canvas * vocab,
        canvas, dim, vocab, nullptr, false, dtable));
  }
  return AddGrad(embed, dtable);
}

absl::Status CpuBlockOps::HeadSoftmax(const Act& h, int64_t t, Act* probs) {
  const int64_t dim = arch_->dim, vocab = arch_->vocab;
  SHARDD_ASSIGN_OR_RETURN(const float* head_w, Param(arch_->head));
  float* p = F(probs);
  SHARDD_RETURN_IF_ERROR(
      kernels::LinearForward(F(h), head_w, t, dim, vocab, p));
  if (arch_->final_logit_softcap > 0) {
    kernels::SoftcapForward(p, t * vocab, arch_->final_logit_softcap);
  }
  for (int64_t r = 0; r < t; ++r) {
    float* row = p + r * vocab;
    const float top = *std::max_element(row, row + vocab);
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v) total += kernels::SoftmaxTerm(row[v], top);
    for (int64_t v = 0; v < vocab; ++v) {
      row[v] = kernels::SoftmaxProb(kernels::SoftmaxTerm(row[v], top), total);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBlockOps::AuxStart(Saved* aux) {
  CpuAuxState* s = aux->Get<CpuAuxState>();
  const int64_t experts = arch_->aux_experts;
  s->stats.counts.assign(experts + 2, 0);
  s->stats.counts[experts + 1] = 1;  // This rank.
  s->stats.prob_sums.assign(experts, 0.0f);
  s->sums.assign(experts, 0.0);
  return absl::OkStatus();
}

absl::Status CpuBlockOps::AuxAccumulate(const Saved& router,
                                        const Act& indices, int64_t rows,
                                        Saved* aux) {
  const RouterState* r = router.Peek<RouterState>();
  CpuAuxState* s = aux->Peek<CpuAuxState>();
  if (r == nullptr || s == nullptr) {
    return absl::FailedPreconditionError(
        "load-balancing statistics without a router forward");
  }
  const int64_t experts = arch_->aux_experts;
  // HF's top-k of softmax(logits) is the router's choice for both softmax
  // scorings (the softmax keeps the logits' order).
  SHARDD_RETURN_IF_ERROR(kernels::RouterAuxLossAccumulate(
      kernels::RouterSoftmax(r->cache), indices.as<int32_t>(), rows, experts,
      arch_->top_k, s->stats.counts.data(), s->sums.data()));
  s->stats.counts[experts] += rows;
  return absl::OkStatus();
}

absl::Status CpuBlockOps::AuxFinishForward(Saved* aux) {
  CpuAuxState* s = aux->Peek<CpuAuxState>();
  if (s == nullptr) {
    return absl::FailedPreconditionError("load-balancing statistics missing");
  }
  // fp32 for the all-reduce; the counts stay exact.
  for (int64_t e = 0; e < arch_->aux_experts; ++e) {
    s->stats.prob_sums[e] = static_cast<float>(s->sums[e]);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> CpuBlockOps::AuxLoss(Saved* aux, double coef,
                                            double denominator) {
  CpuAuxState* s = aux->Peek<CpuAuxState>();
  if (s == nullptr) {
    return absl::FailedPreconditionError("load-balancing statistics missing");
  }
  // The statistics are the micro-batch's now (summed over its ranks); each
  // rank's gradient is multiplied by the number of ranks, whose average the
  // reduce-scatter forms.
  const int64_t experts = arch_->aux_experts;
  const int64_t* counts = s->stats.counts.data();
  const std::vector<double> sums(s->stats.prob_sums.begin(),
                                 s->stats.prob_sums.end());
  const double value = kernels::RouterAuxLossValue(counts, sums.data(),
                                                   counts[experts], experts);
  s->grad_scale =
      coef * static_cast<double>(counts[experts + 1]) / denominator;
  return value;
}

absl::Status CpuBlockOps::AuxLogitGrad(const Saved& router, int64_t rows,
                                       const Saved& aux, Act* d_logits) {
  const RouterState* r = router.Peek<RouterState>();
  const CpuAuxState* s = aux.Peek<CpuAuxState>();
  if (r == nullptr || s == nullptr) {
    return absl::FailedPreconditionError(
        "load-balancing gradient without its forward");
  }
  const int64_t experts = arch_->aux_experts;
  return kernels::RouterAuxLossBackward(
      kernels::RouterSoftmax(r->cache), rows, experts, s->stats.counts.data(),
      s->stats.counts[experts], s->grad_scale, F(d_logits));
}

void CpuBlockOps::ResetLoss() {
  loss_sum_ = 0.0;
  tokens_ = 0;
}

double CpuBlockOps::loss(int terms) const {
  return terms == 0 ? 0.0 : loss_sum_ / terms;
}

}  // namespace step
}  // namespace shardd
