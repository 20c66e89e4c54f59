#ifndef SHARDD_CHECKPOINT_HF_WEIGHTS_H_
#define SHARDD_CHECKPOINT_HF_WEIGHTS_H_

// A Hugging Face safetensors checkpoint as the initial values of a shardd
// model's parameters (`shardctl train --init-from DIR`). Every rank opens the
// checkpoint (headers only) and reads, with pread, only the bytes of the
// element ranges it owns, converting F32, BF16 and F16 to its fp32 master.
//
// Names. A parameter is read from the tensor of the same name, or, for MoE
// layers, from the Hugging Face tensors it was built from
// (model/hf_config.cc, docs/model-spec.md):
//
//   shardd model.layers.L.moe.<rest>       HF model.layers.L.mlp.<rest> or
//                                          .block_sparse_moe.<rest>; a
//                                          router moe.gate.{weight,bias} also
//                                          mlp.router.* (GPT-OSS)
//   moe.experts.gate_and_up_projs [E,D,2I]  per expert E:
//       mlp.experts.E.{gate_proj,up_proj}.weight [I, D] (Qwen3-MoE,
//       DeepSeek-V3) or block_sparse_moe.experts.E.{w1,w3}.weight (Mixtral),
//       transposed into columns [0, I) and [I, 2I); or GPT-OSS's fused
//       mlp.experts.gate_up_proj [E, D, 2I] whose columns interleave gate
//       (even) and up (odd)
//   moe.experts.down_projs [E, I, D]       per expert down_proj / w2 [D, I],
//                                          transposed; or GPT-OSS's
//                                          mlp.experts.down_proj [E, I, D]
//   moe.experts.gate_up_proj_bias [E, 2I]  mlp.experts.gate_up_proj_bias,
//                                          de-interleaved like the weight
//   moe.experts.down_proj_bias [E, D]      mlp.experts.down_proj_bias
//
// DiffusionGemmaForBlockDiffusion (the released checkpoint, as NeMo
// AutoModel's state-dict adapter maps it): model.X is model.decoder.X, and
//   moe.gate.{scale,proj.weight}           router.{scale,proj.weight}
//   moe.experts.gate_and_up_projs [E,D,2I] experts.gate_up_proj [E, 2I, D],
//                                          each expert transposed
//   moe.experts.down_projs [E, I, D]       experts.down_proj [E, D, I], each
//                                          expert transposed and times
//                                          router.per_expert_scale[e]
//                                          (fp32, while reading)
// The vision tower, embed_vision and the encoder's duplicated layer_scalar
// buffers are IgnoredTensors, not UnusedTensors.
//
// Bytes read. A range covering whole rows of a transposed expert matrix
// reads one block per expert projection; partial rows read exactly their
// elements, one pread per source row. Interleaved GPT-OSS rows are read
// whole when a range covers part of a row (at most two rows per range). A
// scaled binding (DiffusionGemma's down_projs) also reads one scale element
// per expert the range touches, so its bytes exceed the owned bytes by that.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/hf_files.h"
#include "checkpoint/safetensors.h"
#include "layout/initial_values.h"
#include "proto/model.pb.h"

namespace shardd {
namespace checkpoint {

class HfWeights final : public InitialValues {
 public:
  // Opens the checkpoint at `path` (a directory holding
  // model.safetensors.index.json or model.safetensors, or either file) and
  // binds every parameter of `model` (tied parameters are their target's)
  // to its tensors, checking names, shapes and dtypes; no tensor data is
  // read. Errors: NOT_FOUND (no checkpoint at `path`; a parameter's tensor
  // missing, naming the tensor names tried and the checkpoint); DATA_LOSS (a
  // malformed index or safetensors header, a tensor the index puts in a file
  // that lacks it); INVALID_ARGUMENT naming the tensor and its file: a shape
  // other than the model's (both shapes given), a dtype other than F32,
  // BF16 or F16, experts of one layer split across namings, more experts in
  // the checkpoint than the model has.
  static absl::StatusOr<std::unique_ptr<HfWeights>> Open(
      const std::string& path, const v1::ModelSpec& model);

