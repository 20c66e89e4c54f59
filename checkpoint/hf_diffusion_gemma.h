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

#include <vector>

#include "absl/status/statusor.h"
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

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_DIFFUSION_GEMMA_H_
