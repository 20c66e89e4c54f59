#ifndef SHARDD_WORKER_EXEC_STEP_CHECKS_H_
#define SHARDD_WORKER_EXEC_STEP_CHECKS_H_

// Checks and small helpers the step executor and both backends (CPU:
// cpu_backend.h, GPU: cuda_backend.h) share, so the two answer bad input
// with the same codes and words.

#include <cstdint>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "kernels/cpu/adamw.h"
#include "proto/plan.pb.h"
#include "proto/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/data/batch_sampler.h"
#include "worker/model/expert_exchange.h"
#include "worker/model/moe_model.h"

namespace shardd {

// The program header against the plan the worker holds: FAILED_PRECONDITION
// "stale plan" when plan_fingerprint differs; INVALID_ARGUMENT naming the
// field for microbatches outside [1, kMaxMicrobatches], passes outside
// [1, kMaxPasses] or no_grad_passes outside [0, passes).
absl::Status CheckProgramHeader(const v1::StepProgram& program,
                                uint64_t plan_fingerprint);

// INVALID_ARGUMENT unless there is one micro-batch per program micro-batch,
// each with rows >= 1, seq_len >= 1 and rows * seq_len inputs and targets.
absl::Status CheckStepBatches(const v1::StepProgram& header,
                              absl::Span<const data::MicroBatch> batches);

// The model options of a step shape (counts below 1 read as 1), with the
// self-conditioning scale and the block-diffusion knobs of the job.
MoeModelOptions ModelOptionsFor(int microbatches, int passes,
                                int no_grad_passes, float scale,
                                const DiffusionTrainingOptions& diffusion);

// Whether two model options describe the same step shape.
bool SameStepShape(const MoeModelOptions& a, const MoeModelOptions& b);

// Resets `model`'s step and installs one batch per micro-batch (a CPU or a
// device model). Errors: the model's, prefixed "batches[m]: ".
template <typename Model>
absl::Status SetStepBatches(Model* model,
                            absl::Span<const data::MicroBatch> batches) {
  model->ResetStep();
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    const absl::Status set =
        model->SetBatch(static_cast<int>(m), b.inputs.data(), b.targets.data(),
                        b.rows, b.seq_len);
    if (!set.ok()) {
      return absl::Status(set.code(),
                          absl::StrCat("batches[", m, "]: ", set.message()));
    }
  }
  return absl::OkStatus();
}

namespace step_checks_internal {
// fn()'s status, OK when it returns nothing (a CPU model's setters cannot
// fail where a device model's can).
template <typename Fn>
absl::Status StatusOf(Fn fn) {
  if constexpr (std::is_void<decltype(fn())>::value) {
    fn();
    return absl::OkStatus();
  } else {
    return fn();
  }
}
}  // namespace step_checks_internal

// Applies the plan's recompute policy (plan.activations().layers(), per
// layer: the whole layer or its experts) to `model`, a CPU or a device
// model with `layers` layers. Errors: INVALID_ARGUMENT for a plan layer
// outside [0, layers); the model's SetRecompute's.
template <typename Model>
absl::Status ApplyRecompute(const v1::ShardingPlan& plan, int layers,
                            Model* model) {
  std::vector<bool> whole(layers, false), experts(layers, false);
  for (const v1::LayerActivations& l : plan.activations().layers()) {
    if (l.layer() < 0 || l.layer() >= layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan.activations.layers: layer ", l.layer(),
                       " outside [0, ", layers, ")"));
    }
    whole[l.layer()] = l.recompute();
    experts[l.layer()] = l.recompute_experts();
  }
  return model->SetRecompute(std::move(whole), std::move(experts));
}

