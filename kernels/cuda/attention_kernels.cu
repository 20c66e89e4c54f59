// Flash-style attention on the GPU, the generic path (any head dims, fp32
// or bf16; bf16 calls with head dims 64 and 128 go to the tensor-core
// kernels of attention_mma_kernels.cu): fp32 arithmetic on tiles in shared
// memory, online softmax in the forward, recomputed probabilities in the
// backward (one kernel for dK/dV per key tile, looping over the query heads
// of its kv head, so nothing is added atomically; one for dQ per query tile).
// Deterministic: every sum has a fixed order.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_kernels.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/kernel_launch.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kBlockQ = 16;   // Query rows per forward / dQ block.
constexpr int kBlockK = 32;   // Keys per tile (one per lane of a warp).
constexpr int kBlockKV = 16;  // Keys per dK/dV block.

__device__ __forceinline__ int MinRows(int64_t limit, int64_t left) {
  return static_cast<int>(limit < left ? limit : left);
}

__device__ __forceinline__ int64_t Dv(const AttentionLaunch& a) {
  return a.v_head_dim == 0 ? a.head_dim : a.v_head_dim;
}

// Element offsets of row i of head h (q/out/dq) and of key j of kv head g.
__device__ __forceinline__ int64_t QRow(const AttentionLaunch& a, int64_t b,
                                        int64_t i, int64_t h, int64_t width) {
  return ((b * a.q_len + i) * a.q_heads + h) * width;
}
__device__ __forceinline__ int64_t KRow(const AttentionLaunch& a, int64_t b,
                                        int64_t j, int64_t g, int64_t width) {
  return ((b * a.kv_len + j) * a.kv_heads + g) * width;
}

