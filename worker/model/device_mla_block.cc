#include "worker/model/device_mla_block.h"

#include <type_traits>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/bf16_cast.h"
#include "kernels/cuda/bias.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/dtype.h"
#include "kernels/cuda/rms_norm.h"
#include "kernels/cuda/rope.h"
#include "worker/model/attention_geometry.h"
#include "worker/model/device_linear.h"
#include "worker/model/device_mla_kernels.h"

namespace shardd {

namespace kc = ::shardd::kernels::cuda;

void DeviceMlaActs::Reset() {
  for (DeviceBuffer* b :
       {&n, &qa, &qa_inv, &qa_n, &c, &c_inv, &c_n, &q, &k, &v, &o, &lse}) {
    b->Reset();
  }
}

kernels::AttentionOptions DeviceMlaBlock::OptionsOf(
    const MoeArchitecture& a, const MoeLayerSpec& layer) const {
  kernels::AttentionOptions options = SelfAttentionOptions(a, layer);
  options.key_begin = key_begin_;
  return options;
}

absl::StatusOr<DeviceBuffer> DeviceMlaBlock::Alloc(int64_t bytes) {
  return DeviceBuffer::Allocate(allocator_, bytes, MemoryKind::kWorkspace,
                                stream_);
}

template <typename T>
absl::Status DeviceMlaBlock::Forward(const MoeLayerSpec& layer,
                                     const DeviceMlaParams& p, DeviceBuffer n,
                                     int64_t batch, int64_t seq,
                                     const int32_t* positions,
                                     const kc::DeviceRopeTable& rope_table,
                                     DeviceMlaActs* acts, T* y) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, h = a.q_heads;
  const int64_t nope = a.nope_head_dim, rope = a.rope_head_dim;
  const int64_t qk = nope + rope, dv = a.v_head_dim;
  const int64_t rq = a.q_lora_rank, rkv = a.kv_lora_rank;
  const int64_t wa = rkv + rope, wb = nope + dv;
  constexpr int64_t kElem = sizeof(T);
  constexpr kc::DType dt = kc::DTypeOf<T>::value;
  const kernels::RopeLayout layout = RopeLayoutOf(a);
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas_, stream_, "mla"));
  acts->Reset();
  acts->n = std::move(n);
  // Queries.
  SHARDD_ASSIGN_OR_RETURN(acts->q, Alloc(t * h * qk * kElem));
  if (rq > 0) {
    SHARDD_ASSIGN_OR_RETURN(acts->qa, Alloc(t * rq * kElem));
    SHARDD_ASSIGN_OR_RETURN(acts->qa_n, Alloc(t * rq * kElem));
    SHARDD_ASSIGN_OR_RETURN(acts->qa_inv, Alloc(t * 4));
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, rq, d, acts->n.data(), d,
                                          false, p.wqa, d, true, 0.0f,
                                          acts->qa.data(), dt, rq, "q_a_proj"));
    if (layer.attention_bias) {
      SHARDD_RETURN_IF_ERROR(kc::AddBias(static_cast<const T*>(p.bqa), t, rq,
                                         acts->qa.as<T>(), stream_));
    }
    SHARDD_RETURN_IF_ERROR(
        kc::RmsNormForward(acts->qa.as<T>(), static_cast<const T*>(p.q_a_norm),
                           t, rq, kMlaLatentNormEps, acts->qa_n.as<T>(),
                           acts->qa_inv.as<float>(), stream_));
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, t, h * qk, rq, acts->qa_n.data(), rq, false, p.wqb, rq, true,
        0.0f, acts->q.data(), dt, h * qk, "q_b_proj"));
  } else {
    SHARDD_RETURN_IF_ERROR(
        StorageGemm<T>(cublas_, t, h * qk, d, acts->n.data(), d, false, p.wq, d,
                       true, 0.0f, acts->q.data(), dt, h * qk, "q_proj"));
  }
  // The compressed kv [c ; k_rope] and its split.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer kva, Alloc(t * wa * kElem));
  SHARDD_RETURN_IF_ERROR(
      StorageGemm<T>(cublas_, t, wa, d, acts->n.data(), d, false, p.wkva, d,
                     true, 0.0f, kva.data(), dt, wa, "kv_a_proj_with_mqa"));
  if (layer.attention_bias) {
    SHARDD_RETURN_IF_ERROR(kc::AddBias(static_cast<const T*>(p.bkva), t, wa,
                                       kva.as<T>(), stream_));
  }
  SHARDD_ASSIGN_OR_RETURN(acts->c, Alloc(t * rkv * kElem));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer kr, Alloc(t * rope * kElem));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(kva.as<T>(), wa, 1, acts->c.as<T>(), rkv,
                                      t, rkv, stream_),
      "mla: latent split");
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(kva.as<T>() + rkv, wa, 1, kr.as<T>(),
                                      rope, t, rope, stream_),
      "mla: rope key split");
  SHARDD_ASSIGN_OR_RETURN(acts->c_n, Alloc(t * rkv * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->c_inv, Alloc(t * 4));
  SHARDD_RETURN_IF_ERROR(kc::RmsNormForward(
      acts->c.as<T>(), static_cast<const T*>(p.kv_a_norm), t, rkv,
      kMlaLatentNormEps, acts->c_n.as<T>(), acts->c_inv.as<float>(), stream_));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer kvb, Alloc(t * h * wb * kElem));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
      cublas_, t, h * wb, rkv, acts->c_n.data(), rkv, false, p.wkvb, rkv, true,
      0.0f, kvb.data(), dt, h * wb, "kv_b_proj"));
  // RoPE on the rope parts: every query head's and the one shared key.
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(rope_table, layout, HeadsRopeShape(t, h, qk, nope),
                     positions, acts->q.as<T>(), false, stream_));
  SHARDD_RETURN_IF_ERROR(kc::RopeRotate(rope_table, layout,
                                        HeadsRopeShape(t, 1, rope, 0),
                                        positions, kr.as<T>(), false, stream_));
  // k = [k_nope ; k_rope shared by the heads], v.
  SHARDD_ASSIGN_OR_RETURN(acts->k, Alloc(t * h * qk * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->v, Alloc(t * h * dv * kElem));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(kvb.as<T>(), wb, 1, acts->k.as<T>(), qk,
                                      t * h, nope, stream_),
      "mla: k_nope");
  SHARDD_CUDA_RETURN_IF_ERROR(device_model::LaunchStridedCopy(
                                  kr.as<T>(), rope, h, acts->k.as<T>() + nope,
                                  qk, t * h, rope, stream_),
                              "mla: shared k_rope");
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(kvb.as<T>() + nope, wb, 1,
                                      acts->v.as<T>(), dv, t * h, dv, stream_),
      "mla: v");
  SHARDD_ASSIGN_OR_RETURN(acts->o, Alloc(t * h * dv * kElem));
  SHARDD_ASSIGN_OR_RETURN(acts->lse, Alloc(batch * h * seq * 4));
  SHARDD_RETURN_IF_ERROR(kc::AttentionForward(
      SelfAttentionDims(a, batch, seq), OptionsOf(a, layer),
      acts->q.as<T>(), acts->k.as<T>(), acts->v.as<T>(), acts->o.as<T>(),
      acts->lse.as<float>(), stream_));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, h * dv, acts->o.data(),
                                        h * dv, false, p.wo, h * dv, true, 0.0f,
                                        y, dt, d, "o_proj"));
  if (!layer.attention_bias) return absl::OkStatus();
  return kc::AddBias(static_cast<const T*>(p.bo), t, d, y, stream_);
}

