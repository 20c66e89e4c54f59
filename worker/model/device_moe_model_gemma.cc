// DiffusionGemma's decoder layer on the GPU: the computation of
// worker/model/gemma_layer.h (read it for the math), split the same way
// into LAYER and EXPERTS, with the decode's attention over
// [encoder K/V ; canvas K/V] block by block. Same kernels as the other
// layers (cuBLAS projections, kernels/cuda/ norms, RoPE, attention, dense
// MLP, router, grouped experts); storage T, fp32 accumulation.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/row_major_gemm.h"
#include "worker/model/device_linear.h"
#include "worker/model/device_moe_model_impl.h"

namespace shardd {
namespace device_moe_internal {
namespace {

// `height` rows of `width` bytes from src (rows `spitch` apart) to dst
// (`dpitch` apart), on the stream: gathers and scatters of sequence rows.
absl::Status Copy2D(void* dst, int64_t dpitch, const void* src, int64_t spitch,
                    int64_t width, int64_t height, cudaStream_t stream) {
  if (width == 0 || height == 0) return absl::OkStatus();
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                        cudaMemcpyDeviceToDevice, stream),
      "DiffusionGemma: copying rows");
  return absl::OkStatus();
}

template <typename T>
const char* At(const DeviceBuffer& b, int64_t elements) {
  return static_cast<const char*>(b.data()) + elements * sizeof(T);
}
template <typename T>
char* At(DeviceBuffer& b, int64_t elements) {
  return static_cast<char*>(b.data()) + elements * sizeof(T);
}

}  // namespace

absl::Status ModelState::PrepareGemma(int64_t seq) {
  // The weightless norms' weights: over D (the router's, the
  // self-conditioning's) and over a head (v_norm).
  int64_t width = dim;
  for (const LayerInfo& l : layers) width = std::max(width, l.layer_head_dim);
  const int64_t elem = options.activations == DeviceDType::kFloat32 ? 4 : 2;
  if (ones.bytes() < width * elem) {
    SHARDD_RETURN_IF_ERROR(AllocInto(&ones, width * elem));
    std::vector<float> host(width, 1.0f);
    std::vector<uint16_t> bf16(width, 0x3F80);  // 1.0 in bf16.
    // Pageable memory: the copy completes before the call returns.
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(ones.data(),
                   elem == 4 ? static_cast<const void*>(host.data())
                             : static_cast<const void*>(bf16.data()),
                   width * elem, cudaMemcpyHostToDevice),
        "DiffusionGemma: ones");
  }
  if (seq <= gemma_rope_positions) return absl::OkStatus();
  if (seq > max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seq: ", seq, " tokens exceed the model's max_position_embeddings (",
        max_positions, ")"));
  }
  const RopeFrequencies* tables[2] = {&rope, &sliding_rope};
  for (int i = 0; i < 2; ++i) {
    if (tables[i]->inv_freq.empty()) continue;
    SHARDD_ASSIGN_OR_RETURN(
        const kernels::RopeTable table,
        kernels::BuildRopeTable(tables[i]->inv_freq, seq,
                                tables[i]->attention_factor));
    const int64_t bytes =
        static_cast<int64_t>(table.cos.size() * sizeof(float));
    SHARDD_RETURN_IF_ERROR(AllocInto(&rope_cos[i], bytes));
    SHARDD_RETURN_IF_ERROR(AllocInto(&rope_sin[i], bytes));
    SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpy(rope_cos[i].data(), table.cos.data(),
                                           bytes, cudaMemcpyHostToDevice),
                                "DiffusionGemma: rope table");
    SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpy(rope_sin[i].data(), table.sin.data(),
                                           bytes, cudaMemcpyHostToDevice),
                                "DiffusionGemma: rope table");
  }
  gemma_rope_positions = seq;
  return absl::OkStatus();
}

kc::DeviceRopeTable ModelState::GemmaRope(const LayerInfo& spec) const {
  const int i = spec.sliding ? 1 : 0;
  const RopeFrequencies& f = spec.sliding ? sliding_rope : rope;
  return {rope_cos[i].as<float>(), rope_sin[i].as<float>(),
          static_cast<int64_t>(f.inv_freq.size()) * 2, gemma_rope_positions};
}

void ModelState::ReleaseGemmaLayer(GemmaLayerState* g) {
  for (DeviceBuffer* b : g->Buffers()) b->Reset();
  ReleaseExpertSlot(&g->experts);
}

namespace {

// y = RMSNorm(x; w) into fresh buffers y [rows, dim] and inv [rows].
template <typename T>
absl::Status NormInto(ModelState& m, const T* x, const T* w, int64_t rows,
                      int64_t dim, DeviceBuffer* y, DeviceBuffer* inv) {
  SHARDD_RETURN_IF_ERROR(m.AllocInto(y, rows * dim * sizeof(T)));
  SHARDD_RETURN_IF_ERROR(m.AllocInto(inv, rows * sizeof(float)));
  return kc::RmsNormForward(x, w, rows, dim, m.eps, y->as<T>(),
                            inv->as<float>(), m.stream);
}

// dx (= or +=) RMSNorm'(dy) of input x; dweight (fp32, may be null) +=.
template <typename T>
absl::Status NormBack(ModelState& m, const T* dy, const T* x, const T* w,
                      const DeviceBuffer& inv, int64_t rows, int64_t dim, T* dx,
                      bool accumulate, float* dweight,
                      std::vector<DeviceBuffer>* temps) {
  const size_t ws_bytes =
      dweight == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(rows, dim);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                          m.Alloc(static_cast<int64_t>(ws_bytes)));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(dy, x, w, inv.as<float>(), rows,
                                             dim, dx, accumulate, dweight,
                                             ws.data(), ws_bytes, m.stream));
  temps->push_back(std::move(ws));
  return absl::OkStatus();
}

