#ifndef SHARDD_MODEL_HF_ATTENTION_H_
#define SHARDD_MODEL_HF_ATTENTION_H_

// The attention part of a Hugging Face config.json (internal to model/,
// used by hf_config): RoPE, positions, sliding windows.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "model/config_reader.h"
#include "proto/model.pb.h"

namespace shardd {
namespace hf_internal {

// How a family marks its sliding-window layers when the config has no
// layer_types list.
enum class SlidingLayers {
  kNone,        // Llama: no sliding window.
  kAllWhenSet,  // Mistral/Mixtral: every layer when sliding_window is set.
  kQwen,        // Qwen: layers >= max_window_layers when use_sliding_window.
  kAlternate,   // GPT-OSS: even layers slide (sliding_window, default 128).
};

// Fills `out` (rope, max_position_embeddings, sliding window and layers)
// from the config: rope_parameters (transformers 5) or rope_theta with
// rope_scaling (4.x); layer_types ("full_attention"/"sliding_attention")
// when present. Errors: INVALID_ARGUMENT naming the field (an unsupported
// rope type lists the supported ones).
absl::Status ReadAttention(const ConfigReader& r, int64_t layers,
                           SlidingLayers sliding, v1::AttentionSpec* out);

// Fills `rope` from one rope_parameters object `p` (printed as `where` in
// errors): rope_type (or type), rope_theta and partial_rotary_factor (else
// the defaults given), and the type's own fields.
absl::Status ReadRopeObject(const json& p, const std::string& where,
                            double default_theta, double default_partial,
                            int64_t max_positions, v1::RopeSpec* rope);

}  // namespace hf_internal
}  // namespace shardd

#endif  // SHARDD_MODEL_HF_ATTENTION_H_
