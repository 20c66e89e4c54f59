// Tensor-core attention for bf16 storage and head dims 64 and 128 (q, k and
// v the same width): FlashAttention-2's schedule on mma.sync m16n8k16 (bf16
// operands, fp32 accumulation). Every mask of attention_mask.h, sinks, GQA
// and q_offset, with the generic kernels' semantics (attention_kernels.cu),
// which remain the path for everything else. attention_test.cc derives the
// tolerance; docs/performance.md has the measurements.
//
// Each warp owns 16 rows of a tile. The accumulator layout of m16n8k16
// (lane = 4 * gr + qd: rows gr and gr + 8, columns 2 * qd and 2 * qd + 1 of
// each 8-wide n-tile) is also the A-operand layout of the next product, so
// probabilities and dS never leave registers; they are rounded to bf16 on
// the way in (the one rounding the generic path does not have). Operands
// read as B come from row-major tiles in shared memory: as aligned 32-bit
// loads where B's n is the tile's row (K in Q K^T, dO in dO V^T), through
// ldmatrix's transpose where B's k is (V, dO, Q and K in the products with
// P, P^T, dS^T and dS).
//
// Deterministic: fixed loops, each output element owned by one thread, no
// atomics. Forward: one block per (64 queries, head, sequence). Backward:
// dK/dV per (64 keys, kv head, sequence), looping over the query heads of
// the group; dQ per (64 queries, head, sequence).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention_kernels.h"
#include "kernels/cuda/device_math.h"
#include "kernels/cuda/kernel_launch.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // rows (queries or keys) per block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// D += A B, A 16x16 (row), B 16x8 (col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void Mma(float* d, const uint32_t* a, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16Bits(lo)) |
         (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16);
}

__device__ __forceinline__ uint32_t Load32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// The B fragment (k 16 x n 8) of a product whose B is stored row-major by k
// in shared memory ([k][n], `stride` elements per row): rows k0 .. k0 + 15
// at columns n0 .. n0 + 7, through ldmatrix's transpose (lanes 0-15 give the
// rows' addresses; 16-31 repeat them).
__device__ __forceinline__ void LoadBTrans(const uint16_t* base, int stride,
                                           int k0, int n0, int lane,
                                           uint32_t* b0, uint32_t* b1) {
  const uint16_t* row = base + (k0 + (lane & 15)) * stride + n0;
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(*b0), "=r"(*b1)
               : "r"(addr));
}

// The A fragment of k-step `kt` of rows `row0 + [0, 16)` of a row-major
// bf16 matrix with `stride` elements per row (global or shared memory);
// rows at or past `rows` read as zero.
__device__ __forceinline__ void LoadA(const uint16_t* base, int64_t stride,
                                      int row0, int rows, int kt, int gr,
                                      int qd, uint32_t* a) {
  const int c = kt * 16 + 2 * qd;
  const bool r0 = row0 + gr < rows, r1 = row0 + gr + 8 < rows;
  const uint16_t* p0 = base + static_cast<int64_t>(row0 + gr) * stride + c;
  const uint16_t* p1 = p0 + 8 * stride;
  a[0] = r0 ? Load32(p0) : 0u;
  a[1] = r1 ? Load32(p1) : 0u;
  a[2] = r0 ? Load32(p0 + 8) : 0u;
  a[3] = r1 ? Load32(p1 + 8) : 0u;
}

// A fragments of the product's left operand from two accumulator n-tiles
// (columns 16 kt .. 16 kt + 15), rounded to bf16.
__device__ __forceinline__ void AccToA(const float* lo, const float* hi,
                                       uint32_t* a) {
  a[0] = Pack(lo[0], lo[1]);
  a[1] = Pack(lo[2], lo[3]);
  a[2] = Pack(hi[0], hi[1]);
  a[3] = Pack(hi[2], hi[3]);
}

// Whether every (query position, key) pair of the tile is visible and in
// range, so the per-element mask can be skipped.
__device__ __forceinline__ bool TileAllVisible(const MaskRule& r, int64_t p0,
                                               int64_t p1, int64_t j0,
                                               int64_t j1) {
  switch (r.mask) {
    case AttentionMask::kBidirectional:
      return true;
    case AttentionMask::kCausal:
      return j1 <= p0;
    case AttentionMask::kSlidingWindow:
      return j1 <= p0 && p1 - j0 < r.window;
    case AttentionMask::kBlockCausal:
      return j1 / r.block <= p0 / r.block;
  }
  return false;
}

