#ifndef SHARDD_LAYOUT_PARAM_INIT_H_
#define SHARDD_LAYOUT_PARAM_INIT_H_

// Deterministic parameter initialisation that does not depend on the layout:
// element i of parameter P always gets the same value, whether one process
// holds the whole tensor or a rank holds a dim-0 slice or a flat range of it.
// That is what lets a sharded run start from exactly the weights of an
// unsharded one, with no communication.
//
// The value of element i is a function of (seed, P's fully qualified name, i)
// through a counter-based generator (SplitMix64), so any element can be
// produced alone.

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "proto/model.pb.h"

namespace shardd {

enum class InitKind {
  kOnes,     // Norm scales (RMSNorm weight), layer scalars.
  kZeros,    // Biases.
  kUniform,  // Uniform(-a, a) with a = scale / sqrt(fan_in).
};

struct InitRule {
  InitKind kind = InitKind::kUniform;
  // For kUniform: the bound a = scale / sqrt(fan_in); fan_in is the last
  // dimension of the parameter (the input features of an (out, in) weight,
  // or D for grouped experts' [E, D, 2I] rows -- see InitRuleFor).
  double bound = 0.0;
};

// The rule for a parameter, from its name, module kind and shape:
// norm weights (1-D params of MODULE_NORM, names ending in "norm.weight" or
// "layernorm.weight", "layer_scalar", "scale") are ones; names ending in
// "bias" are zeros; embeddings are uniform with std 0.02; everything else
// uses bound 1/sqrt(fan_in) with fan_in the
// parameter's reduction dimension (shape[1] of a 2-D (out, in) weight, D for
// gate_and_up_projs [E, D, 2I], I for down_projs [E, I, D]).
InitRule InitRuleFor(const v1::TensorSpec& tensor, v1::ModuleKind owner_kind,
                     absl::string_view fqn);

// Writes elements [begin, begin + count) of the flattened parameter `fqn`
// into out[0..count).
void InitParamRange(uint64_t seed, absl::string_view fqn, const InitRule& rule,
                    int64_t begin, int64_t count, float* out);

// The per-parameter stream id mixed into the generator (FNV-1a of the name).
uint64_t ParamStreamId(absl::string_view fqn);

}  // namespace shardd

#endif  // SHARDD_LAYOUT_PARAM_INIT_H_
