// CudaBlockOps' DiffusionGemma ops: the decoder layer of
// worker/model/gemma_layer.h (read it for the math) split into LAYER and
// EXPERTS, the decode's attention over [encoder K/V ; canvas K/V] block by
// block (per run of sequences sharing a prefix), the recompute of a
// checkpointed layer, the self-conditioning block and the head's softmax.
// Storage T (float or bf16 bits), fp32 accumulation; every parameter
// gradient fp32 and added to.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/row_major_gemm.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/cuda_block_ops.h"
#include "worker/model/cuda_block_ops_kernels.h"
#include "worker/model/device_linear.h"

namespace shardd {
namespace step {
namespace {

namespace kc = ::shardd::kernels::cuda;
using device_model::DeviceStepLoss;

// One layer's state in one pass (the CPU's GemmaLayerActs). Storage type
// unless noted.
struct GemmaState : BlockState {
  DeviceBuffer x_in, in_inv, n;      // input, fp32 [T], normed
  DeviceBuffer q_pre, k_pre, v_pre;  // the projections
  DeviceBuffer q_inv, k_inv, v_inv;  // fp32 per (token, head)
  DeviceBuffer q, k, v, o, lse;      // the attention's
  DeviceBuffer attn, post_inv, m;    // o Wo^T, its norm, mid
  DeviceBuffer pre_inv, dense_in, dense_out, mlp_saved, post1_inv;
  DeviceBuffer r_inv, r_in, router_saved, indices, weights;
  DeviceBuffer pre2_inv, experts_in, experts_out, post2_inv;
  DeviceBuffer sum, post_ff_inv;  // h1 (+ h2 after EXPERTS), its norm
  DeviceBuffer experts_memory;
  std::shared_ptr<kc::GroupedExpertsWorkspace> experts;
  // post_feedforward_layernorm_2, post_feedforward_layernorm,
  // pre_feedforward_layernorm_2 [D] each and layer_scalar, copied by
  // FORWARD(EXPERTS): BACKWARD(EXPERTS) runs where only the experts' unit
  // may be gathered.
  DeviceBuffer layer_w;
  // BACKWARD(EXPERTS) -> BACKWARD(LAYER): d(m), d(h1 + h2), the routing
  // weights' gradient (fp32) and the three feed-forward norms' weight
  // gradients (fp32 [3D], added to the layer unit's by BACKWARD(LAYER)).
  DeviceBuffer dm, dsum, dweights, d_ff_norms;
  // The encode's: the decodes' gradients of its k and v (fp32), added by
  // its BACKWARD(LAYER).
  DeviceBuffer dk_ext, dv_ext;
  // Expert parallelism: where the routed rows went (DISPATCH to BACKWARD
  // DISPATCH) and the rows between the commands: received with their local
  // experts and weights, their outputs; backward the output gradients,
  // then the input and weight gradients.
  ExpertRoute route;
  DeviceBuffer x_r, ids_r, w_r, y_r, dy_r, dx_r, dw_r;

  std::vector<DeviceBuffer*> Buffers() {
    return {&x_in,
            &in_inv,
            &n,
            &q_pre,
            &k_pre,
            &v_pre,
            &q_inv,
            &k_inv,
            &v_inv,
            &q,
            &k,
            &v,
            &o,
            &lse,
            &attn,
            &post_inv,
            &m,
            &pre_inv,
            &dense_in,
            &dense_out,
            &mlp_saved,
            &post1_inv,
            &r_inv,
            &r_in,
            &router_saved,
            &indices,
            &weights,
            &pre2_inv,
            &experts_in,
            &experts_out,
            &post2_inv,
            &sum,
            &post_ff_inv,
            &experts_memory,
            &layer_w,
            &dm,
            &dsum,
            &dweights,
            &d_ff_norms,
            &dk_ext,
            &dv_ext,
            &x_r,
            &ids_r,
            &w_r,
            &y_r,
            &dy_r,
            &dx_r,
            &dw_r};
  }
  int64_t bytes() const override {
    int64_t total = 0;
    for (DeviceBuffer* b : const_cast<GemmaState*>(this)->Buffers()) {
      total += b->bytes();
    }
    return total;
  }
  void ReleaseExperts() {
    experts_memory.Reset();
    experts.reset();
  }
};

// The self-conditioning block of a decode with gradients (what its
// backward reads; a decode without gradients keeps nothing).
struct SelfConditioningState : BlockState {
  DeviceBuffer signal, p, p_inv, mlp_saved, sum, sum_inv;
  int64_t bytes() const override {
    return signal.bytes() + p.bytes() + p_inv.bytes() + mlp_saved.bytes() +
           sum.bytes() + sum_inv.bytes();
  }
};

// A layer's state, or FAILED_PRECONDITION with `missing` (a command that
// came before the forward that makes the state).
absl::StatusOr<GemmaState*> GemmaStateOf(Saved* layer, const char* missing) {
  GemmaState* g = layer->Peek<GemmaState>();
  if (g == nullptr) return absl::FailedPreconditionError(missing);
  return g;
}

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

// D^-0.5, the router input's scale besides the learned one.
float RouterRoot(int64_t d) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
}

}  // namespace

struct CudaBlockOps::Gemma {
  using Temps = std::vector<DeviceBuffer>;

  // y = RMSNorm(x; w) into fresh buffers y [rows, dim] and inv [rows].
  template <typename T>
  static absl::Status NormInto(CudaBlockOps& o, const T* x, const T* w,
                               int64_t rows, int64_t dim, DeviceBuffer* y,
                               DeviceBuffer* inv) {
    y->Reset();
    inv->Reset();
    SHARDD_ASSIGN_OR_RETURN(*y, o.Alloc(rows * dim * sizeof(T)));
    SHARDD_ASSIGN_OR_RETURN(*inv, o.Alloc(rows * sizeof(float)));
    return kc::RmsNormForward(x, w, rows, dim, o.arch_->eps, y->as<T>(),
                              inv->as<float>(), o.stream_);
  }

