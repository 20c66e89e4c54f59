#ifndef SHARDD_KERNELS_CPU_GROUPED_EXPERTS_H_
#define SHARDD_KERNELS_CPU_GROUPED_EXPERTS_H_

// Grouped MoE experts on the CPU, fp32, with NeMo GroupedExperts' layout and
// semantics (torch_mm path):
//
//   W_gu [E, D, 2I]: gate half then up half (concatenated, not interleaved)
//   W_d  [E, I, D]
//
// Forward, for x[T, D], indices[T, K], weights[T, K] and an optional
// token_mask[T] (false = padding: its K assignments are dropped):
//   1. flatten to T*K assignments and sort them by expert with a STABLE
//      counting sort (ties keep token order, then k order);
//   2. gather the permuted rows Xe of each expert e;
//   3. h = Xe @ W_gu[e]                   [n_e, 2I]   (cblas_sgemm)
//   4. a = act(h[:, :I]) * h[:, I:] * w   [n_e, I]    routing weight applied
//      inside the activation, between up and down, as NeMo does
//   5. o = a @ W_d[e]                     [n_e, D]    (cblas_sgemm)
//   6. y[t] = sum over t's assignments in k order of o  (fp32, deterministic)
// with act = silu (SwiGLU) or gelu with the tanh approximation (GeGLU).
//
// GPT-OSS (ExpertOptions): biases join the two matmuls and the activation
// is the clamped "swigluoai" (kClampedSwiGLU):
//   3'. h = Xe @ W_gu[e] + b_gu[e]
//   4'. g = min(h[:, :I], limit), u = clamp(h[:, I:], -limit, limit),
//       a = g * sigmoid(alpha * g) * (u + 1) * w
//   5'. o = a @ W_d[e] + w * b_d[e]
// which is Hugging Face's (h @ W_d + b_d) * w. The clamps pass gradient
// where the input lies inside [-limit, limit] inclusive, as torch.clamp does.
//
// An expert that receives no tokens still takes part: it contributes exactly
// zero, and its slices of dW_gu / dW_d are accumulated with zero (left as
// they are), so every rank's gradient buffers have the same shape and the
// same collectives follow whatever the routing was.
//
// All arrays are dense and row-major. The work is spread over the compute
// pool (compute_pool.h): whole experts per thread when there are at least
// twice as many experts as threads, else split GEMMs (gemm.h); the gather
// and scatter by rows. Results do not depend on the thread count, and
// nothing is allocated once the workspace is warm.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/uninit_vector.h"

namespace shardd {
namespace kernels {

enum class GatedActivation {
  kSwiGLU,         // silu(g) * u
  kGeGLU,          // gelu_tanh(g) * u
  kClampedSwiGLU,  // GPT-OSS, above (grouped experts only)
};

// What GPT-OSS adds: the clamped activation's constants and per-expert
// biases (null: none). The backward is given the same constants and biases
// with the same values (they may have moved: a regathered parameter).
struct ExpertOptions {
  float alpha = 1.702f;                 // kClampedSwiGLU: sigmoid gain, > 0
  float limit = 7.0f;                   // kClampedSwiGLU: clamp, > 0
  const float* gate_up_bias = nullptr;  // b_gu [E, 2I]
  const float* down_bias = nullptr;     // b_d [E, D]
};

// Gradients of the biases, ADDED to like dW_gu / dW_d (null skips one).
struct ExpertBiasGrads {
  float* gate_up = nullptr;  // [E, 2I]
  float* down = nullptr;     // [E, D]
};

struct ExpertDims {
  int64_t tokens = 0;        // T >= 0
  int64_t dim = 0;           // D >= 1
  int64_t intermediate = 0;  // I >= 1
  int64_t experts = 0;       // E >= 1
  int64_t top_k = 0;         // K in [1, E]
};

// Routing layout and saved activations of one forward, plus backward scratch.
// Owned by the caller: one per expert call whose backward is still pending
// (e.g. one per layer and pass), reused across steps. Buffers only grow, so a
// warm workspace makes no allocation. Not thread-safe. Callers may read the
// routing layout after a forward; everything else is internal.
struct GroupedExpertsWorkspace {
  ExpertDims dims;  // of the last forward
  GatedActivation activation = GatedActivation::kSwiGLU;
  ExpertOptions options;     // of the last forward
  bool has_forward = false;  // set by a successful forward
  int64_t rows = 0;          // N: unmasked assignments