// D^-0.5, the router input's scale besides the learned one.
float RouterRoot(int64_t d) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
}

// The router reads RMSNorm(m) * scale * D^-0.5: one RMSNorm whose weight is
// scale * D^-0.5 [D], formed here in storage type T.
template <typename T>
absl::StatusOr<DeviceBuffer> RouterNormWeight(ModelState& m, const T* scale) {
  const int64_t bytes = m.dim * static_cast<int64_t>(sizeof(T));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w, m.Alloc(bytes));
  SHARDD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(w.data(), scale, bytes,
                                              cudaMemcpyDeviceToDevice,
                                              m.stream),
                              "DiffusionGemma: router scale");
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchScale(w.as<T>(), RouterRoot(m.dim), m.dim, m.stream),
      "DiffusionGemma: router scale");
  return w;
}

absl::StatusOr<DeviceBuffer> Zeroed(ModelState& m, int64_t bytes) {
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer b, m.Alloc(bytes));
  SHARDD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.data(), 0, bytes, m.stream),
                              "DiffusionGemma: zeroing");
  return b;
}

}  // namespace

template <typename T>
absl::Status ModelState::GemmaLayerForward(const LayerInfo& spec,
                                           DeviceParamSource* params,
                                           int64_t batch, int64_t seq,
                                           const int32_t* positions,
                                           const GemmaDecodeView* decode,
                                           GemmaLayerState* g) {
  constexpr int64_t kElem = sizeof(T);
  const kc::DType dt = kc::DTypeOf<T>::value;
  const int64_t t = batch * seq, d = dim, hq = q_heads;
  const int64_t hkv = spec.layer_kv_heads, hd = spec.layer_head_dim;
  std::vector<DeviceBuffer> temps;
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas, stream, "gemma layer"));
  SHARDD_ASSIGN_OR_RETURN(const T* w_in, Param<T>(params, spec.norm, &temps));
  SHARDD_RETURN_IF_ERROR(
      NormInto<T>(*this, g->x_in.as<T>(), w_in, t, d, &g->n, &g->in_inv));
  // The self-attention.
  SHARDD_ASSIGN_OR_RETURN(const T* wq, Param<T>(params, spec.q_proj, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wk, Param<T>(params, spec.k_proj, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* wo, Param<T>(params, spec.o_proj, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* qn, Param<T>(params, spec.q_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* kn, Param<T>(params, spec.k_norm, &temps));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->q_pre, t * hq * hd * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->k_pre, t * hkv * hd * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->v_pre, t * hkv * hd * kElem));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas, t, hq * hd, d, g->n.data(), d, false, wq, d, true,
                     0.0f, g->q_pre.data(), dt, hq * hd, "q_proj"));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas, t, hkv * hd, d, g->n.data(), d, false, wk, d, true,
                     0.0f, g->k_pre.data(), dt, hkv * hd, "k_proj"));
  if (spec.values_from_keys) {
    // Full layers: the values are k_proj's output before k_norm and RoPE.
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(g->v_pre.data(), g->k_pre.data(), g->k_pre.bytes(),
                        cudaMemcpyDeviceToDevice, stream),
        "DiffusionGemma: values from keys");
  } else {
    SHARDD_ASSIGN_OR_RETURN(const T* wv, Param<T>(params, spec.v_proj, &temps));
    SHARDD_RETURN_IF_ERROR(
        StorageGemm<T>(cublas, t, hkv * hd, d, g->n.data(), d, false, wv, d,
                       true, 0.0f, g->v_pre.data(), dt, hkv * hd, "v_proj"));
  }
  SHARDD_RETURN_IF_ERROR(
      NormInto<T>(*this, g->q_pre.as<T>(), qn, t * hq, hd, &g->q, &g->q_inv));
  SHARDD_RETURN_IF_ERROR(
      NormInto<T>(*this, g->k_pre.as<T>(), kn, t * hkv, hd, &g->k, &g->k_inv));
  SHARDD_RETURN_IF_ERROR(NormInto<T>(*this, g->v_pre.as<T>(), ones.as<T>(),
                                     t * hkv, hd, &g->v, &g->v_inv));
  const kc::DeviceRopeTable table = GemmaRope(spec);
  SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                        HeadsRopeShape(t, hq, hd), positions,
                                        g->q.as<T>(), false, stream));
  SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                        HeadsRopeShape(t, hkv, hd), positions,
                                        g->k.as<T>(), false, stream));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->o, t * hq * hd * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->lse, batch * hq * seq * 4));
  if (decode != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        GemmaDecodeAttentionForward<T>(spec, *decode, batch, seq, g));
  } else {
    SHARDD_RETURN_IF_ERROR(kc::AttentionForward(
        GemmaAttentionDims(*this, spec, batch, seq),
        GemmaAttentionOptions(*this, spec, false), g->q.as<T>(), g->k.as<T>(),
        g->v.as<T>(), g->o.as<T>(), g->lse.as<float>(), stream));
  }
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->attn, t * d * kElem));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas, t, d, hq * hd, g->o.data(),
                                        hq * hd, false, wo, hq * hd, true, 0.0f,
                                        g->attn.data(), dt, d, "o_proj"));
  // m = x + post_attention_layernorm(attn).
  SHARDD_ASSIGN_OR_RETURN(const T* w_post,
                          Param<T>(params, spec.post_norm, &temps));
  DeviceBuffer normed;
  SHARDD_RETURN_IF_ERROR(
      NormInto<T>(*this, g->attn.as<T>(), w_post, t, d, &normed, &g->post_inv));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->m, t * d * kElem));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchResidualAdd(g->x_in.as<T>(), normed.as<T>(), nullptr,
                                      g->m.as<T>(), t * d, stream),
      "DiffusionGemma: attention residual");
  temps.push_back(std::move(normed));
  // The dense branch: h1, kept in `sum` until the experts add h2.
  SHARDD_ASSIGN_OR_RETURN(const T* w_pre,
                          Param<T>(params, spec.pre_ff_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_post1,
                          Param<T>(params, spec.post_ff_norm_1, &temps));
  SHARDD_RETURN_IF_ERROR(
      NormInto<T>(*this, g->m.as<T>(), w_pre, t, d, &g->dense_in, &g->pre_inv));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->dense_out, t * d * kElem));
  SHARDD_RETURN_IF_ERROR(MlpForward<T>(
      {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter}, params,
      g->dense_in.as<T>(), t, g->dense_out.as<T>(), &g->mlp_saved));
  SHARDD_RETURN_IF_ERROR(NormInto<T>(*this, g->dense_out.as<T>(), w_post1, t, d,
                                     &g->sum, &g->post1_inv));
  // The router's input (RouterNormWeight).
  SHARDD_ASSIGN_OR_RETURN(const T* scale,
                          Param<T>(params, spec.router_scale, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* proj, Param<T>(params, spec.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w_router,
                          RouterNormWeight<T>(*this, scale));
  SHARDD_RETURN_IF_ERROR(NormInto<T>(*this, g->m.as<T>(), w_router.as<T>(), t,
                                     d, &g->r_in, &g->r_inv));
  temps.push_back(std::move(w_router));
  const kc::RouterDims rd{t, d, spec.experts, top_k, renormalize_topk};
  const size_t router_bytes = kc::RouterSavedBytes(rd);
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->indices, t * top_k * 4));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->weights, t * top_k * 4));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->router_saved, router_bytes));
  SHARDD_RETURN_IF_ERROR(
      kc::RouterForward(rd, g->r_in.as<T>(), proj, g->indices.as<int32_t>(),
                        g->weights.as<float>(), g->router_saved.data(),
                        router_bytes, cublas, stream));
  // The experts' input.
  SHARDD_ASSIGN_OR_RETURN(const T* w_pre2,
                          Param<T>(params, spec.pre_ff_norm_2, &temps));
  return NormInto<T>(*this, g->m.as<T>(), w_pre2, t, d, &g->experts_in,
                     &g->pre2_inv);
}