  // dx (= or +=) RMSNorm'(dy) of input x; dweight (fp32, may be null) +=.
  template <typename T>
  static absl::Status NormBack(CudaBlockOps& o, const T* dy, const T* x,
                               const T* w, const DeviceBuffer& inv,
                               int64_t rows, int64_t dim, T* dx,
                               bool accumulate, float* dweight, Temps* temps) {
    const size_t ws_bytes =
        dweight == nullptr ? 0 : kc::RmsNormBackwardWorkspaceBytes(rows, dim);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                            o.Alloc(static_cast<int64_t>(ws_bytes)));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(dy, x, w, inv.as<float>(), rows,
                                               dim, dx, accumulate, dweight,
                                               ws.data(), ws_bytes, o.stream_));
    temps->push_back(std::move(ws));
    return absl::OkStatus();
  }

  // The router reads RMSNorm(m) * scale * D^-0.5: one RMSNorm whose weight
  // is scale * D^-0.5 [D], formed here in storage type T.
  template <typename T>
  static absl::StatusOr<DeviceBuffer> RouterNormWeight(CudaBlockOps& o,
                                                       const T* scale) {
    const int64_t d = o.arch_->dim;
    const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w, o.Alloc(bytes));
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(w.data(), scale, bytes, cudaMemcpyDeviceToDevice,
                        o.stream_),
        "DiffusionGemma: router scale");
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchScale(w.as<T>(), RouterRoot(d), d, o.stream_),
        "DiffusionGemma: router scale");
    return w;
  }

  static absl::StatusOr<DeviceBuffer> Zeroed(CudaBlockOps& o, int64_t bytes) {
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer b, o.Alloc(bytes));
    SHARDD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.data(), 0, bytes, o.stream_),
                                "DiffusionGemma: zeroing");
    return b;
  }

  static kc::DeviceRopeTable Rope(const CudaBlockOps& o,
                                  const MoeLayerSpec& spec) {
    const int i = spec.sliding ? 1 : 0;
    const RopeFrequencies& f =
        spec.sliding ? o.arch_->sliding_rope : o.arch_->rope;
    return {o.gemma_cos_[i].as<float>(), o.gemma_sin_[i].as<float>(),
            static_cast<int64_t>(f.inv_freq.size()) * 2, o.gemma_positions_};
  }

  // Each token's RoPE position: the causal pass's (packed rows restart
  // per example; *key_begin their device starts, or null), or a decode's
  // canvas positions prefix + j (SFT rows: each row's own prefix, at most
  // the last encoder position).
  static absl::Status PositionsOf(CudaBlockOps& o, int64_t batch, int64_t seq,
                                  const GemmaDecodeView* decode,
                                  const int32_t** positions,
                                  const int32_t** key_begin) {
    *key_begin = nullptr;
    if (decode == nullptr) {
      SHARDD_RETURN_IF_ERROR(o.Geometry(batch, seq, positions));
      if (o.uploaded_packed_) *key_begin = o.key_begin_.as<int32_t>();
      return absl::OkStatus();
    }
    const int64_t t = batch * seq;
    std::vector<int32_t> host(t);
    for (int64_t i = 0; i < t; ++i) {
      const int64_t row = i / seq;
      const int64_t p =
          (decode->row_prefix == nullptr ? decode->prefix
                                         : decode->row_prefix[row]) +
          i % seq;
      host[i] = static_cast<int32_t>(
          decode->row_prefix == nullptr
              ? p
              : std::min<int64_t>(p, decode->encoder_seq - 1));
    }
    // Every decode layer of a micro-batch reads the same: upload once.
    if (o.decode_positions_.empty() || host != o.decode_positions_host_) {
      SHARDD_ASSIGN_OR_RETURN(o.decode_positions_,
                              o.UploadBuffer(host.data(), t));
      o.decode_positions_host_ = std::move(host);
    }
    *positions = o.decode_positions_.as<int32_t>();
    return absl::OkStatus();
  }

  // A run's keys and values [n, enc + blk.len, kv row] of decode block
  // `blk`: its encoder rows [key_lo, key_end), then its canvas rows of g's.
  template <typename T>
  static absl::Status ComposeKeys(CudaBlockOps& o, const MoeLayerSpec& spec,
                                  const GemmaDecodeView& d, const GemmaState& e,
                                  const GemmaDecodeBlock& blk,
                                  const DecodeRows& rows, int64_t batch,
                                  int64_t seq, const GemmaState& g,
                                  DeviceBuffer* k, DeviceBuffer* v) {
    constexpr int64_t kElem = sizeof(T);
    const int64_t row = spec.layer_kv_heads * spec.layer_head_dim;
    const int64_t enc = rows.key_end - rows.key_lo, len = enc + blk.len;
    const int64_t n = rows.end - rows.begin;
    if (e.k.bytes() != batch * d.encoder_seq * row * kElem || rows.key_lo < 0) {
      return absl::FailedPreconditionError(
          "decode: the encode's K/V of this layer do not match the batch");
    }
    SHARDD_ASSIGN_OR_RETURN(*k, o.Alloc(n * len * row * kElem));
    SHARDD_ASSIGN_OR_RETURN(*v, o.Alloc(n * len * row * kElem));
    const DeviceBuffer* enc_kv[2] = {&e.k, &e.v};
    const DeviceBuffer* own_kv[2] = {&g.k, &g.v};
    DeviceBuffer* out_kv[2] = {k, v};
    for (int i = 0; i < 2; ++i) {
      SHARDD_RETURN_IF_ERROR(Copy2D(
          out_kv[i]->data(), len * row * kElem,
          At<T>(*enc_kv[i], (rows.begin * d.encoder_seq + rows.key_lo) * row),
          d.encoder_seq * row * kElem, enc * row * kElem, n, o.stream_));
      SHARDD_RETURN_IF_ERROR(
          Copy2D(At<T>(*out_kv[i], enc * row), len * row * kElem,
                 At<T>(*own_kv[i], (rows.begin * seq + blk.begin) * row),
                 seq * row * kElem, blk.len * row * kElem, n, o.stream_));
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<GemmaState*> EncoderOf(const GemmaDecodeView& d) {
    GemmaState* e =
        d.encoder == nullptr ? nullptr : d.encoder->Peek<GemmaState>();
    if (e == nullptr) {
      return absl::FailedPreconditionError(
          "a DiffusionGemma decode before its layer's encode");
    }
    return e;
  }

  template <typename T>
  static absl::Status DecodeForward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                    const GemmaDecodeView& d, int64_t batch,
                                    int64_t seq, GemmaState* g) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t hq = a.q_heads, qrow = hq * spec.layer_head_dim;
    SHARDD_ASSIGN_OR_RETURN(const GemmaState* e, EncoderOf(d));
    for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
      for (const DecodeRows& rows : GemmaDecodeRowRuns(
               a, spec, d.prefix, d.row_prefix, d.encoder_seq, blk, batch)) {
        const int64_t n = rows.end - rows.begin;
        const int64_t len = rows.key_end - rows.key_lo + blk.len;
        Temps temps;
        DeviceBuffer k, v;
        SHARDD_RETURN_IF_ERROR(
            ComposeKeys<T>(o, spec, d, *e, blk, rows, batch, seq, *g, &k, &v));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer q,
                                o.Alloc(n * blk.len * qrow * kElem));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer out,
                                o.Alloc(n * blk.len * qrow * kElem));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer lse,
                                o.Alloc(n * hq * blk.len * 4));
        SHARDD_RETURN_IF_ERROR(
            Copy2D(q.data(), blk.len * qrow * kElem,
                   At<T>(g->q, (rows.begin * seq + blk.begin) * qrow),
                   seq * qrow * kElem, blk.len * qrow * kElem, n, o.stream_));
        kernels::AttentionDims dims = GemmaAttentionDims(a, spec, n, blk.len);
        dims.kv_len = len;
        SHARDD_RETURN_IF_ERROR(kc::AttentionForward(
            dims, GemmaAttentionOptions(a, spec, true), q.as<T>(), k.as<T>(),
            v.as<T>(), out.as<T>(), lse.as<float>(), o.stream_));
        SHARDD_RETURN_IF_ERROR(
            Copy2D(At<T>(g->o, (rows.begin * seq + blk.begin) * qrow),
                   seq * qrow * kElem, out.data(), blk.len * qrow * kElem,
                   blk.len * qrow * kElem, n, o.stream_));
        // lse [batch, hq, seq]: (sequence, head) rows of `seq`.
        SHARDD_RETURN_IF_ERROR(Copy2D(
            At<float>(g->lse, rows.begin * hq * seq + blk.begin), seq * 4,
            lse.data(), blk.len * 4, blk.len * 4, n * hq, o.stream_));
        for (DeviceBuffer* b : {&k, &v, &q, &out, &lse}) {
          temps.push_back(std::move(*b));
        }
      }
    }
    return absl::OkStatus();
  }

  // The decode's attention backward from d_o: dq, dk, dv (fp32, the canvas
  // rows) are written and the encoder rows' K/V gradients added to the
  // encode's dk_ext / dv_ext.
  template <typename T>
  static absl::Status DecodeBackward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                     const GemmaDecodeView& d, int64_t batch,
                                     int64_t seq, const GemmaState& g,
                                     const DeviceBuffer& d_o, DeviceBuffer* dq,
                                     DeviceBuffer* dk, DeviceBuffer* dv) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t hq = a.q_heads, hd = spec.layer_head_dim;
    const int64_t row = spec.layer_kv_heads * hd, qrow = hq * hd;
    SHARDD_ASSIGN_OR_RETURN(GemmaState * e, EncoderOf(d));
    const int64_t total = batch * d.encoder_seq * row;
    if (e->dk_ext.bytes() != total * 4) {
      SHARDD_ASSIGN_OR_RETURN(e->dk_ext, Zeroed(o, total * 4));
      SHARDD_ASSIGN_OR_RETURN(e->dv_ext, Zeroed(o, total * 4));
    }
    const kernels::AttentionOptions options =
        GemmaAttentionOptions(a, spec, true);
    for (const GemmaDecodeBlock& blk : GemmaDecodeBlocks(d.block, seq)) {
      for (const DecodeRows& rows : GemmaDecodeRowRuns(
               a, spec, d.prefix, d.row_prefix, d.encoder_seq, blk, batch)) {
        const int64_t n = rows.end - rows.begin;
        const int64_t enc = rows.key_end - rows.key_lo, len = enc + blk.len;
        Temps temps;
        DeviceBuffer k, v;
        SHARDD_RETURN_IF_ERROR(
            ComposeKeys<T>(o, spec, d, *e, blk, rows, batch, seq, g, &k, &v));
        // The run's block of q, o, d_o rows and lse.
        const int64_t qbytes = n * blk.len * qrow * kElem;
        const int64_t q0 = (rows.begin * seq + blk.begin) * qrow;
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer q, o.Alloc(qbytes));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer out, o.Alloc(qbytes));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dout, o.Alloc(qbytes));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer lse,
                                o.Alloc(n * hq * blk.len * 4));
        const DeviceBuffer* rows_from[3] = {&g.q, &g.o, &d_o};
        DeviceBuffer* rows_to[3] = {&q, &out, &dout};
        for (int i = 0; i < 3; ++i) {
          SHARDD_RETURN_IF_ERROR(
              Copy2D(rows_to[i]->data(), blk.len * qrow * kElem,
                     At<T>(*rows_from[i], q0), seq * qrow * kElem,
                     blk.len * qrow * kElem, n, o.stream_));
        }
        SHARDD_RETURN_IF_ERROR(
            Copy2D(lse.data(), blk.len * 4,
                   At<float>(g.lse, rows.begin * hq * seq + blk.begin), seq * 4,
                   blk.len * 4, n * hq, o.stream_));
        kernels::AttentionDims dims = GemmaAttentionDims(a, spec, n, blk.len);
        dims.kv_len = len;
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdq,
                                Zeroed(o, n * blk.len * qrow * 4));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdk, Zeroed(o, n * len * row * 4));
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer bdv, Zeroed(o, n * len * row * 4));
        const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                                o.Alloc(static_cast<int64_t>(ws_bytes)));
        SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
            dims, options, q.as<T>(), k.as<T>(), v.as<T>(), out.as<T>(),
            lse.as<float>(), dout.as<T>(), bdq.as<float>(), bdk.as<float>(),
            bdv.as<float>(), nullptr, ws.data(), ws_bytes, o.stream_));
        SHARDD_RETURN_IF_ERROR(Copy2D(At<float>(*dq, q0), seq * qrow * 4,
                                      bdq.data(), blk.len * qrow * 4,
                                      blk.len * qrow * 4, n, o.stream_));
        // The encoder rows' gradients join the encode's; the canvas rows'
        // are this pass's.
        DeviceBuffer* ext[2] = {&e->dk_ext, &e->dv_ext};
        DeviceBuffer* block_grads[2] = {&bdk, &bdv};
        DeviceBuffer* own[2] = {dk, dv};
        for (int i = 0; i < 2; ++i) {
          for (int64_t j = 0; j < n && enc > 0; ++j) {
            const int64_t b = rows.begin + j;
            float* dst = reinterpret_cast<float*>(
                At<float>(*ext[i], (b * d.encoder_seq + rows.key_lo) * row));
            const float* src = reinterpret_cast<const float*>(
                At<float>(*block_grads[i], j * len * row));
            SHARDD_CUDA_RETURN_IF_ERROR(
                device_model::LaunchResidualAdd(dst, src, nullptr, dst,
                                                enc * row, o.stream_),
                "DiffusionGemma: encoder K/V gradients");
          }
          SHARDD_RETURN_IF_ERROR(
              Copy2D(At<float>(*own[i], (rows.begin * seq + blk.begin) * row),
                     seq * row * 4, At<float>(*block_grads[i], enc * row),
                     len * row * 4, blk.len * row * 4, n, o.stream_));
        }
        for (DeviceBuffer* b :
             {&k, &v, &q, &out, &dout, &lse, &bdq, &bdk, &bdv, &ws}) {
          temps.push_back(std::move(*b));
        }
      }
    }
    return absl::OkStatus();
  }

  // LAYER's forward from g->x_in (a recompute refills what a checkpoint
  // dropped with the same values; the K/V gradients of decodes, the
  // experts' backward products and the copied layer weights stay).
  template <typename T>
  static absl::Status LayerFromInput(CudaBlockOps& o, const MoeLayerSpec& spec,
                                     int64_t batch, int64_t seq,
                                     const GemmaDecodeView* decode,
                                     GemmaState* g) {
    constexpr int64_t kElem = sizeof(T);
    const kc::DType dt = kc::DTypeOf<T>::value;
    const MoeArchitecture& a = *o.arch_;
    const int64_t t = batch * seq, d = a.dim, hq = a.q_heads;
    const int64_t hkv = spec.layer_kv_heads, hd = spec.layer_head_dim;
    cublasHandle_t cublas = o.cublas_;
    cudaStream_t stream = o.stream_;
    Temps temps;
    auto param = [&](const ArchTensor& w) { return o.Param<T>(w, &temps); };
    auto alloc = [&](DeviceBuffer* b, int64_t bytes) -> absl::Status {
      b->Reset();
      SHARDD_ASSIGN_OR_RETURN(*b, o.Alloc(bytes));
      return absl::OkStatus();
    };
    const int32_t* positions = nullptr;
    const int32_t* key_begin = nullptr;
    SHARDD_RETURN_IF_ERROR(
        PositionsOf(o, batch, seq, decode, &positions, &key_begin));
    SHARDD_ASSIGN_OR_RETURN(const T* w_in, param(spec.norm));
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->x_in.as<T>(), w_in, t, d, &g->n, &g->in_inv));
    // The self-attention.
    SHARDD_ASSIGN_OR_RETURN(const T* wq, param(spec.q_proj));
    SHARDD_ASSIGN_OR_RETURN(const T* wk, param(spec.k_proj));
    SHARDD_ASSIGN_OR_RETURN(const T* wo, param(spec.o_proj));
    SHARDD_ASSIGN_OR_RETURN(const T* qn, param(spec.q_norm));
    SHARDD_ASSIGN_OR_RETURN(const T* kn, param(spec.k_norm));
    SHARDD_RETURN_IF_ERROR(alloc(&g->q_pre, t * hq * hd * kElem));
    SHARDD_RETURN_IF_ERROR(alloc(&g->k_pre, t * hkv * hd * kElem));
    SHARDD_RETURN_IF_ERROR(alloc(&g->v_pre, t * hkv * hd * kElem));
    SHARDD_RETURN_IF_ERROR(
        StorageGemm<T>(cublas, t, hq * hd, d, g->n.data(), d, false, wq, d,
                       true, 0.0f, g->q_pre.data(), dt, hq * hd, "q_proj"));
    SHARDD_RETURN_IF_ERROR(
        StorageGemm<T>(cublas, t, hkv * hd, d, g->n.data(), d, false, wk, d,
                       true, 0.0f, g->k_pre.data(), dt, hkv * hd, "k_proj"));
    if (spec.values_from_keys) {
      // Full layers: the values are k_proj's output before k_norm and RoPE.
      SHARDD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(g->v_pre.data(), g->k_pre.data(), g->k_pre.bytes(),
                          cudaMemcpyDeviceToDevice, stream),
          "DiffusionGemma: values from keys");
    } else {
      SHARDD_ASSIGN_OR_RETURN(const T* wv, param(spec.v_proj));
      SHARDD_RETURN_IF_ERROR(
          StorageGemm<T>(cublas, t, hkv * hd, d, g->n.data(), d, false, wv, d,
                         true, 0.0f, g->v_pre.data(), dt, hkv * hd, "v_proj"));
    }
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->q_pre.as<T>(), qn, t * hq, hd, &g->q, &g->q_inv));
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->k_pre.as<T>(), kn, t * hkv, hd, &g->k, &g->k_inv));
    SHARDD_RETURN_IF_ERROR(NormInto<T>(o, g->v_pre.as<T>(), o.ones_.as<T>(),
                                       t * hkv, hd, &g->v, &g->v_inv));
    const kc::DeviceRopeTable table = Rope(o, spec);
    SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                          HeadsRopeShape(t, hq, hd), positions,
                                          g->q.as<T>(), false, stream));
    SHARDD_RETURN_IF_ERROR(kc::RopeRotate(table, kernels::RopeLayout::kHalf,
                                          HeadsRopeShape(t, hkv, hd), positions,
                                          g->k.as<T>(), false, stream));
    SHARDD_RETURN_IF_ERROR(alloc(&g->o, t * hq * hd * kElem));
    SHARDD_RETURN_IF_ERROR(alloc(&g->lse, batch * hq * seq * 4));
    if (decode != nullptr) {
      SHARDD_RETURN_IF_ERROR(DecodeForward<T>(o, spec, *decode, batch, seq, g));
    } else {
      kernels::AttentionOptions options = GemmaAttentionOptions(a, spec, false);
      options.key_begin = key_begin;
      SHARDD_RETURN_IF_ERROR(
          kc::AttentionForward(GemmaAttentionDims(a, spec, batch, seq), options,
                               g->q.as<T>(), g->k.as<T>(), g->v.as<T>(),
                               g->o.as<T>(), g->lse.as<float>(), stream));
    }
    SHARDD_RETURN_IF_ERROR(alloc(&g->attn, t * d * kElem));
    SHARDD_RETURN_IF_ERROR(
        StorageGemm<T>(cublas, t, d, hq * hd, g->o.data(), hq * hd, false, wo,
                       hq * hd, true, 0.0f, g->attn.data(), dt, d, "o_proj"));
    // m = x + post_attention_layernorm(attn).
    SHARDD_ASSIGN_OR_RETURN(const T* w_post, param(spec.post_norm));
    DeviceBuffer normed;
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->attn.as<T>(), w_post, t, d, &normed, &g->post_inv));
    SHARDD_RETURN_IF_ERROR(alloc(&g->m, t * d * kElem));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(g->x_in.as<T>(), normed.as<T>(),
                                        nullptr, g->m.as<T>(), t * d, stream),
        "DiffusionGemma: attention residual");
    temps.push_back(std::move(normed));
    // The dense branch: h1, kept in `sum` until the experts add h2.
    SHARDD_ASSIGN_OR_RETURN(const T* w_pre, param(spec.pre_ff_norm));
    SHARDD_ASSIGN_OR_RETURN(const T* w_post1, param(spec.post_ff_norm_1));
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->m.as<T>(), w_pre, t, d, &g->dense_in, &g->pre_inv));
    SHARDD_RETURN_IF_ERROR(alloc(&g->dense_out, t * d * kElem));
    SHARDD_RETURN_IF_ERROR(o.MlpForwardRaw<T>(
        {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter},
        g->dense_in.as<T>(), t, g->dense_out.as<T>(), &g->mlp_saved));
    SHARDD_RETURN_IF_ERROR(NormInto<T>(o, g->dense_out.as<T>(), w_post1, t, d,
                                       &g->sum, &g->post1_inv));
    // The router's input (RouterNormWeight).
    SHARDD_ASSIGN_OR_RETURN(const T* scale, param(spec.router_scale));
    SHARDD_ASSIGN_OR_RETURN(const T* proj, param(spec.gate));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w_router,
                            RouterNormWeight<T>(o, scale));
    SHARDD_RETURN_IF_ERROR(NormInto<T>(o, g->m.as<T>(), w_router.as<T>(), t, d,
                                       &g->r_in, &g->r_inv));
    temps.push_back(std::move(w_router));
    const kc::RouterDims rd{t, d, spec.experts, a.top_k, a.renormalize_topk};
    const size_t router_bytes = kc::RouterSavedBytes(rd);
    SHARDD_RETURN_IF_ERROR(alloc(&g->indices, t * a.top_k * 4));
    SHARDD_RETURN_IF_ERROR(alloc(&g->weights, t * a.top_k * 4));
    SHARDD_RETURN_IF_ERROR(alloc(&g->router_saved, router_bytes));
    SHARDD_RETURN_IF_ERROR(
        kc::RouterForward(rd, g->r_in.as<T>(), proj, g->indices.as<int32_t>(),
                          g->weights.as<float>(), g->router_saved.data(),
                          router_bytes, cublas, stream));
    // The experts' input.
    SHARDD_ASSIGN_OR_RETURN(const T* w_pre2, param(spec.pre_ff_norm_2));
    return NormInto<T>(o, g->m.as<T>(), w_pre2, t, d, &g->experts_in,
                       &g->pre2_inv);
  }

  // The grouped experts over dims.tokens rows x [rows, D] with their
  // choices and weights into y [rows, D], the workspace kept in g for the
  // backward (the whole layer's or, expert-parallel, the received rows').
  template <typename T>
  static absl::Status GroupedForward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                     const kc::ExpertDims& dims, const void* x,
                                     const int32_t* ids, const float* weights,
                                     void* y, GemmaState* g) {
    Temps temps;
    SHARDD_ASSIGN_OR_RETURN(const T* w_gu, o.Param<T>(spec.w_gu, &temps));
    SHARDD_ASSIGN_OR_RETURN(const T* w_d, o.Param<T>(spec.w_d, &temps));
    g->ReleaseExperts();
    SHARDD_ASSIGN_OR_RETURN(ExpertSlot slot, o.AcquireExpertSlot(dims));
    g->experts_memory = std::move(slot.memory);
    g->experts = std::move(slot.workspace);
    const int64_t syncs_before = g->experts->host_syncs();
    const absl::Status forward = kc::GroupedExpertsForward(
        dims, o.ExpertOptions(), x, ids, weights, /*token_mask=*/nullptr, w_gu,
        w_d, y, g->experts.get(), o.cublas_, o.stream_);
    o.host_syncs_ += g->experts->host_syncs() - syncs_before;
    return forward;
  }

  // GroupedForward's backward: dx [rows, D] and the weights' gradient from
  // dy, the experts' weight gradients added.
  template <typename T>
  static absl::Status GroupedBackward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                      const kc::ExpertDims& dims,
                                      const void* dy, void* dx,
                                      float* d_weights, GemmaState* g) {
    if (g->experts == nullptr) {
      return absl::FailedPreconditionError(
          "BACKWARD(EXPERTS) of a DiffusionGemma layer without its forward");
    }
    Temps temps;
    SHARDD_ASSIGN_OR_RETURN(const T* w_gu, o.Param<T>(spec.w_gu, &temps));
    SHARDD_ASSIGN_OR_RETURN(const T* w_d, o.Param<T>(spec.w_d, &temps));
    SHARDD_ASSIGN_OR_RETURN(float* dw_gu, o.Grad(spec.w_gu));
    SHARDD_ASSIGN_OR_RETURN(float* dw_d, o.Grad(spec.w_d));
    return kc::GroupedExpertsBackward(dims, o.ExpertOptions(), w_gu, w_d, dy,
                                      dx, /*accumulate_dx=*/false, d_weights,
                                      dw_gu, dw_d, kc::ExpertBiasGrads{},
                                      g->experts.get(), o.cublas_, o.stream_);
  }

  // EXPERTS: the layer's output into x [T, D] (copying the layer weights
  // the backward reads); with null x only the experts' state again (the
  // grouped experts, their output and post_feedforward_layernorm_2's
  // inverse RMS) from the kept inputs, before a recomputed layer's
  // BACKWARD(EXPERTS). With `ep` the routed experts run expert-parallel
  // (spec holds this rank's block): DISPATCH copies the weights and sends
  // the rows, EXPERTS runs the local experts, COMBINE brings the outputs
  // back and finishes the layer; kAll runs the three in order.
  template <typename T>
  static absl::Status ExpertsForward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                     int64_t t, GemmaState* g, T* x,
                                     const RoutedExchange* ep,
                                     ExpertsPhase phase) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t d = a.dim;
    cudaStream_t stream = o.stream_;
    Temps temps;
    const bool all = phase == ExpertsPhase::kAll;
    const bool exchanged = ep != nullptr && ep->exchange != nullptr;
    if (!all && !exchanged) {
      return absl::FailedPreconditionError(
          "DISPATCH / COMBINE of a DiffusionGemma layer without expert "
          "parallelism");
    }
    if (phase == ExpertsPhase::kCombine && x == nullptr) {
      return absl::InvalidArgumentError("COMBINE without the layer's output");
    }
    if (g->experts_in.empty() || g->indices.empty()) {
      return absl::FailedPreconditionError(
          "EXPERTS of a DiffusionGemma layer without its LAYER");
    }
    if (x != nullptr && (all || phase == ExpertsPhase::kDispatch)) {
      SHARDD_ASSIGN_OR_RETURN(const T* w_post2,
                              o.Param<T>(spec.post_ff_norm_2, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* w_post,
                              o.Param<T>(spec.post_ff_norm, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* w_pre2,
                              o.Param<T>(spec.pre_ff_norm_2, &temps));
      SHARDD_ASSIGN_OR_RETURN(const T* ls,
                              o.Param<T>(spec.layer_scalar, &temps));
      g->layer_w.Reset();
      SHARDD_ASSIGN_OR_RETURN(g->layer_w, o.Alloc((3 * d + 1) * kElem));
      const T* parts[4] = {w_post2, w_post, w_pre2, ls};
      for (int i = 0; i < 4; ++i) {
        SHARDD_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(At<T>(g->layer_w, i * d), parts[i],
                            (i < 3 ? d : 1) * kElem, cudaMemcpyDeviceToDevice,
                            stream),
            "DiffusionGemma: the layer weights the experts' backward reads");
      }
    }
    if (!all && phase != ExpertsPhase::kCombine) {
      return ExchangedForward<T>(o, spec, t, g, *ep, phase);
    }
    if (g->layer_w.bytes() != (3 * d + 1) * kElem) {
      return absl::FailedPreconditionError(
          x == nullptr ? "recompute of a DiffusionGemma layer's experts "
                         "without its forward"
                       : "COMBINE of a DiffusionGemma layer without its "
                         "DISPATCH");
    }
    const T* w_post2 = g->layer_w.as<T>();
    const T* w_post = w_post2 + d;
    const T* ls = w_post2 + 3 * d;
    if (!all) {
      SHARDD_RETURN_IF_ERROR(ExchangedForward<T>(o, spec, t, g, *ep, phase));
    } else if (exchanged) {
      for (ExpertsPhase p : {ExpertsPhase::kDispatch, ExpertsPhase::kCompute,
                             ExpertsPhase::kCombine}) {
        SHARDD_RETURN_IF_ERROR(ExchangedForward<T>(o, spec, t, g, *ep, p));
      }
    } else {
      g->experts_out.Reset();
      SHARDD_ASSIGN_OR_RETURN(g->experts_out, o.Alloc(t * d * kElem));
      SHARDD_RETURN_IF_ERROR(GroupedForward<T>(
          o, spec, {t, d, spec.moe_inter, spec.experts, a.top_k},
          g->experts_in.data(), g->indices.as<int32_t>(),
          g->weights.as<float>(), g->experts_out.data(), g));
    }
    DeviceBuffer h2;
    SHARDD_RETURN_IF_ERROR(NormInto<T>(o, g->experts_out.as<T>(), w_post2, t, d,
                                       &h2, &g->post2_inv));
    temps.push_back(std::move(h2));
    if (x == nullptr) return absl::OkStatus();  // The kept sum has h2.
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchResidualAdd(g->sum.as<T>(), temps.back().as<T>(),
                                        nullptr, g->sum.as<T>(), t * d, stream),
        "DiffusionGemma: h1 + h2");
    DeviceBuffer total;
    SHARDD_RETURN_IF_ERROR(
        NormInto<T>(o, g->sum.as<T>(), w_post, t, d, &total, &g->post_ff_inv));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchSumTimesScalar(g->m.as<T>(), total.as<T>(), ls, x,
                                           t * d, stream),
        "DiffusionGemma: layer output");
    temps.push_back(std::move(total));
    return absl::OkStatus();
  }

  // One expert-parallel share of EXPERTS' forward (gemma_layer.cc's
  // ExchangedForward on the device): DISPATCH routes the choices and sends
  // the experts' input rows, EXPERTS runs the local experts top-1 over the
  // received rows (each row's weight applied there), COMBINE writes
  // experts_out.
  template <typename T>
  static absl::Status ExchangedForward(CudaBlockOps& o,
                                       const MoeLayerSpec& spec, int64_t t,
                                       GemmaState* g, const RoutedExchange& ep,
                                       ExpertsPhase phase) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t d = a.dim;
    const int k = a.top_k;
    const int64_t r = g->route.received;
    switch (phase) {
      case ExpertsPhase::kDispatch: {
        std::vector<int32_t> choices;
        SHARDD_RETURN_IF_ERROR(
            o.ReadChoicesRaw(g->indices.as<int32_t>(), t * k, &choices));
        SHARDD_RETURN_IF_ERROR(ep.exchange->Route(
            choices.data(), t, k, ep.max_received_rows, &g->route));
        // At least one row: a buffer of 0 bytes has no memory.
        const int64_t rows = std::max<int64_t>(1, g->route.received);
        for (DeviceBuffer* b : {&g->x_r, &g->ids_r, &g->w_r}) b->Reset();
        SHARDD_ASSIGN_OR_RETURN(g->x_r, o.Alloc(rows * d * kElem));
        SHARDD_ASSIGN_OR_RETURN(g->ids_r, o.Alloc(rows * 4));
        SHARDD_ASSIGN_OR_RETURN(g->w_r, o.Alloc(rows * 4));
        return o.ExchangeDispatchT<T>(
            *ep.exchange, g->route, g->experts_in.as<T>(),
            g->weights.as<float>(), g->indices.as<int32_t>(), g->x_r.as<T>(),
            g->ids_r.as<int32_t>(), g->w_r.as<float>());
      }
      case ExpertsPhase::kCompute: {
        if (g->route.t != t || g->x_r.empty()) {
          return absl::FailedPreconditionError(
              "EXPERTS of an expert-parallel DiffusionGemma layer before its "
              "DISPATCH");
        }
        g->y_r.Reset();
        SHARDD_ASSIGN_OR_RETURN(g->y_r,
                                o.Alloc(std::max<int64_t>(1, r) * d * kElem));
        // Top-1 over the block, each row's weight applied here.
        SHARDD_RETURN_IF_ERROR(GroupedForward<T>(
            o, spec, {r, d, spec.moe_inter, spec.experts, 1}, g->x_r.data(),
            g->ids_r.as<int32_t>(), g->w_r.as<float>(), g->y_r.data(), g));
        for (DeviceBuffer* b : {&g->x_r, &g->ids_r, &g->w_r}) b->Reset();
        return absl::OkStatus();
      }
      case ExpertsPhase::kCombine: {
        if (g->route.t != t || g->y_r.empty()) {
          return absl::FailedPreconditionError(
              "COMBINE of an expert-parallel DiffusionGemma layer before its "
              "EXPERTS");
        }
        g->experts_out.Reset();
        SHARDD_ASSIGN_OR_RETURN(g->experts_out, o.Alloc(t * d * kElem));
        SHARDD_RETURN_IF_ERROR(o.ExchangeCombineT<T>(g->route, g->y_r.as<T>(),
                                                     g->experts_out.as<T>()));
        g->y_r.Reset();
        return absl::OkStatus();
      }
      case ExpertsPhase::kAll:
        break;
    }
    return absl::InternalError("ExchangedForward of the whole EXPERTS");
  }

  // BACKWARD(EXPERTS) from dx (the layer output's gradient): with `ep`,
  // BACKWARD COMBINE starts it and sends the experts' output gradients,
  // BACKWARD EXPERTS runs the local experts' backward, BACKWARD DISPATCH
  // brings the input and weight gradients back and finishes it.
  template <typename T>
  static absl::Status ExpertsBackward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                      int64_t t, const T* dx, GemmaState* g,
                                      const RoutedExchange* ep,
                                      ExpertsPhase phase) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t d = a.dim;
    cudaStream_t stream = o.stream_;
    const bool all = phase == ExpertsPhase::kAll;
    const bool exchanged = ep != nullptr && ep->exchange != nullptr;
    if (!all && !exchanged) {
      return absl::FailedPreconditionError(
          "BACKWARD DISPATCH / COMBINE of a DiffusionGemma layer without "
          "expert parallelism");
    }
    if (g->layer_w.bytes() != (3 * d + 1) * kElem) {
      return absl::FailedPreconditionError(
          "BACKWARD(EXPERTS) of a DiffusionGemma layer without its forward");
    }
    if (exchanged && (g->route.t != t || g->route.k != a.top_k)) {
      return absl::FailedPreconditionError(
          "BACKWARD of an expert-parallel DiffusionGemma layer without its "
          "forward's route");
    }
    Temps temps;
    const T* w_post2 = g->layer_w.as<T>();
    const T* w_post = w_post2 + d;
    const T* w_pre2 = w_post + d;
    const T* ls = w_pre2 + d;
    DeviceBuffer g2;  // The experts' output gradient [T, D].
    if (all || phase == ExpertsPhase::kCombine) {
      if (g->experts_out.empty()) {
        return absl::FailedPreconditionError(
            "BACKWARD(EXPERTS) of a DiffusionGemma layer without its "
            "forward");
      }
      // The residual and the post-feed-forward norm both see dx *
      // layer_scalar.
      g->dm.Reset();
      SHARDD_ASSIGN_OR_RETURN(g->dm, o.Alloc(t * d * kElem));
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchSumTimesScalar(dx, static_cast<const T*>(nullptr),
                                             ls, g->dm.as<T>(), t * d, stream),
          "DiffusionGemma: d(m)");
      SHARDD_ASSIGN_OR_RETURN(g->d_ff_norms, Zeroed(o, 3 * d * 4));
      float* d_norms = g->d_ff_norms.as<float>();
      g->dsum.Reset();
      SHARDD_ASSIGN_OR_RETURN(g->dsum, o.Alloc(t * d * kElem));
      SHARDD_RETURN_IF_ERROR(
          NormBack<T>(o, g->dm.as<T>(), g->sum.as<T>(), w_post, g->post_ff_inv,
                      t, d, g->dsum.as<T>(), false, d_norms, &temps));
      SHARDD_ASSIGN_OR_RETURN(g2, o.Alloc(t * d * kElem));
      SHARDD_RETURN_IF_ERROR(NormBack<T>(
          o, g->dsum.as<T>(), g->experts_out.as<T>(), w_post2, g->post2_inv, t,
          d, g2.as<T>(), false, d_norms + d, &temps));
    }
    if (!all && phase != ExpertsPhase::kDispatch) {
      SHARDD_RETURN_IF_ERROR(ExchangedBackward<T>(o, spec, t, g2, g, phase,
                                                  /*dn=*/nullptr));
      temps.push_back(std::move(g2));
      return absl::OkStatus();
    }
    if (g->d_ff_norms.bytes() != 3 * d * 4) {
      return absl::FailedPreconditionError(
          "BACKWARD DISPATCH of a DiffusionGemma layer before its BACKWARD "
          "COMBINE");
    }
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dn, o.Alloc(t * d * kElem));
    g->dweights.Reset();
    SHARDD_ASSIGN_OR_RETURN(g->dweights, o.Alloc(t * a.top_k * 4));
    if (!all) {
      SHARDD_RETURN_IF_ERROR(
          ExchangedBackward<T>(o, spec, t, g2, g, phase, &dn));
    } else if (exchanged) {
      for (ExpertsPhase p : {ExpertsPhase::kCombine, ExpertsPhase::kCompute,
                             ExpertsPhase::kDispatch}) {
        SHARDD_RETURN_IF_ERROR(ExchangedBackward<T>(o, spec, t, g2, g, p, &dn));
      }
    } else {
      SHARDD_RETURN_IF_ERROR(GroupedBackward<T>(
          o, spec, {t, d, spec.moe_inter, spec.experts, a.top_k}, g2.data(),
          dn.data(), g->dweights.as<float>(), g));
    }
    SHARDD_RETURN_IF_ERROR(NormBack<T>(
        o, dn.as<T>(), g->m.as<T>(), w_pre2, g->pre2_inv, t, d, g->dm.as<T>(),
        true, g->d_ff_norms.as<float>() + 2 * d, &temps));
    temps.push_back(std::move(g2));
    temps.push_back(std::move(dn));
    return absl::OkStatus();
  }

  // One expert-parallel share of BACKWARD(EXPERTS) (gemma_layer.cc's
  // ExchangedBackward): COMBINE sends g2 (the experts' output gradient),
  // EXPERTS runs the local experts' backward over the received rows,
  // DISPATCH writes *dn [T, D] and dweights.
  template <typename T>
  static absl::Status ExchangedBackward(CudaBlockOps& o,
                                        const MoeLayerSpec& spec, int64_t t,
                                        const DeviceBuffer& g2, GemmaState* g,
                                        ExpertsPhase phase, DeviceBuffer* dn) {
    constexpr int64_t kElem = sizeof(T);
    const int64_t d = o.arch_->dim;
    const int64_t r = g->route.received;
    const int64_t rows = std::max<int64_t>(1, r);
    switch (phase) {
      case ExpertsPhase::kCombine: {
        g->dy_r.Reset();
        SHARDD_ASSIGN_OR_RETURN(g->dy_r, o.Alloc(rows * d * kElem));
        return o.ExchangeDispatchGradT<T>(g->route, g2.as<T>(),
                                          g->dy_r.as<T>());
      }
      case ExpertsPhase::kCompute: {
        if (g->dy_r.empty() || g->experts == nullptr) {
          return absl::FailedPreconditionError(
              "BACKWARD EXPERTS of an expert-parallel DiffusionGemma layer "
              "before its BACKWARD COMBINE");
        }
        for (DeviceBuffer* b : {&g->dx_r, &g->dw_r}) b->Reset();
        SHARDD_ASSIGN_OR_RETURN(g->dx_r, o.Alloc(rows * d * kElem));
        SHARDD_ASSIGN_OR_RETURN(g->dw_r, o.Alloc(rows * 4));
        SHARDD_RETURN_IF_ERROR(GroupedBackward<T>(
            o, spec, {r, d, spec.moe_inter, spec.experts, 1}, g->dy_r.data(),
            g->dx_r.data(), g->dw_r.as<float>(), g));
        g->dy_r.Reset();
        return absl::OkStatus();
      }
      case ExpertsPhase::kDispatch:
        if (g->dx_r.empty() || dn == nullptr) {
          return absl::FailedPreconditionError(
              "BACKWARD DISPATCH of an expert-parallel DiffusionGemma layer "
              "before its BACKWARD EXPERTS");
        }
        SHARDD_RETURN_IF_ERROR(o.ExchangeCombineGradT<T>(
            g->route, g->dx_r.as<T>(), g->dw_r.as<float>(), dn->as<T>(),
            g->dweights.as<float>()));
        for (DeviceBuffer* b : {&g->dx_r, &g->dw_r}) b->Reset();
        g->route = ExpertRoute();
        return absl::OkStatus();
      case ExpertsPhase::kAll:
        break;
    }
    return absl::InternalError("ExchangedBackward of the whole EXPERTS");
  }

  // BACKWARD(LAYER): dx becomes the gradient of the layer's input.
  template <typename T>
  static absl::Status LayerBackward(CudaBlockOps& o, const MoeLayerSpec& spec,
                                    int64_t batch, int64_t seq,
                                    const GemmaDecodeView* decode,
                                    GemmaState* g, T* dx) {
    constexpr int64_t kElem = sizeof(T);
    const kc::DType dt = kc::DTypeOf<T>::value;
    const MoeArchitecture& a = *o.arch_;
    const int64_t t = batch * seq, d = a.dim, hq = a.q_heads;
    const int64_t hkv = spec.layer_kv_heads, hd = spec.layer_head_dim;
    cublasHandle_t cublas = o.cublas_;
    cudaStream_t stream = o.stream_;
    if (g->dm.empty() || g->dsum.empty() || g->d_ff_norms.empty() ||
        g->x_in.empty() || g->q.empty()) {
      return absl::FailedPreconditionError(
          "BACKWARD(LAYER) of a DiffusionGemma layer before its experts' "
          "or without its forward");
    }
    Temps temps;
    auto param = [&](const ArchTensor& w) { return o.Param<T>(w, &temps); };
    const int32_t* positions = nullptr;
    const int32_t* key_begin = nullptr;
    SHARDD_RETURN_IF_ERROR(
        PositionsOf(o, batch, seq, decode, &positions, &key_begin));
    // The feed-forward norms' gradients BACKWARD(EXPERTS) formed.
    const ArchTensor* ff_norms[3] = {&spec.post_ff_norm, &spec.post_ff_norm_2,
                                     &spec.pre_ff_norm_2};
    for (int i = 0; i < 3; ++i) {
      SHARDD_ASSIGN_OR_RETURN(float* gw, o.Grad(*ff_norms[i]));
      if (gw == nullptr) continue;
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchResidualAdd(gw, g->d_ff_norms.as<float>() + i * d,
                                          nullptr, gw, d, stream),
          "DiffusionGemma: feed-forward norm gradients");
    }
    // The dense branch, from d(h1 + h2).
    SHARDD_ASSIGN_OR_RETURN(const T* w_post1, param(spec.post_ff_norm_1));
    SHARDD_ASSIGN_OR_RETURN(const T* w_pre, param(spec.pre_ff_norm));
    SHARDD_ASSIGN_OR_RETURN(float* d_post1, o.Grad(spec.post_ff_norm_1));
    SHARDD_ASSIGN_OR_RETURN(float* d_pre, o.Grad(spec.pre_ff_norm));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer g2, o.Alloc(t * d * kElem));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer gb, o.Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, g->dsum.as<T>(), g->dense_out.as<T>(),
                                       w_post1, g->post1_inv, t, d, g2.as<T>(),
                                       false, d_post1, &temps));
    SHARDD_RETURN_IF_ERROR(o.MlpBackwardRaw<T>(
        {&spec.mlp_gate, &spec.mlp_up, &spec.mlp_down, spec.mlp_inter},
        g->dense_in.as<T>(), t, g2.as<T>(), g->mlp_saved, gb.as<T>(),
        /*accumulate=*/false));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, gb.as<T>(), g->m.as<T>(), w_pre,
                                       g->pre_inv, t, d, g->dm.as<T>(), true,
                                       d_pre, &temps));
    // The router: frozen in the release, but its weights depend on m.
    SHARDD_ASSIGN_OR_RETURN(const T* scale, param(spec.router_scale));
    SHARDD_ASSIGN_OR_RETURN(const T* proj, param(spec.gate));
    SHARDD_ASSIGN_OR_RETURN(float* dproj, o.Grad(spec.gate));
    SHARDD_ASSIGN_OR_RETURN(float* dscale, o.Grad(spec.router_scale));
    const kc::RouterDims rd{t, d, spec.experts, a.top_k, a.renormalize_topk};
    const size_t router_ws = kc::RouterBackwardWorkspaceBytes(rd, dt);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer rws, o.Alloc(router_ws));
    SHARDD_RETURN_IF_ERROR(kc::RouterBackward(
        rd, g->r_in.as<T>(), proj, g->dweights.as<float>(), nullptr,
        g->router_saved.data(), static_cast<size_t>(g->router_saved.bytes()),
        gb.as<T>(), /*accumulate_dx=*/false, dproj, nullptr, rws.data(),
        router_ws, cublas, stream));
    temps.push_back(std::move(rws));
    const float root = RouterRoot(d);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer w_router,
                            RouterNormWeight<T>(o, scale));
    DeviceBuffer d_w_router;  // d(scale * root), then d(scale) += root * it.
    if (dscale != nullptr) {
      SHARDD_ASSIGN_OR_RETURN(d_w_router, Zeroed(o, d * 4));
    }
    SHARDD_RETURN_IF_ERROR(NormBack<T>(
        o, gb.as<T>(), g->m.as<T>(), w_router.as<T>(), g->r_inv, t, d,
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
    // m = x + post_attention_layernorm(attn); gb becomes d(attn), dx d(m).
    SHARDD_ASSIGN_OR_RETURN(const T* w_post, param(spec.post_norm));
    SHARDD_ASSIGN_OR_RETURN(float* d_post, o.Grad(spec.post_norm));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, g->dm.as<T>(), g->attn.as<T>(),
                                       w_post, g->post_inv, t, d, gb.as<T>(),
                                       false, d_post, &temps));
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dx, g->dm.data(), g->dm.bytes(),
                        cudaMemcpyDeviceToDevice, stream),
        "DiffusionGemma: the residual's gradient");
    g->dm.Reset();
    // The attention, from d(attn).
    SHARDD_ASSIGN_OR_RETURN(const T* wo, param(spec.o_proj));
    SHARDD_ASSIGN_OR_RETURN(const T* qn, param(spec.q_norm));
    SHARDD_ASSIGN_OR_RETURN(const T* kn, param(spec.k_norm));
    SHARDD_ASSIGN_OR_RETURN(float* dwo, o.Grad(spec.o_proj));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer d_o, o.Alloc(t * hq * hd * kElem));
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas, t, hq * hd, d, gb.data(), d, false, wo, hq * hd, false, 0.0f,
        d_o.data(), dt, hq * hd, "o_proj backward"));
    if (dwo != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas, d, hq * hd, t, gb.data(), d,
                                            true, g->o.data(), hq * hd, false,
                                            1.0f, dwo, kc::DType::kFloat32,
                                            hq * hd, "o_proj weight gradient"));
    }
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq, Zeroed(o, t * hq * hd * 4));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk, Zeroed(o, t * hkv * hd * 4));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv, Zeroed(o, t * hkv * hd * 4));
    if (decode != nullptr) {
      SHARDD_RETURN_IF_ERROR(DecodeBackward<T>(o, spec, *decode, batch, seq, *g,
                                               d_o, &dq, &dk, &dv));
    } else {
      const kernels::AttentionDims dims =
          GemmaAttentionDims(a, spec, batch, seq);
      kernels::AttentionOptions options = GemmaAttentionOptions(a, spec, false);
      options.key_begin = key_begin;
      const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer aws,
                              o.Alloc(static_cast<int64_t>(ws_bytes)));
      SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
          dims, options, g->q.as<T>(), g->k.as<T>(), g->v.as<T>(), g->o.as<T>(),
          g->lse.as<float>(), d_o.as<T>(), dq.as<float>(), dk.as<float>(),
          dv.as<float>(), nullptr, aws.data(), ws_bytes, stream));
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
    const kc::DeviceRopeTable table = Rope(o, spec);
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
        SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, o.Alloc(n * kElem));
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
    SHARDD_ASSIGN_OR_RETURN(float* dqn, o.Grad(spec.q_norm));
    SHARDD_ASSIGN_OR_RETURN(float* dkn, o.Grad(spec.k_norm));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq_pre, o.Alloc(t * hq * hd * kElem));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk_pre, o.Alloc(t * hkv * hd * kElem));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv_pre, o.Alloc(t * hkv * hd * kElem));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, dq.as<T>(), g->q_pre.as<T>(), qn,
                                       g->q_inv, t * hq, hd, dq_pre.as<T>(),
                                       false, dqn, &temps));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, dk.as<T>(), g->k_pre.as<T>(), kn,
                                       g->k_inv, t * hkv, hd, dk_pre.as<T>(),
                                       false, dkn, &temps));
    // v_norm has no weight.
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, dv.as<T>(), g->v_pre.as<T>(),
                                       o.ones_.as<T>(), g->v_inv, t * hkv, hd,
                                       dv_pre.as<T>(), false, nullptr, &temps));
    if (spec.values_from_keys) {
      SHARDD_CUDA_RETURN_IF_ERROR(device_model::LaunchResidualAdd(
                                      dk_pre.as<T>(), dv_pre.as<T>(), nullptr,
                                      dk_pre.as<T>(), t * hkv * hd, stream),
                                  "DiffusionGemma: values from keys");
    }
    // The projections of n; gb becomes d(n).
    struct Projection {
      const ArchTensor* tensor;
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
      SHARDD_ASSIGN_OR_RETURN(const T* w, param(*pr.tensor));
      SHARDD_ASSIGN_OR_RETURN(float* dw, o.Grad(*pr.tensor));
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas, t, d, pr.out, pr.grad->data(), pr.out, false, w, d, false,
          beta, gb.data(), dt, d, pr.tensor->name.c_str()));
      beta = 1.0f;
      if (dw != nullptr) {
        SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
            cublas, pr.out, d, t, pr.grad->data(), pr.out, true, g->n.data(), d,
            false, 1.0f, dw, kc::DType::kFloat32, d, pr.tensor->name.c_str()));
      }
    }
    SHARDD_ASSIGN_OR_RETURN(const T* w_in, param(spec.norm));
    SHARDD_ASSIGN_OR_RETURN(float* d_in, o.Grad(spec.norm));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, gb.as<T>(), g->x_in.as<T>(), w_in,
                                       g->in_inv, t, d, dx, true, d_in,
                                       &temps));
    for (DeviceBuffer* b :
         {&g2, &gb, &d_o, &dq, &dk, &dv, &dq_pre, &dk_pre, &dv_pre}) {
      temps.push_back(std::move(*b));
    }
    return absl::OkStatus();
  }

  // probs [t, V] fp32 (storage-type GEMM operand on the way in).
  template <typename T>
  static absl::StatusOr<const T*> ProbsIn(CudaBlockOps& o, const Act& probs,
                                          Temps* temps) {
    if constexpr (std::is_same<T, float>::value) {
      return probs.as<float>();
    } else {
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, o.Alloc(probs.numel() * 2));
      SHARDD_RETURN_IF_ERROR(kc::CastFp32ToBf16(
          probs.as<float>(), cast.as<uint16_t>(), probs.numel(), o.stream_));
      const uint16_t* data = cast.as<uint16_t>();
      temps->push_back(std::move(cast));
      return data;
    }
  }

  template <typename T>
  static absl::Status SelfCondForward(CudaBlockOps& o,
                                      const BlockDiffusionSpec& bd,
                                      const Act& noised, const Act* probs,
                                      const std::vector<uint8_t>& coin,
                                      int64_t batch, int64_t r, Saved* state,
                                      Act* x) {
    constexpr int64_t kElem = sizeof(T);
    const kc::DType dt = kc::DTypeOf<T>::value;
    const MoeArchitecture& a = *o.arch_;
    const int64_t t = batch * r, d = a.dim, vocab = a.vocab;
    cudaStream_t stream = o.stream_;
    Temps temps;
    SelfConditioningState* sc = state->Get<SelfConditioningState>();
    *sc = SelfConditioningState();
    SHARDD_ASSIGN_OR_RETURN(const T* table, o.Param<T>(a.embed, &temps));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer e, o.Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(kc::EmbeddingForward(
        table, vocab, d, noised.as<int32_t>(), t, e.as<T>(),
        &o.step_loss_.as<DeviceStepLoss>()->bad_ids, stream));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchScale(e.as<T>(), a.embedding_scale, t * d, stream),
        "self-conditioning: embedding scale");
    DeviceBuffer sum;
    if (probs != nullptr) {
      // s = softmax(sc_logits) @ E * scale for the sequences whose coin came
      // up; pre_norm, the gated MLP, added to the embeddings.
      if (probs->numel() != t * vocab) {
        return absl::FailedPreconditionError(
            "self-conditioning: the probabilities do not match the canvas");
      }
      SHARDD_ASSIGN_OR_RETURN(const T* p_in, ProbsIn<T>(o, *probs, &temps));
      SHARDD_ASSIGN_OR_RETURN(sc->signal, Zeroed(o, t * d * kElem));
      for (int64_t s = 0; s < batch; ++s) {
        if (!coin[s]) continue;
        SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
            o.cublas_, r, d, vocab, p_in + s * r * vocab, vocab, false, table,
            d, false, 0.0f, sc->signal.as<T>() + s * r * d, dt, d,
            "self-conditioning signal"));
      }
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchScale(sc->signal.as<T>(), a.embedding_scale,
                                    t * d, stream),
          "self-conditioning: signal scale");
      SHARDD_ASSIGN_OR_RETURN(const T* pre_w, o.Param<T>(bd.pre_norm, &temps));
      SHARDD_RETURN_IF_ERROR(
          NormInto<T>(o, sc->signal.as<T>(), pre_w, t, d, &sc->p, &sc->p_inv));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer mlp_out, o.Alloc(t * d * kElem));
      SHARDD_RETURN_IF_ERROR(o.MlpForwardRaw<T>(
          {&bd.gate, &bd.up, &bd.down, bd.inter}, sc->p.as<T>(), t,
          mlp_out.as<T>(), &sc->mlp_saved));
      SHARDD_ASSIGN_OR_RETURN(sum, o.Alloc(t * d * kElem));
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchResidualAdd(e.as<T>(), mlp_out.as<T>(), nullptr,
                                          sum.as<T>(), t * d, stream),
          "self-conditioning: e + mlp");
      temps.push_back(std::move(mlp_out));
      temps.push_back(std::move(e));
    } else {
      // No signal: pre_norm(0) = 0 and the MLP gives 0, so the input is
      // post_norm(e).
      sum = std::move(e);
    }
    SHARDD_ASSIGN_OR_RETURN(sc->sum_inv, o.Alloc(t * 4));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(sum.as<T>(), o.ones_.as<T>(), t,
                                              d, a.eps, x->as<T>(),
                                              sc->sum_inv.as<float>(), stream));
    if (probs != nullptr) {
      sc->sum = std::move(sum);
    } else {
      // A decode without a signal has no backward: keep nothing.
      temps.push_back(std::move(sum));
      *sc = SelfConditioningState();
    }
    return absl::OkStatus();
  }

  template <typename T>
  static absl::Status SelfCondBackward(CudaBlockOps& o,
                                       const BlockDiffusionSpec& bd,
                                       const Act& noised, const Act& probs,
                                       const std::vector<uint8_t>& coin,
                                       int64_t batch, int64_t r, Saved* state,
                                       const Act& dx) {
    constexpr int64_t kElem = sizeof(T);
    const MoeArchitecture& a = *o.arch_;
    const int64_t t = batch * r, d = a.dim, vocab = a.vocab;
    cudaStream_t stream = o.stream_;
    SelfConditioningState* sc = state->Peek<SelfConditioningState>();
    if (sc == nullptr || sc->sum.empty()) {
      return absl::FailedPreconditionError(
          "self-conditioning backward without its forward");
    }
    Temps temps;
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer g, o.Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
        dx.as<T>(), sc->sum.as<T>(), o.ones_.as<T>(), sc->sum_inv.as<float>(),
        t, d, g.as<T>(), /*accumulate_dx=*/false, nullptr, nullptr, 0, stream));
    // The MLP and pre_norm, down to d(signal).
    SHARDD_ASSIGN_OR_RETURN(const T* pre_w, o.Param<T>(bd.pre_norm, &temps));
    SHARDD_ASSIGN_OR_RETURN(float* dpre, o.Grad(bd.pre_norm));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dp, o.Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(o.MlpBackwardRaw<T>(
        {&bd.gate, &bd.up, &bd.down, bd.inter}, sc->p.as<T>(), t, g.as<T>(),
        sc->mlp_saved, dp.as<T>(), /*accumulate=*/false));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ds, o.Alloc(t * d * kElem));
    SHARDD_RETURN_IF_ERROR(NormBack<T>(o, dp.as<T>(), sc->signal.as<T>(), pre_w,
                                       sc->p_inv, t, d, ds.as<T>(), false, dpre,
                                       &temps));
    SHARDD_ASSIGN_OR_RETURN(float* dtable, o.Grad(a.embed));
    if (dtable != nullptr) {
      // The embeddings: the canvas ids' rows and, through s = probs @ E *
      // scale (probs detached), probs^T d(s) * scale.
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchScale(g.as<T>(), a.embedding_scale, t * d,
                                    stream),
          "self-conditioning: embedding scale");
      const size_t ws_bytes = kc::EmbeddingBackwardWorkspaceBytes(vocab, t);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, o.Alloc(ws_bytes));
      SHARDD_RETURN_IF_ERROR(kc::EmbeddingBackward(
          g.as<T>(), noised.as<int32_t>(), t, vocab, d, dtable, ws.data(),
          ws_bytes, &o.step_loss_.as<DeviceStepLoss>()->bad_ids, stream,
          a.pad_id));
      temps.push_back(std::move(ws));
      SHARDD_CUDA_RETURN_IF_ERROR(
          device_model::LaunchScale(ds.as<T>(), a.embedding_scale, t * d,
                                    stream),
          "self-conditioning: signal scale");
      SHARDD_ASSIGN_OR_RETURN(const T* p_in, ProbsIn<T>(o, probs, &temps));
      for (int64_t s = 0; s < batch; ++s) {
        if (!coin[s]) continue;
        SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
            o.cublas_, vocab, d, r, p_in + s * r * vocab, vocab, true,
            ds.as<T>() + s * r * d, d, false, 1.0f, dtable, kc::DType::kFloat32,
            d, "self-conditioning embedding gradient"));
      }
    }
    for (DeviceBuffer* buf : {&g, &dp, &ds}) temps.push_back(std::move(*buf));
    return absl::OkStatus();
  }

  template <typename T>
  static absl::Status HeadSoftmax(CudaBlockOps& o, const Act& h, int64_t t,
                                  Act* probs) {
    const MoeArchitecture& a = *o.arch_;
    Temps temps;
    SHARDD_ASSIGN_OR_RETURN(const T* head_w, o.Param<T>(a.head, &temps));
    const kc::CrossEntropyDims dims{t, a.dim, a.vocab};
    kc::CudaCrossEntropyOptions options;
    options.softcap = a.final_logit_softcap;
    const size_t ws_bytes =
        kc::LmHeadSoftmaxWorkspaceBytes(dims, kc::DTypeOf<T>::value, options);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws, o.Alloc(ws_bytes));
    if constexpr (std::is_same<T, float>::value) {
      return kc::LmHeadSoftmax(dims, h.as<float>(), head_w, probs->as<float>(),
                               ws.data(), ws_bytes, options, o.cublas_,
                               o.stream_);
    } else {
      // The kernel writes storage type; the step keeps fp32.
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer p, o.Alloc(probs->numel() * 2));
      SHARDD_RETURN_IF_ERROR(kc::LmHeadSoftmax(
          dims, h.as<uint16_t>(), head_w, p.as<uint16_t>(), ws.data(), ws_bytes,
          options, o.cublas_, o.stream_));
      SHARDD_RETURN_IF_ERROR(kc::CastBf16ToFp32(
          p.as<uint16_t>(), probs->as<float>(), probs->numel(), o.stream_));
      temps.push_back(std::move(p));
      temps.push_back(std::move(ws));
      return absl::OkStatus();
    }
  }
};

