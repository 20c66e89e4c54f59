#include "layout/param_init.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/match.h"
#include "common/fingerprint.h"
#include "model/lora.h"

namespace shardd {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from the top 53 bits.
double UnitUniform(uint64_t bits) {
  return static_cast<double>(bits >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

bool IsNormLike(const v1::TensorSpec& tensor, v1::ModuleKind owner_kind,
                absl::string_view fqn) {
  if (owner_kind == v1::MODULE_NORM && tensor.shape_size() == 1) return true;
  return absl::EndsWith(fqn, "norm.weight") ||
         absl::EndsWith(fqn, "layernorm.weight") ||
         absl::EndsWith(fqn, "layer_scalar") || absl::EndsWith(fqn, ".scale");
}

}  // namespace

uint64_t ParamStreamId(absl::string_view fqn) {
  Fingerprint64 f;
  f.AddString(fqn);
  return f.value();
}

InitRule InitRuleFor(const v1::TensorSpec& tensor, v1::ModuleKind owner_kind,
                     absl::string_view fqn) {
  InitRule rule;
  if (IsNormLike(tensor, owner_kind, fqn)) {
    rule.kind = InitKind::kOnes;
    return rule;
  }
  if (absl::EndsWith(fqn, "bias")) {
    rule.kind = InitKind::kZeros;
    return rule;
  }
  // LoRA (model/lora.h) as PEFT starts it: B zero, so step 0 computes the
  // base model; A as nn.Linear's kaiming_uniform(a=sqrt(5)), a bound of
  // 1/sqrt(in) with in its last dim ([R, in], or [E, R, in] for experts).
  const LoraAdapter adapter = LoraAdapterOf(fqn);
  if (adapter == LoraAdapter::kB) {
    rule.kind = InitKind::kZeros;
    return rule;
  }
  if (adapter == LoraAdapter::kA) {
    rule.bound = 1.0 / std::sqrt(static_cast<double>(
                           tensor.shape(tensor.shape_size() - 1)));
    return rule;
  }
  rule.kind = InitKind::kUniform;
  int64_t fan_in = 1;
  const int dims = tensor.shape_size();
  if (owner_kind == v1::MODULE_EMBEDDING) {
    // Embedding rows are looked up, not multiplied; with a tied LM head they
    // also produce the logits of RMS-normalised states, so they start small
    // (uniform with std 0.02, the usual LM choice): the first loss is then
    // about log(vocab) instead of many nats above it.
    rule.bound = 0.02 * std::sqrt(3.0);
    return rule;
  }
  if (owner_kind == v1::MODULE_GROUPED_EXPERTS && dims == 3) {
    fan_in = tensor.shape(1);  // [E, D, 2I] -> D; [E, I, D] -> I.
  } else if (dims >= 2) {
    fan_in = tensor.shape(dims - 1);  // (out, in) weights.
  } else if (dims == 1) {
    fan_in = tensor.shape(0);
  }
  rule.bound = 1.0 / std::sqrt(static_cast<double>(fan_in < 1 ? 1 : fan_in));
  return rule;
}

void InitParamRange(uint64_t seed, absl::string_view fqn, const InitRule& rule,
                    int64_t begin, int64_t count, float* out) {
  switch (rule.kind) {
    case InitKind::kOnes:
      for (int64_t i = 0; i < count; ++i) out[i] = 1.0f;
      return;
    case InitKind::kZeros:
      for (int64_t i = 0; i < count; ++i) out[i] = 0.0f;
      return;
    case InitKind::kUniform:
      break;
  }
  const uint64_t stream = SplitMix64(seed ^ SplitMix64(ParamStreamId(fqn)));
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t bits = SplitMix64(stream + static_cast<uint64_t>(begin + i) *
                                                  0xd1b54a32d192ed03ULL);
    out[i] = static_cast<float>(UnitUniform(bits) * rule.bound);
  }
}

}  // namespace shardd