// Copies rows [row0, row0 + kTile) (those below `rows`; the rest zero) of a
// [.., heads, D] bf16 tensor at head `head` of sequence `b` (len rows per
// sequence) into shared memory, row-major with stride D + 8 (16-byte
// vectors; consecutive threads take consecutive chunks of a row).
template <int D, int kTile>
__device__ __forceinline__ void LoadTile(const uint16_t* src, int64_t b,
                                         int64_t len, int64_t heads,
                                         int64_t head, int64_t row0,
                                         int64_t rows, uint16_t* rm) {
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < kTile * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c8 = idx % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row0 + r < rows) {
      v = *reinterpret_cast<const uint4*>(
          src + ((b * len + row0 + r) * heads + head) * D + c8 * 8);
    }
    *reinterpret_cast<uint4*>(rm + r * (D + 8) + c8 * 8) = v;
  }
}

// ---------------------------------------------------------------------------
// Forward.

template <int D>
__global__ void __launch_bounds__(kThreads)
    MmaForwardKernel(AttentionLaunch a, const uint16_t* __restrict__ q,
                     const uint16_t* __restrict__ k,
                     const uint16_t* __restrict__ v, uint16_t* __restrict__ out,
                     float* __restrict__ lse) {
  constexpr int kBK = 64;
  extern __shared__ __align__(16) uint16_t smem_fwd[];
  uint16_t* ks = smem_fwd;            // [kBK][D + 8]
  uint16_t* vs = ks + kBK * (D + 8);  // [kBK][D + 8]
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t g = h / (a.q_heads / a.kv_heads);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, qd = lane & 3;
  const int64_t row0 = i0 + warp * 16;  // this warp's first query

  // Q fragments straight from global memory (read once).
  uint32_t qa[D / 16][4];
  {
    const uint16_t* base = q + ((b * a.q_len + row0) * a.q_heads + h) * D;
    const int rows_left = static_cast<int>(
        a.q_len - row0 < 16 ? (a.q_len - row0 > 0 ? a.q_len - row0 : 0) : 16);
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      LoadA(base, a.q_heads * D, 0, rows_left, kt, gr, qd, qa[kt]);
    }
  }
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float scale2 = a.scale * kLog2e;
  const int64_t pos[2] = {row0 + gr + a.rule.q_offset,
                          row0 + gr + 8 + a.rule.q_offset};
  const bool row_ok[2] = {row0 + gr < a.q_len, row0 + gr + 8 < a.q_len};
  const int64_t first[2] = {
      row_ok[0] ? PackedFirstKey(a.key_begin, a.q_len, b, row0 + gr) : 0,
      row_ok[1] ? PackedFirstKey(a.key_begin, a.q_len, b, row0 + gr + 8) : 0};

  const int64_t last_row = (i0 + kRows < a.q_len ? i0 + kRows : a.q_len) - 1;
  int64_t k_begin, k_end;
  MaskKeyRange(a.rule, i0 + a.rule.q_offset, last_row + a.rule.q_offset,
               a.kv_len, &k_begin, &k_end);
  const int64_t wp0 = row0 + a.rule.q_offset, wp1 = row0 + 15 + a.rule.q_offset;
  for (int64_t j0 = k_begin; j0 < k_end; j0 += kBK) {
    __syncthreads();  // the previous tile is consumed
    LoadTile<D, kBK>(k, b, a.kv_len, a.kv_heads, g, j0, k_end, ks);
    LoadTile<D, kBK>(v, b, a.kv_len, a.kv_heads, g, j0, k_end, vs);
    __syncthreads();
    float s[kBK / 8][4];
#pragma unroll
    for (int n = 0; n < kBK / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const uint16_t* kr = ks + (n * 8 + gr) * (D + 8) + 2 * qd;
#pragma unroll
      for (int kt = 0; kt < D / 16; ++kt) {
        Mma(s[n], qa[kt], Load32(kr + kt * 16), Load32(kr + kt * 16 + 8));
      }
    }
    const bool full = a.key_begin == nullptr && row0 + 15 < a.q_len &&
                      j0 + kBK <= k_end &&
                      TileAllVisible(a.rule, wp0, wp1, j0, j0 + kBK - 1);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kBK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int64_t j = j0 + n * 8 + 2 * qd + (e & 1);
        float x = s[n][e] * scale2;
        if (!full && !(row_ok[r] && j < k_end &&
                       MaskAllowsFrom(a.rule, pos[r], j, first[r]))) {
          x = -INFINITY;
        }
        s[n][e] = x;
        tile_max[r] = fmaxf(tile_max[r], x);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] =
          fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
      tile_max[r] =
          fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
    }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], tile_max[r]);
      corr[r] = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int n = 0; n < kBK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[r]);
        s[n][e] = p;
        l[r] += p;
      }
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr[0];
      o[n][1] *= corr[0];
      o[n][2] *= corr[1];
      o[n][3] *= corr[1];
    }
