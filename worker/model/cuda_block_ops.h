#ifndef SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_H_
#define SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_H_

// BlockOps on one CUDA device (docs/step_driver.md): the arithmetic and
// memory ModelStep drives on a GPU, with the kernels of kernels/cuda and
// the device attention blocks. Activations are stored in the job's compute
// dtype (bf16 under mixed precision, else fp32) with fp32 accumulation;
// norm statistics, routing weights and every parameter gradient are fp32.
// Parameters are read and gradients added through a DeviceParamSource
// (a parameter held in the other dtype is cast into a temporary; a frozen
// one gets no gradient).
//
// Everything is enqueued on one stream and nothing waits for the device,
// except the grouped experts' one synchronization per forward (the
// per-expert counts cuBLAS's grouped GEMM needs; host_synchronizations()),
// ReadStepLoss (the step's end) and, outside the commands, the RoPE
// tables' upload when SetBatch brings a longer sequence than any before.
// The step's loss, token count and data-error counters stay in device
// memory until ReadStepLoss. Memory comes from a DeviceAllocator (kind
// kWorkspace), so after the first step no cudaMalloc happens; the step's
// ActivationLedger counts the activations in their storage bytes.
//
// DiffusionGemma's layer (gemma_layer.h has the math) runs here too
// (cuda_block_ops_gemma.cc), its decode's attention block by block over
// [encoder K/V ; canvas K/V]. Expert parallelism's row exchanges run here
// too (cuda_block_ops_exchange.cc: kernels/cuda/expert_permute around
// NCCL all-to-alls), DiffusionGemma's excepted.
//
// Not run on a GPU yet (written 2026-12-07; tools/gpu_check.sh runs its
// tests first when a GPU is lent).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/cuda/grouped_experts.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/block_ops.h"
#include "worker/model/device_attention_block.h"
#include "worker/model/device_mla_block.h"
#include "worker/model/device_param_source.h"
#include "worker/model/moe_architecture.h"

namespace shardd {
namespace step {

// A pass's load-balancing statistics in device memory (the CPU's
// HostRouterAuxStats): what the caller all-reduces between FORWARD(HEAD)
// and BACKWARD(HEAD) on the ops' stream.
struct DeviceAuxStats {
  int64_t* counts = nullptr;  // [E + 2] int64: choices, rows, ranks
  int64_t num_counts = 0;
  float* prob_sums = nullptr;  // [E] fp32
  int64_t num_prob_sums = 0;
};

class CudaBlockOps : public BlockOps {
 public:
  // On `device` (set current by the caller around every call), enqueuing
  // on `stream` (not owned; outlives the ops), activations in `storage`.
  // `arch` and `allocator` outlive the ops.
  // Errors: INVALID_ARGUMENT for a null arch, stream or allocator; cuBLAS
  // and allocation errors.
  static absl::StatusOr<std::unique_ptr<CudaBlockOps>> Create(
      const MoeArchitecture* arch, DeviceDType storage, cudaStream_t stream,
      DeviceAllocator* allocator);
  ~CudaBlockOps() override;

  // The parameters of the commands that follow (not owned).
  void Bind(DeviceParamSource* params) { params_ = params; }

  // Waits for the stream; the mean over `terms` loss terms and the target
  // tokens counted since ResetLoss (loss() and loss_tokens() return them
  // afterwards). Errors: INVALID_ARGUMENT for token ids or targets outside
  // the vocabulary that reached the kernels; CUDA errors.
  struct StepLoss {
    double loss = 0.0;
    int64_t tokens = 0;
  };
  absl::StatusOr<StepLoss> ReadStepLoss(int terms);
  // Host waits so far (the grouped experts' count reads).
  int64_t host_synchronizations() const { return host_syncs_; }
  // The device statistics behind an aux Saved (all null before AuxStart).
  DeviceAuxStats AuxStatsOf(Saved* aux) const;