// Forward: one block per (query tile, head, sequence).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ForwardKernel(AttentionLaunch a, const T* __restrict__ q,
                  const T* __restrict__ k, const T* __restrict__ v,
                  T* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int64_t dh = a.head_dim, dv = Dv(a);
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t g = h / (a.q_heads / a.kv_heads);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockQ;
  const int bq = MinRows(kBlockQ, a.q_len - i0);
  float* qs = smem;                      // [kBlockQ][dh]
  float* ks = qs + kBlockQ * dh;         // [kBlockK][dh + 1]
  float* vs = ks + kBlockK * (dh + 1);   // [kBlockK][dv]
  float* ps = vs + kBlockK * dv;         // [kBlockQ][kBlockK]
  float* acc = ps + kBlockQ * kBlockK;   // [kBlockQ][dv]
  float* row_m = acc + kBlockQ * dv;     // [kBlockQ]
  float* row_l = row_m + kBlockQ;        // [kBlockQ]
  float* row_c = row_l + kBlockQ;        // [kBlockQ] rescale of this tile
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int64_t idx = tid; idx < kBlockQ * dh; idx += kThreads) {
    const int r = static_cast<int>(idx / dh);
    qs[idx] = r < bq ? LoadAsFloat(q + QRow(a, b, i0 + r, h, dh) + idx % dh)
                     : 0.0f;
  }
  for (int64_t idx = tid; idx < kBlockQ * dv; idx += kThreads) acc[idx] = 0.0f;
  if (tid < kBlockQ) {
    row_m[tid] = -INFINITY;
    row_l[tid] = 0.0f;
  }
  int64_t k_begin, k_end;
  MaskKeyRange(a.rule, i0 + a.rule.q_offset, i0 + bq - 1 + a.rule.q_offset,
               a.kv_len, &k_begin, &k_end);
  __syncthreads();

  for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlockK) {
    const int bk = MinRows(kBlockK, k_end - j0);
    for (int64_t idx = tid; idx < kBlockK * dh; idx += kThreads) {
      const int c = static_cast<int>(idx / dh);
      ks[c * (dh + 1) + idx % dh] =
          c < bk ? LoadAsFloat(k + KRow(a, b, j0 + c, g, dh) + idx % dh) : 0.0f;
    }
    for (int64_t idx = tid; idx < kBlockK * dv; idx += kThreads) {
      const int c = static_cast<int>(idx / dv);
      vs[idx] =
          c < bk ? LoadAsFloat(v + KRow(a, b, j0 + c, g, dv) + idx % dv) : 0.0f;
    }
    __syncthreads();
    // Scores, masked to -inf.
    for (int idx = tid; idx < kBlockQ * kBlockK; idx += kThreads) {
      const int r = idx / kBlockK, c = idx % kBlockK;
      float s = -INFINITY;
      if (r < bq && c < bk &&
          MaskAllowsFrom(a.rule, i0 + r + a.rule.q_offset, j0 + c,
                         PackedFirstKey(a.key_begin, a.q_len, b, i0 + r))) {
        float dot = 0.0f;
        for (int64_t e = 0; e < dh; ++e) dot += qs[r * dh + e] * ks[c * (dh + 1) + e];
        s = a.scale * dot;
      }
      ps[idx] = s;
    }
    __syncthreads();
    // Online softmax: a warp per row, a lane per key.
    for (int r = warp; r < kBlockQ; r += kThreads / 32) {
      const float s = ps[r * kBlockK + lane];
      const float block_max = WarpMax(s);
      float m = row_m[r], p = 0.0f, correction = 1.0f;
      if (block_max != -INFINITY) {
        const float m_new = fmaxf(m, block_max);
        correction = expf(m - m_new);
        p = s == -INFINITY ? 0.0f : expf(s - m_new);
        m = m_new;
      }
      const float sum = WarpSum(p);
      ps[r * kBlockK + lane] = p;
      if (lane == 0) {
        row_l[r] = row_l[r] * correction + sum;
        row_m[r] = m;
        row_c[r] = correction;
      }
    }
    __syncthreads();
    for (int64_t idx = tid; idx < kBlockQ * dv; idx += kThreads) {
      const int r = static_cast<int>(idx / dv);
      const int64_t e = idx % dv;
      float sum = 0.0f;
      for (int c = 0; c < bk; ++c) sum += ps[r * kBlockK + c] * vs[c * dv + e];
      acc[idx] = acc[idx] * row_c[r] + sum;
    }
    __syncthreads();
  }
  // The sink joins the denominator only.
  if (tid < bq) {
    float m = row_m[tid], l = row_l[tid], correction = 1.0f;
    if (a.sinks != nullptr) {
      const float sink = a.sinks[h];
      const float m_new = fmaxf(m, sink);
      correction = expf(m - m_new);
      l = l * correction + expf(sink - m_new);
      m = m_new;
    }
    row_c[tid] = l > 0.0f ? correction / l : 0.0f;
    lse[(b * a.q_heads + h) * a.q_len + i0 + tid] =
        l > 0.0f ? m + logf(l) : -INFINITY;
  }
  __syncthreads();
  for (int64_t idx = tid; idx < bq * dv; idx += kThreads) {
    const int r = static_cast<int>(idx / dv);
    StoreFromFloat(out + QRow(a, b, i0 + r, h, dv) + idx % dv,
                   acc[idx] * row_c[r]);
  }
}

// delta[b, h, i] = dO . O and the sink's share -p_sink * delta; a warp per
// row.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DeltaKernel(AttentionLaunch a, const T* __restrict__ out,
                const T* __restrict__ d_out, const float* __restrict__ lse,
                float* __restrict__ delta, float* __restrict__ sink_part) {
  const int64_t dv = Dv(a);
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  // row = (b * Hq + h) * T + i.
  const int64_t i = row % a.q_len, bh = row / a.q_len;
  const int64_t h = bh % a.q_heads, b = bh / a.q_heads;
  const int64_t at = QRow(a, b, i, h, dv);
  float sum = 0.0f;
  for (int64_t e = lane; e < dv; e += 32) {
    sum += LoadAsFloat(out + at + e) * LoadAsFloat(d_out + at + e);
  }
  sum = WarpSum(sum);
  if (lane == 0) {
    delta[row] = sum;
    if (sink_part != nullptr) {
      const float l = lse[row];
      sink_part[row] = l == -INFINITY ? 0.0f : -expf(a.sinks[h] - l) * sum;
    }
  }
}

// d_sinks[h] += sum over (b, i) of sink_part: a block per head, fixed tree.
__global__ void __launch_bounds__(kThreads)
    SinkReduceKernel(AttentionLaunch a, const float* __restrict__ sink_part,
                     float* __restrict__ d_sinks) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x;
  float sum = 0.0f;
  for (int64_t b = 0; b < a.batch; ++b) {
    const float* part = sink_part + (b * a.q_heads + h) * a.q_len;
    for (int64_t i = threadIdx.x; i < a.q_len; i += kThreads) sum += part[i];
  }
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) d_sinks[h] += sum;
}

