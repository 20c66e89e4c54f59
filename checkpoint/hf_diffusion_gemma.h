#ifndef SHARDD_CHECKPOINT_HF_DIFFUSION_GEMMA_H_
#define SHARDD_CHECKPOINT_HF_DIFFUSION_GEMMA_H_

// shardd's DiffusionGemma parameters under the released Hugging Face
// checkpoint's names and layouts (DiffusionGemmaForBlockDiffusion; the
// inverse of NeMo AutoModel's state-dict adapter, which shardd's tree
// follows):
//
//   shardd model.X                          HF model.decoder.X
//   model.layers.L.moe.gate.{scale,proj.weight}
//                                           model.decoder.layers.L.router.*
//   moe.experts.gate_and_up_projs [E,D,2I]  experts.gate_up_proj [E, 2I, D]
//   moe.experts.down_projs [E, I, D]        experts.down_proj [E, D, I] and
//                                           router.per_expert_scale [E] = 1
//   model.layers.L.layer_scalar             also written as
//                      model.encoder.language_model.layers.L.layer_scalar
//   lm_head.weight                          dropped (tied to the embedding)
//
// per_expert_scale was folded into down_projs on import, so it is written
// as ones next to the folded weights: Hugging Face computes the same
// experts, and `--init-from` reads the export back bit for bit (x * 1.0f is
// x). HF ties the encoder's weights to the decoder's but not its buffers,
// so the encoder's layer_scalar copies are written for HF to load.
//
// DiffusionGemmaHfToShardd is the inverse: the same renames and transposes
// backwards, with per_expert_scale folded into down_projs as `--init-from`
// folds it (checkpoint/hf_weights.h). Where the mapping is not bijective:
//   - per_expert_scale: scales that are all exactly 1 leave down_projs'
//     bytes untouched (the export's ones, in down_proj's dtype, round-trip
//     bit for bit; ones of another dtype come back in that one); other
//     scales give an F32 down_projs of the fp32 products (what
//     `--init-from` computes), which exports again as those products with
//     unit scales, not as the original weights and scales;
//   - the DiffusionGemmaIgnoredTensor tensors (vision tower, embed_vision,
//     the encoder's layer_scalar copies) are dropped; the export writes the
//     layer_scalar copies again from the decoder's, not the others;
//   - lm_head.weight is dropped by the export (tied), so a shardd
//     lm_head.weight does not come back; other names outside model. are
//     kept as they are both ways.

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "checkpoint/hf_interop.h"

namespace shardd {
namespace checkpoint {

// Renames and transposes `tensors` as above; sorted by name. Errors:
// INVALID_ARGUMENT naming the tensor: a moe tensor other than the router's
// scale / proj.weight and the two expert tensors, an expert tensor that is
// not 3-D, a dtype without a 1.0 to write (not F32, BF16 or F16) for
// per_expert_scale, two tensors with one name after conversion.
absl::StatusOr<std::vector<HostTensor>> DiffusionGemmaShardToHf(
    std::vector<HostTensor> tensors);

// The inverse of DiffusionGemmaShardToHf (see above); sorted by name.
// Errors: INVALID_ARGUMENT naming the tensor: a model. tensor outside
// model.decoder. that is not a DiffusionGemmaIgnoredTensor; a router or
// experts tensor other than router.{scale,proj.weight,per_expert_scale} and
// experts.{gate_up_proj,down_proj}; an expert tensor that is not 3-D; next
// to a down_proj, a gate_up_proj [E, 2I, D] with an odd 2I, or a down_proj
// other than its dtype and [E, D, I] (both shapes given); a down_proj without
// router.per_expert_scale or the reverse; a per_expert_scale other than
// [E] for down_proj's E (both shapes given) or of a dtype other than F32,
// BF16 or F16; unless the scales are all 1, a down_proj of such another
// dtype; two tensors with one name after conversion.
absl::StatusOr<std::vector<HostTensor>> DiffusionGemmaHfToShardd(
    std::vector<HostTensor> tensors);

// Whether `name` is a tensor of the released DiffusionGemma checkpoint that
// no parameter of shardd's text stack reads: the vision tower
// (model.encoder.vision_tower.*), its embedder (model.encoder.embed_vision.*)
// and the encoder's layer_scalar buffers
// (model.encoder.language_model.layers.L.layer_scalar: HF ties the
// encoder's weights to the decoder's, but not buffers, so these are saved
// twice).
bool DiffusionGemmaIgnoredTensor(absl::string_view name);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_DIFFUSION_GEMMA_H_
