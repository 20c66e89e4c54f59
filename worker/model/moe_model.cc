#include "worker/model/moe_model.h"

#include <utility>

#include "absl/memory/memory.h"
#include "common/status_macros.h"
#include "model/model_util.h"

namespace shardd {

absl::StatusOr<std::unique_ptr<MoeModel>> MoeModel::Create(
    const v1::ModelSpec& model, const MoeModelOptions& options) {
  SHARDD_RETURN_IF_ERROR(ValidateModelSpec(model));
  SHARDD_RETURN_IF_ERROR(CheckModelStepShape(
      options.passes, options.no_grad_passes, options.microbatches));
  SHARDD_ASSIGN_OR_RETURN(MoeArchitecture arch, ReadMoeArchitecture(model));
  auto m = absl::WrapUnique(new MoeModel());
  m->arch_ = std::make_unique<MoeArchitecture>(std::move(arch));
  auto ops = std::make_unique<step::CpuBlockOps>(m->arch_.get());
  m->ops_ = ops.get();
  SHARDD_ASSIGN_OR_RETURN(
      m->step_,
      step::ModelStep::Create(
          m->arch_.get(), StepShapeOf(options, model.dims().canvas_length()),
          std::move(ops)));
  return m;
}

step::StepShape StepShapeOf(const MoeModelOptions& options,
                            int64_t canvas_length) {
  step::StepShape shape;
  shape.passes = options.passes;
  shape.no_grad_passes = options.no_grad_passes;
  shape.microbatches = options.microbatches;
  shape.self_conditioning_scale = options.self_conditioning_scale;
  shape.diffusion = options.diffusion;
  shape.canvas_length = canvas_length;
  return shape;
}

absl::Status MoeModel::SetBatch(int microbatch, const int32_t* inputs,
                                const int32_t* targets, int64_t batch,
                                int64_t seq) {
  return step_->SetBatch(microbatch, inputs, targets, batch, seq);
}

absl::Status MoeModel::SetRowSegments(int microbatch,
                                      const int32_t* segment_starts) {
  return step_->SetRowSegments(microbatch, segment_starts);
}

absl::Status MoeModel::SetSequenceKeys(int microbatch, int64_t step,
                                       const int64_t* sequence_indices) {
  return step_->SetSequenceKeys(microbatch, step, sequence_indices);
}

void MoeModel::HoldSelfConditioningForTest(bool hold) {
  step_->HoldSelfConditioningForTest(hold);
}

absl::Status MoeModel::Run(const v1::Command& command, ParamSource* params) {
  ops_->Bind(params);
  const absl::Status status = step_->Run(command);
  ops_->Bind(nullptr);
  return status;
}

void MoeModel::SetEvaluation(bool eval) { step_->SetEvaluation(eval); }

absl::Status MoeModel::SetCanvasRows(int microbatch, const int32_t* starts,
                                     const int32_t* targets) {
  return step_->SetCanvasRows(microbatch, starts, targets);
}

void MoeModel::SetGlobalLossTokens(int64_t global_counted, int ranks,
                                   int64_t global_canvas) {
  step_->SetGlobalLossTokens(global_counted, ranks, global_canvas);
}

absl::Status MoeModel::SetExpertExchange(ExpertExchange* exchange,
                                         double capacity_factor) {
  return step_->SetExpertExchange(exchange, capacity_factor);
}

void MoeModel::ResetStep() { step_->ResetStep(); }

double MoeModel::step_loss() const { return step_->step_loss(); }

int64_t MoeModel::step_tokens() const { return step_->step_tokens(); }

bool MoeModel::router_aux_loss() const { return arch_->aux_on(); }

MoeModel::RouterAuxStats* MoeModel::router_aux_stats(int pass) {
  step::Saved* aux = step_->aux_stats(pass, 0);
  return aux == nullptr ? nullptr : &aux->Get<step::CpuAuxState>()->stats;
}

absl::Status MoeModel::SetRecompute(std::vector<bool> layers,
                                    std::vector<bool> experts) {
  return step_->SetRecompute(std::move(layers), std::move(experts));
}

int64_t MoeModel::activation_bytes() const {
  return step_->activation_bytes();
}

int64_t MoeModel::command_activation_peak() const {
  return step_->command_activation_peak();
}

int MoeModel::num_layers() const {
  return static_cast<int>(arch_->layers.size());
}

int64_t MoeModel::vocab_size() const { return arch_->vocab; }

}  // namespace shardd