// Recomputes p and ds = p * (dp - delta) for a [kBlockQ, bk] tile whose q,
// dO, k, v rows are in shared memory (k with a padded row of dh + 1).
__device__ __forceinline__ void TileGradients(
    const AttentionLaunch& a, int64_t b, int64_t i0, int bq, int64_t j0, int bk,
    int tile_k, const float* qs, const float* dos, const float* ks,
    const float* vs, const float* lse_s, const float* delta_s, float* ps,
    float* dss) {
  const int64_t dh = a.head_dim, dv = Dv(a);
  for (int idx = threadIdx.x; idx < kBlockQ * tile_k; idx += kThreads) {
    const int r = idx / tile_k, c = idx % tile_k;
    float p = 0.0f, ds = 0.0f;
    if (r < bq && c < bk && lse_s[r] != -INFINITY &&
        MaskAllowsFrom(a.rule, i0 + r + a.rule.q_offset, j0 + c,
                       PackedFirstKey(a.key_begin, a.q_len, b, i0 + r))) {
      float dot = 0.0f;
      for (int64_t e = 0; e < dh; ++e) dot += qs[r * dh + e] * ks[c * (dh + 1) + e];
      p = expf(a.scale * dot - lse_s[r]);
      float dp = 0.0f;
      for (int64_t e = 0; e < dv; ++e) dp += dos[r * dv + e] * vs[c * dv + e];
      ds = p * (dp - delta_s[r]);
    }
    ps[idx] = p;
    dss[idx] = ds;
  }
}

// Loads the query-side rows of a tile: q, dO, lse and delta.
template <typename T>
__device__ __forceinline__ void LoadQueryTile(
    const AttentionLaunch& a, int64_t b, int64_t h, int64_t i0, int bq,
    const T* q, const T* d_out, const float* lse, const float* delta,
    float* qs, float* dos, float* lse_s, float* delta_s) {
  const int64_t dh = a.head_dim, dv = Dv(a);
  for (int64_t idx = threadIdx.x; idx < kBlockQ * dh; idx += kThreads) {
    const int r = static_cast<int>(idx / dh);
    qs[idx] = r < bq ? LoadAsFloat(q + QRow(a, b, i0 + r, h, dh) + idx % dh)
                     : 0.0f;
  }
  for (int64_t idx = threadIdx.x; idx < kBlockQ * dv; idx += kThreads) {
    const int r = static_cast<int>(idx / dv);
    dos[idx] = r < bq
                   ? LoadAsFloat(d_out + QRow(a, b, i0 + r, h, dv) + idx % dv)
                   : 0.0f;
  }
  if (threadIdx.x < kBlockQ) {
    const int r = threadIdx.x;
    const int64_t row = (b * a.q_heads + h) * a.q_len + i0 + r;
    lse_s[r] = r < bq ? lse[row] : -INFINITY;
    delta_s[r] = r < bq ? delta[row] : 0.0f;
  }
}

// Loads `count` key and value rows from j0 into ks (padded) and vs.
template <typename T>
__device__ __forceinline__ void LoadKeyTile(const AttentionLaunch& a,
                                            int64_t b, int64_t g, int64_t j0,
                                            int bk, int tile_k, const T* k,
                                            const T* v, float* ks, float* vs) {
  const int64_t dh = a.head_dim, dv = Dv(a);
  for (int64_t idx = threadIdx.x; idx < tile_k * dh; idx += kThreads) {
    const int c = static_cast<int>(idx / dh);
    ks[c * (dh + 1) + idx % dh] =
        c < bk ? LoadAsFloat(k + KRow(a, b, j0 + c, g, dh) + idx % dh) : 0.0f;
  }
  for (int64_t idx = threadIdx.x; idx < tile_k * dv; idx += kThreads) {
    const int c = static_cast<int>(idx / dv);
    vs[idx] =
        c < bk ? LoadAsFloat(v + KRow(a, b, j0 + c, g, dv) + idx % dv) : 0.0f;
  }
}

