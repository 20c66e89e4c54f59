#ifndef SHARDD_MODEL_ROPE_FREQUENCIES_H_
#define SHARDD_MODEL_ROPE_FREQUENCIES_H_

// A model's RoPE frequencies and attention factor from its RopeSpec, as
// Hugging Face's rope initialisers compute them (modeling_rope_utils):
//   default       f_i = theta^(-2i / R), R = int(head_dim * partial)
//   linear        default / factor
//   llama3        default, low frequencies (wavelength > original /
//                 low_freq_factor) / factor, a smooth blend between
//                 original / high_freq_factor and original /
//                 low_freq_factor
//   yarn          a ramp between default (fast dims) and default / factor
//                 (slow dims) over the correction range of beta_fast and
//                 beta_slow rotations at original_max_position_embeddings
//                 (floored / ceiled unless untruncated); attention
//                 factor given, or
//                 m(factor, mscale) / m(factor, mscale_all_dim) with both
//                 set, else m(factor), m(s, k) = 0.1 k ln s + 1 (1 for
//                 s <= 1)
//   proportional  head_dim / 2 frequencies: the first int(partial *
//                 head_dim / 2) are theta^(-2i / head_dim), the rest 0 (those
//                 dims do not rotate); all / factor (1 when unset)
// Computed in double and rounded once to fp32.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"

namespace shardd {

struct RopeFrequencies {
  std::vector<float> inv_freq;  // R / 2; R is the rotary dims.
  float attention_factor = 1.0f;
  bool interleaved = false;
};

// Errors: INVALID_ARGUMENT naming the RopeSpec field for an unknown type, a
// non-positive theta or factor where one is needed, or a rotary dimension
// below 2.
absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const v1::RopeSpec& rope,
                                                       int64_t head_dim);

}  // namespace shardd

#endif  // SHARDD_MODEL_ROPE_FREQUENCIES_H_