absl::Status CudaBlockOps::PrepareGemma(int64_t seq) {
  const MoeArchitecture& a = *arch_;
  // The weightless norms' weights: over D (the self-conditioning's) and
  // over a head (v_norm).
  int64_t width = a.dim;
  for (const MoeLayerSpec& l : a.layers) {
    width = std::max(width, l.layer_head_dim);
  }
  const int64_t elem = bf16() ? 2 : 4;
  if (ones_.bytes() < width * elem) {
    ones_.Reset();
    SHARDD_ASSIGN_OR_RETURN(ones_, Alloc(width * elem));
    std::vector<float> host(width, 1.0f);
    std::vector<uint16_t> bf16_ones(width, 0x3F80);  // 1.0 in bf16.
    // On the stream the block is reused on, then waited for (once).
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(ones_.data(),
                        elem == 4 ? static_cast<const void*>(host.data())
                                  : static_cast<const void*>(bf16_ones.data()),
                        width * elem, cudaMemcpyHostToDevice, stream_),
        "DiffusionGemma: ones");
    SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_),
                                "DiffusionGemma: ones");
  }
  if (seq <= gemma_positions_) return absl::OkStatus();
  if (seq > a.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seq: ", seq, " tokens exceed the model's max_position_embeddings (",
        a.max_positions, ")"));
  }
  const RopeFrequencies* tables[2] = {&a.rope, &a.sliding_rope};
  for (int i = 0; i < 2; ++i) {
    if (tables[i]->inv_freq.empty()) continue;
    SHARDD_ASSIGN_OR_RETURN(
        const kernels::RopeTable table,
        kernels::BuildRopeTable(tables[i]->inv_freq, seq,
                                tables[i]->attention_factor));
    const int64_t bytes =
        static_cast<int64_t>(table.cos.size() * sizeof(float));
    gemma_cos_[i].Reset();
    gemma_sin_[i].Reset();
    SHARDD_ASSIGN_OR_RETURN(gemma_cos_[i], Alloc(bytes));
    SHARDD_ASSIGN_OR_RETURN(gemma_sin_[i], Alloc(bytes));
    // On the stream the blocks are reused on, then waited for: the host
    // tables go on return (once per longer seq, at SetBatch).
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(gemma_cos_[i].data(), table.cos.data(), bytes,
                        cudaMemcpyHostToDevice, stream_),
        "DiffusionGemma: rope table");
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(gemma_sin_[i].data(), table.sin.data(), bytes,
                        cudaMemcpyHostToDevice, stream_),
        "DiffusionGemma: rope table");
    SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_),
                                "DiffusionGemma: rope table");
  }
  gemma_positions_ = seq;
  return absl::OkStatus();
}

