#ifndef SHARDD_WORKER_MODEL_BLOCK_OPS_H_
#define SHARDD_WORKER_MODEL_BLOCK_OPS_H_

// The per-device half of a training step (docs/step_driver.md). ModelStep
// (model_step.h) decides what a step computes, keeps, frees and recomputes;
// a BlockOps supplies only the arithmetic of the blocks (norms, attention,
// router, experts, MLP, head) and the memory they run on. The CPU's is
// CpuBlockOps (cpu_block_ops.h); the GPU's will follow the same interface.
//
// Memory is handed out as Act (an activation or temporary buffer of one
// element type) and Saved (a block's opaque state between its forward and
// backward). Both are counted by an ActivationLedger while they hold memory
// and are attached to it, which is how the step measures the activation
// bytes the planner predicts (planner/activation_model.h).

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace step {

// Element types of an Act. kStorage is the device's activation storage type
// (fp32 on the CPU; the job's compute dtype on a GPU).
enum class Elem : uint8_t { kStorage, kF32, kI32 };

// Live activation bytes and the most held since BeginCommand.
class ActivationLedger {
 public:
  void Add(int64_t bytes) {
    live_ += bytes;
    if (live_ > peak_) peak_ = live_;
  }
  void Sub(int64_t bytes) { live_ -= bytes; }
  void BeginCommand() { peak_ = live_; }
  int64_t live() const { return live_; }
  int64_t command_peak() const { return peak_; }

 private:
  int64_t live_ = 0;
  int64_t peak_ = 0;
};

// A device's memory behind an Act.
class ActMemory {
 public:
  virtual ~ActMemory() = default;
  virtual void* data() = 0;
};

// A buffer of `numel` elements, move-only. Attached to a ledger (Track) it
// counts its bytes there until it is reset or destroyed.
class Act {
 public:
  Act() = default;
  Act(std::unique_ptr<ActMemory> memory, Elem elem, int64_t numel,
      int64_t bytes)
      : memory_(std::move(memory)), elem_(elem), numel_(numel), bytes_(bytes) {}
  Act(Act&& other) noexcept { *this = std::move(other); }
  Act& operator=(Act&& other) noexcept {
    if (this != &other) {
      Reset();
      memory_ = std::move(other.memory_);
      elem_ = other.elem_;
      numel_ = other.numel_;
      bytes_ = other.bytes_;
      ledger_ = other.ledger_;
      other.numel_ = other.bytes_ = 0;
      other.ledger_ = nullptr;
    }
    return *this;
  }
  Act(const Act&) = delete;
  Act& operator=(const Act&) = delete;
  ~Act() { Reset(); }

  // Counts this buffer in `ledger` (once; a tracked Act stays tracked).
  void Track(ActivationLedger* ledger) {
    if (ledger_ != nullptr || ledger == nullptr || memory_ == nullptr) return;
    ledger_ = ledger;
    ledger_->Add(bytes_);
  }
  void Reset() {
    if (ledger_ != nullptr) ledger_->Sub(bytes_);
    ledger_ = nullptr;
    memory_.reset();
    numel_ = bytes_ = 0;
  }

  bool empty() const { return memory_ == nullptr; }
  Elem elem() const { return elem_; }
  int64_t numel() const { return numel_; }
  int64_t bytes() const { return bytes_; }
  void* data() { return memory_ == nullptr ? nullptr : memory_->data(); }
  const void* data() const {
    return memory_ == nullptr ? nullptr : memory_->data();
  }
  template <typename T>
  T* as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data());
  }

 private:
  std::unique_ptr<ActMemory> memory_;
  Elem elem_ = Elem::kStorage;
  int64_t numel_ = 0;
  int64_t bytes_ = 0;
  ActivationLedger* ledger_ = nullptr;
};

