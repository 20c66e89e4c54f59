#include "worker/model/block_diffusion.h"

#include "absl/strings/str_cat.h"
#include "worker/data/rng.h"

namespace shardd {

absl::Status BuildDiffusionCanvas(const int32_t* inputs, int64_t batch,
                                  int64_t seq, int64_t canvas, int64_t vocab,
                                  int64_t step,
                                  const int64_t* sequence_indices,
                                  DiffusionCanvas* out) {
  if (canvas < 1 || canvas >= seq || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block diffusion: needs 1 <= canvas_length < seq (the encoder keys "
        "before the canvas), got canvas_length ",
        canvas, ", seq ", seq));
  }
  out->clean.resize(batch * canvas);
  out->noised.resize(batch * canvas);
  out->self_cond.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const uint64_t index = static_cast<uint64_t>(sequence_indices[b]);
    data::SplitMix64 rng(data::StreamSeed(static_cast<uint64_t>(step),
                                          kDiffusionNoiseDomain, index));
    const double level =
        kDiffusionNoiseEps + (1.0 - kDiffusionNoiseEps) * rng.NextDouble();
    for (int64_t j = 0; j < canvas; ++j) {
      const int32_t clean = inputs[b * seq + seq - canvas + j];
      const double u = rng.NextDouble();
      const auto token = static_cast<int32_t>(rng.NextBelow(vocab));
      out->clean[b * canvas + j] = clean;
      out->noised[b * canvas + j] = u < level ? token : clean;
    }
    data::SplitMix64 coin(data::StreamSeed(static_cast<uint64_t>(step),
                                           kSelfConditioningDomain, index));
    out->self_cond[b] = coin.NextDouble() < kSelfConditioningP ? 1 : 0;
  }
  return absl::OkStatus();
}

}  // namespace shardd
