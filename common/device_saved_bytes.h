#ifndef SHARDD_COMMON_DEVICE_SAVED_BYTES_H_
#define SHARDD_COMMON_DEVICE_SAVED_BYTES_H_

// The sizes of what the CUDA kernels keep between a forward and its
// backward, in a header that needs no CUDA: the planner counts a GPU
// worker's activations with them (planner/activation_model.cc) and the
// kernels carve exactly these layouts (kernels/cuda/router.cc,
// dense_mlp.cc, grouped_experts.cc; kernels/cuda:device_saved_bytes_test
// holds both to the same numbers). Every region starts on a 256-byte
// boundary, so each count is rounded up region by region.

#include <cstdint>

namespace shardd {
namespace device_bytes {

inline constexpr int64_t kAlignment = 256;

constexpr int64_t Aligned(int64_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// RouterForward's saved state: probabilities or logits [T, E] fp32, the
// denominators [T] fp32, the choices [T, K] int32 and, for the sigmoid and
// top-k-then-softmax scorings (`keeps_selected`), the selected weights or
// scores [T, K] fp32.
constexpr int64_t RouterSaved(int64_t tokens, int64_t experts, int64_t top_k,
                              bool keeps_selected) {
  return Aligned(tokens * experts * 4) + Aligned(tokens * 4) +
         Aligned(tokens * top_k * 4) +
         (keeps_selected ? Aligned(tokens * top_k * 4) : 0);
}

// DenseMlpForward's saved state: the gate and up projections [T, I] in the
// storage type (`elem` bytes).
constexpr int64_t DenseMlpSaved(int64_t tokens, int64_t inter, int64_t elem) {
  return 2 * Aligned(tokens * inter * elem);
}

// The grouped experts' routing is counted in chunks of this many slots.
inline constexpr int64_t kExpertRoutingChunk = 2048;
// The per-expert GEMMs with their own pointer arrays (forward 2, backward 4).
inline constexpr int64_t kExpertGemmSlots = 6;

// GroupedExpertsWorkspaceBytes: one workspace per layer call, held from the
// forward to the backward. Over T * K slots: the status word and per-expert
// counts, the routing chunks' counts, offsets, the nonempty list, each
// slot's row, token, weight and weight gradient, the GEMM pointer arrays,
// and in the storage type the permuted inputs [T*K, D], gate/up
// pre-activations [T*K, 2I], activations [T*K, I], the output (then its
// gradient, then the inputs') [T*K, D], and the gradients of the
// activations [T*K, I] and pre-activations [T*K, 2I]. Regions start
// aligned; the last one ends the workspace unrounded.
constexpr int64_t GroupedExpertsWorkspace(int64_t tokens, int64_t top_k,
                                          int64_t experts, int64_t dim,
                                          int64_t inter, int64_t elem) {
  const int64_t slots = tokens * top_k;
  const int64_t chunks =
      (slots + kExpertRoutingChunk - 1) / kExpertRoutingChunk;
  return Aligned((1 + experts) * 4) + Aligned(chunks * experts * 4) +
         Aligned((experts + 1) * 4) + Aligned(experts * 4) +
         4 * Aligned(slots * 4) + Aligned(kExpertGemmSlots * 3 * experts * 8) +
         2 * Aligned(slots * dim * elem) + Aligned(slots * 2 * inter * elem) +
         2 * Aligned(slots * inter * elem) + slots * 2 * inter * elem;
}

}  // namespace device_bytes
}  // namespace shardd

#endif  // SHARDD_COMMON_DEVICE_SAVED_BYTES_H_