// A block's saved state on one device (a router's softmax, an MLP's hidden
// activations, an attention's q/k/v and log-sum-exp, ...).
class BlockState {
 public:
  virtual ~BlockState() = default;
  virtual int64_t bytes() const = 0;
};

// A BlockState slot. The block that fills it creates the state; the step
// calls Sync after each op that may have grown or trimmed it, so the ledger
// follows what it holds.
class Saved {
 public:
  Saved() = default;
  Saved(Saved&& other) noexcept { *this = std::move(other); }
  Saved& operator=(Saved&& other) noexcept {
    if (this != &other) {
      Reset();
      state_ = std::move(other.state_);
      ledger_ = other.ledger_;
      counted_ = other.counted_;
      other.ledger_ = nullptr;
      other.counted_ = 0;
    }
    return *this;
  }
  Saved(const Saved&) = delete;
  Saved& operator=(const Saved&) = delete;
  ~Saved() { Reset(); }

  bool empty() const { return state_ == nullptr; }
  // The state as the device's type S, created when empty.
  template <typename S>
  S* Get() {
    if (state_ == nullptr) state_ = std::make_unique<S>();
    return static_cast<S*>(state_.get());
  }
  // The held state (null when empty).
  template <typename S>
  const S* Peek() const {
    return static_cast<const S*>(state_.get());
  }
  template <typename S>
  S* Peek() {
    return static_cast<S*>(state_.get());
  }
  // Re-reads the state's bytes into `ledger`.
  void Sync(ActivationLedger* ledger) {
    if (ledger == nullptr) return;
    if (ledger_ != nullptr && ledger_ != ledger) Reset();
    ledger_ = ledger;
    const int64_t now = state_ == nullptr ? 0 : state_->bytes();
    if (now > counted_) ledger_->Add(now - counted_);
    if (now < counted_) ledger_->Sub(counted_ - now);
    counted_ = now;
  }
  void Reset() {
    if (ledger_ != nullptr) ledger_->Sub(counted_);
    ledger_ = nullptr;
    counted_ = 0;
    state_.reset();
  }

 private:
  std::unique_ptr<BlockState> state_;
  ActivationLedger* ledger_ = nullptr;
  int64_t counted_ = 0;
};

// A gated MLP's weights (a dense layer's, or beside the experts).
struct MlpTensors {
  const ArchTensor* gate = nullptr;
  const ArchTensor* up = nullptr;
  const ArchTensor* down = nullptr;
  int64_t inter = 0;
};

// How a head's cross-entropy enters the step's loss and gradient.
struct LossTerm {
  // The gradient of each counted token's loss (1 / the tokens the step's
  // mean divides by).
  float grad_scale = 0.0f;
  // The term's weight in the step's loss sum (its mean is added times it).
  double weight = 1.0;
};

// A DiffusionGemma decode's view of its encode: the same layer's state in
// pass 0 (gemma_layer.h's GemmaDecode).
struct GemmaDecodeView {
  int64_t prefix = 0;       // Canvas row j sits at position prefix + j.
  int64_t encoder_seq = 0;  // Rows per sequence of the encode's K/V.
  int64_t block = 0;        // Canvas rows per decode block.
  Saved* encoder = nullptr;
  // SFT rows: [batch] each row's own prefix (gemma_layer.h's GemmaDecode).
  const int32_t* row_prefix = nullptr;
};

// What a DiffusionGemma layer's state keeps (GemmaTrim).
enum class GemmaKeep : uint8_t {
  // Everything but the grouped experts' workspace (after their backward).
  kAllButExpertsWorkspace,
  // Everything but the experts' state and output (they recompute).
  kAllButExperts,
  // A recomputed layer's checkpoint: its input and what BACKWARD(EXPERTS)
  // reads besides the experts' state; with kv, the K/V a decode reads.
  kCheckpoint,
  kCheckpointAndKv,
};

