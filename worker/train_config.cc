#include "worker/train_config.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

// A hyper-parameter that must be finite and >= 0; 0 means `fallback`.
absl::StatusOr<double> NonNegativeOr(double value, double fallback,
                                     const char* field) {
  if (!std::isfinite(value) || value < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.", field, ": must be finite and >= 0 (0 = default ",
                     fallback, "), got ", value));
  }
  return value == 0.0 ? fallback : value;
}

absl::StatusOr<double> BetaOr(double value, double fallback,
                              const char* field) {
  if (!std::isfinite(value) || value < 0.0 || value >= 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.", field, ": must be in [0, 1) (0 = default ",
                     fallback, "), got ", value));
  }
  return value == 0.0 ? fallback : value;
}

}  // namespace

kernels::AdamWConfig AdamWConfigOf(const v1::TrainConfig& train) {
  kernels::AdamWConfig adamw;
  adamw.lr = train.lr();
  adamw.beta1 = train.beta1();
  adamw.beta2 = train.beta2();
  adamw.eps = train.eps();
  adamw.weight_decay = train.weight_decay();
  return adamw;
}

OptimizerOptions OptimizerOptionsOf(const v1::TrainConfig& train) {
  OptimizerOptions o;
  if (!train.optimizer().empty()) o.name = train.optimizer();
  o.muon.lr = train.muon_lr() == 0.0 ? kDefaultMuonLr : train.muon_lr();
  o.muon.momentum = train.muon_momentum() == 0.0 ? kDefaultMuonMomentum
                                                 : train.muon_momentum();
  o.muon.ns_steps =
      train.muon_ns_steps() == 0 ? kDefaultMuonNsSteps : train.muon_ns_steps();
  return o;
}

LrSchedule LrScheduleOf(const v1::TrainConfig& train) {
  LrSchedule s;
  // Resolved configs carry a valid name; an unknown one reads as constant.
  if (!ParseLrScheduleKind(train.lr_schedule(), &s.kind).ok()) {
    s.kind = LrSchedule::Kind::kConstant;
  }
  s.warmup_steps = train.warmup_steps();
  s.decay_steps = train.decay_steps() > 0 ? train.decay_steps() : train.steps();
  s.min_lr = train.min_lr();
  return s;
}

DiffusionTrainingOptions DiffusionOptionsOf(const v1::TrainConfig& train) {
  const v1::DiffusionTraining& d = train.diffusion();
  DiffusionTrainingOptions o;
  if (d.has_noise_eps()) o.noise_eps = d.noise_eps();
  if (d.has_self_conditioning_p())
    o.self_conditioning_p = d.self_conditioning_p();
  if (d.has_encoder_loss_weight()) {
    o.encoder_loss_weight = d.encoder_loss_weight();
  }
  if (d.has_diffusion_loss_weight()) {
    o.diffusion_loss_weight = d.diffusion_loss_weight();
  }
  o.response_length = d.response_length();
  return o;
}