// dK and dV of a key tile: one block per (key tile, kv head, sequence),
// looping over the query heads that share the kv head.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    KeyValueGradKernel(AttentionLaunch a, const T* __restrict__ q,
                       const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ d_out,
                       const float* __restrict__ lse,
                       const float* __restrict__ delta, float* __restrict__ dk,
                       float* __restrict__ dvg) {
  extern __shared__ float smem[];
  const int64_t dh = a.head_dim, dv = Dv(a);
  const int64_t b = blockIdx.z, g = blockIdx.y;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kBlockKV;
  const int bk = MinRows(kBlockKV, a.kv_len - j0);
  const int64_t group = a.q_heads / a.kv_heads;
  float* ks = smem;                         // [kBlockKV][dh + 1]
  float* vs = ks + kBlockKV * (dh + 1);     // [kBlockKV][dv]
  float* dk_acc = vs + kBlockKV * dv;       // [kBlockKV][dh]
  float* dv_acc = dk_acc + kBlockKV * dh;   // [kBlockKV][dv]
  float* qs = dv_acc + kBlockKV * dv;       // [kBlockQ][dh]
  float* dos = qs + kBlockQ * dh;           // [kBlockQ][dv]
  float* ps = dos + kBlockQ * dv;           // [kBlockQ][kBlockKV]
  float* dss = ps + kBlockQ * kBlockKV;     // [kBlockQ][kBlockKV]
  float* lse_s = dss + kBlockQ * kBlockKV;  // [kBlockQ]
  float* delta_s = lse_s + kBlockQ;         // [kBlockQ]

  LoadKeyTile(a, b, g, j0, bk, kBlockKV, k, v, ks, vs);
  for (int64_t idx = threadIdx.x; idx < kBlockKV * dh; idx += kThreads) dk_acc[idx] = 0.0f;
  for (int64_t idx = threadIdx.x; idx < kBlockKV * dv; idx += kThreads) dv_acc[idx] = 0.0f;
  int64_t q_begin, q_end;
  MaskQueryRange(a.rule, j0, j0 + bk - 1, a.q_len, &q_begin, &q_end);
  __syncthreads();
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    for (int64_t i0 = q_begin; i0 < q_end; i0 += kBlockQ) {
      const int bq = MinRows(kBlockQ, q_end - i0);
      LoadQueryTile(a, b, h, i0, bq, q, d_out, lse, delta, qs, dos, lse_s,
                    delta_s);
      __syncthreads();
      TileGradients(a, b, i0, bq, j0, bk, kBlockKV, qs, dos, ks, vs, lse_s,
                    delta_s, ps, dss);
      __syncthreads();
      // dV += P^T dO; dK += scale dS^T Q.
      for (int64_t idx = threadIdx.x; idx < kBlockKV * dv; idx += kThreads) {
        const int c = static_cast<int>(idx / dv);
        const int64_t e = idx % dv;
        float sum = 0.0f;
        for (int r = 0; r < bq; ++r) sum += ps[r * kBlockKV + c] * dos[r * dv + e];
        dv_acc[idx] += sum;
      }
      for (int64_t idx = threadIdx.x; idx < kBlockKV * dh; idx += kThreads) {
        const int c = static_cast<int>(idx / dh);
        const int64_t e = idx % dh;
        float sum = 0.0f;
        for (int r = 0; r < bq; ++r) sum += dss[r * kBlockKV + c] * qs[r * dh + e];
        dk_acc[idx] += a.scale * sum;
      }
      __syncthreads();
    }
  }
  for (int64_t idx = threadIdx.x; idx < bk * dh; idx += kThreads) {
    const int c = static_cast<int>(idx / dh);
    if (dk != nullptr) dk[KRow(a, b, j0 + c, g, dh) + idx % dh] += dk_acc[idx];
  }
  for (int64_t idx = threadIdx.x; idx < bk * dv; idx += kThreads) {
    const int c = static_cast<int>(idx / dv);
    if (dvg != nullptr) dvg[KRow(a, b, j0 + c, g, dv) + idx % dv] += dv_acc[idx];
  }
}

// Keys per dQ tile: kBlockK, or kBlockKV when the head dims are so wide
// that kBlockK keys would not fit in an H100's 227 KiB of shared memory
// (DiffusionGemma's 512-wide full-attention heads). A function of the dims
// only, so a call's summation order does not depend on the device.
__host__ __device__ __forceinline__ int QueryGradTileK(
    const AttentionLaunch& a) {
  const int64_t dv = a.v_head_dim == 0 ? a.head_dim : a.v_head_dim;
  return a.head_dim > 256 || dv > 256 ? kBlockKV : kBlockK;
}