// The arithmetic and memory of one device. Weights are named by their
// ArchTensor and read from the parameters bound for the current command;
// parameter gradients are added there (nothing for a frozen parameter).
// Unless said otherwise, outputs are allocated by the caller with the
// input's row count, and every op returns the kernels' errors
// (INVALID_ARGUMENT for bad shapes or ids, FAILED_PRECONDITION for a
// backward without its forward) and the parameter source's.
class BlockOps {
 public:
  virtual ~BlockOps() = default;

  // ---- Memory.
  // A buffer of `numel` elements, zeroed when `zero` (else unspecified).
  virtual absl::StatusOr<Act> Allocate(Elem elem, int64_t numel,
                                       bool zero) = 0;
  // An int32 buffer holding host values [n].
  virtual absl::StatusOr<Act> Upload(const int32_t* host, int64_t n) = 0;
  // dst (allocated, same numel) = src.
  virtual absl::Status Copy(const Act& src, Act* dst) = 0;
  // Readies the blocks for sequences of `seq` tokens (RoPE tables).
  // Errors: INVALID_ARGUMENT beyond the model's max_position_embeddings.
  virtual absl::Status Prepare(int64_t seq) = 0;
  // Whether activations are kept per (pass, micro-batch) (micro-batches may
  // interleave), rather than per pass.
  virtual bool per_microbatch_state() const = 0;

  // ---- Elementwise, in storage type.
  // x += a, or x += (a + b) with b.
  virtual absl::Status Add(Act* x, const Act& a, const Act* b) = 0;
  // out = x + a.
  virtual absl::Status Sum(const Act& x, const Act& a, Act* out) = 0;
  virtual absl::Status Scale(Act* x, float s) = 0;
  // x += s * h.
  virtual absl::Status AddScaled(Act* x, const Act& h, float s) = 0;

