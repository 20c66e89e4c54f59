#ifndef SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_
#define SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_

// What a model's self-attention asks of the attention and RoPE kernels, for
// the CPU (attention_block) and GPU (device_attention_block) sublayers alike:
// the kernel shapes and options of a layer, and the RoPE table.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "worker/model/moe_architecture.h"

namespace shardd {

// [batch] sequences of `seq` tokens attending to themselves (MLA: v heads
// of v_head_dim).
kernels::AttentionDims SelfAttentionDims(const MoeArchitecture& arch,
                                         int64_t batch, int64_t seq);

// Scale dims.attention.softmax_scale, or head_dim^-0.5 when unset; causal,
// or sliding-window for a sliding layer.
kernels::AttentionOptions SelfAttentionOptions(const MoeArchitecture& arch,
                                               const MoeLayerSpec& layer);

kernels::RopeLayout RopeLayoutOf(const MoeArchitecture& arch);

// DiffusionGemma's layers (gemma_layer.h, and the GPU model's), each with
// its own kv heads and head dim. The scale is dims.attention.softmax_scale
// (Gemma 4's 1.0: q_norm and k_norm carry it), else layer_head_dim^-0.5;
// causal or sliding-window; a decode block is given exactly the keys its
// mask allows, so it attends to all of them.
kernels::AttentionDims GemmaAttentionDims(const MoeArchitecture& arch,
                                          const MoeLayerSpec& layer,
                                          int64_t batch, int64_t seq);
kernels::AttentionOptions GemmaAttentionOptions(const MoeArchitecture& arch,
                                                const MoeLayerSpec& layer,
                                                bool decode);

// A decode's canvas rows [begin, begin + len), in blocks of `block` rows
// (0: one block) over `seq` canvas rows.
struct GemmaDecodeBlock {
  int64_t begin = 0, len = 0;
};
std::vector<GemmaDecodeBlock> GemmaDecodeBlocks(int64_t block, int64_t seq);

// Consecutive sequences of a decode that share a prefix, and a block's
// encoder keys [key_lo, key_end) for them.
struct DecodeRows {
  int64_t begin = 0, end = 0;
  int64_t prefix = 0;
  int64_t key_lo = 0, key_end = 0;
};

// A decode's `batch` sequences in runs of one prefix (`row_prefix` [batch]
// each sequence's, or null: `prefix` for all), with block `blk`'s encoder
// keys for each run: they end at min(prefix + blk.begin, encoder_seq).
std::vector<DecodeRows> GemmaDecodeRowRuns(const MoeArchitecture& arch,
                                           const MoeLayerSpec& layer,
                                           int64_t prefix,
                                           const int32_t* row_prefix,
                                           int64_t encoder_seq,
                                           const GemmaDecodeBlock& blk,
                                           int64_t batch);

// The first encoder row the decode block starting at canvas row `begin`
// sees on `layer` (its encoder keys end at prefix + begin): 0 on full
// layers, the sliding window's start on sliding ones.
int64_t GemmaEncoderLow(const MoeArchitecture& arch, const MoeLayerSpec& layer,
                        int64_t prefix, int64_t begin);


// RoPE on `heads` heads of `head_stride` elements per token (packed, so
// heads * head_stride per token), from dim `dim_offset` of each head on (the
// rope part of an MLA head; 0 elsewhere).
kernels::RopeShape HeadsRopeShape(int64_t tokens, int64_t heads,
                                  int64_t head_stride, int64_t dim_offset = 0);

// The RoPE table for positions [0, seq). Errors: INVALID_ARGUMENT for seq
// beyond the model's max_position_embeddings, and BuildRopeTable's.
absl::StatusOr<kernels::RopeTable> RopeTableFor(const MoeArchitecture& arch,
                                                int64_t seq);

// RoPE positions of `tokens` tokens in rows of `seq`: t % seq + offset,
// less the start of the token's example within its row for packed rows
// (`segment_starts` [tokens], docs/sft_data.md; null: one sequence per row).
inline void FillPositions(const int32_t* segment_starts, int64_t tokens,
                          int64_t seq, int64_t offset,
                          std::vector<int32_t>* out) {
  out->resize(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    (*out)[t] = static_cast<int32_t>(
        t % seq + offset - (segment_starts == nullptr ? 0 : segment_starts[t]));
  }
}

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_
