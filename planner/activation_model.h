#ifndef SHARDD_PLANNER_ACTIVATION_MODEL_H_
#define SHARDD_PLANNER_ACTIVATION_MODEL_H_

// The activations one rank keeps for one micro-batch (micro_batch_size
// sequences of seq_len tokens), per layer and computation, for the
// architectures the CPU workers train (Llama, Mixtral, Qwen3-MoE,
// DeepSeek-V3, GPT-OSS, DiffusionGemma's causal pass and block-diffusion
// step; docs/design.md, "Activation memory"). The step
// model (program/step_model.h) replays them with the step program, so a
// plan's peak counts parameters, gradients and activations together.
//
// The bytes are derived from the model's shapes, independently of the
// workers' code, and equal what the CPU model holds
// (worker/exec/step_executor_test checks it on every layout); a GPU
// worker's are checked by worker/exec:device_parity_cuda_test on a GPU.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/model.pb.h"
#include "proto/plan.pb.h"

namespace shardd {

// PlanOptions.ep_capacity_factor when 0: a rank's experts are assumed to
// receive at most twice the balanced share of routed rows.
inline constexpr double kDefaultEpCapacityFactor = 2.0;

// Whether a GPU worker keeps its activations in bf16: some unit of `plan`
// computes in bf16 (mixed precision, or bf16 parameters). The planner's
// activation model and the CUDA step apply this one rule.
inline bool ActivationsInBf16(const v1::ShardingPlan& plan) {
  for (const v1::FsdpUnit& unit : plan.units()) {
    if (unit.precision().compute_dtype() == v1::BFLOAT16) return true;
  }
  return false;
}

// PlanOptions.activation_checkpointing parsed: which layers recompute.
struct CheckpointPolicy {
  enum Kind { kNone, kAll, kExperts, kEveryK };
  Kind kind = kNone;
  int every = 0;  // kEveryK: layers 0, K, 2K, ...
  std::string Text() const;
};

// "none" or "", "all", "experts", "every:K" with K >= 1.
// Errors: INVALID_ARGUMENT naming activation_checkpointing and the forms
// allowed.
absl::StatusOr<CheckpointPolicy> ParseCheckpointPolicy(absl::string_view text);

// The activation model of `model` for options.micro_batch_size() sequences
// of options.seq_len() tokens with options.activation_checkpointing(), for
// the step shape options.passes() / no_grad_passes() (as planned: for
// DiffusionGemma 3 / 1 is the block-diffusion step, which decodes
// options.response_length() rows, 0: dims.canvas_length). With
// options.mesh().ep() > 1 the experts' bytes are those of E / ep local
// experts over options.ep_capacity_factor() (0: the default) times the
// balanced rows, plus the exchange's buffers; the planner has checked both.
// For options.worker_device() CUDA it counts what a GPU worker keeps: the
// step's activations in the storage dtype (bf16 when `bf16_storage`, the
// plan's ActivationsInBf16) and its kernels' saved state
// (common/device_saved_bytes.h); for a CPU worker everything in fp32.
// Errors: INVALID_ARGUMENT naming the field (micro_batch_size or seq_len
// < 1 or too large for 64-bit byte counts, a malformed
// activation_checkpointing, response_length outside [1, seq_len), a layer
// whose parameters are not shaped as the architecture needs).
absl::StatusOr<v1::ActivationModel> ModelActivations(
    const v1::ModelSpec& model, const v1::PlanOptions& options,
    bool bf16_storage = false);

}  // namespace shardd

#endif  // SHARDD_PLANNER_ACTIVATION_MODEL_H_
