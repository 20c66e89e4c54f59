#ifndef SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_
#define SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_

// What a model's self-attention asks of the attention and RoPE kernels, for
// the CPU (attention_block) and GPU (device_attention_block) sublayers alike:
// the kernel shapes and options of a layer, and the RoPE table.

#include <cstdint>

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

// RoPE on `heads` heads of `head_stride` elements per token (packed, so
// heads * head_stride per token), from dim `dim_offset` of each head on (the
// rope part of an MLA head; 0 elsewhere).
kernels::RopeShape HeadsRopeShape(int64_t tokens, int64_t heads,
                                  int64_t head_stride, int64_t dim_offset = 0);

// The RoPE table for positions [0, seq). Errors: INVALID_ARGUMENT for seq
// beyond the model's max_position_embeddings, and BuildRopeTable's.
absl::StatusOr<kernels::RopeTable> RopeTableFor(const MoeArchitecture& arch,
                                                int64_t seq);

}  // namespace shardd

#endif  // SHARDD_WORKER_MODEL_ATTENTION_GEOMETRY_H_