// Installs what a step's batches carry besides tokens on `model` (a CPU or
// a device model) for a step of `header` on a mesh of `ranks` data-parallel
// ranks: packed rows, evaluation, the masked loss's global counts,
// DiffusionGemma's canvas keys and SFT canvas rows. Errors: the model's,
// prefixed "batches[m]: " where one batch is at fault.
template <typename Model>
absl::Status SetStepExtras(const v1::StepProgram& header, int ranks,
                           absl::Span<const data::MicroBatch> batches,
                           Model* model) {
  auto prefixed = [](size_t m, const absl::Status& s) {
    return s.ok() ? s
                  : absl::Status(s.code(), absl::StrCat("batches[", m,
                                                        "]: ", s.message()));
  };
  for (size_t m = 0; m < batches.size(); ++m) {
    if (batches[m].segment_starts.empty()) continue;
    SHARDD_RETURN_IF_ERROR(
        prefixed(m, model->SetRowSegments(static_cast<int>(m),
                                          batches[m].segment_starts.data())));
  }
  using step_checks_internal::StatusOf;
  SHARDD_RETURN_IF_ERROR(
      StatusOf([&] { return model->SetEvaluation(header.eval()); }));
  // A masked batch (SFT): the loss is the mean over the global batch's
  // counted tokens, shared by every data-parallel rank.
  SHARDD_RETURN_IF_ERROR(StatusOf([&] {
    return model->SetGlobalLossTokens(
        batches.empty() ? 0 : batches[0].step_counted, ranks,
        batches.empty() ? 0 : batches[0].step_canvas_counted);
  }));
  // DiffusionGemma's canvas noise is keyed by the step and each row's global
  // index, so every data-parallel layout draws the same.
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    if (static_cast<int64_t>(b.sequence_indices.size()) != b.rows) continue;
    SHARDD_RETURN_IF_ERROR(
        prefixed(m, model->SetSequenceKeys(static_cast<int>(m), header.step(),
                                           b.sequence_indices.data())));
  }
  // DiffusionGemma's SFT rows: each row's own prompt and canvas.
  for (size_t m = 0; m < batches.size(); ++m) {
    if (batches[m].canvas_starts.empty()) continue;
    SHARDD_RETURN_IF_ERROR(
        prefixed(m, model->SetCanvasRows(static_cast<int>(m),
                                         batches[m].canvas_starts.data(),
                                         batches[m].canvas_targets.data())));
  }
  return absl::OkStatus();
}

// The communicators an executor is created with: `shard_group` has
// plan.mesh().dp_shard() ranks with this rank at `shard_rank`; under HSDP
// `replicas` has dp_replicate ranks with this rank at `replica_rank`, and
// without it holds one rank or is null. INVALID_ARGUMENT naming the group.
// Expert parallelism (plan.mesh.ep > 1): `groups` holds an ep_shard group
// of dp_shard / ep ranks with this rank at shard_rank % (dp_shard / ep) and
// an ep group of ep ranks with it at shard_rank / (dp_shard / ep); without
// it both are null. Errors: INVALID_ARGUMENT naming the group.
absl::Status CheckExpertGroups(const v1::ShardingPlan& plan, int shard_rank,
                               const ExpertGroups& groups);

// The routed experts of `model`'s MoE layers (the same in every layer).
// Errors: INVALID_ARGUMENT when it has none or the layers differ.
absl::StatusOr<int64_t> RoutedExperts(const v1::ModelSpec& model);

// The token exchange of a job with expert parallelism over its ep group
// `ep` (null without expert parallelism: mesh.ep <= 1), and the plan's
// bound on the rows a rank's experts receive (0: none), for either
// backend. Errors: RoutedExperts' and ExpertExchange::Create's.
absl::StatusOr<std::unique_ptr<ExpertExchange>> ExchangeFor(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model, Communicator* ep,
    absl::Duration timeout);
double EpCapacityBound(const v1::ShardingPlan& plan);

absl::Status CheckStepGroups(const v1::ShardingPlan& plan, int shard_rank,
                             int replica_rank, const Communicator& shard_group,
                             const Communicator* replicas);

// INVALID_ARGUMENT for a collective timeout that is not positive and finite,
// max_grad_norm < 0 or not finite, or an AdamW hyper-parameter out of range
// (checked by an empty step, so OPTIMIZER_STEP cannot fail half-way).
absl::Status CheckStepOptions(absl::Duration collective_timeout,
                              double max_grad_norm,
                              const kernels::AdamWConfig& adamw);

// Every slice size the plan reshards to after forward needs its group (the
// slice's re-gather would otherwise fail mid-step): a group of G ranks with
// this rank at shard_rank % G. INVALID_ARGUMENT naming the unit otherwise.
template <typename Group>
absl::Status CheckSliceGroups(const v1::ShardingPlan& plan, int shard_rank,
                              const std::map<int, Group*>& slice_groups) {
  const int dp_shard = plan.mesh().dp_shard();
  for (const v1::FsdpUnit& unit : plan.units()) {
    const v1::ReshardPolicy& policy = unit.reshard_after_forward();
    if (policy.policy_case() != v1::ReshardPolicy::kGroupSize) continue;
    const int g = policy.group_size();
    if (g <= 1 || g >= dp_shard) continue;
    auto it = slice_groups.find(g);
    if (it == slice_groups.end() || it->second == nullptr ||
        it->second->world_size() != g || it->second->rank() != shard_rank % g) {
      return absl::InvalidArgumentError(
          absl::StrCat("slice_groups: unit '", unit.name(),
                       "' reshards after forward to groups of ", g,
                       " ranks, which needs a slice group of ", g,
                       " ranks with this rank at shard_rank % ", g, " (",
                       shard_rank % g, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardd

#endif  // SHARDD_WORKER_EXEC_STEP_CHECKS_H_