  // ---- Blocks.
  // x [t, D] = the embedding rows of ids [t] (int32).
  virtual absl::Status EmbedForward(const Act& ids, int64_t t, Act* x) = 0;
  // The embedding's gradient from dx (first scaled in place by `scale`
  // when the table trains and scale != 1).
  virtual absl::Status EmbedBackward(Act* dx, const Act& ids, int64_t t,
                                     float scale) = 0;
  // y [rows, D] = RMSNorm(x; w), inv [rows] fp32 its inverse RMS.
  virtual absl::Status NormForward(const ArchTensor& w, const Act& x,
                                   int64_t rows, Act* y, Act* inv) = 0;
  // dx = (or += with `accumulate`) RMSNorm'(dy); w's gradient is added.
  virtual absl::Status NormBackward(const ArchTensor& w, const Act& dy,
                                    const Act& x, const Act& inv, int64_t rows,
                                    Act* dx, bool accumulate) = 0;
  // The layer's self-attention sublayer (MHA/GQA or DeepSeek-V3's latent
  // attention, as `layer` says) over the normed input n [batch * seq, D]:
  // y [T, D], its saved state in `state`.
  virtual absl::Status AttentionForward(const MoeLayerSpec& layer,
                                        const Act& n, int64_t batch,
                                        int64_t seq, Saved* state, Act* y) = 0;
  // dn [T, D] (overwritten) from dy; the sublayer's gradients are added.
  virtual absl::Status AttentionBackward(const MoeLayerSpec& layer,
                                         const Saved& state, int64_t batch,
                                         int64_t seq, const Act& dy,
                                         Act* dn) = 0;
  // y [t, D] = the gated MLP of x [t, D].
  virtual absl::Status MlpForward(const MlpTensors& mlp, const Act& x,
                                  int64_t t, Saved* state, Act* y) = 0;
  // dx = (or += with `accumulate`) the MLP's input gradient.
  virtual absl::Status MlpBackward(const MlpTensors& mlp, const Act& x,
                                   int64_t t, const Act& dy, Saved* state,
                                   Act* dx, bool accumulate) = 0;
  // The layer's router over x [t, D]: indices [t, K] int32 and weights
  // [t, K] fp32.
  virtual absl::Status RouterForward(const MoeLayerSpec& layer, const Act& x,
                                     int64_t t, Act* indices, Act* weights,
                                     Saved* state) = 0;
  // dx += the router's input gradient from d_weights [t, K] fp32 and
  // extra_d_logits [t, E] fp32 (null: none).
  virtual absl::Status RouterBackward(const MoeLayerSpec& layer, const Act& x,
                                      int64_t t, const Act& d_weights,
                                      const Act* extra_d_logits, Saved* state,
                                      Act* dx) = 0;
  // The layer's grouped experts: y [t, D] from x, indices and weights
  // [t, k] (k: the model's top_k, or 1 for rows an expert-parallel
  // exchange delivered, with `layer` holding only the local experts).
  virtual absl::Status ExpertsForward(const MoeLayerSpec& layer, const Act& x,
                                      const Act& indices, const Act& weights,
                                      int64_t t, int k, Saved* state,
                                      Act* y) = 0;
  // dx [t, D] and d_weights [t, k] fp32 (overwritten) from dy.
  virtual absl::Status ExpertsBackward(const MoeLayerSpec& layer,
                                       const Act& dy, int64_t t, int k,
                                       Saved* state, Act* dx,
                                       Act* d_weights) = 0;
  // Whether Act memory is host memory.
  virtual bool host_memory() const = 0;
  // Expert parallelism (expert_exchange.h) on this device's activations:
  // the router's choices [n] int32 read back to the host for the route,
  // and ExpertExchange's four row exchanges (Dispatch, Combine,
  // DispatchGrad, CombineGrad) of `route` through `exchange`'s group, with
  // rows of arch.dim values; outputs are allocated by the caller, the
  // received ones with route.received rows (at least one).
  virtual absl::Status ReadChoices(const Act& indices, int64_t n,
                                   std::vector<int32_t>* host) = 0;
  virtual absl::Status ExchangeDispatch(ExpertExchange& exchange,
                                        const ExpertRoute& route,
                                        const Act& x, const Act& weights,
                                        const Act& indices, Act* x_r,
                                        Act* ids_r, Act* w_r) = 0;
  virtual absl::Status ExchangeCombine(ExpertExchange& exchange,
                                       const ExpertRoute& route,
                                       const Act& y_r, Act* y) = 0;
  virtual absl::Status ExchangeDispatchGrad(ExpertExchange& exchange,
                                            const ExpertRoute& route,
                                            const Act& dy, Act* dy_r) = 0;
  virtual absl::Status ExchangeCombineGrad(ExpertExchange& exchange,
                                           const ExpertRoute& route,
                                           const Act& dx_r, const Act& dw_r,
                                           Act* dx, Act* d_weights) = 0;
  // Packed rows for the attention of the computations that follow
  // (docs/sft_data.md): segment_starts [t] host memory, each token's
  // example start within its row, or null. FAILED_PRECONDITION where the
  // ops do not run packed rows.
  virtual absl::Status SetRowSegments(const int32_t* segment_starts) = 0;
  // The head's cross-entropy of h [t, D] against targets [t] (int32, -1
  // ignored), its mean times term.weight added to the step's loss with
  // `extra_loss` (the load-balancing term), and with dh (else forward
  // only) dh [t, D] = its gradient times term.grad_scale, the head's
  // gradient added.
  virtual absl::Status HeadLoss(const Act& h, const Act& targets, int64_t t,
                                const LossTerm& term, double extra_loss,
                                Act* dh) = 0;