template <typename T>
absl::Status ModelState::ComposeDecodeKeys(const LayerInfo& spec,
                                           const GemmaDecodeView& d,
                                           const GemmaDecodeBlock& blk,
                                           int64_t batch, int64_t seq,
                                           const GemmaLayerState& g,
                                           DeviceBuffer* k, DeviceBuffer* v) {
  constexpr int64_t kElem = sizeof(T);
  const int64_t row = spec.layer_kv_heads * spec.layer_head_dim;
  const int64_t end = d.prefix + blk.begin;  // Encoder keys end here.
  const int64_t lo = GemmaEncoderLow(*this, spec, d.prefix, blk.begin);
  const int64_t enc = end - lo, len = enc + blk.len;
  const GemmaLayerState& e = *d.encoder;
  if (e.k.bytes() != batch * d.encoder_seq * row * kElem ||
      end > d.encoder_seq) {
    return absl::FailedPreconditionError(
        "decode: the encode's K/V of this layer do not match the batch");
  }
  SHARDD_RETURN_IF_ERROR(AllocInto(k, batch * len * row * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(v, batch * len * row * kElem));
  const DeviceBuffer* enc_kv[2] = {&e.k, &e.v};
  const DeviceBuffer* own_kv[2] = {&g.k, &g.v};
  DeviceBuffer* out_kv[2] = {k, v};
  for (int i = 0; i < 2; ++i) {
    SHARDD_RETURN_IF_ERROR(Copy2D(
        out_kv[i]->data(), len * row * kElem, At<T>(*enc_kv[i], lo * row),
        d.encoder_seq * row * kElem, enc * row * kElem, batch, stream));
    SHARDD_RETURN_IF_ERROR(
        Copy2D(At<T>(*out_kv[i], enc * row), len * row * kElem,
               At<T>(*own_kv[i], blk.begin * row), seq * row * kElem,
               blk.len * row * kElem, batch, stream));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaDecodeAttentionForward(const LayerInfo& spec,
                                                     const GemmaDecodeView& d,
                                                     int64_t batch, int64_t seq,
                                                     GemmaLayerState* g) {
  constexpr int64_t kElem = sizeof(T);
  const int64_t hq = q_heads, qrow = hq * spec.layer_head_dim;
  for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
    const int64_t end = d.prefix + blk.begin;  // Encoder keys end here.
    const int64_t lo = GemmaEncoderLow(*this, spec, d.prefix, blk.begin);
    const int64_t len = end - lo + blk.len;
    std::vector<DeviceBuffer> temps;
    DeviceBuffer k, v;
    SHARDD_RETURN_IF_ERROR(
        ComposeDecodeKeys<T>(spec, d, blk, batch, seq, *g, &k, &v));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer q,
                            Alloc(batch * blk.len * qrow * kElem));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer o,
                            Alloc(batch * blk.len * qrow * kElem));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer lse, Alloc(batch * hq * blk.len * 4));
    SHARDD_RETURN_IF_ERROR(
        Copy2D(q.data(), blk.len * qrow * kElem, At<T>(g->q, blk.begin * qrow),
               seq * qrow * kElem, blk.len * qrow * kElem, batch, stream));
    kernels::AttentionDims dims =
        GemmaAttentionDims(*this, spec, batch, blk.len);
    dims.kv_len = len;
    SHARDD_RETURN_IF_ERROR(kc::AttentionForward(
        dims, GemmaAttentionOptions(*this, spec, true), q.as<T>(), k.as<T>(),
        v.as<T>(), o.as<T>(), lse.as<float>(), stream));
    SHARDD_RETURN_IF_ERROR(
        Copy2D(At<T>(g->o, blk.begin * qrow), seq * qrow * kElem, o.data(),
               blk.len * qrow * kElem, blk.len * qrow * kElem, batch, stream));
    // lse [batch, hq, rows]: (batch, head) rows of `seq`.
    SHARDD_RETURN_IF_ERROR(Copy2D(At<float>(g->lse, blk.begin), seq * 4,
                                  lse.data(), blk.len * 4, blk.len * 4,
                                  batch * hq, stream));
    for (DeviceBuffer* b : {&k, &v, &q, &o, &lse})
      temps.push_back(std::move(*b));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaDecodeAttentionBackward(
    const LayerInfo& spec, const GemmaDecodeView& d, int64_t batch, int64_t seq,
    const GemmaLayerState& g, const DeviceBuffer& d_o, DeviceBuffer* dq,
    DeviceBuffer* dk, DeviceBuffer* dv) {
  constexpr int64_t kElem = sizeof(T);
  const int64_t hq = q_heads, hd = spec.layer_head_dim;
  const int64_t row = spec.layer_kv_heads * hd, qrow = hq * hd;
  GemmaLayerState& e = *d.encoder;
  const int64_t n = batch * d.encoder_seq * row;
  if (e.dk_ext.bytes() != n * 4) {
    SHARDD_ASSIGN_OR_RETURN(e.dk_ext, Zeroed(*this, n * 4));
    SHARDD_ASSIGN_OR_RETURN(e.dv_ext, Zeroed(*this, n * 4));
  }
  const kernels::AttentionOptions options =
      GemmaAttentionOptions(*this, spec, true);
  for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
    const int64_t end = d.prefix + blk.begin;
    const int64_t lo = GemmaEncoderLow(*this, spec, d.prefix, blk.begin);
    const int64_t enc = end - lo, len = enc + blk.len;
    std::vector<DeviceBuffer> temps;
    DeviceBuffer k, v;
    SHARDD_RETURN_IF_ERROR(
        ComposeDecodeKeys<T>(spec, d, blk, batch, seq, g, &k, &v));
    // The block's q, o, d_o rows and lse.
    const int64_t qbytes = batch * blk.len * qrow * kElem;
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer q, Alloc(qbytes));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer o, Alloc(qbytes));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dout, Alloc(qbytes));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer lse, Alloc(batch * hq * blk.len * 4));
    const DeviceBuffer* rows_from[3] = {&g.q, &g.o, &d_o};
    DeviceBuffer* rows_to[3] = {&q, &o, &dout};
    for (int i = 0; i < 3; ++i) {
      SHARDD_RETURN_IF_ERROR(Copy2D(rows_to[i]->data(), blk.len * qrow * kElem,
                                    At<T>(*rows_from[i], blk.begin * qrow),
                                    seq * qrow * kElem, blk.len * qrow * kElem,
                                    batch, stream));
    }
    SHARDD_RETURN_IF_ERROR(Copy2D(lse.data(), blk.len * 4,
                                  At<float>(g.lse, blk.begin), seq * 4,
                                  blk.len * 4, batch * hq, stream));
    kernels::AttentionDims dims =
        GemmaAttentionDims(*this, spec, batch, blk.len);
    dims.kv_len = len;
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdq,
                            Zeroed(*this, batch * blk.len * qrow * 4));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdk,
                            Zeroed(*this, batch * len * row * 4));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdv,
                            Zeroed(*this, batch * len * row * 4));
    const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                            Alloc(static_cast<int64_t>(ws_bytes)));
    SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
        dims, options, q.as<T>(), k.as<T>(), v.as<T>(), o.as<T>(),
        lse.as<float>(), dout.as<T>(), bdq.as<float>(), bdk.as<float>(),
        bdv.as<float>(), nullptr, ws.data(), ws_bytes, stream));
    SHARDD_RETURN_IF_ERROR(
        Copy2D(At<float>(*dq, blk.begin * qrow), seq * qrow * 4, bdq.data(),
               blk.len * qrow * 4, blk.len * qrow * 4, batch, stream));
    // The encoder rows' gradients join the encode's; the canvas rows' are
    // this pass's.
    DeviceBuffer* ext[2] = {&e.dk_ext, &e.dv_ext};
    DeviceBuffer* block_grads[2] = {&bdk, &bdv};
    DeviceBuffer* own[2] = {dk, dv};
    for (int i = 0; i < 2; ++i) {
      for (int64_t b = 0; b < batch && enc > 0; ++b) {
        float* dst = reinterpret_cast<float*>(
            At<float>(*ext[i], (b * d.encoder_seq + lo) * row));
        const float* src = reinterpret_cast<const float*>(
            At<float>(*block_grads[i], b * len * row));
        SHARDD_CUDA_RETURN_IF_ERROR(
            device_model::LaunchResidualAdd(dst, src, nullptr, dst, enc * row,
                                            stream),
            "DiffusionGemma: encoder K/V gradients");
      }
      SHARDD_RETURN_IF_ERROR(
          Copy2D(At<float>(*own[i], blk.begin * row), seq * row * 4,
                 At<float>(*block_grads[i], enc * row), len * row * 4,
                 blk.len * row * 4, batch, stream));
    }
    for (DeviceBuffer* b :
         {&k, &v, &q, &o, &dout, &lse, &bdq, &bdk, &bdv, &ws}) {
      temps.push_back(std::move(*b));
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaExpertsForward(const LayerInfo& spec,
                                             DeviceParamSource* params,
                                             int64_t t, bool saves,
                                             GemmaLayerState* g, T* x) {
  constexpr int64_t kElem = sizeof(T);
  const int64_t d = dim;
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* w_gu, Param<T>(params, spec.w_gu, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(params, spec.w_d, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_post2,
                          Param<T>(params, spec.post_ff_norm_2, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_post,
                          Param<T>(params, spec.post_ff_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_pre2,
                          Param<T>(params, spec.pre_ff_norm_2, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* ls,
                          Param<T>(params, spec.layer_scalar, &temps));
  if (saves) {
    SHARDD_RETURN_IF_ERROR(AllocInto(&g->layer_w, (3 * d + 1) * kElem));
    const T* parts[4] = {w_post2, w_post, w_pre2, ls};
    for (int i = 0; i < 4; ++i) {
      SHARDD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(At<T>(g->layer_w, i * d), parts[i],
                          (i < 3 ? d : 1) * kElem, cudaMemcpyDeviceToDevice,
                          stream),
          "DiffusionGemma: the layer weights the experts' backward reads");
    }
  }
  const kc::ExpertDims dims{t, d, spec.moe_inter, spec.experts, top_k};
  ReleaseExpertSlot(&g->experts);
  SHARDD_ASSIGN_OR_RETURN(g->experts, AcquireExpertSlot(dims));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->experts_out, t * d * kElem));
  const int64_t syncs_before = g->experts.workspace->host_syncs();
  const absl::Status forward = kc::GroupedExpertsForward(
      dims, ExpertOptions(), g->experts_in.data(), g->indices.as<int32_t>(),
      g->weights.as<float>(), /*token_mask=*/nullptr, w_gu, w_d,
      g->experts_out.data(), g->experts.workspace, cublas, stream);
  host_syncs += g->experts.workspace->host_syncs() - syncs_before;
  SHARDD_RETURN_IF_ERROR(forward);
  DeviceBuffer h2, total;
  SHARDD_RETURN_IF_ERROR(NormInto<T>(*this, g->experts_out.as<T>(), w_post2, t,
                                     d, &h2, &g->post2_inv));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchResidualAdd(g->sum.as<T>(), h2.as<T>(), nullptr,
                                      g->sum.as<T>(), t * d, stream),
      "DiffusionGemma: h1 + h2");
  SHARDD_RETURN_IF_ERROR(NormInto<T>(*this, g->sum.as<T>(), w_post, t, d,
                                     &total, &g->post_ff_inv));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchSumTimesScalar(g->m.as<T>(), total.as<T>(), ls, x,
                                         t * d, stream),
      "DiffusionGemma: layer output");
  temps.push_back(std::move(h2));
  temps.push_back(std::move(total));
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaExpertsBackward(const LayerInfo& spec,
                                              DeviceParamSource* params,
                                              int64_t t, const T* dx,
                                              GemmaLayerState* g) {
  constexpr int64_t kElem = sizeof(T);
  const int64_t d = dim;
  if (g->layer_w.bytes() != (3 * d + 1) * kElem ||
      g->experts.workspace == nullptr) {
    return absl::FailedPreconditionError(
        "BACKWARD(EXPERTS) of a DiffusionGemma layer without its forward");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_ASSIGN_OR_RETURN(const T* w_gu, Param<T>(params, spec.w_gu, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_d, Param<T>(params, spec.w_d, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dw_gu, Grad(params, spec.w_gu));
  SHARDD_ASSIGN_OR_RETURN(float* dw_d, Grad(params, spec.w_d));
  const T* w_post2 = g->layer_w.as<T>();
  const T* w_post = w_post2 + d;
  const T* w_pre2 = w_post + d;
  const T* ls = w_pre2 + d;
  // The residual and the post-feed-forward norm both see dx * layer_scalar.
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->dm, t * d * kElem));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchSumTimesScalar(dx, static_cast<const T*>(nullptr), ls,
                                         g->dm.as<T>(), t * d, stream),
      "DiffusionGemma: d(m)");
  SHARDD_ASSIGN_OR_RETURN(g->d_ff_norms, Zeroed(*this, 3 * d * 4));
  float* d_norms = g->d_ff_norms.as<float>();
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->dsum, t * d * kElem));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, g->dm.as<T>(), g->sum.as<T>(),
                                     w_post, g->post_ff_inv, t, d,
                                     g->dsum.as<T>(), false, d_norms, &temps));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer g2, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(
      NormBack<T>(*this, g->dsum.as<T>(), g->experts_out.as<T>(), w_post2,
                  g->post2_inv, t, d, g2.as<T>(), false, d_norms + d, &temps));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dn, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(AllocInto(&g->dweights, t * top_k * 4));
  const kc::ExpertDims dims{t, d, spec.moe_inter, spec.experts, top_k};
  SHARDD_RETURN_IF_ERROR(kc::GroupedExpertsBackward(
      dims, ExpertOptions(), w_gu, w_d, g2.data(), dn.data(),
      /*accumulate_dx=*/false, g->dweights.as<float>(), dw_gu, dw_d,
      kc::ExpertBiasGrads{}, g->experts.workspace, cublas, stream));
  ReleaseExpertSlot(&g->experts);
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, dn.as<T>(), g->m.as<T>(), w_pre2,
                                     g->pre2_inv, t, d, g->dm.as<T>(), true,
                                     d_norms + 2 * d, &temps));
  temps.push_back(std::move(g2));
  temps.push_back(std::move(dn));
  return absl::OkStatus();
}

