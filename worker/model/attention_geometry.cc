#include "worker/model/attention_geometry.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace shardd {

kernels::AttentionDims SelfAttentionDims(const MoeArchitecture& arch,
                                         int64_t batch, int64_t seq) {
  kernels::AttentionDims d;
  d.batch = batch;
  d.q_len = seq;
  d.kv_len = seq;
  d.q_heads = arch.q_heads;
  d.kv_heads = arch.kv_heads;
  d.head_dim = arch.head_dim;
  d.v_head_dim = arch.mla ? arch.v_head_dim : 0;  // 0: head_dim
  return d;
}

kernels::AttentionOptions SelfAttentionOptions(const MoeArchitecture& arch,
                                               const MoeLayerSpec& layer) {
  kernels::AttentionOptions o;
  o.scale = static_cast<float>(arch.softmax_scale > 0
                                   ? arch.softmax_scale
                                   : 1.0 / std::sqrt(double(arch.head_dim)));
  o.mask = layer.sliding ? kernels::AttentionMask::kSlidingWindow
                         : kernels::AttentionMask::kCausal;
  o.window = arch.sliding_window;
  return o;
}

kernels::RopeShape HeadsRopeShape(int64_t tokens, int64_t heads,
                                  int64_t head_stride, int64_t dim_offset) {
  kernels::RopeShape shape;
  shape.tokens = tokens;
  shape.heads = heads;
  shape.token_stride = heads * head_stride;
  shape.head_stride = head_stride;
  shape.dim_offset = dim_offset;
  return shape;
}

kernels::RopeLayout RopeLayoutOf(const MoeArchitecture& arch) {
  return arch.rope.interleaved ? kernels::RopeLayout::kInterleaved
                               : kernels::RopeLayout::kHalf;
}

absl::StatusOr<kernels::RopeTable> RopeTableFor(const MoeArchitecture& arch,
                                                int64_t seq) {
  if (seq > arch.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seq: ", seq, " tokens exceed the model's max_position_embeddings (",
        arch.max_positions, ")"));
  }
  return kernels::BuildRopeTable(arch.rope.inv_freq, seq,
                                 arch.rope.attention_factor);
}

kernels::AttentionDims GemmaAttentionDims(const MoeArchitecture& arch,
                                          const MoeLayerSpec& layer,
                                          int64_t batch, int64_t seq) {
  kernels::AttentionDims d = SelfAttentionDims(arch, batch, seq);
  d.kv_heads = layer.layer_kv_heads;
  d.head_dim = layer.layer_head_dim;
  return d;
}

kernels::AttentionOptions GemmaAttentionOptions(const MoeArchitecture& arch,
                                                const MoeLayerSpec& layer,
                                                bool decode) {
  kernels::AttentionOptions o = SelfAttentionOptions(arch, layer);
  if (arch.softmax_scale <= 0) {
    o.scale = static_cast<float>(
        1.0 / std::sqrt(static_cast<double>(layer.layer_head_dim)));
  }
  if (decode) o.mask = kernels::AttentionMask::kBidirectional;
  return o;
}

std::vector<GemmaDecodeBlock> GemmaDecodeBlocks(int64_t block, int64_t seq) {
  const int64_t size = block > 0 ? block : seq;
  std::vector<GemmaDecodeBlock> blocks;
  for (int64_t c = 0; c < seq; c += size) {
    blocks.push_back({c, std::min(size, seq - c)});
  }
  return blocks;
}

int64_t GemmaEncoderLow(const MoeArchitecture& arch, const MoeLayerSpec& layer,
                        int64_t prefix, int64_t begin) {
  if (!layer.sliding) return 0;
  return std::max<int64_t>(0, prefix + begin - arch.sliding_window + 1);
}

std::vector<DecodeRows> GemmaDecodeRowRuns(const MoeArchitecture& arch,
                                           const MoeLayerSpec& layer,
                                           int64_t prefix,
                                           const int32_t* row_prefix,
                                           int64_t encoder_seq,
                                           const GemmaDecodeBlock& blk,
                                           int64_t batch) {
  auto prefix_of = [&](int64_t b) -> int64_t {
    return row_prefix == nullptr ? prefix : row_prefix[b];
  };
  std::vector<DecodeRows> runs;
  for (int64_t b = 0; b < batch;) {
    DecodeRows r;
    r.begin = b;
    r.prefix = prefix_of(b);
    while (b < batch && prefix_of(b) == r.prefix) ++b;
    r.end = b;
    r.key_end = std::min(r.prefix + blk.begin, encoder_seq);
    r.key_lo = std::min(GemmaEncoderLow(arch, layer, r.prefix, blk.begin),
                        r.key_end);
    runs.push_back(r);
  }
  return runs;
}

}  // namespace shardd