  absl::StatusOr<Act> Allocate(Elem elem, int64_t numel, bool zero) override;
  absl::StatusOr<Act> Upload(const int32_t* host, int64_t n) override;
  absl::Status Copy(const Act& src, Act* dst) override;
  absl::Status Prepare(int64_t seq) override;
  bool per_microbatch_state() const override { return true; }

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
  absl::Status RouterForward(const MoeLayerSpec& layer, const Act& x, int64_t t,
                             Act* indices, Act* weights, Saved* state) override;
  absl::Status RouterBackward(const MoeLayerSpec& layer, const Act& x,
                              int64_t t, const Act& d_weights,
                              const Act* extra_d_logits, Saved* state,
                              Act* dx) override;
  absl::Status ExpertsForward(const MoeLayerSpec& layer, const Act& x,
                              const Act& indices, const Act& weights, int64_t t,
                              int k, Saved* state, Act* y) override;
  absl::Status ExpertsBackward(const MoeLayerSpec& layer, const Act& dy,
                               int64_t t, int k, Saved* state, Act* dx,
                               Act* d_weights) override;
  bool host_memory() const override { return false; }
  // Expert parallelism: the exchange's rows move over `ep` (the expert
  // group's NCCL communicator, the one the ExpertExchange was made with;
  // not owned), stream-ordered with the ops' stream; the route's counts go
  // through the exchange itself. Null: no expert parallelism.
  void SetExpertGroup(NcclCommunicator* ep, absl::Duration timeout) {
    ep_group_ = ep;
    ep_timeout_ = timeout;
  }
  // One host wait (the choices' copy back).
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
  // Adds coef * the loss to the device's step loss itself and returns 0
  // (the statistics never visit the host), so the caller's extra_loss
  // stays 0.
  absl::StatusOr<double> AuxLoss(Saved* aux, double coef,
                                 double denominator) override;
  absl::Status AuxLogitGrad(const Saved& router, int64_t rows, const Saved& aux,
                            Act* d_logits) override;

  // Zeroes the device's step loss (stream-ordered); an error surfaces at
  // the next ReadStepLoss.
  void ResetLoss() override;
  double loss(int terms) const override;
  int64_t loss_tokens() const override { return tokens_; }

 private:
  CudaBlockOps(const MoeArchitecture* arch, DeviceDType storage,
               cudaStream_t stream, DeviceAllocator* allocator);

  bool bf16() const { return storage_ == DeviceDType::kBFloat16; }
  absl::StatusOr<DeviceBuffer> Alloc(int64_t bytes);
  // `host` [n] in a new device buffer, through pinned staging (no wait).
  absl::StatusOr<DeviceBuffer> UploadBuffer(const int32_t* host, int64_t n);
  absl::StatusOr<DeviceBuffer> UploadBytes(const void* host, int64_t bytes);
  // A route's order or position (worker/model/expert_exchange.h).
  absl::StatusOr<DeviceBuffer> UploadRoute(const std::vector<int64_t>& host);
  // Expert parallelism's row exchanges in storage type T on device memory
  // (cuda_block_ops_exchange.cc): the Act forms and DiffusionGemma's state
  // both call these. Dispatch: the route's rows of x [t, D] with their
  // weights and choices -> x_r [received, D], ids_r (local expert) and w_r.
  // Combine: y_r [received, D] -> y [t, D]. DispatchGrad: dy [t, D] ->
  // dy_r. CombineGrad: dx_r, dw_r -> dx [t, D] and d_weights [t, K].
  template <typename T>
  absl::Status ExchangeDispatchT(ExpertExchange& exchange,
                                 const ExpertRoute& route, const T* x,
                                 const float* weights, const int32_t* indices,
                                 T* x_r, int32_t* ids_r, float* w_r);
  template <typename T>
  absl::Status ExchangeCombineT(const ExpertRoute& route, const T* y_r, T* y);
  template <typename T>
  absl::Status ExchangeDispatchGradT(const ExpertRoute& route, const T* dy,
                                     T* dy_r);
  template <typename T>
  absl::Status ExchangeCombineGradT(const ExpertRoute& route, const T* dx_r,
                                    const float* dw_r, T* dx, float* d_weights);
  // n values of `a` in fp32: its own memory when T is float, else widened
  // into `widened`.
  template <typename T>
  absl::StatusOr<const float*> Widened(const T* a, int64_t n,
                                       DeviceBuffer* widened);
  // The router's n choices (device int32) on the host (waits for the
  // stream: the exchange's counts go first).
  absl::Status ReadChoicesRaw(const int32_t* indices, int64_t n,
                              std::vector<int32_t>* host);
  // One all-to-all of fp32 rows `width` wide over the expert group, ordered
  // after the stream's work and before what follows on it: `send` in route
  // order -> `recv` by source rank, or the reverse.
  absl::Status ExchangeRows(const ExpertRoute& route, bool reverse,
                            int64_t width, const float* send, float* recv);
  // The parameter in storage type T (a cast into `temps` when it is held
  // in the other dtype), or in fp32 with T = float.
  template <typename T>
  absl::StatusOr<const T*> Param(const ArchTensor& t,
                                 std::vector<DeviceBuffer>* temps);
  // The fp32 gradient to add to; null for a frozen parameter.
  absl::StatusOr<float*> Grad(const ArchTensor& t);
  // The packed rows' device key_begin and each token's RoPE position for
  // batch x seq tokens (uploaded when they changed).
  absl::Status Geometry(int64_t batch, int64_t seq, const int32_t** positions);
  template <typename T>
  absl::Status AttentionForwardT(const MoeLayerSpec& layer, const Act& n,
                                 int64_t batch, int64_t seq, Saved* state,
                                 Act* y);
  template <typename T>
  absl::Status AttentionBackwardT(const MoeLayerSpec& layer, const Saved& state,
                                  int64_t batch, int64_t seq, const Act& dy,
                                  Act* dn);
  template <typename T>
  absl::Status ExpertsForwardT(const MoeLayerSpec& layer, const Act& x,
                               const Act& indices, const Act& weights,
                               int64_t t, int k, Saved* state, Act* y);
  template <typename T>
  absl::Status ExpertsBackwardT(const MoeLayerSpec& layer, const Act& dy,
                                int64_t t, int k, Saved* state, Act* dx,
                                Act* d_weights);
  template <typename T>
  absl::Status HeadLossT(const Act& h, const Act& targets, int64_t t,
                         const LossTerm& term, Act* dh);
  // The gated MLP over raw storage pointers: y [t, D] and its saved state
  // (allocated into *saved); the backward writes or adds dx.
  template <typename T>
  absl::Status MlpForwardRaw(const MlpTensors& mlp, const T* x, int64_t t, T* y,
                             DeviceBuffer* saved);
  template <typename T>
  absl::Status MlpBackwardRaw(const MlpTensors& mlp, const T* x, int64_t t,
                              const T* dy, const DeviceBuffer& saved, T* dx,
                              bool accumulate);
  // DiffusionGemma's layer, self-conditioning block and head softmax
  // (cuda_block_ops_gemma.cc).
  struct Gemma;
  // The weightless norms' ones and the full and sliding RoPE tables for
  // positions [0, seq). Errors: INVALID_ARGUMENT beyond
  // max_position_embeddings.
  absl::Status PrepareGemma(int64_t seq);
  // The grouped experts' options of the architecture (no biases).
  kernels::cuda::GroupedExpertsOptions ExpertOptions() const;
  // A grouped-experts workspace of `dims` bound to new device memory.
  struct ExpertSlot {
    DeviceBuffer memory;
    std::shared_ptr<kernels::cuda::GroupedExpertsWorkspace> workspace;
  };
  absl::StatusOr<ExpertSlot> AcquireExpertSlot(
      const kernels::cuda::ExpertDims& dims);