#pragma unroll
    for (int kt = 0; kt < kBK / 16; ++kt) {
      uint32_t pa[4];
      AccToA(s[2 * kt], s[2 * kt + 1], pa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        LoadBTrans(vs, D + 8, kt * 16, n * 8, lane, &b0, &b1);
        Mma(o[n], pa, b0, b1);
      }
    }
  }

  // Row sums over the quad; the sink joins the denominator only.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 1);
    l[r] += __shfl_xor_sync(0xFFFFFFFFu, l[r], 2);
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (a.sinks != nullptr) {
      const float sink = a.sinks[h] * kLog2e;
      const float m_new = fmaxf(m[r], sink);
      const float c = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - m_new);
      l[r] = l[r] * c + exp2f(sink - m_new);
      inv[r] = c;
      m[r] = m_new;
    } else {
      inv[r] = 1.0f;
    }
    inv[r] = l[r] > 0.0f ? inv[r] / l[r] : 0.0f;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_ok[r]) continue;
    const int64_t i = row0 + gr + 8 * r;
    uint16_t* dst = out + ((b * a.q_len + i) * a.q_heads + h) * D + 2 * qd;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + n * 8) =
          Pack(o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r]);
    }
    if (qd == 0) {
      lse[(b * a.q_heads + h) * a.q_len + i] =
          l[r] > 0.0f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------
// Backward: dK and dV. Each warp owns 16 keys; query tiles of kBQ rows.

// Keeps the accumulators in registers at D = 128.
template <int D>
constexpr int kBackwardTile = D <= 64 ? 64 : 32;

template <int D>
__global__ void __launch_bounds__(kThreads)
    MmaKeyValueGradKernel(AttentionLaunch a, const uint16_t* __restrict__ q,
                          const uint16_t* __restrict__ k,
                          const uint16_t* __restrict__ v,
                          const uint16_t* __restrict__ d_out,
                          const float* __restrict__ lse,
                          const float* __restrict__ delta,
                          float* __restrict__ dk, float* __restrict__ dv) {
  constexpr int kBQ = kBackwardTile<D>;
  extern __shared__ __align__(16) uint16_t smem_kv[];
  uint16_t* kb = smem_kv;               // [kRows][D + 8]
  uint16_t* vb = kb + kRows * (D + 8);  // [kRows][D + 8]
  uint16_t* qs = vb + kRows * (D + 8);  // [kBQ][D + 8]
  uint16_t* dos = qs + kBQ * (D + 8);   // [kBQ][D + 8]
  float* lse_s = reinterpret_cast<float*>(dos + kBQ * (D + 8));  // [kBQ]
  float* delta_s = lse_s + kBQ;                                  // [kBQ]
  const int64_t b = blockIdx.z, g = blockIdx.y;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, qd = lane & 3;
  const int64_t group = a.q_heads / a.kv_heads;
  const float scale2 = a.scale * kLog2e;

  LoadTile<D, kRows>(k, b, a.kv_len, a.kv_heads, g, j0, a.kv_len, kb);
  LoadTile<D, kRows>(v, b, a.kv_len, a.kv_heads, g, j0, a.kv_len, vb);
  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.0f;
  }
  const int64_t last_key = (j0 + kRows < a.kv_len ? j0 + kRows : a.kv_len) - 1;
  int64_t q_begin, q_end;
  MaskQueryRange(a.rule, j0, last_key, a.q_len, &q_begin, &q_end);
  const int64_t key[2] = {j0 + warp * 16 + gr, j0 + warp * 16 + gr + 8};
  const int64_t wk0 = j0 + warp * 16, wk1 = wk0 + 15;

  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    for (int64_t i0 = q_begin; i0 < q_end; i0 += kBQ) {
      __syncthreads();  // the previous query tile is consumed
      LoadTile<D, kBQ>(q, b, a.q_len, a.q_heads, h, i0, q_end, qs);
      LoadTile<D, kBQ>(d_out, b, a.q_len, a.q_heads, h, i0, q_end, dos);
      for (int r = threadIdx.x; r < kBQ; r += kThreads) {
        const int64_t row = (b * a.q_heads + h) * a.q_len + i0 + r;
        const bool ok = i0 + r < q_end;
        lse_s[r] = ok ? lse[row] * kLog2e : INFINITY;
        delta_s[r] = ok ? delta[row] : 0.0f;
      }
      __syncthreads();
      // S^T and dP^T: 16 keys x kBQ queries per warp.
      float s[kBQ / 8][4], dp[kBQ / 8][4];
#pragma unroll
      for (int n = 0; n < kBQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
      }
#pragma unroll
      for (int kt = 0; kt < D / 16; ++kt) {
        uint32_t ka[4], va[4];
        LoadA(kb, D + 8, warp * 16, kRows, kt, gr, qd, ka);
        LoadA(vb, D + 8, warp * 16, kRows, kt, gr, qd, va);
#pragma unroll
        for (int n = 0; n < kBQ / 8; ++n) {
          const uint16_t* qr = qs + (n * 8 + gr) * (D + 8) + kt * 16 + 2 * qd;
          Mma(s[n], ka, Load32(qr), Load32(qr + 8));
          const uint16_t* dr = dos + (n * 8 + gr) * (D + 8) + kt * 16 + 2 * qd;
          Mma(dp[n], va, Load32(dr), Load32(dr + 8));
        }
      }
      const bool full =
          a.key_begin == nullptr && i0 + kBQ <= q_end && wk1 < a.kv_len &&
          TileAllVisible(a.rule, i0 + a.rule.q_offset,
                         i0 + kBQ - 1 + a.rule.q_offset, wk0, wk1);
      // P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - delta).
#pragma unroll
      for (int n = 0; n < kBQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qc = n * 8 + 2 * qd + (e & 1);
          const int64_t j = key[e >> 1];
          float p = 0.0f;
          if (full ||
              (i0 + qc < q_end && j < a.kv_len &&
               MaskAllowsFrom(
                   a.rule, i0 + qc + a.rule.q_offset, j,
                   PackedFirstKey(a.key_begin, a.q_len, b, i0 + qc)))) {
            if (lse_s[qc] != -INFINITY) p = exp2f(s[n][e] * scale2 - lse_s[qc]);
          }
          s[n][e] = p;
          dp[n][e] = p * (dp[n][e] - delta_s[qc]);
        }
      }
      // dV += P^T dO, dK += dS^T Q.
#pragma unroll
      for (int kt = 0; kt < kBQ / 16; ++kt) {
        uint32_t pa[4], sa[4];
        AccToA(s[2 * kt], s[2 * kt + 1], pa);
        AccToA(dp[2 * kt], dp[2 * kt + 1], sa);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          uint32_t b0, b1;
          LoadBTrans(dos, D + 8, kt * 16, n * 8, lane, &b0, &b1);
          Mma(dva[n], pa, b0, b1);
          LoadBTrans(qs, D + 8, kt * 16, n * 8, lane, &b0, &b1);
          Mma(dka[n], sa, b0, b1);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= a.kv_len) continue;
    const int64_t at = ((b * a.kv_len + key[r]) * a.kv_heads + g) * D + 2 * qd;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      if (dk != nullptr) {
        dk[at + n * 8] += a.scale * dka[n][2 * r];
        dk[at + n * 8 + 1] += a.scale * dka[n][2 * r + 1];
      }
      if (dv != nullptr) {
        dv[at + n * 8] += dva[n][2 * r];
        dv[at + n * 8 + 1] += dva[n][2 * r + 1];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward: dQ. Each warp owns 16 queries; key tiles of kBK keys.

template <int D>
__global__ void __launch_bounds__(kThreads)
    MmaQueryGradKernel(AttentionLaunch a, const uint16_t* __restrict__ q,
                       const uint16_t* __restrict__ k,
                       const uint16_t* __restrict__ v,
                       const uint16_t* __restrict__ d_out,
                       const float* __restrict__ lse,
                       const float* __restrict__ delta,
                       float* __restrict__ dq) {
  constexpr int kBK = kBackwardTile<D>;
  extern __shared__ __align__(16) uint16_t smem_q[];
  uint16_t* ks = smem_q;              // [kBK][D + 8]
  uint16_t* vs = ks + kBK * (D + 8);  // [kBK][D + 8]
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t g = h / (a.q_heads / a.kv_heads);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, qd = lane & 3;
  const int64_t row0 = i0 + warp * 16;
  const float scale2 = a.scale * kLog2e;

  uint32_t qa[D / 16][4], da[D / 16][4];
  {
    const int64_t stride = a.q_heads * D;
    const int64_t at = ((b * a.q_len + row0) * a.q_heads + h) * D;
    const int rows_left = static_cast<int>(
        a.q_len - row0 < 16 ? (a.q_len - row0 > 0 ? a.q_len - row0 : 0) : 16);
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      LoadA(q + at, stride, 0, rows_left, kt, gr, qd, qa[kt]);
      LoadA(d_out + at, stride, 0, rows_left, kt, gr, qd, da[kt]);
    }
  }
  const bool row_ok[2] = {row0 + gr < a.q_len, row0 + gr + 8 < a.q_len};
  const int64_t pos[2] = {row0 + gr + a.rule.q_offset,
                          row0 + gr + 8 + a.rule.q_offset};
  const int64_t first[2] = {
      row_ok[0] ? PackedFirstKey(a.key_begin, a.q_len, b, row0 + gr) : 0,
      row_ok[1] ? PackedFirstKey(a.key_begin, a.q_len, b, row0 + gr + 8) : 0};
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = (b * a.q_heads + h) * a.q_len + row0 + gr + 8 * r;
    lse2[r] = row_ok[r] ? lse[row] * kLog2e : INFINITY;
    dl[r] = row_ok[r] ? delta[row] : 0.0f;
  }
  float dqa[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
    dqa[n][0] = dqa[n][1] = dqa[n][2] = dqa[n][3] = 0.0f;

  const int64_t last_row = (i0 + kRows < a.q_len ? i0 + kRows : a.q_len) - 1;
  int64_t k_begin, k_end;
  MaskKeyRange(a.rule, i0 + a.rule.q_offset, last_row + a.rule.q_offset,
               a.kv_len, &k_begin, &k_end);
  const int64_t wp0 = row0 + a.rule.q_offset, wp1 = row0 + 15 + a.rule.q_offset;
  for (int64_t j0 = k_begin; j0 < k_end; j0 += kBK) {
    __syncthreads();
    LoadTile<D, kBK>(k, b, a.kv_len, a.kv_heads, g, j0, k_end, ks);
    LoadTile<D, kBK>(v, b, a.kv_len, a.kv_heads, g, j0, k_end, vs);
    __syncthreads();
    float s[kBK / 8][4], dp[kBK / 8][4];
#pragma unroll
    for (int n = 0; n < kBK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
      const uint16_t* kr = ks + (n * 8 + gr) * (D + 8) + 2 * qd;
      const uint16_t* vr = vs + (n * 8 + gr) * (D + 8) + 2 * qd;
#pragma unroll
      for (int kt = 0; kt < D / 16; ++kt) {
        Mma(s[n], qa[kt], Load32(kr + kt * 16), Load32(kr + kt * 16 + 8));
        Mma(dp[n], da[kt], Load32(vr + kt * 16), Load32(vr + kt * 16 + 8));
      }
    }
    const bool full = a.key_begin == nullptr && row0 + 15 < a.q_len &&
                      j0 + kBK <= k_end &&
                      TileAllVisible(a.rule, wp0, wp1, j0, j0 + kBK - 1);
#pragma unroll
    for (int n = 0; n < kBK / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int64_t j = j0 + n * 8 + 2 * qd + (e & 1);
        float p = 0.0f;
        if (full || (row_ok[r] && j < k_end &&
                     MaskAllowsFrom(a.rule, pos[r], j, first[r]))) {
          if (lse2[r] != -INFINITY) p = exp2f(s[n][e] * scale2 - lse2[r]);
        }
        dp[n][e] = p * (dp[n][e] - dl[r]);
      }
    }
#pragma unroll
    for (int kt = 0; kt < kBK / 16; ++kt) {
      uint32_t sa[4];
      AccToA(dp[2 * kt], dp[2 * kt + 1], sa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        LoadBTrans(ks, D + 8, kt * 16, n * 8, lane, &b0, &b1);
        Mma(dqa[n], sa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!row_ok[r]) continue;
    float* dst =
        dq + ((b * a.q_len + row0 + gr + 8 * r) * a.q_heads + h) * D + 2 * qd;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      dst[n * 8] += a.scale * dqa[n][2 * r];
      dst[n * 8 + 1] += a.scale * dqa[n][2 * r + 1];
    }
  }
}

template <int D>
size_t ForwardBytes() {
  return sizeof(uint16_t) * 2 * 64 * (D + 8);
}
template <int D>
size_t KeyValueGradBytes() {
  constexpr int kBQ = kBackwardTile<D>;
  return sizeof(uint16_t) * (2 * kRows * (D + 8) + 2 * kBQ * (D + 8)) +
         2 * sizeof(float) * kBQ;
}
template <int D>
size_t QueryGradBytes() {
  constexpr int kBK = kBackwardTile<D>;
  return sizeof(uint16_t) * 2 * kBK * (D + 8);
}

template <typename Kernel, typename... Args>
cudaError_t Launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream,
                   Args... args) {
  return LaunchWithSharedMemory(kernel, grid, kThreads, smem, stream, args...);
}

