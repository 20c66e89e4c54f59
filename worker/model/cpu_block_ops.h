#ifndef SHARDD_WORKER_MODEL_CPU_BLOCK_OPS_H_
#define SHARDD_WORKER_MODEL_CPU_BLOCK_OPS_H_

// BlockOps on the CPU: host fp32 buffers and the kernels of kernels/cpu,
// parameters read and gradients added through a ParamSource. Gradients are
// staged in zeroed host buffers and added once per op, so a frozen
// parameter's are dropped (ParamSource never sees them).

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/model/attention_block.h"
#include "worker/model/block_ops.h"
#include "worker/model/gemma_layer.h"
#include "worker/model/mla_block.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/param_source.h"

namespace shardd {
namespace step {

// A pass's load-balancing statistics on the host, summed over its MoE
// layers' rows.
struct HostRouterAuxStats {
  // [E + 2]: the top-k choices of each expert, then the rows (tokens times
  // MoE layers), then the ranks summed (1 on each rank).
  std::vector<int64_t> counts;
  // [E]: the routing probabilities' sums per expert.
  std::vector<float> prob_sums;
};

// The CPU's state behind an aux Saved: the statistics the caller reduces,
// their local sums in double and the gradient scale of the pass. O(E), so
// not counted as activations.
struct CpuAuxState : BlockState {
  HostRouterAuxStats stats;
  std::vector<double> sums;
  double grad_scale = 0.0;
  int64_t bytes() const override { return 0; }
};

class CpuBlockOps : public BlockOps {
 public:
  // `arch` outlives the ops.
  explicit CpuBlockOps(const MoeArchitecture* arch);
  ~CpuBlockOps() override;

  // The parameters of the commands that follow (not owned).
  void Bind(ParamSource* params) { params_ = params; }

  absl::StatusOr<Act> Allocate(Elem elem, int64_t numel, bool zero) override;
  absl::StatusOr<Act> Upload(const int32_t* host, int64_t n) override;
  absl::Status Copy(const Act& src, Act* dst) override;
  absl::Status Prepare(int64_t seq) override;
  bool per_microbatch_state() const override { return false; }

  absl::Status Add(Act* x, const Act& a, const Act* b) override;
  absl::Status Sum(const Act& x, const Act& a, Act* out) override;
  absl::Status Scale(Act* x, float s) override;
  absl::Status AddScaled(Act* x, const Act& h, float s) override;

  absl::Status EmbedForward(const Act& ids, int64_t t, Act* x) override;
  absl::Status EmbedBackward(Act* dx, const Act& ids, int64_t t,
                             float scale) override;
  absl::Status NormForward(const ArchTensor& w, const Act& x, int64_t rows,
                           Act* y, Act* inv) override;
  absl::Status NormBackward(const ArchTensor& w, const Act& dy, const Act& x,
                            const Act& inv, int64_t rows, Act* dx,
                            bool accumulate) override;
  absl::Status AttentionForward(const MoeLayerSpec& layer, const Act& n,
                                int64_t batch, int64_t seq, Saved* state,
                                Act* y) override;
  absl::Status AttentionBackward(const MoeLayerSpec& layer, const Saved& state,
                                 int64_t batch, int64_t seq, const Act& dy,
                                 Act* dn) override;
  absl::Status MlpForward(const MlpTensors& mlp, const Act& x, int64_t t,
                          Saved* state, Act* y) override;
  absl::Status MlpBackward(const MlpTensors& mlp, const Act& x, int64_t t,
                           const Act& dy, Saved* state, Act* dx,
                           bool accumulate) override;
  absl::Status RouterForward(const MoeLayerSpec& layer, const Act& x,
                             int64_t t, Act* indices, Act* weights,
                             Saved* state) override;
  absl::Status RouterBackward(const MoeLayerSpec& layer, const Act& x,
                              int64_t t, const Act& d_weights,
                              const Act* extra_d_logits, Saved* state,
                              Act* dx) override;
  absl::Status ExpertsForward(const MoeLayerSpec& layer, const Act& x,
                              const Act& indices, const Act& weights,
                              int64_t t, int k, Saved* state,
                              Act* y) override;
  absl::Status ExpertsBackward(const MoeLayerSpec& layer, const Act& dy,
                               int64_t t, int k, Saved* state, Act* dx,
                               Act* d_weights) override;
  bool host_memory() const override { return true; }
  absl::Status ReadChoices(const Act& indices, int64_t n,
                           std::vector<int32_t>* host) override;
  absl::Status ExchangeDispatch(ExpertExchange& exchange,
                                const ExpertRoute& route, const Act& x,
                                const Act& weights, const Act& indices,
                                Act* x_r, Act* ids_r, Act* w_r) override;
  absl::Status ExchangeCombine(ExpertExchange& exchange,
                               const ExpertRoute& route, const Act& y_r,
                               Act* y) override;
  absl::Status ExchangeDispatchGrad(ExpertExchange& exchange,
                                    const ExpertRoute& route, const Act& dy,
                                    Act* dy_r) override;
  absl::Status ExchangeCombineGrad(ExpertExchange& exchange,
                                   const ExpertRoute& route, const Act& dx_r,
                                   const Act& dw_r, Act* dx,
                                   Act* d_weights) override;
  absl::Status SetRowSegments(const int32_t* segment_starts) override;
  absl::Status HeadLoss(const Act& h, const Act& targets, int64_t t,
                        const LossTerm& term, double extra_loss,
                        Act* dh) override;

