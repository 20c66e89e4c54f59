#include "worker/model/device_attention_block.h"

#include <cmath>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/bias.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/row_major_gemm.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/device_linear.h"

namespace shardd {
namespace {

namespace kc = ::shardd::kernels::cuda;

// The kernel options of `layer` with its sinks (device fp32, or null).
kernels::AttentionOptions OptionsWithSinks(const MoeArchitecture& a,
                                           const MoeLayerSpec& layer,
                                           const DeviceAttentionParams& p,
                                           const int32_t* key_begin) {
  kernels::AttentionOptions options = SelfAttentionOptions(a, layer);
  if (layer.has_sinks) options.sinks = p.sinks;
  options.key_begin = key_begin;
  return options;
}

}  // namespace

void DeviceAttentionActs::Reset() {
  for (DeviceBuffer* b :
       {&n, &q_pre, &k_pre, &q_inv, &k_inv, &q, &k, &v, &o, &lse}) {
    b->Reset();
  }
}

kernels::cuda::DeviceRopeTable DeviceAttentionBlock::RopeTable() const {
  return {cos_.as<float>(), sin_.as<float>(),
          static_cast<int64_t>(arch_->rope.inv_freq.size()) * 2,
          table_positions_};
}

DeviceAttentionBlock::DeviceAttentionBlock(const MoeArchitecture* arch,
                                           DeviceAllocator* allocator,
                                           cudaStream_t stream,
                                           cublasHandle_t cublas)
    : arch_(arch),
      allocator_(allocator),
      stream_(stream),
      cublas_(cublas),
      kernels_(kc::AttentionKernelsFromEnvironment()) {}

DeviceAttentionBlock::~DeviceAttentionBlock() = default;

absl::StatusOr<kc::CudnnAttention*> DeviceAttentionBlock::CudnnFor(
    const kernels::AttentionDims& dims,
    const kernels::AttentionOptions& options, bool bf16) {
  if (!kernels_.ok()) return kernels_.status();
  if (*kernels_ == kc::AttentionKernels::kOwn ||
      !kc::CudnnAttentionSupports(dims, options, bf16).ok()) {
    return nullptr;
  }
  if (cudnn_ == nullptr) {
    absl::StatusOr<std::unique_ptr<kc::CudnnAttention>> created =
        kc::CudnnAttention::Create(stream_);
    if (!created.ok()) {
      if (*kernels_ == kc::AttentionKernels::kCudnn) return created.status();
      SHARDD_LOG(WARNING) << "attention: cuDNN unavailable, the own kernels "
                             "compute every call: "
                          << created.status();
      kernels_ = kc::AttentionKernels::kOwn;
      return nullptr;
    }
    cudnn_ = *std::move(created);
  }
  return cudnn_.get();
}

absl::StatusOr<DeviceBuffer> DeviceAttentionBlock::Alloc(int64_t bytes) {
  return DeviceBuffer::Allocate(allocator_, bytes, MemoryKind::kWorkspace,
                                stream_);
}

absl::Status DeviceAttentionBlock::Prepare(int64_t seq) {
  if (seq <= table_positions_) return absl::OkStatus();
  SHARDD_ASSIGN_OR_RETURN(const kernels::RopeTable table,
                          RopeTableFor(*arch_, seq));
  const int64_t bytes = static_cast<int64_t>(table.cos.size() * sizeof(float));
  SHARDD_ASSIGN_OR_RETURN(cos_, Alloc(bytes));
  SHARDD_ASSIGN_OR_RETURN(sin_, Alloc(bytes));
  // On the stream the blocks are reused on (a plain cudaMemcpy could
  // overtake work still queued there on a reused block), then waited for,
  // so the temporary table may go (once per longer seq, at SetBatch).
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(cos_.data(), table.cos.data(), bytes,
                      cudaMemcpyHostToDevice, stream_),
      "rope table");
  SHARDD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(sin_.data(), table.sin.data(), bytes,
                      cudaMemcpyHostToDevice, stream_),
      "rope table");
  SHARDD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "rope table");
  table_positions_ = seq;
  return absl::OkStatus();
}

