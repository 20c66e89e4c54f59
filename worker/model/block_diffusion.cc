#include "worker/model/block_diffusion.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/rng.h"

namespace shardd {

absl::Status ValidateDiffusionTraining(const DiffusionTrainingOptions& o) {
  if (!(o.noise_eps >= 0.0 && o.noise_eps < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.diffusion.noise_eps: must be in [0, 1), got ", o.noise_eps));
  }
  if (!(o.self_conditioning_p >= 0.0 && o.self_conditioning_p <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.diffusion.self_conditioning_p: must be in [0, 1], "
                     "got ",
                     o.self_conditioning_p));
  }
  for (const auto& [name, w] :
       {std::pair<const char*, double>{"encoder_loss_weight",
                                       o.encoder_loss_weight},
        {"diffusion_loss_weight", o.diffusion_loss_weight}}) {
    if (!std::isfinite(w) || w < 0.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "train.diffusion.", name, ": must be a finite number >= 0, got ", w));
    }
  }
  if (o.response_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.diffusion.response_length: must be >= 0 (0: "
                     "canvas_length), got ",
                     o.response_length));
  }
  return absl::OkStatus();
}

absl::Status BuildDiffusionCanvas(const int32_t* inputs, int64_t batch,
                                  int64_t seq, int64_t canvas, int64_t vocab,
                                  int64_t step, const int64_t* sequence_indices,
                                  const DiffusionTrainingOptions& options,
                                  DiffusionCanvas* out,
                                  const CanvasRows* rows) {
  SHARDD_RETURN_IF_ERROR(ValidateDiffusionTraining(options));
  if (canvas < 1 || canvas >= seq || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block diffusion: needs 1 <= canvas_length < seq (the encoder keys "
        "before the canvas), got canvas_length ",
        canvas, ", seq ", seq));
  }
  out->clean.resize(batch * canvas);
  out->noised.resize(batch * canvas);
  out->targets.resize(batch * canvas);
  out->self_cond.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const uint64_t index = static_cast<uint64_t>(sequence_indices[b]);
    data::SplitMix64 rng(data::StreamSeed(static_cast<uint64_t>(step),
                                          kDiffusionNoiseDomain, index));
    const double level =
        options.noise_eps + (1.0 - options.noise_eps) * rng.NextDouble();
    const int64_t start = rows == nullptr ? seq - canvas : rows->starts[b];
    if (start < 0 || start >= seq) {
      return absl::InvalidArgumentError(
          absl::StrCat("block diffusion: row ", b, "'s canvas starts at ",
                       start, ", outside [0, ", seq, ")"));
    }
    for (int64_t j = 0; j < canvas; ++j) {
      const int64_t i = b * canvas + j;
      const int32_t target = rows == nullptr ? 0 : rows->targets[i];
      int32_t clean = rows != nullptr && start + j >= seq
                          ? rows->pad_id
                          : inputs[b * seq + start + j];
      if (rows != nullptr && target >= 0) clean = target;
      // Both draws always, so a position's noise does not depend on others.
      const double u = rng.NextDouble();
      const auto token = static_cast<int32_t>(rng.NextBelow(vocab));
      const bool scored = rows == nullptr || target >= 0;
      out->clean[i] = clean;
      out->targets[i] = scored ? clean : -1;
      out->noised[i] = scored && u < level ? token : clean;
    }
    data::SplitMix64 coin(data::StreamSeed(static_cast<uint64_t>(step),
                                           kSelfConditioningDomain, index));
    out->self_cond[b] = coin.NextDouble() < options.self_conditioning_p ? 1 : 0;
  }
  return absl::OkStatus();
}

}  // namespace shardd
