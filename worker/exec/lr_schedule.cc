#include "worker/exec/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardd {

double LrSchedule::At(double lr, int64_t step) const {
  if (step < 0) step = 0;
  if (step < warmup_steps) {
    return lr * static_cast<double>(step + 1) /
           static_cast<double>(warmup_steps);
  }
  if (kind == Kind::kConstant) return lr;
  const int64_t span = decay_steps - warmup_steps;
  if (span <= 0) return min_lr;
  const double t =
      static_cast<double>(std::min(step - warmup_steps, span)) / span;
  if (kind == Kind::kCosine) {
    return min_lr + (lr - min_lr) * (1.0 + std::cos(M_PI * t)) / 2.0;
  }
  return lr + (min_lr - lr) * t;
}

absl::Status ParseLrScheduleKind(const std::string& name,
                                 LrSchedule::Kind* kind) {
  if (name.empty() || name == "constant") {
    *kind = LrSchedule::Kind::kConstant;
  } else if (name == "cosine") {
    *kind = LrSchedule::Kind::kCosine;
  } else if (name == "linear") {
    *kind = LrSchedule::Kind::kLinear;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.lr_schedule: must be constant, cosine or linear, got \"", name,
        "\""));
  }
  return absl::OkStatus();
}

const char* LrScheduleKindName(LrSchedule::Kind kind) {
  switch (kind) {
    case LrSchedule::Kind::kConstant:
      return "constant";
    case LrSchedule::Kind::kCosine:
      return "cosine";
    case LrSchedule::Kind::kLinear:
      return "linear";
  }
  return "constant";
}

absl::Status ValidateLrSchedule(const LrSchedule& s, double lr) {
  if (!std::isfinite(lr) || lr <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.lr: must be finite and > 0, got ", lr));
  }
  if (s.warmup_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.warmup_steps: must be >= 0, got ", s.warmup_steps));
  }
  if (s.kind != LrSchedule::Kind::kConstant && s.decay_steps < s.warmup_steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.decay_steps: the decay must end at or after the warmup (",
        s.warmup_steps, " steps), got ", s.decay_steps));
  }
  if (!std::isfinite(s.min_lr) || s.min_lr < 0 || s.min_lr > lr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.min_lr: must be in [0, lr = ", lr, "], got ", s.min_lr));
  }
  return absl::OkStatus();
}

}  // namespace shardd