template <typename T>
absl::Status DeviceAttentionBlock::Forward(const MoeLayerSpec& layer,
                                           const DeviceAttentionParams& p,
                                           DeviceBuffer n, int64_t batch,
                                           int64_t seq,
                                           const int32_t* positions,
                                           DeviceAttentionActs* acts, T* y) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, hd = a.head_dim;
  const int64_t hq = a.q_heads, hkv = a.kv_heads;
  constexpr int64_t kElem = sizeof(T);
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas_, stream_, "attention"));
  acts->Reset();
  acts->n = std::move(n);
  SHARDD_ASSIGN_OR_RETURN(acts->q, Alloc(t * hq * hd * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->k, Alloc(t * hkv * hd * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->v, Alloc(t * hkv * hd * kElem));
  const kc::DType dt = kc::DTypeOf<T>::value;
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, hq * hd, d, acts->n.data(),
                                        d, false, p.wq, d, true, 0.0f,
                                        acts->q.data(), dt, hq * hd, "q_proj"));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas_, t, hkv * hd, d, acts->n.data(), d, false, p.wk, d,
                     true, 0.0f, acts->k.data(), dt, hkv * hd, "k_proj"));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas_, t, hkv * hd, d, acts->n.data(), d, false, p.wv, d,
                     true, 0.0f, acts->v.data(), dt, hkv * hd, "v_proj"));
  if (layer.attention_bias) {
    // Before the norms and RoPE, as nn.Linear adds them.
    SHARDD_RETURN_IF_ERROR(kc::AddBias(static_cast<const T*>(p.bq), t, hq * hd,
                                       acts->q.as<T>(), stream_));
    SHARDD_RETURN_IF_ERROR(kc::AddBias(static_cast<const T*>(p.bk), t, hkv * hd,
                                       acts->k.as<T>(), stream_));
    SHARDD_RETURN_IF_ERROR(kc::AddBias(static_cast<const T*>(p.bv), t, hkv * hd,
                                       acts->v.as<T>(), stream_));
  }
  if (layer.qk_norm) {
    acts->q_pre = std::move(acts->q);
    acts->k_pre = std::move(acts->k);
    SHARDD_ASSIGN_OR_RETURN(acts->q, Alloc(t * hq * hd * kElem));
    SHARDD_ASSIGN_OR_RETURN(acts->k, Alloc(t * hkv * hd * kElem));
    SHARDD_ASSIGN_OR_RETURN(acts->q_inv, Alloc(t * hq * 4));
    SHARDD_ASSIGN_OR_RETURN(acts->k_inv, Alloc(t * hkv * 4));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(
        acts->q_pre.as<T>(), static_cast<const T*>(p.q_norm), t * hq, hd, a.eps,
        acts->q.as<T>(), acts->q_inv.as<float>(), stream_));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(
        acts->k_pre.as<T>(), static_cast<const T*>(p.k_norm), t * hkv, hd,
        a.eps, acts->k.as<T>(), acts->k_inv.as<float>(), stream_));
  }
  const kc::DeviceRopeTable table = RopeTable();
  const kernels::RopeLayout layout = RopeLayoutOf(a);
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(table, layout, kernels::RopeShape{t, hq, hq * hd, hd, 0},
                     positions, acts->q.as<T>(), false, stream_));
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(table, layout, kernels::RopeShape{t, hkv, hkv * hd, hd, 0},
                     positions, acts->k.as<T>(), false, stream_));
  SHARDD_ASSIGN_OR_RETURN(acts->o, Alloc(t * hq * hd * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->lse, Alloc(batch * hq * seq * 4));
  const kernels::AttentionDims dims = SelfAttentionDims(a, batch, seq);
  const kernels::AttentionOptions options = OptionsWithSinks(a, layer, p, key_begin_);
  SHARDD_ASSIGN_OR_RETURN(kc::CudnnAttention * cudnn,
                          CudnnFor(dims, options, sizeof(T) == 2));
  bool done = false;
  if constexpr (sizeof(T) == 2) {
    if (cudnn != nullptr) {
      SHARDD_ASSIGN_OR_RETURN(const size_t ws_bytes,
                              cudnn->ForwardWorkspaceBytes(dims, options));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                              Alloc(static_cast<int64_t>(ws_bytes)));
      SHARDD_RETURN_IF_ERROR(cudnn->Forward(
          dims, options, acts->q.as<T>(), acts->k.as<T>(), acts->v.as<T>(),
          acts->o.as<T>(), acts->lse.as<float>(), ws.data(), ws_bytes));
      done = true;
    }
  }
  if (!done) {
    SHARDD_RETURN_IF_ERROR(kc::AttentionForward(
        dims, options, acts->q.as<T>(), acts->k.as<T>(), acts->v.as<T>(),
        acts->o.as<T>(), acts->lse.as<float>(), stream_));
  }
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, hq * hd, acts->o.data(),
                                        hq * hd, false, p.wo, hq * hd, true,
                                        0.0f, y, dt, d, "o_proj"));
  if (!layer.attention_bias) return absl::OkStatus();
  return kc::AddBias(static_cast<const T*>(p.bo), t, d, y, stream_);
}

