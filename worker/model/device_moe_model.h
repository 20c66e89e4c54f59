#ifndef SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_H_
#define SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_H_

// The GPU training model: the same computation as MoeModel
// (worker/model/moe_model.h; read its header for the exact math) on one
// CUDA device, with the kernels of kernels/cuda/ (bf16 or fp32 storage as
// the parameters' compute dtype says, fp32 accumulation).
//
// Every architecture, DiffusionGemma's causal pass and block-diffusion
// step included, runs the one step driver (ModelStep,
// worker/model/model_step.h) over CudaBlockOps (cuda_block_ops.h): what a
// step computes, keeps, frees and recomputes, evaluation, packed SFT rows
// and the masked loss are decided there, once for both devices
// (docs/step_driver.md). Expert parallelism, DiffusionGemma's included,
// runs through the same driver (none of it has run on a GPU yet).
//
// Everything is stream-ordered on the model's compute stream: Run() only
// enqueues work and never waits for the device, except for the one
// per-forward host synchronization of the grouped experts (reading the
// per-expert counts for cuBLAS' grouped GEMM; kernels/cuda/
// grouped_experts.h), which host_synchronizations() counts. The step's loss
// stays on the device until ReadStepLoss(), which waits (the step's end).
// Activations and workspaces come from a DeviceAllocator (kind kWorkspace),
// so after the first step no cudaMalloc happens.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/model.pb.h"
#include "proto/worker.pb.h"
#include "absl/time/time.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/memory/device_allocator.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/device_param_source.h"
#include "worker/model/moe_model.h"

namespace shardd {

struct DeviceMoeModelOptions {
  MoeModelOptions model;  // passes, no_grad_passes, microbatches, coupling.
  int device = 0;
  // The compute stream (a cudaStream_t); nullptr: the model creates one.
  void* stream = nullptr;
  // Activation dtype (the units' compute dtype): bf16 under mixed precision.
  DeviceDType activations = DeviceDType::kBFloat16;
};

class DeviceMoeModel {
 public:
  // Same spec checks as MoeModel::Create (INVALID_ARGUMENT naming what the
  // GPU path cannot compute), plus FAILED_PRECONDITION when the device is
  // not usable (no GPU, bad device index). `allocator` must outlive the
  // model.
  static absl::StatusOr<std::unique_ptr<DeviceMoeModel>> Create(
      const v1::ModelSpec& model, const DeviceMoeModelOptions& options,
      DeviceAllocator* allocator);
  ~DeviceMoeModel();

  // Host arrays [batch, seq] (targets may hold -1 = ignore), copied to the
  // device asynchronously (pinned staging). Errors as MoeModel::SetBatch.
  absl::Status SetBatch(int microbatch, const int32_t* inputs,
                        const int32_t* targets, int64_t batch, int64_t seq);

  // DiffusionGemma's 3-pass step: the keys of micro-batch `microbatch`'s
  // canvas noise (MoeModel::SetSequenceKeys; block_diffusion.h), so that
  // every data-parallel layout draws the same canvases. Call after SetBatch
  // (which defaults to step 0 and microbatch * batch + row). A no-op for
  // other models. Errors: FAILED_PRECONDITION without the micro-batch's
  // SetBatch.
  absl::Status SetSequenceKeys(int microbatch, int64_t step,
                               const int64_t* sequence_indices);

  // Packed rows (MoeModel::SetRowSegments): each token's example start
  // [batch * seq] on the host, for the micro-batch's attention. Errors:
  // MoeModel's.
  absl::Status SetRowSegments(int microbatch, const int32_t* segment_starts);
  // As MoeModel::SetGlobalLossTokens (never fails; a Status like the
  // other setters).
  absl::Status SetGlobalLossTokens(int64_t global_counted, int ranks,
                                   int64_t global_canvas = 0);
  // As MoeModel::SetCanvasRows. Errors: MoeModel's.
  absl::Status SetCanvasRows(int microbatch, const int32_t* starts,
                             const int32_t* targets);
  // As MoeModel::SetRecompute. Errors: MoeModel's.
  absl::Status SetRecompute(std::vector<bool> layers,
                            std::vector<bool> experts);
  // As MoeModel::SetEvaluation (never fails).
  absl::Status SetEvaluation(bool eval);
  // Expert parallelism: as MoeModel::SetExpertExchange, the rows moving
  // over `ep_group` (the NCCL communicator `exchange` was made with; not
  // owned) on the model's stream. Errors: ModelStep::SetExpertExchange's.
  absl::Status SetExpertExchange(ExpertExchange* exchange,
                                 double capacity_factor,
                                 NcclCommunicator* ep_group,
                                 absl::Duration timeout);

  // Enqueues one FORWARD or BACKWARD command. Errors as MoeModel::Run, plus
  // the CUDA/cuBLAS errors of the kernels.
  absl::Status Run(const v1::Command& command, DeviceParamSource* params);

  // The load-balancing statistics of (pass, micro-batch) in device memory,
  // the GPU form of MoeModel::RouterAuxStats: counts [E + 2] int64 (the
  // choices per expert, the rows, the ranks summed) and prob_sums [E] fp32.
  // Valid from that pass's FORWARD(HEAD) (enqueued) until its next
  // FORWARD(EMBED) or ResetStep; the caller replaces them in place by their
  // sums over the micro-batch's data-parallel ranks, ordered on stream()
  // between that FORWARD(HEAD) and the BACKWARD(HEAD) that reads them.
  // Null pointers when the loss is off, (pass, microbatch) is out of range
  // or the pass has not run its FORWARD(EMBED).
  struct RouterAuxStats {
    int64_t* counts = nullptr;
    int64_t num_counts = 0;
    float* prob_sums = nullptr;
    int64_t num_prob_sums = 0;
  };
  bool router_aux_loss() const;
  RouterAuxStats router_aux_stats(int pass, int microbatch);

  void ResetStep();
  // Waits for the compute stream and returns the mean loss over the grad
  // passes and micro-batches since ResetStep, and the tokens it covers;
  // also surfaces device-side data errors (an out-of-range token id or
  // target counted by the kernels) as INVALID_ARGUMENT.
  struct StepLoss {
    double loss = 0.0;
    int64_t tokens = 0;
  };
  absl::StatusOr<StepLoss> ReadStepLoss();

  // The activation bytes held now and the most held during the last Run,
  // in their storage bytes (the driver's ledger).
  int64_t activation_bytes() const;
  int64_t command_activation_peak() const;
  int64_t host_synchronizations() const;
  void* stream() const;
  int num_layers() const;
  int64_t vocab_size() const;

 private:
  struct Impl;  // ModelStep over CudaBlockOps.
  explicit DeviceMoeModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_DEVICE_MOE_MODEL_H_
