#ifndef SHARDD_WORKER_MODEL_ATTENTION_BLOCK_H_
#define SHARDD_WORKER_MODEL_ATTENTION_BLOCK_H_

// The self-attention sublayer of a decoder layer on the CPU, forward and
// backward, as Hugging Face's Llama / Mixtral / Qwen3 attention computes it:
//
//   q = n Wq^T (+ bq), k = n Wk^T (+ bk), v = n Wv^T (+ bv)
//                                                 (n: the normed input;
//                                                  biases: GPT-OSS)
//   q, k = RMSNorm per head (q_norm, k_norm)      (Qwen3)
//   q, k = RoPE(q), RoPE(k) at each token's position in its sequence
//   o = softmax(q k^T / sqrt(hd) + mask) v        (causal or sliding window,
//                                                  GQA; with GPT-OSS's
//                                                  per-head sink logit in
//                                                  the denominator)
//   y = o Wo^T (+ bo)
//
// Tokens are [batch, seq] sequences laid end to end (T = batch * seq).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/param_source.h"

namespace shardd {

// What one forward keeps for its backward (one layer, one pass).
struct AttentionActs {
  std::vector<float> n;             // [T, D] normed input
  std::vector<float> q_pre, k_pre;  // Before the q/k norms (qk_norm only)
  std::vector<float> q_inv, k_inv;  // Their inverse RMS, per row of hd
  std::vector<float> q, k, v;       // The attention's inputs
  std::vector<float> o;             // [T, Hq * hd] the attention's output
  std::vector<float> lse;           // [batch, Hq, seq]
  int64_t bytes() const;
};

class AttentionBlock {
 public:
  // `arch` outlives the block.
  explicit AttentionBlock(const MoeArchitecture* arch) : arch_(arch) {}

  // Packed rows (docs/sft_data.md): segment_starts [batch * seq] gives
  // each token's example start within its row; RoPE positions restart
  // there and attention stays inside the example. Null: one sequence per
  // row. Not owned; valid until the next call.
  void SetSegments(const int32_t* segment_starts) {
    segments_ = segment_starts;
  }

  // Makes the RoPE table cover positions [0, seq). Errors: INVALID_ARGUMENT
  // for seq beyond the model's max_position_embeddings.
  absl::Status Prepare(int64_t seq);

  // y [T, D] = the sublayer's output for the normed input n [T, D]
  // (overwritten). Saves what the backward needs in `acts`.
  absl::Status Forward(const MoeLayerSpec& layer, ParamSource* params,
                       const float* n, int64_t batch, int64_t seq,
                       AttentionActs* acts, float* y);

  // Given dy [T, D] (the gradient of y), writes dn [T, D] (overwritten) and
  // adds the projections' and q/k norms' gradients through `params`.
  absl::Status Backward(const MoeLayerSpec& layer, ParamSource* params,
                        const AttentionActs& acts, int64_t batch, int64_t seq,
                        const float* dy, float* dn);

 private:
  absl::Status Rotate(std::vector<float>* x, int64_t tokens, int64_t seq,
                      int64_t heads, bool inverse);
  absl::Status AddGrad(ParamSource* params, const ArchTensor& t,
                       const std::vector<float>& g);
  // The kernel options of `layer`, with its sinks from `params`.
  absl::StatusOr<kernels::AttentionOptions> Options(const MoeLayerSpec& layer,
                                                    ParamSource* params);

  const MoeArchitecture* arch_;
  kernels::RopeTable rope_;
  std::vector<int32_t> positions_;
  const int32_t* segments_ = nullptr;  // SetSegments.
  kernels::AttentionWorkspace ws_;
  // Backward scratch.
  std::vector<float> dq_, dk_, dv_, do_, grad_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_ATTENTION_BLOCK_H_