absl::StatusOr<v1::TrainConfig> ResolveTrainConfig(const v1::TrainConfig& train,
                                                   int world_size,
                                                   int plan_microbatches) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be >= 1, got ", world_size));
  }
  v1::TrainConfig out = train;
  if (train.global_batch() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.global_batch: must be >= 1, got ", train.global_batch()));
  }
  if (train.seq_len() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.seq_len: must be >= 1, got ", train.seq_len()));
  }
  const int plan_m = plan_microbatches < 1 ? 1 : plan_microbatches;
  if (train.microbatches() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.microbatches: must be >= 1 (0 = the plan's ",
                     plan_m, "), got ", train.microbatches()));
  }
  if (train.microbatches() != 0 && train.microbatches() != plan_m) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.microbatches: ", train.microbatches(),
                     " differs from the plan's step shape (", plan_m,
                     " micro-batches); plan with the same microbatches"));
  }
  out.set_microbatches(plan_m);
  const int64_t per_step = static_cast<int64_t>(world_size) * plan_m;
  if (train.global_batch() % per_step != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.global_batch: ", train.global_batch(),
                     " sequences must be divisible by world size (", world_size,
                     ") x microbatches (", plan_m, ") = ", per_step));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const double lr, NonNegativeOr(train.lr(), kDefaultLearningRate, "lr"));
  SHARDD_ASSIGN_OR_RETURN(const double beta1,
                          BetaOr(train.beta1(), kDefaultBeta1, "beta1"));
  SHARDD_ASSIGN_OR_RETURN(const double beta2,
                          BetaOr(train.beta2(), kDefaultBeta2, "beta2"));
  SHARDD_ASSIGN_OR_RETURN(const double eps,
                          NonNegativeOr(train.eps(), kDefaultEps, "eps"));
  SHARDD_ASSIGN_OR_RETURN(
      const double weight_decay,
      NonNegativeOr(train.weight_decay(), kDefaultWeightDecay, "weight_decay"));
  if (!std::isfinite(train.grad_clip())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.grad_clip: must be finite (0 = default ", kDefaultGradClip,
        ", < 0 = no clipping), got ", train.grad_clip()));
  }
  if (!train.data_order().empty() && train.data_order() != "random" &&
      train.data_order() != "strided") {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.data_order: must be \"random\" or \"strided\", got \"",
        train.data_order(), "\""));
  }
  out.set_data_order(train.data_order().empty() ? "random"
                                                : train.data_order());
  if (train.synthetic_order() < 0 || train.synthetic_order() > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.synthetic_order: must be in [0, 64] (0 or 1: the Markov "
        "chain), got ",
        train.synthetic_order()));
  }
  if (train.synthetic_order() > 1 && !train.data_path().empty()) {
    return absl::InvalidArgumentError(
        "train.synthetic_order: only for synthetic data, but data_path is "
        "set");
  }
  if (!train.init_from().empty() && train.init_from()[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.init_from: must be an absolute path (every worker reads it), "
        "got \"",
        train.init_from(), "\""));
  }
  if (!train.lora_from().empty() && train.lora_from()[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.lora_from: must be an absolute path (every worker reads it), "
        "got \"",
        train.lora_from(), "\""));
  }
  out.set_lr(lr);
  out.set_beta1(beta1);
  out.set_beta2(beta2);
  out.set_eps(eps);
  out.set_weight_decay(weight_decay);
  out.set_grad_clip(train.grad_clip() == 0.0 ? kDefaultGradClip
                                             : train.grad_clip());
  LrSchedule::Kind kind;
  SHARDD_RETURN_IF_ERROR(ParseLrScheduleKind(train.lr_schedule(), &kind));
  out.set_lr_schedule(LrScheduleKindName(kind));
  if (out.decay_steps() == 0) out.set_decay_steps(out.steps());
  SHARDD_RETURN_IF_ERROR(ValidateLrSchedule(LrScheduleOf(out), out.lr()));
  const OptimizerOptions optimizer = OptimizerOptionsOf(train);
  SHARDD_RETURN_IF_ERROR(ValidateOptimizerOptions(optimizer, "train."));
  out.set_optimizer(optimizer.name);
  out.set_muon_lr(optimizer.muon.lr);
  out.set_muon_momentum(optimizer.muon.momentum);
  out.set_muon_ns_steps(optimizer.muon.ns_steps);
  const DiffusionTrainingOptions diffusion = DiffusionOptionsOf(train);
  SHARDD_RETURN_IF_ERROR(ValidateDiffusionTraining(diffusion));
  if (diffusion.response_length >= train.seq_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.diffusion.response_length: must be below seq_len (",
                     train.seq_len(), ": the prompt before it), got ",
                     diffusion.response_length));
  }
  v1::DiffusionTraining* d = out.mutable_diffusion();
  d->set_noise_eps(diffusion.noise_eps);
  d->set_self_conditioning_p(diffusion.self_conditioning_p);
  d->set_encoder_loss_weight(diffusion.encoder_loss_weight);
  d->set_diffusion_loss_weight(diffusion.diffusion_loss_weight);
  return out;
}

}  // namespace shardd