namespace {

// DiffusionGemma's expert-parallel exchange does not run on this device
// (DeviceMoeModel::SetExpertExchange refuses it up front).
}  // namespace

absl::Status CudaBlockOps::GemmaLayerForward(const MoeLayerSpec& spec,
                                             const Act* x, int64_t batch,
                                             int64_t seq,
                                             const GemmaDecodeView* decode,
                                             Saved* layer) {
  GemmaState* g = layer->Get<GemmaState>();
  if (x != nullptr) {
    // A new forward: no decode has read these K/V yet.
    g->dk_ext.Reset();
    g->dv_ext.Reset();
    g->x_in.Reset();
    SHARDD_ASSIGN_OR_RETURN(g->x_in, Alloc(x->bytes()));
    if (x->bytes() > 0) {
      SHARDD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(g->x_in.data(), x->data(), x->bytes(),
                          cudaMemcpyDeviceToDevice, stream_),
          "DiffusionGemma: the layer's input");
    }
  } else if (g->x_in.bytes() != batch * seq * arch_->dim * (bf16() ? 2 : 4)) {
    return absl::FailedPreconditionError(
        "recompute of a DiffusionGemma layer without its kept input");
  }
  return bf16()
             ? Gemma::LayerFromInput<uint16_t>(*this, spec, batch, seq, decode,
                                               g)
             : Gemma::LayerFromInput<float>(*this, spec, batch, seq, decode, g);
}

