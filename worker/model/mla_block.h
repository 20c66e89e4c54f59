#ifndef SHARDD_WORKER_MODEL_MLA_BLOCK_H_
#define SHARDD_WORKER_MODEL_MLA_BLOCK_H_

// DeepSeek-V3's multi-head latent attention on the CPU, forward and
// backward, as Hugging Face's DeepseekV3Attention computes it (n: the normed
// input; H heads; nope, rope, Dv: the MLA head dims):
//
//   q  = q_b_proj(RMSNorm(q_a_proj n; q_a_layernorm))   [T, H, nope + rope]
//        (or q_proj n when q_lora_rank is 0)
//   [c, kr] = kv_a_proj_with_mqa n                      [T, Rkv], [T, rope]
//   [k_nope, v] = kv_b_proj(RMSNorm(c; kv_a_layernorm)) [T, H, nope], [T, H,
//   Dv] q[..., nope:], kr = RoPE(...)   (kr: one head shared by every head) k
//   = [k_nope, kr]                                   [T, H, nope + rope] o  =
//   softmax(scale q k^T + causal mask) v           [T, H, Dv] y  = o_proj o
//
// The two latent norms use DeepseekV3RMSNorm's default eps 1e-6, not
// rms_norm_eps (HF builds them without it). RoPE pairs (2i, 2i + 1) with
// rope_interleave: HF de-interleaves q and k alike before rotate_half, the
// same permutation of both, which no score can tell apart.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/moe_architecture.h"
#include "worker/model/param_source.h"

namespace shardd {

// What one forward keeps for its backward (one layer, one pass).
struct MlaActs {
  std::vector<float> n;                 // [T, D] normed input
  std::vector<float> qa, qa_inv, qa_n;  // q_a_proj out, inverse RMS, normed
  std::vector<float> c, c_inv, c_n;     // latent kv, inverse RMS, normed
  std::vector<float> q, k, v;           // The attention's inputs
  std::vector<float> o;                 // [T, H * Dv]
  std::vector<float> lse;               // [batch, H, seq]
  int64_t bytes() const;
};

class MlaBlock {
 public:
  // `arch` (with arch->mla) outlives the block.
  explicit MlaBlock(const MoeArchitecture* arch) : arch_(arch) {}

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
                       MlaActs* acts, float* y);

  // Given dy [T, D], writes dn [T, D] (overwritten) and adds every
  // projection's and latent norm's gradient through `params`.
  absl::Status Backward(const MoeLayerSpec& layer, ParamSource* params,
                        const MlaActs& acts, int64_t batch, int64_t seq,
                        const float* dy, float* dn);

 private:
  // RoPE on the rope dims of `heads` heads of `stride` floats each, at
  // offset `offset` in every head.
  absl::Status Rotate(float* x, int64_t tokens, int64_t seq, int64_t heads,
                      int64_t stride, int64_t offset, bool inverse);
  absl::Status AddGrad(ParamSource* params, const ArchTensor& t,
                       const std::vector<float>& g);
  // dW of y = x W^T (rows T, in -> out), added through `params`; dx
  // overwritten or accumulated when non-null.
  absl::Status LinearGrad(ParamSource* params, const ArchTensor& weight,
                          const float* x, const float* dy, int64_t tokens,
                          int64_t in, int64_t out, float* dx, bool accumulate);

  const MoeArchitecture* arch_;
  kernels::RopeTable rope_;
  // The self-attention's options (with the packed rows' segments).
  kernels::AttentionOptions Options(const MoeLayerSpec& layer) const {
    kernels::AttentionOptions o = SelfAttentionOptions(*arch_, layer);
    o.key_begin = segments_;
    return o;
  }
  std::vector<int32_t> positions_;
  const int32_t* segments_ = nullptr;  // SetSegments.
  kernels::AttentionWorkspace ws_;
  // Scratch.
  std::vector<float> kva_, kvb_, kr_, dq_, dk_, dv_, do_, dkva_, dkvb_, dlat_,
      dlat_pre_, grad_;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_MLA_BLOCK_H_