// dQ of a query tile: one block per (query tile, head, sequence).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    QueryGradKernel(AttentionLaunch a, const T* __restrict__ q,
                    const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ d_out, const float* __restrict__ lse,
                    const float* __restrict__ delta, float* __restrict__ dq) {
  extern __shared__ float smem[];
  const int64_t dh = a.head_dim, dv = Dv(a);
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t g = h / (a.q_heads / a.kv_heads);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockQ;
  const int bq = MinRows(kBlockQ, a.q_len - i0);
  const int tile_k = QueryGradTileK(a);
  float* qs = smem;                        // [kBlockQ][dh]
  float* dos = qs + kBlockQ * dh;          // [kBlockQ][dv]
  float* ks = dos + kBlockQ * dv;          // [tile_k][dh + 1]
  float* vs = ks + tile_k * (dh + 1);      // [tile_k][dv]
  float* ps = vs + tile_k * dv;            // [kBlockQ][tile_k]
  float* dss = ps + kBlockQ * tile_k;      // [kBlockQ][tile_k]
  float* dq_acc = dss + kBlockQ * tile_k;  // [kBlockQ][dh]
  float* lse_s = dq_acc + kBlockQ * dh;    // [kBlockQ]
  float* delta_s = lse_s + kBlockQ;        // [kBlockQ]

  LoadQueryTile(a, b, h, i0, bq, q, d_out, lse, delta, qs, dos, lse_s,
                delta_s);
  for (int64_t idx = threadIdx.x; idx < kBlockQ * dh; idx += kThreads) dq_acc[idx] = 0.0f;
  int64_t k_begin, k_end;
  MaskKeyRange(a.rule, i0 + a.rule.q_offset, i0 + bq - 1 + a.rule.q_offset,
               a.kv_len, &k_begin, &k_end);
  __syncthreads();
  for (int64_t j0 = k_begin; j0 < k_end; j0 += tile_k) {
    const int bk = MinRows(tile_k, k_end - j0);
    LoadKeyTile(a, b, g, j0, bk, tile_k, k, v, ks, vs);
    __syncthreads();
    TileGradients(a, b, i0, bq, j0, bk, tile_k, qs, dos, ks, vs, lse_s, delta_s,
                  ps, dss);
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < kBlockQ * dh; idx += kThreads) {
      const int r = static_cast<int>(idx / dh);
      const int64_t e = idx % dh;
      float sum = 0.0f;
      for (int c = 0; c < bk; ++c) sum += dss[r * tile_k + c] * ks[c * (dh + 1) + e];
      dq_acc[idx] += a.scale * sum;
    }
    __syncthreads();
  }
  for (int64_t idx = threadIdx.x; idx < bq * dh; idx += kThreads) {
    const int r = static_cast<int>(idx / dh);
    dq[QRow(a, b, i0 + r, h, dh) + idx % dh] += dq_acc[idx];
  }
}

size_t ForwardSmem(const AttentionLaunch& a) {
  const int64_t dh = a.head_dim, dv = a.v_head_dim == 0 ? dh : a.v_head_dim;
  return sizeof(float) * (kBlockQ * dh + kBlockK * (dh + 1) + kBlockK * dv +
                          kBlockQ * kBlockK + kBlockQ * dv + 3 * kBlockQ);
}

size_t KeyValueGradSmem(const AttentionLaunch& a) {
  const int64_t dh = a.head_dim, dv = a.v_head_dim == 0 ? dh : a.v_head_dim;
  return sizeof(float) *
         (kBlockKV * (dh + 1) + kBlockKV * dv + kBlockKV * dh + kBlockKV * dv +
          kBlockQ * dh + kBlockQ * dv + 2 * kBlockQ * kBlockKV + 2 * kBlockQ);
}

size_t QueryGradSmem(const AttentionLaunch& a) {
  const int64_t dh = a.head_dim, dv = a.v_head_dim == 0 ? dh : a.v_head_dim;
  const int64_t tile_k = QueryGradTileK(a);
  return sizeof(float) *
         (kBlockQ * dh + kBlockQ * dv + tile_k * (dh + 1) + tile_k * dv +
          2 * kBlockQ * tile_k + kBlockQ * dh + 2 * kBlockQ);
}

