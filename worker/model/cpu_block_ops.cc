#include "worker/model/cpu_block_ops.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/compute_pool.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/dense_mlp.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grouped_experts.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/router_aux_loss.h"
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
      mla_(std::make_unique<MlaBlock>(arch)) {}

CpuBlockOps::~CpuBlockOps() = default;

absl::Status CpuBlockOps::Prepare(int64_t seq) {
  for (const MoeLayerSpec& layer : arch_->layers) {
    if (layer.has_attention) {
      return layer.mla ? mla_->Prepare(seq) : attention_->Prepare(seq);
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

absl::Status CpuBlockOps::ExpertsForward(const MoeLayerSpec& layer,
                                         const Act& x, const Act& indices,
                                         const Act& weights, int64_t t,
                                         Saved* state, Act* y) {
  SHARDD_ASSIGN_OR_RETURN(const float* w_gu, Param(layer.w_gu));
  SHARDD_ASSIGN_OR_RETURN(const float* w_d, Param(layer.w_d));
  kernels::ExpertOptions options = arch_->ExpertOptions();
  if (layer.expert_bias) {
    SHARDD_ASSIGN_OR_RETURN(options.gate_up_bias, Param(layer.b_gu));
    SHARDD_ASSIGN_OR_RETURN(options.down_bias, Param(layer.b_d));
  }
  const kernels::ExpertDims dims{t, arch_->dim, layer.moe_inter, layer.experts,
                                 arch_->top_k};
  kernels::GroupedExpertsWorkspace& ws = state->Get<ExpertsState>()->ws;
  SHARDD_RETURN_IF_ERROR(kernels::GroupedExpertsForward(
      dims, arch_->activation, options, F(x), indices.as<int32_t>(),
      F(weights), nullptr, w_gu, w_d, F(y), &ws));
  // The per-row outputs are the kernel's scratch; backward does not read
  // them.
  kernels::UninitVector<float>().swap(ws.o);
  return absl::OkStatus();
}

absl::Status CpuBlockOps::ExpertsBackward(const MoeLayerSpec& layer,
                                          const Act& dy, int64_t t,
                                          Saved* state, Act* dx,
                                          Act* d_weights) {
  SHARDD_ASSIGN_OR_RETURN(const float* w_gu, Param(layer.w_gu));
  SHARDD_ASSIGN_OR_RETURN(const float* w_d, Param(layer.w_d));
  kernels::ExpertOptions options = arch_->ExpertOptions();
  if (layer.expert_bias) {
    SHARDD_ASSIGN_OR_RETURN(options.gate_up_bias, Param(layer.b_gu));
    SHARDD_ASSIGN_OR_RETURN(options.down_bias, Param(layer.b_d));
  }
  const kernels::ExpertDims dims{t, arch_->dim, layer.moe_inter, layer.experts,
                                 arch_->top_k};
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