template <typename T>
absl::Status DeviceMlaBlock::Backward(const MoeLayerSpec& layer,
                                      const DeviceMlaParams& p,
                                      const DeviceMlaActs& acts, int64_t batch,
                                      int64_t seq, const int32_t* positions,
                                      const kc::DeviceRopeTable& rope_table,
                                      const T* dy, T* dn) {
  const MoeArchitecture& a = *arch_;
  const int64_t t = batch * seq, d = a.dim, h = a.q_heads;
  const int64_t nope = a.nope_head_dim, rope = a.rope_head_dim;
  const int64_t qk = nope + rope, dv = a.v_head_dim;
  const int64_t rq = a.q_lora_rank, rkv = a.kv_lora_rank;
  const int64_t wa = rkv + rope, wb = nope + dv;
  constexpr int64_t kElem = sizeof(T);
  constexpr kc::DType dt = kc::DTypeOf<T>::value;
  constexpr kc::DType f32 = kc::DType::kFloat32;
  const kernels::RopeLayout layout = RopeLayoutOf(a);
  SHARDD_RETURN_IF_ERROR(kc::BindCublasHandle(cublas_, stream_, "mla"));
  // y = o Wo^T (+ bo).
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer d_o, Alloc(t * h * dv * kElem));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, h * dv, d, dy, d, false,
                                        p.wo, h * dv, false, 0.0f, d_o.data(),
                                        dt, h * dv, "o_proj backward"));
  if (p.dwo != nullptr) {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, d, h * dv, t, dy, d, true, acts.o.data(), h * dv, false, 1.0f,
        p.dwo, f32, h * dv, "o_proj weight gradient"));
  }
  if (layer.attention_bias && p.dbo != nullptr) {
    SHARDD_RETURN_IF_ERROR(kc::BiasBackward(dy, t, d, p.dbo, stream_));
  }
  // The attention, into zeroed fp32 gradients.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dq, Alloc(t * h * qk * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dk, Alloc(t * h * qk * 4));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dvb, Alloc(t * h * dv * 4));
  for (DeviceBuffer* b : {&dq, &dk, &dvb}) {
    SHARDD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(b->data(), 0, b->bytes(), stream_), "mla: zeroing");
  }
  const kernels::AttentionDims dims = SelfAttentionDims(a, batch, seq);
  const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(dims);
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer ws,
                          Alloc(static_cast<int64_t>(ws_bytes)));
  SHARDD_RETURN_IF_ERROR(kc::AttentionBackward(
      dims, OptionsOf(a, layer), acts.q.as<T>(), acts.k.as<T>(),
      acts.v.as<T>(), acts.o.as<T>(), acts.lse.as<float>(), d_o.as<T>(),
      dq.as<float>(), dk.as<float>(), dvb.as<float>(), /*d_sinks=*/nullptr,
      ws.data(), ws_bytes, stream_));
  // RoPE's backward is the inverse rotation; the shared rope key collects
  // every head's gradient first (fp32, heads in order, as the CPU).
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(rope_table, layout, HeadsRopeShape(t, h, qk, nope),
                     positions, dq.as<float>(), true, stream_));
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dkva32, Alloc(t * wa * 4));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchSumHeads(dk.as<float>() + nope, t, h, qk, rope,
                                   dkva32.as<float>() + rkv, wa, stream_),
      "mla: shared k_rope gradient");
  SHARDD_RETURN_IF_ERROR(
      kc::RopeRotate(rope_table, layout, HeadsRopeShape(t, 1, wa, rkv),
                     positions, dkva32.as<float>(), true, stream_));
  // kv_b_proj's output gradient [k_nope ; v] per head, in storage type T.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dkvb, Alloc(t * h * wb * kElem));
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(dk.as<float>(), qk, 1, dkvb.as<T>(), wb,
                                      t * h, nope, stream_),
      "mla: k_nope gradient");
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(
          dvb.as<float>(), dv, 1, dkvb.as<T>() + nope, wb, t * h, dv, stream_),
      "mla: v gradient");
  // kv_b_proj, then kv_a_layernorm into the latent part of dkva.
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dlat, Alloc(t * rkv * kElem));
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
      cublas_, t, rkv, h * wb, dkvb.data(), h * wb, false, p.wkvb, rkv, false,
      0.0f, dlat.data(), dt, rkv, "kv_b_proj backward"));
  if (p.dwkvb != nullptr) {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, h * wb, rkv, t, dkvb.data(), h * wb, true, acts.c_n.data(),
        rkv, false, 1.0f, p.dwkvb, f32, rkv, "kv_b_proj weight gradient"));
  }
  SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dkva, Alloc(t * wa * kElem));
  {
    const size_t norm_ws = kc::RmsNormBackwardWorkspaceBytes(t, rkv);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer nws,
                            Alloc(static_cast<int64_t>(norm_ws)));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dc, Alloc(t * rkv * kElem));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
        dlat.as<T>(), acts.c.as<T>(), static_cast<const T*>(p.kv_a_norm),
        acts.c_inv.as<float>(), t, rkv, dc.as<T>(), /*accumulate_dx=*/false,
        p.dkv_a_norm, nws.data(), norm_ws, stream_));
    SHARDD_CUDA_RETURN_IF_ERROR(
        device_model::LaunchStridedCopy(dc.as<T>(), rkv, 1, dkva.as<T>(), wa, t,
                                        rkv, stream_),
        "mla: latent gradient");
  }
  // fp32 -> T (a copy for fp32, rounded for bf16: the launcher's overloads).
  SHARDD_CUDA_RETURN_IF_ERROR(
      device_model::LaunchStridedCopy(dkva32.as<float>() + rkv, wa, 1,
                                      dkva.as<T>() + rkv, wa, t, rope, stream_),
      "mla: rope key gradient");
  if (layer.attention_bias && p.dbkva != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        kc::BiasBackward(dkva.as<T>(), t, wa, p.dbkva, stream_));
  }
  SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, wa, dkva.data(), wa,
                                        false, p.wkva, d, false, 0.0f, dn, dt,
                                        d, "kv_a_proj_with_mqa backward"));
  if (p.dwkva != nullptr) {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, wa, d, t, dkva.data(), wa, true, acts.n.data(), d, false, 1.0f,
        p.dwkva, f32, d, "kv_a_proj_with_mqa weight gradient"));
  }
  // The queries: their gradient in storage type T.
  DeviceBuffer dq_s;
  if constexpr (std::is_same<T, float>::value) {
    dq_s = std::move(dq);
  } else {
    SHARDD_ASSIGN_OR_RETURN(dq_s, Alloc(t * h * qk * kElem));
    SHARDD_RETURN_IF_ERROR(kc::CastFp32ToBf16(
        dq.as<float>(), dq_s.as<uint16_t>(), t * h * qk, stream_));
  }
  if (rq > 0) {
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dqa_n, Alloc(t * rq * kElem));
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
        cublas_, t, rq, h * qk, dq_s.data(), h * qk, false, p.wqb, rq, false,
        0.0f, dqa_n.data(), dt, rq, "q_b_proj backward"));
    if (p.dwqb != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas_, h * qk, rq, t, dq_s.data(), h * qk, true, acts.qa_n.data(),
          rq, false, 1.0f, p.dwqb, f32, rq, "q_b_proj weight gradient"));
    }
    const size_t norm_ws = kc::RmsNormBackwardWorkspaceBytes(t, rq);
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer nws,
                            Alloc(static_cast<int64_t>(norm_ws)));
    SHARDD_ASSIGN_OR_RETURN(DeviceBuffer dqa, Alloc(t * rq * kElem));
    SHARDD_RETURN_IF_ERROR(kc::RmsNormBackward(
        dqa_n.as<T>(), acts.qa.as<T>(), static_cast<const T*>(p.q_a_norm),
        acts.qa_inv.as<float>(), t, rq, dqa.as<T>(), /*accumulate_dx=*/false,
        p.dq_a_norm, nws.data(), norm_ws, stream_));
    if (layer.attention_bias && p.dbqa != nullptr) {
      SHARDD_RETURN_IF_ERROR(
          kc::BiasBackward(dqa.as<T>(), t, rq, p.dbqa, stream_));
    }
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, rq, dqa.data(), rq,
                                          false, p.wqa, d, false, 1.0f, dn, dt,
                                          d, "q_a_proj backward"));
    if (p.dwqa != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas_, rq, d, t, dqa.data(), rq, true, acts.n.data(), d, false,
          1.0f, p.dwqa, f32, d, "q_a_proj weight gradient"));
    }
  } else {
    SHARDD_RETURN_IF_ERROR(StorageGemm<T>(cublas_, t, d, h * qk, dq_s.data(),
                                          h * qk, false, p.wq, d, false, 1.0f,
                                          dn, dt, d, "q_proj backward"));
    if (p.dwq != nullptr) {
      SHARDD_RETURN_IF_ERROR(StorageGemm<T>(
          cublas_, h * qk, d, t, dq_s.data(), h * qk, true, acts.n.data(), d,
          false, 1.0f, p.dwq, f32, d, "q_proj weight gradient"));
    }
  }
  return absl::OkStatus();
}

template absl::Status DeviceMlaBlock::Forward<float>(
    const MoeLayerSpec&, const DeviceMlaParams&, DeviceBuffer, int64_t, int64_t,
    const int32_t*, const kc::DeviceRopeTable&, DeviceMlaActs*, float*);
template absl::Status DeviceMlaBlock::Forward<uint16_t>(
    const MoeLayerSpec&, const DeviceMlaParams&, DeviceBuffer, int64_t, int64_t,
    const int32_t*, const kc::DeviceRopeTable&, DeviceMlaActs*, uint16_t*);
template absl::Status DeviceMlaBlock::Backward<float>(
    const MoeLayerSpec&, const DeviceMlaParams&, const DeviceMlaActs&, int64_t,
    int64_t, const int32_t*, const kc::DeviceRopeTable&, const float*, float*);
template absl::Status DeviceMlaBlock::Backward<uint16_t>(
    const MoeLayerSpec&, const DeviceMlaParams&, const DeviceMlaActs&, int64_t,
    int64_t, const int32_t*, const kc::DeviceRopeTable&, const uint16_t*,
    uint16_t*);

}  // namespace shardd
