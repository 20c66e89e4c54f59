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
// (worker/exec/step_executor_test checks it on every layout).

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
// Errors: INVALID_ARGUMENT naming the field (micro_batch_size or seq_len
// < 1 or too large for 64-bit byte counts, a malformed
// activation_checkpointing, response_length outside [1, seq_len), a layer
// whose parameters are not shaped as the architecture needs).
absl::StatusOr<v1::ActivationModel> ModelActivations(
    const v1::ModelSpec& model, const v1::PlanOptions& options);

}  // namespace shardd

#endif  // SHARDD_PLANNER_ACTIVATION_MODEL_H_