template <typename T>
absl::Status ModelState::GemmaLayerBackward(
    const LayerInfo& spec, DeviceParamSource* params, int64_t batch,
    int64_t seq, const int32_t* positions, const GemmaDecodeView* decode,
    GemmaLayerState* g, DeviceBuffer* dx) {
  constexpr int64_t kElem = sizeof(T);
  const kc::DType dt = kc::DTypeOf<T>::value;
  const int64_t t = batch * seq, d = dim, hq = q_heads;
  const int64_t hkv = spec.layer_kv_heads, hd = spec.layer_head_dim;
  if (g->dm.empty() || g->dsum.empty() || g->d_ff_norms.empty()) {
    return absl::FailedPreconditionError(
        "BACKWARD(LAYER) of a DiffusionGemma layer before its experts'");
  }
  std::vector<DeviceBuffer> temps;
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas, stream, "gemma layer"));
  // The feed-forward norms' gradients BACKWARD(EXPERTS) formed.
  const TensorInfo* ff_norms[3] = {&spec.post_ff_norm, &spec.post_ff_norm_2,
                                   &spec.pre_ff_norm_2};
  for (int i = 0; i < 3; ++i) {
    SHARDD_ASSIGN_OR_RETURN(float* gw, Grad(params, *ff_norms[i]));
    if (gw == nullptr) continue;
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(gw, g->d_ff_norms.as<float>() + i * d,
                                        nullptr, gw, d, stream),
        "DiffusionGemma: feed-forward norm gradients");
  }
  // The dense branch, from d(h1 + h2).
  SHARDD_ASSIGN_OR_RETURN(const T* w_post1,
                          Param<T>(params, spec.post_ff_norm_1, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* w_pre,
                          Param<T>(params, spec.pre_ff_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* d_post1, Grad(params, spec.post_ff_norm_1));
  SHARDD_ASSIGN_OR_RETURN(float* d_pre, Grad(params, spec.pre_ff_norm));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer g2, Alloc(t * d * kElem));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer gb, Alloc(t * d * kElem));
  SHARDD_RETURN_IF_ERROR(
      NormBack<T>(*this, g->dsum.as<T>(), g->dense_out.as<T>(), w_post1,
                  g->post1_inv, t, d, g2.as<T>(), false, d_post1, &temps));
  SHARDD_RETURN_IF_ERROR(MlpBackward<T>(
      {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter}, params,
      g->dense_in.as<T>(), t, g2.as<T>(), g->mlp_saved, gb.as<T>(),
      /*accumulate_dx=*/false));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, gb.as<T>(), g->m.as<T>(), w_pre,
                                     g->pre_inv, t, d, g->dm.as<T>(), true,
                                     d_pre, &temps));
  // The router: frozen in the release, but its weights depend on m.
  SHARDD_ASSIGN_OR_RETURN(const T* scale,
                          Param<T>(params, spec.router_scale, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* proj, Param<T>(params, spec.gate, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dproj, Grad(params, spec.gate));
  SHARDD_ASSIGN_OR_RETURN(float* dscale, Grad(params, spec.router_scale));
  const kc::RouterDims rd{t, d, spec.experts, top_k, renormalize_topk};
  const size_t router_ws = kc::RouterBackwardWorkspaceBytes(rd, dt);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer rws, Alloc(router_ws));
  SHARDD_RETURN_IF_ERROR(kc::RouterBackward(
      rd, g->r_in.as<T>(), proj, g->dweights.as<float>(), nullptr,
      g->router_saved.data(), static_cast<size_t>(g->router_saved.bytes()),
      gb.as<T>(), /*accumulate_dx=*/false, dproj, nullptr, rws.data(),
      router_ws, cublas, stream));
  temps.push_back(std::move(rws));
  const float root = RouterRoot(d);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w_router,
                          RouterNormWeight<T>(*this, scale));
  DeviceBuffer d_w_router;  // d(scale * root), then d(scale) += root * it.
  if (dscale != nullptr) {
    SHARDD_ASSIGN_OR_RETURN(d_w_router, Zeroed(*this, d * 4));
  }
  SHARDD_RETURN_IF_ERROR(NormBack<T>(
      *this, gb.as<T>(), g->m.as<T>(), w_router.as<T>(), g->r_inv, t, d,
      g->dm.as<T>(), true,
      d_w_router.empty() ? nullptr : d_w_router.as<float>(), &temps));
  if (dscale != nullptr) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchAddScaled(dscale, d_w_router.as<float>(), root, d,
                                      stream),
        "DiffusionGemma: router scale gradient");
  }
  temps.push_back(std::move(w_router));
  temps.push_back(std::move(d_w_router));
  // m = x + post_attention_layernorm(attn); gb becomes d(attn).
  SHARDD_ASSIGN_OR_RETURN(const T* w_post,
                          Param<T>(params, spec.post_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* d_post, Grad(params, spec.post_norm));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, g->dm.as<T>(), g->attn.as<T>(),
                                     w_post, g->post_inv, t, d, gb.as<T>(),
                                     false, d_post, &temps));
  *dx = std::move(g->dm);
  // The attention, from d(attn).
  SHARDD_ASSIGN_OR_RETURN(const T* wo, Param<T>(params, spec.o_proj, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* qn, Param<T>(params, spec.q_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(const T* kn, Param<T>(params, spec.k_norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* dwo, Grad(params, spec.o_proj));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer d_o, Alloc(t * hq * hd * kElem));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas, t, hq * hd, d, gb.data(), d, false, wo, hq * hd,
                     false, 0.0f, d_o.data(), dt, hq * hd, "o_proj backward"));
  if (dwo != nullptr) {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas, d, hq * hd, t, gb.data(), d, true, g->o.data(), hq * hd, false,
        1.0f, dwo, kc::DType::kFloat32, hq * hd, "o_proj weight gradient"));
  }
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq, Zeroed(*this, t * hq * hd * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk, Zeroed(*this, t * hkv * hd * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv, Zeroed(*this, t * hkv * hd * 4));
  if (decode != nullptr) {
    SHARDD_RETURN_IF_ERROR(GemmaDecodeAttentionBackward<T>(
        spec, *decode, batch, seq, *g, d_o, &dq, &dk, &dv));
  } else {
    const kernels::AttentionDims dims =
        GemmaAttentionDims(*this, spec, batch, seq);
    const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer aws,
                            Alloc(static_cast<int64_t>(ws_bytes)));
    SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
        dims, GemmaAttentionOptions(*this, spec, false), g->q.as<T>(),
        g->k.as<T>(), g->v.as<T>(), g->o.as<T>(), g->lse.as<float>(),
        d_o.as<T>(), dq.as<float>(), dk.as<float>(), dv.as<float>(), nullptr,
        aws.data(), ws_bytes, stream));
    temps.push_back(std::move(aws));
  }
  if (!g->dk_ext.empty()) {
    // The encode: the decodes' gradients of the same (post-RoPE) k and v.
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(dk.as<float>(), g->dk_ext.as<float>(),
                                        nullptr, dk.as<float>(), t * hkv * hd,
                                        stream),
        "DiffusionGemma: decode K gradients");
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(dv.as<float>(), g->dv_ext.as<float>(),
                                        nullptr, dv.as<float>(), t * hkv * hd,
                                        stream),
        "DiffusionGemma: decode V gradients");
    g->dk_ext.Reset();
    g->dv_ext.Reset();
  }
  const kc::DeviceRopeTable table = GemmaRope(spec);
  SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                        HeadsRopeShape(t, hq, hd), positions,
                                        dq.as<float>(), true, stream));
  SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                        HeadsRopeShape(t, hkv, hd), positions,
                                        dk.as<float>(), true, stream));
  // The gradients of q, k, v in storage type T.
  auto to_storage = [&](DeviceBuffer* b, int64_t n) -> absl::Status {
    if constexpr (std::is_same<T, float>::value) {
      return absl::OkStatus();
    } else {
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, Alloc(n * kElem));
      SHARDD_RETURN_IF_ERROR(
          kc::CastFp32ToBf16(b->as<float>(), cast.as<uint16_t>(), n, stream));
      temps.push_back(std::move(*b));
      *b = std::move(cast);
      return absl::OkStatus();
    }
  };
  SHARDD_RETURN_IF_ERROR(to_storage(&dq, t * hq * hd));
  SHARDD_RETURN_IF_ERROR(to_storage(&dk, t * hkv * hd));
  SHARDD_RETURN_IF_ERROR(to_storage(&dv, t * hkv * hd));
  SHARDD_ASSIGN_OR_RETURN(float* dqn, Grad(params, spec.q_norm));
  SHARDD_ASSIGN_OR_RETURN(float* dkn, Grad(params, spec.k_norm));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq_pre, Alloc(t * hq * hd * kElem));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk_pre, Alloc(t * hkv * hd * kElem));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv_pre, Alloc(t * hkv * hd * kElem));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, dq.as<T>(), g->q_pre.as<T>(), qn,
                                     g->q_inv, t * hq, hd, dq_pre.as<T>(),
                                     false, dqn, &temps));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, dk.as<T>(), g->k_pre.as<T>(), kn,
                                     g->k_inv, t * hkv, hd, dk_pre.as<T>(),
                                     false, dkn, &temps));
  // v_norm has no weight.
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, dv.as<T>(), g->v_pre.as<T>(),
                                     ones.as<T>(), g->v_inv, t * hkv, hd,
                                     dv_pre.as<T>(), false, nullptr, &temps));
  if (spec.values_from_keys) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(dk_pre.as<T>(), dv_pre.as<T>(), nullptr,
                                        dk_pre.as<T>(), t * hkv * hd, stream),
        "DiffusionGemma: values from keys");
  }
  // The projections of n; gb becomes d(n).
  struct Projection {
    const TensorInfo* tensor;
    const DeviceBuffer* grad;
    int64_t out;
  };
  std::vector<Projection> projections = {{&spec.q_proj, &dq_pre, hq * hd},
                                         {&spec.k_proj, &dk_pre, hkv * hd}};
  if (!spec.values_from_keys) {
    projections.push_back({&spec.v_proj, &dv_pre, hkv * hd});
  }
  float beta = 0.0f;
  for (const Projection& pr : projections) {
    SHARDD_ASSIGN_OR_RETURN(const T* w, Param<T>(params, *pr.tensor, &temps));
    SHARDD_ASSIGN_OR_RETURN(float* dw, Grad(params, *pr.tensor));
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas, t, d, pr.out, pr.grad->data(), pr.out, false, w, d, false, beta,
        gb.data(), dt, d, pr.tensor->name.c_str()));
    beta = 1.0f;
    if (dw != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas, pr.out, d, t, pr.grad->data(), pr.out, true, g->n.data(), d,
          false, 1.0f, dw, kc::DType::kFloat32, d, pr.tensor->name.c_str()));
    }
  }
  SHARDD_ASSIGN_OR_RETURN(const T* w_in, Param<T>(params, spec.norm, &temps));
  SHARDD_ASSIGN_OR_RETURN(float* d_in, Grad(params, spec.norm));
  SHARDD_RETURN_IF_ERROR(NormBack<T>(*this, gb.as<T>(), g->x_in.as<T>(), w_in,
                                     g->in_inv, t, d, dx->as<T>(), true, d_in,
                                     &temps));
  for (DeviceBuffer* b :
       {&g2, &gb, &d_o, &dq, &dk, &dv, &dq_pre, &dk_pre, &dv_pre}) {
    temps.push_back(std::move(*b));
  }
  return absl::OkStatus();
}

#define SHARDD_GEMMA_INSTANTIATE(T)                                           \
  template absl::Status ModelState::GemmaLayerForward<T>(                     \
      const LayerInfo&, DeviceParamSource*, int64_t, int64_t, const int32_t*, \
      const GemmaDecodeView*, GemmaLayerState*);                              \
  template absl::Status ModelState::GemmaExpertsForward<T>(                   \
      const LayerInfo&, DeviceParamSource*, int64_t, bool, GemmaLayerState*,  \
      T*);                                                                    \
  template absl::Status ModelState::GemmaExpertsBackward<T>(                  \
      const LayerInfo&, DeviceParamSource*, int64_t, const T*,                \
      GemmaLayerState*);                                                      \
  template absl::Status ModelState::GemmaLayerBackward<T>(                    \
      const LayerInfo&, DeviceParamSource*, int64_t, int64_t, const int32_t*, \
      const GemmaDecodeView*, GemmaLayerState*, DeviceBuffer*);
SHARDD_GEMMA_INSTANTIATE(float)
SHARDD_GEMMA_INSTANTIATE(uint16_t)
#undef SHARDD_GEMMA_INSTANTIATE

}  // namespace device_moe_internal
}  // namespace shardd