template <typename T>
absl::Status DeviceAttentionBlock::Backward(const MoeLayerSpec& layer,
                                            const DeviceAttentionParams& p,
                                            const DeviceAttentionActs& acts,
                                            int64_t batch, int64_t seq,
                                            const int32_t* positions,
                                            const T* dy, T* dn) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, hd = a.head_dim;
  const int64_t hq = a.q_heads, hkv = a.kv_heads;
  constexpr int64_t kElem = sizeof(T);
  const kc::DType dt = kc::DTypeOf<T>::value;
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas_, stream_, "attention"));
  // y = o Wo^T: d_o = dy Wo; dWo += dy^T o.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer d_o, Alloc(t * hq * hd * kElem));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, hq * hd, d, dy, d, false,
                                        p.wo, hq * hd, false, 0.0f, d_o.data(),
                                        dt, hq * hd, "o_proj backward"));
  if (p.dwo != nullptr) {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, d, hq * hd, t, dy, d, true, acts.o.data(), hq * hd, false,
        1.0f, p.dwo, kc::DType::kFloat32, hq * hd, "o_proj weight gradient"));
  }
  if (p.dbo != nullptr) {
    SHARDD_RETURN_IF_ERROR(kc::BiasBackward(dy, t, d, p.dbo, stream_));
  }
  // The attention, into zeroed fp32 gradients.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq, Alloc(t * hq * hd * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk, Alloc(t * hkv * hd * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv, Alloc(t * hkv * hd * 4));
  for (DeviceBuffer* b : {&dq, &dk, &dv}) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(b->data(), 0, b->bytes(), stream_), "zeroing");
  }
  const kernels::AttentionDims dims = SelfAttentionDims(a, batch, seq);
  const kernels::AttentionOptions options = OptionsWithSinks(a, layer, p, key_begin_);
  SHARDD_ASSIGN_OR_RETURN(kc::CudnnAttention * cudnn,
                          CudnnFor(dims, options, sizeof(T) == 2));
  bool done = false;
  if constexpr (sizeof(T) == 2) {
    if (cudnn != nullptr) {
      // cuDNN writes bf16 gradients; widened to fp32 here, the rest of the
      // backward (RoPE, norms, projections) is the same for both kernels.
      SHARDD_ASSIGN_OR_RETURN(const size_t ws_bytes,
                              cudnn->BackwardWorkspaceBytes(dims, options));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                              Alloc(static_cast<int64_t>(ws_bytes)));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq16, Alloc(t * hq * hd * kElem));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk16, Alloc(t * hkv * hd * kElem));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dv16, Alloc(t * hkv * hd * kElem));
      SHARDD_RETURN_IF_ERROR(cudnn->Backward(
          dims, options, acts.q.as<T>(), acts.k.as<T>(), acts.v.as<T>(),
          acts.o.as<T>(), acts.lse.as<float>(), d_o.as<T>(),
          dq16.as<uint16_t>(), dk16.as<uint16_t>(), dv16.as<uint16_t>(),
          ws.data(), ws_bytes));
      SHARDD_RETURN_IF_ERROR(kc::CastBf16ToFp32(
          dq16.as<uint16_t>(), dq.as<float>(), t * hq * hd, stream_));
      SHARDD_RETURN_IF_ERROR(kc::CastBf16ToFp32(
          dk16.as<uint16_t>(), dk.as<float>(), t * hkv * hd, stream_));
      SHARDD_RETURN_IF_ERROR(kc::CastBf16ToFp32(
          dv16.as<uint16_t>(), dv.as<float>(), t * hkv * hd, stream_));
      done = true;
    }
  }
  if (!done) {
    const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                            Alloc(static_cast<int64_t>(ws_bytes)));
    SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
        dims, options, acts.q.as<T>(), acts.k.as<T>(), acts.v.as<T>(),
        acts.o.as<T>(), acts.lse.as<float>(), d_o.as<T>(), dq.as<float>(),
        dk.as<float>(), dv.as<float>(), layer.has_sinks ? p.dsinks : nullptr,
        ws.data(), ws_bytes, stream_));
  }
  // RoPE's backward is the inverse rotation.
  const kc::DeviceRopeTable table = RopeTable();
  const kernels::RopeLayout layout = RopeLayoutOf(a);
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(table, layout, kernels::RopeShape{t, hq, hq * hd, hd, 0},
                     positions, dq.as<float>(), true, stream_));
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(table, layout, kernels::RopeShape{t, hkv, hkv * hd, hd, 0},
                     positions, dk.as<float>(), true, stream_));
  // The gradients of q, k, v in storage type T.
  auto to_storage = [&](DeviceBuffer* g, int64_t n) -> absl::Status {
    if constexpr (std::is_same<T, float>::value) {
      return absl::OkStatus();
    } else {
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer cast, Alloc(n * kElem));
      SHARDD_RETURN_IF_ERROR(
          kc::CastFp32ToBf16(g->as<float>(), cast.as<uint16_t>(), n, stream_));
      *g = std::move(cast);
      return absl::OkStatus();
    }
  };
  SHARDD_RETURN_IF_ERROR(to_storage(&dq, t * hq * hd));
  SHARDD_RETURN_IF_ERROR(to_storage(&dk, t * hkv * hd));
  SHARDD_RETURN_IF_ERROR(to_storage(&dv, t * hkv * hd));
  if (layer.qk_norm) {
    for (int side = 0; side < 2; ++side) {
      const int64_t heads = side == 0 ? hq : hkv;
      DeviceBuffer& g = side == 0 ? dq : dk;
      float* dweight = side == 0 ? p.dq_norm : p.dk_norm;
      const size_t norm_ws = kc::RmsNormBackwardWorkspaceBytes(t * heads, hd);
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer nws,
                              Alloc(static_cast<int64_t>(norm_ws)));
      SHARDD_ASSIGN_OR_RETURN(DeviceBuffer pre, Alloc(t * heads * hd * kElem));
      SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
          g.as<T>(), (side == 0 ? acts.q_pre : acts.k_pre).as<T>(),
          static_cast<const T*>(side == 0 ? p.q_norm : p.k_norm),
          (side == 0 ? acts.q_inv : acts.k_inv).as<float>(), t * heads, hd,
          pre.as<T>(), /*accumulate_dx=*/false, dweight, nws.data(), norm_ws,
          stream_));
      g = std::move(pre);
    }
  }
  // The projections of n: dn = dq Wq + dk Wk + dv Wv; dW += dg^T n; the
  // biases' gradients are those of the projections' outputs (before RoPE
  // and the norms, whose backward ran above).
  struct Projection {
    const void* w;
    float* dw;
    float* db;
    const DeviceBuffer* g;
    int64_t out;
    const char* name;
  };
  const Projection projections[] = {
      {p.wq, p.dwq, p.dbq, &dq, hq * hd, "q_proj"},
      {p.wk, p.dwk, p.dbk, &dk, hkv * hd, "k_proj"},
      {p.wv, p.dwv, p.dbv, &dv, hkv * hd, "v_proj"}};
  float beta = 0.0f;
  for (const Projection& pr : projections) {
    if (layer.attention_bias && pr.db != nullptr) {
      SHARDD_RETURN_IF_ERROR(kc::BiasBackward(
          static_cast<const T*>(pr.g->data()), t, pr.out, pr.db, stream_));
    }
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, pr.out, pr.g->data(),
                                          pr.out, false, pr.w, d, false, beta,
                                          dn, dt, d, pr.name));
    beta = 1.0f;
    if (pr.dw != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas_, pr.out, d, t, pr.g->data(), pr.out, true, acts.n.data(), d,
          false, 1.0f, pr.dw, kc::DType::kFloat32, d, pr.name));
    }
  }
  return absl::OkStatus();
}

template absl::Status DeviceAttentionBlock::Forward<float>(
    const MoeLayerSpec&, const DeviceAttentionParams&, DeviceBuffer, int64_t,
    int64_t, const int32_t*, DeviceAttentionActs*, float*);
template absl::Status DeviceAttentionBlock::Forward<uint16_t>(
    const MoeLayerSpec&, const DeviceAttentionParams&, DeviceBuffer, int64_t,
    int64_t, const int32_t*, DeviceAttentionActs*, uint16_t*);
template absl::Status DeviceAttentionBlock::Backward<float>(
    const MoeLayerSpec&, const DeviceAttentionParams&,
    const DeviceAttentionActs&, int64_t, int64_t, const int32_t*, const float*,
    float*);
template absl::Status DeviceAttentionBlock::Backward<uint16_t>(
    const MoeLayerSpec&, const DeviceAttentionParams&,
    const DeviceAttentionActs&, int64_t, int64_t, const int32_t*,
    const uint16_t*, uint16_t*);

}  // namespace shardd