absl::Status CudaBlockOps::GemmaExpertsForward(const MoeLayerSpec& spec,
                                               int64_t t, Saved* layer, Act* x,
                                               const RoutedExchange* ep,
                                               ExpertsPhase phase) {
  SHARDD_ASSIGN_OR_RETURN(
      GemmaState * g,
      GemmaStateOf(layer,
                   "EXPERTS of a DiffusionGemma layer without its LAYER"));
  return bf16() ? Gemma::ExpertsForward<uint16_t>(
                      *this, spec, t, g,
                      x == nullptr ? nullptr : x->as<uint16_t>(), ep, phase)
                : Gemma::ExpertsForward<float>(
                      *this, spec, t, g,
                      x == nullptr ? nullptr : x->as<float>(), ep, phase);
}

absl::Status CudaBlockOps::GemmaExpertsBackward(const MoeLayerSpec& spec,
                                                int64_t t, const Act& dx,
                                                Saved* layer,
                                                const RoutedExchange* ep,
                                                ExpertsPhase phase) {
  SHARDD_ASSIGN_OR_RETURN(
      GemmaState * g,
      GemmaStateOf(layer,
                   "BACKWARD(EXPERTS) of a DiffusionGemma layer without "
                   "its forward"));
  return bf16() ? Gemma::ExpertsBackward<uint16_t>(
                      *this, spec, t, dx.as<uint16_t>(), g, ep, phase)
                : Gemma::ExpertsBackward<float>(*this, spec, t, dx.as<float>(),
                                                g, ep, phase);
}