  // ---- DiffusionGemma (gemma_layer.h has the math, block_diffusion.h the
  // canvas).
  // LAYER's forward into `layer` from x [T, D] (copied in), or with null x
  // again from the kept input (a recompute; FAILED_PRECONDITION without
  // it). `decode`: the layer runs the canvas of a decode.
  virtual absl::Status GemmaLayerForward(const MoeLayerSpec& spec,
                                         const Act* x, int64_t batch,
                                         int64_t seq,
                                         const GemmaDecodeView* decode,
                                         Saved* layer) = 0;
  // EXPERTS' forward: the layer's output into *x [T, D]; with null x only
  // the experts' state again (a recompute before their backward). With
  // `ep`, the routed experts run expert-parallel and `spec` holds this
  // rank's block; `phase` is the share of the DISPATCH, EXPERTS or COMBINE
  // command (x written by COMBINE), or kAll.
  virtual absl::Status GemmaExpertsForward(const MoeLayerSpec& spec,
                                           int64_t t, Saved* layer, Act* x,
                                           const RoutedExchange* ep,
                                           ExpertsPhase phase) = 0;
  // BACKWARD(EXPERTS) from dx, the gradient of the layer's output (`ep` as
  // in the forward; BACKWARD COMBINE, EXPERTS, DISPATCH's shares in that
  // order).
  virtual absl::Status GemmaExpertsBackward(const MoeLayerSpec& spec,
                                            int64_t t, const Act& dx,
                                            Saved* layer,
                                            const RoutedExchange* ep,
                                            ExpertsPhase phase) = 0;
  // BACKWARD(LAYER): dx becomes the gradient of the layer's input; a
  // decode's encoder-row K/V gradients are added to decode->encoder.
  virtual absl::Status GemmaLayerBackward(const MoeLayerSpec& spec,
                                          int64_t batch, int64_t seq,
                                          const GemmaDecodeView* decode,
                                          Saved* layer, Act* dx) = 0;
  virtual void GemmaTrim(GemmaKeep keep, Saved* layer) = 0;
  // The decode's input x [batch * canvas, D] from the noised canvas ids:
  // the scaled embeddings, plus with `probs` [batch * canvas, V] the
  // self-conditioning signal of the sequences whose coin is set, through
  // the block's norms and MLP (spec: BlockDiffusionSpec's tensors).
  virtual absl::Status SelfConditioningForward(
      const BlockDiffusionSpec& spec, const Act& noised, const Act* probs,
      const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
      Saved* state, Act* x) = 0;
  // Its backward from dx: the block's and the embedding's gradients.
  virtual absl::Status SelfConditioningBackward(
      const BlockDiffusionSpec& spec, const Act& noised, const Act& probs,
      const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
      Saved* state, const Act& dx) = 0;
  // probs [t, V] fp32 = softmax of the head's (soft-capped) logits of h.
  virtual absl::Status HeadSoftmax(const Act& h, int64_t t, Act* probs) = 0;

  // ---- The load-balancing loss (statistics in `aux`, one per pass).
  // Zeroes the statistics; this rank counts as one.
  virtual absl::Status AuxStart(Saved* aux) = 0;
  // Adds the rows of a router's last forward.
  virtual absl::Status AuxAccumulate(const Saved& router, const Act& indices,
                                     int64_t rows, Saved* aux) = 0;
  // Rounds the local sums for the caller's all-reduce.
  virtual absl::Status AuxFinishForward(Saved* aux) = 0;
  // The loss from the (reduced) statistics; sets the gradient scale
  // coef * ranks / denominator for AuxLogitGrad.
  virtual absl::StatusOr<double> AuxLoss(Saved* aux, double coef,
                                         double denominator) = 0;
  // d_logits [rows, E] fp32 of the router's last forward.
  virtual absl::Status AuxLogitGrad(const Saved& router, int64_t rows,
                                    const Saved& aux, Act* d_logits) = 0;

  // ---- The step's loss.
  virtual void ResetLoss() = 0;
  // The mean over `terms` loss terms and the target tokens counted.
  virtual double loss(int terms) const = 0;
  virtual int64_t loss_tokens() const = 0;
};

}  // namespace step
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_BLOCK_OPS_H_