  const MoeArchitecture* arch_;
  const DeviceDType storage_;
  cudaStream_t stream_;
  DeviceAllocator* allocator_;
  DeviceParamSource* params_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer cublas_workspace_;
  std::unique_ptr<DeviceAttentionBlock> attention_;
  std::unique_ptr<DeviceMlaBlock> mla_;
  // device_model::DeviceStepLoss, its pinned host copy, and a zeroing
  // error not yet reported.
  DeviceBuffer step_loss_;
  void* pinned_loss_ = nullptr;
  absl::Status reset_error_;
  double loss_sum_ = 0.0;  // ReadStepLoss's.
  int64_t tokens_ = 0;
  double host_extra_loss_ = 0.0;  // HeadLoss's extra_loss terms.
  int64_t host_syncs_ = 0;
  // Pinned staging buffers of uploads, each free again once its event
  // completed.
  struct Staging {
    char* host = nullptr;
    int64_t capacity = 0;  // Bytes.
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  std::vector<Staging> staging_;
  // Expert parallelism's group (SetExpertGroup).
  NcclCommunicator* ep_group_ = nullptr;
  absl::Duration ep_timeout_ = absl::Seconds(60);
  // Packed rows: the host segments of the calls that follow (not owned),
  // and what the device buffers below were built from.
  const int32_t* segments_ = nullptr;
  std::vector<int32_t> uploaded_segments_;
  int64_t uploaded_batch_ = -1, uploaded_seq_ = -1;
  bool uploaded_packed_ = false;
  DeviceBuffer positions_, key_begin_;
  // A decode's canvas positions, as last uploaded.
  std::vector<int32_t> decode_positions_host_;
  DeviceBuffer decode_positions_;
  // DiffusionGemma: ones [max(D, head dims)] in storage type, and the full
  // (0) and sliding (1) layers' RoPE tables over gemma_positions_.
  DeviceBuffer ones_;
  DeviceBuffer gemma_cos_[2], gemma_sin_[2];
  int64_t gemma_positions_ = 0;
  // Grouped-experts workspace objects by (device address, bytes): the
  // caching allocator hands the same blocks back step after step, so the
  // objects (a pinned buffer, an event) are made in the first step only.
  // A state holding one shares it, so dropping the cache's entries never
  // frees one in use.
  std::map<std::pair<void*, size_t>,
           std::shared_ptr<kernels::cuda::GroupedExpertsWorkspace>>
      expert_workspaces_;
};

}  // namespace step
}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_CUDA_BLOCK_OPS_H_