  absl::Status GemmaLayerForward(const MoeLayerSpec& spec, const Act* x,
                                 int64_t batch, int64_t seq,
                                 const GemmaDecodeView* decode,
                                 Saved* layer) override;
  absl::Status GemmaExpertsForward(const MoeLayerSpec& spec, int64_t t,
                                   Saved* layer, Act* x,
                                   const RoutedExchange* ep,
                                   ExpertsPhase phase) override;
  absl::Status GemmaExpertsBackward(const MoeLayerSpec& spec, int64_t t,
                                    const Act& dx, Saved* layer,
                                    const RoutedExchange* ep,
                                    ExpertsPhase phase) override;
  absl::Status GemmaLayerBackward(const MoeLayerSpec& spec, int64_t batch,
                                  int64_t seq, const GemmaDecodeView* decode,
                                  Saved* layer, Act* dx) override;
  void GemmaTrim(GemmaKeep keep, Saved* layer) override;
  absl::Status SelfConditioningForward(const BlockDiffusionSpec& spec,
                                       const Act& noised, const Act* probs,
                                       const std::vector<uint8_t>& coin,
                                       int64_t batch, int64_t canvas,
                                       Saved* state, Act* x) override;
  absl::Status SelfConditioningBackward(const BlockDiffusionSpec& spec,
                                        const Act& noised, const Act& probs,
                                        const std::vector<uint8_t>& coin,
                                        int64_t batch, int64_t canvas,
                                        Saved* state, const Act& dx) override;
  absl::Status HeadSoftmax(const Act& h, int64_t t, Act* probs) override;

  absl::Status AuxStart(Saved* aux) override;
  absl::Status AuxAccumulate(const Saved& router, const Act& indices,
                             int64_t rows, Saved* aux) override;
  absl::Status AuxFinishForward(Saved* aux) override;
  absl::StatusOr<double> AuxLoss(Saved* aux, double coef,
                                 double denominator) override;
  absl::Status AuxLogitGrad(const Saved& router, int64_t rows,
                            const Saved& aux, Act* d_logits) override;

  void ResetLoss() override;
  double loss(int terms) const override;
  int64_t loss_tokens() const override { return tokens_; }

 private:
  absl::StatusOr<const float*> Param(const ArchTensor& t);
  // A layer's grouped experts: weights and options (biases included).
  struct ExpertWeights {
    const float* w_gu = nullptr;
    const float* w_d = nullptr;
    kernels::ExpertOptions options;
  };
  absl::StatusOr<ExpertWeights> ExpertsOf(const MoeLayerSpec& layer);
  // A zeroed gradient staging buffer of n floats in `buffer`.
  float* Zeroed(std::vector<float>* buffer, int64_t n);
  // Adds staged gradient values (nothing for a frozen parameter).
  absl::Status AddGrad(const ArchTensor& t, const float* values);

  const MoeArchitecture* arch_;
  ParamSource* params_ = nullptr;
  std::unique_ptr<AttentionBlock> attention_;
  std::unique_ptr<MlaBlock> mla_;
  std::unique_ptr<GemmaLayerBlock> gemma_;
  std::vector<float> scratch_, scratch2_;  // Gradient staging.
  double loss_sum_ = 0.0;  // Sum of the terms' weighted means.
  int64_t tokens_ = 0;
};

}  // namespace step
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_CPU_BLOCK_OPS_H_
