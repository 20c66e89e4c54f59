#ifndef SHARDD_KERNELS_CPU_ROUTER_H_
#define SHARDD_KERNELS_CPU_ROUTER_H_

// MoE router on the CPU, fp32: a linear layer (with an optional bias),
// then one of two scorings. kSoftmaxThenTopK is softmax over all experts,
// top-k, and renormalization of the k selected weights (NeMo's Gemma4Gate
// steps 3-4, without its input norm and scale, which the model applies
// before calling this):
//
//   logits[T, E]  = x[T, D] @ W[E, D]^T (+ b[E])           (cblas_sgemm)
//   probs[t, :]   = softmax(logits[t, :])
//   indices[t, :] = top-k of probs[t, :], largest first; equal probabilities
//                   are ordered by the lower expert index (deterministic)
//   weights[t, k] = probs[t, indices[t, k]] / max(sum_j probs[t, idx_j], 1e-20)
//                   (renormalize, Mixtral and NeMo), or probs[t, indices[t, k]]
//                   as they are (Qwen3 with norm_topk_prob false)
//
// kTopKThenSoftmax (GPT-OSS's GptOssTopKRouter) selects on the logits and
// normalises only the selected ones (`renormalize` is ignored):
//
//   indices[t, :] = top-k of logits[t, :] (same order and tie rule)
//   weights[t, :] = softmax(logits[t, indices[t, :]])       (sum to 1)
//
// kSigmoidGroupLimited (DeepSeek-V3's DeepseekV3TopkRouter) scores each
// expert on its own and picks within groups, steered by a selection-only
// bias c[E] (e_score_correction_bias) that gets no gradient:
//
//   s[t, e]       = sigmoid(logits[t, e])
//   choice[t, e]  = s[t, e] + c[e]
//   group score   = sum of the 2 largest choices of each of `groups` groups
//                   of E / groups consecutive experts
//   kept groups   = the top_groups largest group scores (ties: lower group)
//   indices[t, :] = top-k of choice with the other groups' entries set to
//                   0 (not -inf: Hugging Face's masked_fill(..., 0.0))
//   weights[t, k] = scale * s[t, idx_k] / (sum_j s[t, idx_j] + 1e-20)
//                   (renormalize), or scale * s[t, idx_k]
//
// All arrays are dense, row-major, with the shapes given in brackets. GEMMs
// run through kernels::Sgemm (gemm.h, split over the compute pool);
// everything else is a single-threaded loop that allocates nothing once the
// cache is warm.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/router_select.h"

namespace shardd {
namespace kernels {

// RouterScoring and the per-token selection rules live in router_select.h,
// shared with the CUDA router.

struct RouterDims {
  int64_t tokens = 0;       // T >= 0
  int64_t dim = 0;          // D >= 1
  int64_t experts = 0;      // E >= 1
  int64_t top_k = 0;        // K in [1, E]
  bool renormalize = true;  // Divide the k weights by their sum.
  RouterScoring scoring = RouterScoring::kSoftmaxThenTopK;
  // kSigmoidGroupLimited: groups divides E into groups of >= 2 experts,
  // top_groups in [1, groups] with K <= top_groups * E / groups; scale
  // multiplies the weights (routed_scaling_factor).
  int64_t groups = 1;
  int64_t top_groups = 1;
  float scale = 1.0f;
  // kTopKThenSoftmax: also keep softmax(logits) over all E experts (the
  // load-balancing loss's routing probabilities; kSoftmaxThenTopK keeps them
  // anyway). See RouterSoftmax.
  bool keep_softmax = false;
};

// What RouterForward saves for RouterBackward, plus backward scratch. Owned
// by the caller, one per router call that still needs its backward (e.g. one
// per layer and pass); reused across steps, it only grows. Not thread-safe.
struct RouterCache {
  RouterDims dims;           // of the last forward
  bool has_forward = false;  // set by a successful RouterForward
  // [T, E] softmax output; kTopKThenSoftmax: [T, K] the weights;
  // kSigmoidGroupLimited: [T, K] the selected sigmoid scores.
  std::vector<float> probs;
  std::vector<float> row;         // kSigmoidGroupLimited forward scratch
  std::vector<int32_t> row_idx;  // (per token, reused)
  std::vector<int32_t> indices;  // [T, K] copy of the selected experts
  // [T] clamped sum of the selected probs; -1 when not renormalized.
  std::vector<float> denom;
  std::vector<float> d_logits;  // [T, E] backward scratch
  std::vector<float> softmax;   // [T, E] kTopKThenSoftmax with keep_softmax

  // Bytes held (capacity), for memory accounting.
  size_t bytes() const;
};

// Forward. x: [T, D]; w: [E, D]; indices: [T, K] out; weights: [T, K] out.
// x, w, indices and weights may be null only when T == 0.
// Errors: INVALID_ARGUMENT for a negative T, D or E < 1, K outside [1, E],
// a dimension that does not fit cblas' int, or a null pointer.
absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, int32_t* indices, float* weights,
                           RouterCache* cache);

// The same with a bias b [E] added to the logits (null: none).
absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias, int32_t* indices,
                           float* weights, RouterCache* cache);

// The same with a selection-only bias [E] (kSigmoidGroupLimited's
// e_score_correction_bias; null: none, and it must be null for the other
// scorings).
absl::Status RouterForward(const RouterDims& dims, const float* x,
                           const float* w, const float* bias,
                           const float* selection_bias, int32_t* indices,
                           float* weights, RouterCache* cache);

// Backward of RouterForward, given d_weights = dL/dweights [T, K].
//   dx [T, D]: dL/dx. Overwritten, or added to when `accumulate_dx` is true
//     (useful when x also feeds another branch). Null skips it.
//   dw [E, D]: dL/dW, always ADDED to (gradients accumulate across passes and
//     micro-batches; zero it at the start of a step). Null skips it: a frozen
//     router just passes dw = nullptr, and then x may be null too.
// x [T, D] and w [E, D] must be the forward's inputs. Gradients are those of
// the piecewise-smooth function with the top-k selection held fixed.
// Errors: FAILED_PRECONDITION if `cache` holds no forward or `dims` differ
// from the forward's; INVALID_ARGUMENT for a required null pointer.
absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights, float* dx,
                            bool accumulate_dx, float* dw, RouterCache* cache);

// The same, also ADDING dL/db [E] to d_bias (null skips it).
absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights, float* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            RouterCache* cache);

// The same, with extra_d_logits [T, E] (null: none) added to dL/dlogits
// before dx, dW and db are formed: the gradient another loss of the same
// logits sends (the load-balancing loss, kernels/cpu/router_aux_loss.h).
absl::Status RouterBackward(const RouterDims& dims, const float* x,
                            const float* w, const float* d_weights,
                            const float* extra_d_logits, float* dx,
                            bool accumulate_dx, float* dw, float* d_bias,
                            RouterCache* cache);

// softmax(logits) [T, E] over all experts of the cache's last forward:
// kSoftmaxThenTopK's probabilities, or kTopKThenSoftmax's when the forward
// had keep_softmax; null otherwise (and for kSigmoidGroupLimited).
const float* RouterSoftmax(const RouterCache& cache);

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_ROUTER_H_