dim3 QueryGrid(const AttentionLaunch& a) {
  return dim3(static_cast<unsigned>((a.q_len + kRows - 1) / kRows),
              static_cast<unsigned>(a.q_heads), static_cast<unsigned>(a.batch));
}

template <int D>
cudaError_t Forward(const AttentionLaunch& a, const uint16_t* q,
                    const uint16_t* k, const uint16_t* v, uint16_t* out,
                    float* lse, cudaStream_t stream) {
  return Launch(MmaForwardKernel<D>, QueryGrid(a), ForwardBytes<D>(), stream, a,
                q, k, v, out, lse);
}

template <int D>
cudaError_t Backward(const AttentionLaunch& a, const uint16_t* q,
                     const uint16_t* k, const uint16_t* v,
                     const uint16_t* d_out, const float* lse,
                     const float* delta, float* dq, float* dk, float* dv,
                     cudaStream_t stream) {
  if (dk != nullptr || dv != nullptr) {
    const dim3 grid(static_cast<unsigned>((a.kv_len + kRows - 1) / kRows),
                    static_cast<unsigned>(a.kv_heads),
                    static_cast<unsigned>(a.batch));
    const cudaError_t error =
        Launch(MmaKeyValueGradKernel<D>, grid, KeyValueGradBytes<D>(), stream,
               a, q, k, v, d_out, lse, delta, dk, dv);
    if (error != cudaSuccess) return error;
  }
  if (dq == nullptr) return cudaSuccess;
  return Launch(MmaQueryGradKernel<D>, QueryGrid(a), QueryGradBytes<D>(),
                stream, a, q, k, v, d_out, lse, delta, dq);
}

bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

bool AttentionMmaSupports(const AttentionLaunch& a, const void* q,
                          const void* k, const void* v, const void* o,
                          const void* d_out) {
  const int64_t dv = a.v_head_dim == 0 ? a.head_dim : a.v_head_dim;
  return (a.head_dim == 64 || a.head_dim == 128) && dv == a.head_dim &&
         a.kv_len > 0 && Aligned16(q) && Aligned16(k) && Aligned16(v) &&
         Aligned16(o) && (d_out == nullptr || Aligned16(d_out));
}

cudaError_t LaunchAttentionMmaForward(const AttentionLaunch& a,
                                      const uint16_t* q, const uint16_t* k,
                                      const uint16_t* v, uint16_t* out,
                                      float* lse, cudaStream_t stream) {
  return a.head_dim == 64 ? Forward<64>(a, q, k, v, out, lse, stream)
                          : Forward<128>(a, q, k, v, out, lse, stream);
}

cudaError_t LaunchAttentionMmaBackward(const AttentionLaunch& a,
                                       const uint16_t* q, const uint16_t* k,
                                       const uint16_t* v, const uint16_t* d_out,
                                       const float* lse, const float* delta,
                                       float* dq, float* dk, float* dv,
                                       cudaStream_t stream) {
  return a.head_dim == 64
             ? Backward<64>(a, q, k, v, d_out, lse, delta, dq, dk, dv, stream)
             : Backward<128>(a, q, k, v, d_out, lse, delta, dq, dk, dv, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