template <typename Kernel, typename... Args>
cudaError_t Launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream,
                   Args... args) {
  return LaunchWithSharedMemory(kernel, grid, kThreads, smem, stream, args...);
}

}  // namespace

size_t AttentionSharedMemoryBytes(const AttentionLaunch& a) {
  size_t bytes = ForwardSmem(a);
  if (KeyValueGradSmem(a) > bytes) bytes = KeyValueGradSmem(a);
  if (QueryGradSmem(a) > bytes) bytes = QueryGradSmem(a);
  return bytes;
}

template <typename T>
cudaError_t LaunchAttentionForward(const AttentionLaunch& a, const T* q,
                                   const T* k, const T* v, T* out, float* lse,
                                   cudaStream_t stream) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (AttentionMmaSupports(a, q, k, v, out, nullptr)) {
      return LaunchAttentionMmaForward(a, q, k, v, out, lse, stream);
    }
  }
  const dim3 grid(static_cast<unsigned>((a.q_len + kBlockQ - 1) / kBlockQ),
                  static_cast<unsigned>(a.q_heads),
                  static_cast<unsigned>(a.batch));
  return Launch(ForwardKernel<T>, grid, ForwardSmem(a), stream, a, q, k, v,
                out, lse);
}

template <typename T>
cudaError_t LaunchAttentionBackward(const AttentionLaunch& a, const T* q,
                                    const T* k, const T* v, const T* out,
                                    const float* lse, const T* d_out, float* dq,
                                    float* dk, float* dv, float* d_sinks,
                                    float* delta, float* sink_part,
                                    cudaStream_t stream) {
  const int64_t rows = a.batch * a.q_heads * a.q_len;
  const bool sinks = a.sinks != nullptr && d_sinks != nullptr;
  const unsigned delta_blocks =
      static_cast<unsigned>((rows + kThreads / 32 - 1) / (kThreads / 32));
  DeltaKernel<T><<<delta_blocks, kThreads, 0, stream>>>(
      a, out, d_out, lse, delta, sinks ? sink_part : nullptr);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  if (sinks) {
    SinkReduceKernel<<<static_cast<unsigned>(a.q_heads), kThreads, 0,
                       stream>>>(a, sink_part, d_sinks);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (AttentionMmaSupports(a, q, k, v, out, d_out)) {
      return LaunchAttentionMmaBackward(a, q, k, v, d_out, lse, delta, dq, dk,
                                        dv, stream);
    }
  }
  if ((dk != nullptr || dv != nullptr) && a.kv_len > 0) {
    const dim3 grid(
        static_cast<unsigned>((a.kv_len + kBlockKV - 1) / kBlockKV),
        static_cast<unsigned>(a.kv_heads), static_cast<unsigned>(a.batch));
    error = Launch(KeyValueGradKernel<T>, grid, KeyValueGradSmem(a), stream, a,
                   q, k, v, d_out, lse, static_cast<const float*>(delta), dk,
                   dv);
    if (error != cudaSuccess) return error;
  }
  if (dq != nullptr && a.kv_len > 0) {
    const dim3 grid(static_cast<unsigned>((a.q_len + kBlockQ - 1) / kBlockQ),
                    static_cast<unsigned>(a.q_heads),
                    static_cast<unsigned>(a.batch));
    error = Launch(QueryGradKernel<T>, grid, QueryGradSmem(a), stream, a, q, k,
                   v, d_out, lse, static_cast<const float*>(delta), dq);
  }
  return error;
}

template cudaError_t LaunchAttentionForward<float>(const AttentionLaunch&,
                                                   const float*, const float*,
                                                   const float*, float*,
                                                   float*, cudaStream_t);
template cudaError_t LaunchAttentionForward<uint16_t>(
    const AttentionLaunch&, const uint16_t*, const uint16_t*, const uint16_t*,
    uint16_t*, float*, cudaStream_t);
template cudaError_t LaunchAttentionBackward<float>(
    const AttentionLaunch&, const float*, const float*, const float*,
    const float*, const float*, const float*, float*, float*, float*, float*,
    float*, float*, cudaStream_t);
template cudaError_t LaunchAttentionBackward<uint16_t>(
    const AttentionLaunch&, const uint16_t*, const uint16_t*, const uint16_t*,
    const uint16_t*, const float*, const uint16_t*, float*, float*, float*,
    float*, float*, float*, cudaStream_t);

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
