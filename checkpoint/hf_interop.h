#ifndef SHARDD_CHECKPOINT_HF_INTEROP_H_
#define SHARDD_CHECKPOINT_HF_INTEROP_H_

// Hugging Face safetensors checkpoints <-> shardd parameters.
//
// HF MoE checkpoints store one Linear per expert; shardd stacks a layer's
// experts into grouped tensors (model/hf_config.cc):
//
//   Qwen3-MoE:
//   model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
//              model.layers.L.mlp.gate.weight (router)
//   Mixtral:   model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight
//              (w1 = gate, w3 = up, w2 = down)
//              model.layers.L.block_sparse_moe.gate.weight (router)
//   shardd:    model.layers.L.moe.experts.gate_and_up_projs [E, D, 2I]
//                (gate^T in columns [0, I), up^T in [I, 2I))
//              model.layers.L.moe.experts.down_projs        [E, I, D] (down^T)
//              model.layers.L.moe.gate.weight               [E, D]
//
// HF Linear weights are [out, in]: gate/up [I, D], down [D, I]; hence the
// transposes. GPT-OSS and DiffusionGemma fuse a layer's experts instead:
//
//   GPT-OSS:   model.layers.L.mlp.experts.gate_up_proj      [E, D, 2I]
//                (gate j in column 2j, up j in column 2j + 1)
//              model.layers.L.mlp.experts.gate_up_proj_bias [E, 2I] (same)
//              model.layers.L.mlp.experts.down_proj         [E, I, D]
//              model.layers.L.mlp.experts.down_proj_bias    [E, D]
//              model.layers.L.mlp.router.{weight,bias}      (router)
//   shardd:    moe.experts.{gate_and_up_projs,gate_up_proj_bias} with the
//              gate half then the up half, moe.experts.{down_projs,
//              down_proj_bias} as they are, moe.gate.{weight,bias}
//   DiffusionGemma: model.decoder.X for model.X, experts transposed per
//              expert (checkpoint/hf_diffusion_gemma.h)
//
// Every other tensor keeps its name, shape and bytes. Values are moved bit
// for bit in their stored dtype (no conversion), so import then export
// gives back the original bytes, with these exceptions:
//   - a moe tensor other than the experts' and the router's (a shared
//     expert, DeepSeek's gate.e_score_correction_bias) is exported under
//     the HF MoE module (Qwen3-MoE, Mixtral, GPT-OSS), but stays under that
//     name on import;
//   - GPT-OSS: an moe.experts tensor other than the four above is exported
//     as mlp.experts.<name> but refused on import;
//   - DiffusionGemma: router.per_expert_scale is folded into down_projs on
//     import and exported as ones in down_proj's dtype (exact only for
//     such ones);
//     the vision tower and the encoder's layer_scalar copies are dropped on
//     import (the copies are exported again from the decoder's);
//     lm_head.weight is not exported (tied).
//
// The conversion works on whole tensors in memory: fine for conversion
// tools and tests; a loader of a large model should instead import once into
// a shardd checkpoint (ImportHfToCheckpoint) and let each rank read its
// shard from that.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardd {
namespace checkpoint {

// A whole tensor in memory, row-major.
struct HostTensor {
  std::string name;
  std::string dtype;  // Safetensors tag.
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

enum class HfMoeNaming {
  kNone,      // No per-expert tensors or routers.
  kQwen3Moe,  // Also DeepSeek-V3's.
  kMixtral,
  // GPT-OSS: mlp.experts.{gate_up_proj [E, D, 2I] with gate/up columns
  // interleaved, gate_up_proj_bias, down_proj, down_proj_bias}, router
  // mlp.router.{weight,bias}.
  kGptOss,
  // DiffusionGemmaForBlockDiffusion: the shared stack under model.decoder.,
  // fused experts [E, 2I, D] / [E, D, I], router.per_expert_scale written as
  // ones and folded into down_projs when read
  // (checkpoint/hf_diffusion_gemma.h).
  kDiffusionGemma,
};

// Reads every tensor of an HF checkpoint. `path` is a .safetensors file, a
// model.safetensors.index.json (sharded: {"weight_map": {tensor: file}}), or
// a directory holding either (the index preferred). Returns the tensors
// sorted by name. Errors: NOT_FOUND (no checkpoint at `path`);
// INVALID_ARGUMENT (a weight_map file name with "/" or ".."); DATA_LOSS (a
// malformed index or safetensors file, a tensor the weight_map puts in a
// file that lacks it, a tensor in a file the weight_map does not list there,
// a tensor in two files).
absl::StatusOr<std::vector<HostTensor>> ReadHfTensors(const std::string& path);

// Writes `tensors` as an HF checkpoint into directory `dir` (created if
// missing): model.safetensors, or, when max_shard_bytes > 0 and the data is
// larger, model-0000K-of-0000N.safetensors files of at most max_shard_bytes
// of tensor data each (a larger tensor gets a file of its own) plus
// model.safetensors.index.json. Tensors are written in the order given, with
// __metadata__ {"format": "pt"}. Errors: those of WriteSafetensors.
absl::Status WriteHfTensors(const std::string& dir,
                            const std::vector<HostTensor>& tensors,
                            int64_t max_shard_bytes = 0);

// HF names -> shardd: stacks each MoE layer's experts (Qwen3-MoE,
// Mixtral) or de-interleaves and renames its fused experts (GPT-OSS) and
// renames its router; a checkpoint with any model.decoder. tensor is
// DiffusionGemma's (DiffusionGemmaHfToShardd). Returns the tensors sorted
// by name and, in `naming`, which naming the input used (kNone: no MoE
// tensor). ShardToHf of the result with that naming gives back the input,
// and HfToShardd of ShardToHf's output gives back its input, but for the
// exceptions listed at the top of this file. Errors: INVALID_ARGUMENT
// naming the tensor: Qwen3-MoE, Mixtral and GPT-OSS naming mixed; an expert
// missing a projection or experts not numbered 0..E-1; expert shapes or
// dtypes that disagree (gate/up [I, D], down [D, I]); a per-expert tensor
// of another kind (e.g. a Qwen3-MoE bias, GPT-OSS's MXFP4 blocks); a
// GPT-OSS layer without gate_up_proj or down_proj, a gate_up_proj not
// [E, D, 2I] with an even 2I, a down_proj not of its dtype and [E, I, D],
// biases not [E, 2I] / [E, D] (both shapes given); the errors of
// DiffusionGemmaHfToShardd; two tensors with one name after conversion.
absl::StatusOr<std::vector<HostTensor>> HfToShardd(
    std::vector<HostTensor> tensors, HfMoeNaming* naming = nullptr);

// shardd names -> HF `naming` (the inverse of HfToShardd); sorted by name.
// Other tensors of a layer's moe module (shared experts, DeepSeek's
// gate.e_score_correction_bias) keep their names under the HF MoE module.
// Errors: INVALID_ARGUMENT for MoE tensors with naming kNone, shapes that
// are not [E, D, 2I] / [E, I, D] with matching E, D, I, a layer with only
// one of the two, other moe.experts tensors (biases) that the Qwen3-MoE and
// Mixtral namings have no place for, a GPT-OSS gate/up tensor with an odd
// last dim.
absl::StatusOr<std::vector<HostTensor>> ShardToHf(
    std::vector<HostTensor> tensors, HfMoeNaming naming);

// ReadHfTensors + HfToShardd, then saves the result as a committed shardd
// checkpoint of `step` under `root` (one file, one chunk per tensor) that
// any world size and strategy can load. Returns its path. Errors: those of
// the parts (BeginCheckpoint, WriteRankFile, CommitCheckpoint).
absl::StatusOr<std::string> ImportHfToCheckpoint(const std::string& hf_path,
                                                 const std::string& root,
                                                 int64_t step = 0);

// Reads the parameters of a committed shardd checkpoint (every tensor
// without a "/" state suffix), ShardToHf, WriteHfTensors. Errors: those of
// CheckpointReader (after VerifyAll) and the parts.
absl::Status ExportCheckpointToHf(const std::string& checkpoint_dir,
                                  HfMoeNaming naming, const std::string& dir,
                                  int64_t max_shard_bytes = 0);

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_INTEROP_H_
