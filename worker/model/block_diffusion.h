#ifndef SHARDD_WORKER_MODEL_BLOCK_DIFFUSION_H_
#define SHARDD_WORKER_MODEL_BLOCK_DIFFUSION_H_

// DiffusionGemma's block-diffusion step (docs/model-spec.md): the canvas of
// a sequence, its D3PM-uniform noise and the self-conditioning coin, drawn
// from counter-based streams keyed by (step, global sequence index) so that
// every data-parallel layout sees the same canvases.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace shardd {

// NeMo AutoModel's defaults (corrupt_uniform_random's eps,
// self_conditioning_p, encoder_loss_weight).
inline constexpr double kDiffusionNoiseEps = 1e-3;
inline constexpr double kSelfConditioningP = 0.5;
inline constexpr double kEncoderLossWeight = 1.0;

// The knobs of a block-diffusion training job (TrainConfig.diffusion,
// proto/coordinator.proto, which documents them).
struct DiffusionTrainingOptions {
  double noise_eps = kDiffusionNoiseEps;
  double self_conditioning_p = kSelfConditioningP;
  double encoder_loss_weight = kEncoderLossWeight;
  double diffusion_loss_weight = 1.0;
  // The canvas rows per sequence (the last tokens, the response), cut into
  // blocks of canvas_length; 0: canvas_length (one block).
  int64_t response_length = 0;
};

// INVALID_ARGUMENT naming the field (as train.diffusion.<field>) unless
// noise_eps is in [0, 1), self_conditioning_p in [0, 1], both weights
// finite and >= 0 and response_length >= 0.
absl::Status ValidateDiffusionTraining(const DiffusionTrainingOptions& o);

// StreamSeed domains (worker/data/rng.h keeps 1..5 for the data pipeline).
inline constexpr uint64_t kDiffusionNoiseDomain = 16;
inline constexpr uint64_t kSelfConditioningDomain = 17;

struct DiffusionCanvas {
  std::vector<int32_t> clean;     // [B, R] the canvas's clean tokens
  std::vector<int32_t> noised;    // [B, R]
  std::vector<int32_t> targets;   // [B, R] the diffusion loss's (-1: none)
  std::vector<uint8_t> self_cond; // [B] the coin
};

// SFT rows (docs/sft_data.md, "DiffusionGemma"): row b's canvas is its own
// response, from position starts[b] on, and only the positions with a
// target (the counted ones) are noised and scored.
struct CanvasRows {
  const int32_t* starts = nullptr;   // [B] each row's response start
  const int32_t* targets = nullptr;  // [B, R] clean token or -1
  int32_t pad_id = 0;                // canvas rows past the row's end
};

// For inputs [batch, seq] with `sequence_indices` [batch] (global indices)
// at optimizer step `step`. Without `rows` the canvas is each row's last R
// tokens, every position noised and scored; with `rows` it is row b's
// tokens from rows->starts[b] on (pad_id past the row), the positions
// whose rows->targets is -1 kept clean and unscored. Sequence b's stream SplitMix64(StreamSeed(step,
// kDiffusionNoiseDomain, index_b)) draws t = eps + (1 - eps) u, then per
// canvas position u and a token NextBelow(vocab) (both always drawn), the
// token replacing the clean one when u < t; the coin is
// SplitMix64(StreamSeed(step, kSelfConditioningDomain, index_b))
// .NextDouble() < self_conditioning_p (eps and p from `options`).
// INVALID_ARGUMENT unless 1 <= canvas < seq, vocab >= 1 and every start
// is in [0, seq), and for options ValidateDiffusionTraining rejects.
absl::Status BuildDiffusionCanvas(const int32_t* inputs, int64_t batch,
                                  int64_t seq, int64_t canvas, int64_t vocab,
                                  int64_t step, const int64_t* sequence_indices,
                                  const DiffusionTrainingOptions& options,
                                  DiffusionCanvas* out,
                                  const CanvasRows* rows = nullptr);

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_BLOCK_DIFFUSION_H_