absl::Status CudaBlockOps::GemmaLayerBackward(const MoeLayerSpec& spec,
                                              int64_t batch, int64_t seq,
                                              const GemmaDecodeView* decode,
                                              Saved* layer, Act* dx) {
  SHARDD_ASSIGN_OR_RETURN(
      GemmaState * g,
      GemmaStateOf(layer,
                   "BACKWARD(LAYER) of a DiffusionGemma layer without its "
                   "forward"));
  return bf16() ? Gemma::LayerBackward<uint16_t>(*this, spec, batch, seq,
                                                 decode, g, dx->as<uint16_t>())
                : Gemma::LayerBackward<float>(*this, spec, batch, seq, decode,
                                              g, dx->as<float>());
}

void CudaBlockOps::GemmaTrim(GemmaKeep keep, Saved* layer) {
  GemmaState* g = layer->Peek<GemmaState>();
  if (g == nullptr) return;
  switch (keep) {
    case GemmaKeep::kAllButExpertsWorkspace:
      g->ReleaseExperts();
      return;
    case GemmaKeep::kAllButExperts:
      g->ReleaseExperts();
      g->experts_out.Reset();
      g->post2_inv.Reset();
      return;
    case GemmaKeep::kCheckpoint:
    case GemmaKeep::kCheckpointAndKv: {
      // The input and what BACKWARD(EXPERTS) reads besides the experts'
      // state (as the CPU's GemmaLayerBlock::KeepCheckpoint).
      GemmaState kept;
      kept.x_in = std::move(g->x_in);
      kept.m = std::move(g->m);
      kept.sum = std::move(g->sum);
      kept.pre2_inv = std::move(g->pre2_inv);
      kept.post_ff_inv = std::move(g->post_ff_inv);
      kept.experts_in = std::move(g->experts_in);
      kept.indices = std::move(g->indices);
      kept.weights = std::move(g->weights);
      kept.layer_w = std::move(g->layer_w);
      if (keep == GemmaKeep::kCheckpointAndKv) {
        kept.k = std::move(g->k);
        kept.v = std::move(g->v);
      }
      // The dropped buffers are freed stream-ordered.
      *g = std::move(kept);
      return;
    }
  }
}

