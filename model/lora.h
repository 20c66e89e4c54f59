#ifndef SHARDD_MODEL_LORA_H_
#define SHARDD_MODEL_LORA_H_

// LoRA adapters in a model spec (docs/lora.md). ApplyLora rewrites a spec
// so that each targeted weight W gains two trainable adapters and every
// other parameter is frozen; the planner then shards the adapters like any
// parameter (in their layer's unit, or the experts' unit), and counts
// optimizer state and gradient reduce-scatters for them only.
//
// Names and layouts follow PEFT so the export is a plain rename:
//   a linear module M (weight [out, in]):  M.lora_A.weight [R, in],
//                                          M.lora_B.weight [out, R];
//   stacked experts (gate_and_up_projs [E, D, 2I], down_projs [E, I, D],
//   shardd's in-major layout): <tensor>_lora_A [E, R, in] and
//   <tensor>_lora_B [E, out, R] beside them, with in/out those of
//   Hugging Face's [E, out, in] (gate_up_proj: in D, out 2I, one A shared
//   by the gate and up halves, as PEFT adapts the fused tensor).
// The effective weight is W + (alpha / R) B A (per expert; transposed into
// the in-major layout for the stacked experts).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/model.pb.h"

namespace shardd {

// Rewrites `model` for `config` and records it in model->lora. Errors:
// INVALID_ARGUMENT naming lora.rank (< 1), lora.alpha (not finite and
// > 0), lora.targets (empty, a duplicate, or a name that matches no linear
// module nor "experts" in this model, with the names that would), or the
// model (already adapted); UNIMPLEMENTED for DiffusionGemma.
absl::Status ApplyLora(const v1::LoraConfig& config, v1::ModelSpec* model);

// One adapted weight.
struct LoraTarget {
  std::string base;  // Fully qualified name of W.
  std::string a;     // Of lora_A.
  std::string b;     // Of lora_B.
  // 0: a linear, W [out, in]. E >= 1: stacked experts, W [E, in, out].
  int64_t experts = 0;
  int64_t in = 0;
  int64_t out = 0;
  int64_t rank = 0;
  double scale = 0;  // alpha / rank.
};

// The adapted weights of a rewritten spec, in walk order (empty when
// model.lora is unset). Errors: INVALID_ARGUMENT when the adapters named
// by model.lora are missing or have the wrong shape.
absl::StatusOr<std::vector<LoraTarget>> LoraTargetsOf(
    const v1::ModelSpec& model);

// Which adapter a fully qualified name is: M.lora_A.weight or
// <tensor>_lora_A (kA), the same with B (kB), or none.
enum class LoraAdapter { kNone, kA, kB };
LoraAdapter LoraAdapterOf(absl::string_view fqn);

// True for an adapter parameter's fully qualified name.
inline bool IsLoraAdapter(absl::string_view fqn) {
  return LoraAdapterOf(fqn) != LoraAdapter::kNone;
}

// The spec without adapters, lora unset and the base's own frozen flags
// unknown (every parameter left as the rewrite marked it): what a base
// checkpoint is checked against.
v1::ModelSpec WithoutLoraAdapters(const v1::ModelSpec& model);

}  // namespace shardd

#endif  // SHARDD_MODEL_LORA_H_