  // Errors: NOT_FOUND (a parameter not bound by Open); OUT_OF_RANGE
  // (begin/end outside the tensor); DATA_LOSS / INTERNAL (a file shrank or
  // an I/O error), each naming the parameter.
  absl::Status Read(const std::string& name, const v1::TensorSpec& tensor,
                    int64_t begin, int64_t end, float* out) const override;

  // The per-expert factors folded into parameter `name` ([E, ...]):
  // DiffusionGemma's router.per_expert_scale for a down_projs, E ones for
  // any other stacked-expert parameter read transposed, empty for the rest
  // (nothing folded). LoRA adapters of the folded
  // weight scale by them (checkpoint/peft_adapters.h). Errors: NOT_FOUND
  // (not bound by Open); DATA_LOSS / INTERNAL reading the scale.
  absl::StatusOr<std::vector<float>> ExpertScales(
      const std::string& name) const;

  // Tensor data bytes read so far over all files.
  int64_t data_bytes_read() const;
  // Checkpoint tensors no parameter reads (e.g. the lm_head.weight of a tied
  // model), sorted, without the IgnoredTensors.
  std::vector<std::string> UnusedTensors() const;
  // Tensors known to be no part of the model's tree, left out of
  // UnusedTensors so a caller warns only of surprises: DiffusionGemma's
  // model.encoder.vision_tower.*, model.encoder.embed_vision.* and the
  // encoder's layer_scalar copies of the decoder's. Sorted.
  std::vector<std::string> IgnoredTensors() const;
  const std::string& path() const { return checkpoint_.path; }

  using Source = HfTensorRef;
  // Columns [col_begin, col_end) of an expert's [R, C] matrix are the
  // transpose of `source` ([col_end - col_begin, R]).
  struct ColumnSource {
    int64_t col_begin = 0;
    int64_t col_end = 0;
    Source source;
    int64_t offset = 0;  // Elements before the matrix in a fused [E, ...].
  };
  enum class Layout {
    kDirect,       // Same elements in the same order.
    kInterleaved,  // Rows of 2I: column j < I from 2j, else 2(j - I) + 1.
    kTransposedExperts,  // Per expert an [R, C] matrix of ColumnSources.
  };
  struct Binding {
    Layout layout = Layout::kDirect;
    Source source;  // kDirect, kInterleaved.
    int64_t row_length = 0;  // kInterleaved: 2I; kTransposedExperts: C.
    int64_t rows = 0;        // kTransposedExperts: R.
    std::vector<std::vector<ColumnSource>> experts;  // kTransposedExperts.
    // When set, element i is multiplied (fp32) by scale[i / scale_block]:
    // DiffusionGemma's per_expert_scale folded into down_projs.
    bool scaled = false;
    Source scale;
    int64_t scale_block = 0;
  };

 private:
  HfWeights() = default;
  absl::Status Bind(const std::string& name, const v1::TensorSpec& tensor);
  absl::StatusOr<Source> Find(const std::string& tensor) const;
  // The released DiffusionGemma names (model.decoder.*).
  absl::Status BindDiffusionGemma(const std::string& name,
                                  const std::vector<int64_t>& shape);
  absl::Status ApplyScale(const Binding& b, int64_t begin, int64_t end,
                          float* out) const;
  absl::Status ReadTransposed(const Binding& b, int64_t begin, int64_t end,
                              float* out) const;
  absl::Status ReadInterleaved(const Binding& b, int64_t begin, int64_t end,
                               float* out) const;

  HfCheckpointFiles checkpoint_;
  std::map<std::string, Binding> bindings_;  // By parameter name.
  bool diffusion_gemma_ = false;  // model.decoder.* naming.
};

}  // namespace checkpoint
}  // namespace shardd

#endif  // SHARDD_CHECKPOINT_HF_WEIGHTS_H_