absl::Status CudaBlockOps::SelfConditioningForward(
    const BlockDiffusionSpec& spec, const Act& noised, const Act* probs,
    const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
    Saved* state, Act* x) {
  return bf16() ? Gemma::SelfCondForward<uint16_t>(
                      *this, spec, noised, probs, coin, batch, canvas, state, x)
                : Gemma::SelfCondForward<float>(*this, spec, noised, probs,
                                                coin, batch, canvas, state, x);
}

absl::Status CudaBlockOps::SelfConditioningBackward(
    const BlockDiffusionSpec& spec, const Act& noised, const Act& probs,
    const std::vector<uint8_t>& coin, int64_t batch, int64_t canvas,
    Saved* state, const Act& dx) {
  return bf16()
             ? Gemma::SelfCondBackward<uint16_t>(*this, spec, noised, probs,
                                                 coin, batch, canvas, state, dx)
             : Gemma::SelfCondBackward<float>(*this, spec, noised, probs, coin,
                                              batch, canvas, state, dx);
}

absl::Status CudaBlockOps::HeadSoftmax(const Act& h, int64_t t, Act* probs) {
  return bf16() ? Gemma::HeadSoftmax<uint16_t>(*this, h, t, probs)
                : Gemma::HeadSoftmax<float>(*this, h, t, probs);
}

}  // namespace step
}  // namespace shardd