  // Routing layout. Rows are assignments sorted by expert; expert e owns rows
  // [expert_offsets[e], expert_offsets[e + 1]).
  std::vector<int64_t> expert_offsets;  // [E + 1]
  std::vector<int32_t> row_token;       // [N] token of each row
  std::vector<int32_t> row_of_slot;     // [T * K] row of t*K+k, -1 if masked
  std::vector<float> row_weight;        // [N] routing weight of each row
  std::vector<int64_t> expert_cursor;   // [E] sort scratch

  // Saved activations (every row written before it is read, so grown
  // without zeroing).
  UninitVector<float> xs;  // [N, D]  permuted inputs
  UninitVector<float> h;   // [N, 2I] gate and up pre-activations
  UninitVector<float> a;   // [N, I]  weighted activation (input to down)

  // Scratch: o / dO [N, D], dA [N, I], dH [N, 2I], dXs [N, D], and the
  // routing-weight gradient of each row [N].
  UninitVector<float> o;
  UninitVector<float> da;
  UninitVector<float> dh;
  UninitVector<float> dxs;
  UninitVector<float> row_dweight;

  // Bytes held (capacity), for memory accounting.
  size_t bytes() const;
};

// Forward. x: [T, D]; indices: [T, K] in [0, E) (masked tokens' entries are
// ignored); weights: [T, K]; token_mask: [T] or null for all tokens;
// w_gu: [E, D, 2I]; w_d: [E, I, D]; y: [T, D], overwritten (masked tokens get
// zeros). Pointers other than token_mask may be null only when T == 0.
// Saves what the backward needs in `ws`.
// Errors: INVALID_ARGUMENT for bad dims (T < 0, D, I or E < 1, K outside
// [1, E], sizes beyond cblas' int), a null pointer, or an unmasked index
// outside [0, E).
absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   GatedActivation activation, const float* x,
                                   const int32_t* indices, const float* weights,
                                   const bool* token_mask, const float* w_gu,
                                   const float* w_d, float* y,
                                   GroupedExpertsWorkspace* ws);

// The same with GPT-OSS's options. Errors also: INVALID_ARGUMENT for
// kClampedSwiGLU with alpha or limit not > 0.
absl::Status GroupedExpertsForward(const ExpertDims& dims,
                                   GatedActivation activation,
                                   const ExpertOptions& options, const float* x,
                                   const int32_t* indices, const float* weights,
                                   const bool* token_mask, const float* w_gu,
                                   const float* w_d, float* y,
                                   GroupedExpertsWorkspace* ws);

// Backward of the last GroupedExpertsForward on `ws`, whose w_gu and w_d must
// be passed again unchanged. dy: [T, D].
//   dx [T, D]: overwritten, or added to when `accumulate_dx` is true. Masked
//     tokens get zero (or are left as they are when accumulating).
//   d_weights [T, K]: dL/dweights, overwritten (zero for masked tokens); it
//     feeds RouterBackward.
//   dw_gu [E, D, 2I] and dw_d [E, I, D]: ADDED to (gradients accumulate
//     across passes and micro-batches; zero them at the start of a step).
// Any output may be null to skip it (frozen experts pass dw_gu = dw_d =
// nullptr). The workspace is not consumed: calling backward twice adds the
// parameter gradients twice.
// Errors: FAILED_PRECONDITION if `ws` holds no forward or `dims` /
// `activation` differ from the forward's; INVALID_ARGUMENT for a required
// null pointer.
absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, GatedActivation activation, const float* w_gu,
    const float* w_d, const float* dy, float* dx, bool accumulate_dx,
    float* d_weights, float* dw_gu, float* dw_d, GroupedExpertsWorkspace* ws);

// The same after a forward with `options` (passed again, equal), also
// adding the bias gradients.
absl::Status GroupedExpertsBackward(
    const ExpertDims& dims, GatedActivation activation,
    const ExpertOptions& options, const float* w_gu, const float* w_d,
    const float* dy, float* dx, bool accumulate_dx, float* d_weights,
    float* dw_gu, float* dw_d, const ExpertBiasGrads& bias_grads,
    GroupedExpertsWorkspace* ws);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_GROUPED_EXPERTS_H_
