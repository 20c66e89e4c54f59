// Device kernels of the CUDA grouped experts; see grouped_experts_kernels.h.
// Plain CUDA C++ (no absl): the host wrappers in grouped_experts.cc turn the
// returned cudaError_t into absl::Status.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/gate_element.h"
#include "kernels/cuda/grouped_experts_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace internal {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
// Caps grid-stride grids; every kernel loops over the rest.
constexpr int64_t kMaxBlocks = int64_t{1} << 18;

int GridFor(int64_t items, int64_t per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & uintptr_t{15}) == 0;
}

// ---------------------------------------------------------------------------
// Element types: storage is fp32 or bf16, arithmetic is fp32.

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  // kernels/cpu/bf16.h's rounding (nearest even; a NaN keeps its sign and
  // payload, where __float2bfloat16_rn would make it canonical).
  __nv_bfloat16_raw raw;
  raw.x = Fp32ToBf16(v);
  return __nv_bfloat16(raw);
}

// kVec elements moved as one (up to 16-byte) load or store.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// 16 bytes per access when the row length and the pointers allow it.
template <typename T>
constexpr int kWideVec = 16 / static_cast<int>(sizeof(T));

// The gates (SiluGate, GeluTanhGate, ProductGate, ClampedSwiGluGate) are
// kernels/cpu/gate_element.h: the CPU kernel's arithmetic, operation for
// operation.

// ---------------------------------------------------------------------------
// Block-wide helpers (blockDim.x a multiple of 32, at most 1024).

__device__ __forceinline__ int32_t WarpInclusiveScan(int32_t v) {
  const int lane = threadIdx.x & 31;
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t other = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += other;
  }
  return v;
}

// Exclusive prefix of `value` over the threads of the block, in thread
// order; *total gets the block sum. scratch: 33 ints of shared memory.
__device__ int32_t BlockExclusiveScan(int32_t value, int32_t* scratch,
                                      int32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int32_t inclusive = WarpInclusiveScan(value);
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = lane < warps ? scratch[lane] : 0;
    const int32_t w_inclusive = WarpInclusiveScan(w);
    scratch[lane] = w_inclusive - w;
    if (lane == 31) scratch[32] = w_inclusive;
  }
  __syncthreads();
  const int32_t result = scratch[warp] + inclusive - value;
  *total = scratch[32];
  __syncthreads();  // scratch may be reused right away
  return result;
}

// Sum over the block in a fixed order (same result every run); valid in
// thread 0. scratch: 32 floats of shared memory.
__device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float sum = 0.0f;
  if (warp == 0) {
    sum = lane < warps ? scratch[lane] : 0.0f;
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(kFullMask, sum, d);
  }
  __syncthreads();
  return sum;
}

// ---------------------------------------------------------------------------
// Routing: a stable counting sort of the T*K assignments by expert.
//   count: per-chunk histograms (shared-memory atomics only count, so they
//          cannot reorder anything);
//   scan:  per-expert exclusive scan over chunks, then over experts;
//   place: within a chunk, slots are ranked in slot order: a warp ranks its
//          32 slots with __match_any_sync, and the warps of a block take
//          turns on the shared per-expert cursors.

constexpr int kCountThreads = 256;
constexpr int kScanThreads = 1024;
constexpr int kPlaceThreads = 256;

__global__ void RoutingCountKernel(const int32_t* __restrict__ indices,
                                   const bool* __restrict__ token_mask,
                                   int64_t slots, int64_t top_k, int experts,
                                   int32_t* __restrict__ chunk_counts,
                                   uint32_t* status) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kRoutingChunk;
  const int64_t end =
      begin + kRoutingChunk < slots ? begin + kRoutingChunk : slots;
  for (int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
    if (token_mask != nullptr && !token_mask[s / top_k]) continue;
    const int32_t e = indices[s];
    if (e < 0 || e >= experts) {
      atomicMin(status, static_cast<uint32_t>(s));
      continue;
    }
    atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) out[e] = hist[e];
}

__global__ void RoutingScanKernel(int32_t* __restrict__ chunk_counts,
                                  int64_t chunks, int experts,
                                  int32_t* __restrict__ expert_rows,
                                  int32_t* __restrict__ offsets,
                                  int32_t* __restrict__ nonempty_experts) {
  extern __shared__ int32_t rows[];  // [experts]
  __shared__ int32_t scratch[33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  // One warp per expert scans that expert's column over the chunks.
  for (int e = warp; e < experts; e += warps) {
    int32_t carry = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += 32) {
      const int64_t c = c0 + lane;
      int32_t* cell = chunk_counts + c * experts + e;
      const int32_t v = c < chunks ? *cell : 0;
      const int32_t inclusive = WarpInclusiveScan(v);
      if (c < chunks) *cell = carry + inclusive - v;
      carry += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (lane == 0) {
      rows[e] = carry;
      expert_rows[e] = carry;
    }
  }
  __syncthreads();
  // Then the whole block scans the totals; each thread owns a contiguous
  // run of experts so the order stays ascending.
  const int per_thread = (experts + blockDim.x - 1) / blockDim.x;
  const int first = threadIdx.x * per_thread;
  int32_t row_sum = 0, group_sum = 0;
  for (int i = 0; i < per_thread; ++i) {
    const int e = first + i;
    if (e < experts) {
      row_sum += rows[e];
      group_sum += rows[e] > 0 ? 1 : 0;
    }
  }
  int32_t total_rows = 0, total_groups = 0;
  int32_t row_prefix = BlockExclusiveScan(row_sum, scratch, &total_rows);
  int32_t group_prefix = BlockExclusiveScan(group_sum, scratch, &total_groups);
  for (int i = 0; i < per_thread; ++i) {
    const int e = first + i;
    if (e >= experts) break;
    offsets[e] = row_prefix;
    row_prefix += rows[e];
    if (rows[e] > 0) nonempty_experts[group_prefix++] = e;
  }
  if (threadIdx.x == 0) offsets[experts] = total_rows;
}

__global__ void RoutingPlaceKernel(
    const int32_t* __restrict__ indices, const bool* __restrict__ token_mask,
    const float* __restrict__ weights, int64_t slots, int64_t top_k,
    int experts, const int32_t* __restrict__ chunk_bases,
    const int32_t* __restrict__ offsets, int32_t* __restrict__ row_of_slot,
    int32_t* __restrict__ row_token, float* __restrict__ row_weight) {
  extern __shared__ int32_t next_row[];  // [experts]
  const int64_t chunk = blockIdx.x;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    next_row[e] = offsets[e] + chunk_bases[chunk * experts + e];
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  const int64_t begin = chunk * kRoutingChunk;
  const int64_t end =
      begin + kRoutingChunk < slots ? begin + kRoutingChunk : slots;
  // The trip count is the same for every thread of the block, so the
  // __syncthreads below are reached uniformly.
  for (int64_t round = begin; round < end; round += blockDim.x) {
    const int64_t s = round + threadIdx.x;
    int32_t e = -1;
    int64_t t = 0;
    if (s < end) {
      t = s / top_k;
      if (token_mask == nullptr || token_mask[t]) {
        const int32_t idx = indices[s];
        if (idx >= 0 && idx < experts) e = idx;
      }
    }
    // Lanes of this warp routed to the same expert (including e = -1).
    const unsigned peers = __match_any_sync(kFullMask, e);
    int32_t row = -1;
    for (int w = 0; w < warps; ++w) {
      __syncthreads();  // the previous warp's cursor updates are visible
      if (warp == w) {
        const int32_t base = e >= 0 ? next_row[e] : 0;
        __syncwarp();  // every peer has read the cursor before it moves
        if (e >= 0) {
          row = base + __popc(peers & lanes_below);
          if ((peers & lanes_below) == 0) next_row[e] = base + __popc(peers);
        }
      }
    }
    if (s < end) {
      row_of_slot[s] = row;
      if (row >= 0) {
        row_token[row] = static_cast<int32_t>(t);
        row_weight[row] = weights[s];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Row movement.

template <typename T, int kVec>
__global__ void GatherRowsKernel(const T* __restrict__ src,
                                 const int32_t* __restrict__ row_of_slot,
                                 int64_t slots, int64_t top_k, int64_t dim,
                                 T* __restrict__ dst) {
  using P = Pack<T, kVec>;
  const int64_t packs = dim / kVec;
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {
    const int32_t row = row_of_slot[s];
    if (row < 0) continue;
    const P* in = reinterpret_cast<const P*>(src + (s / top_k) * dim);
    P* out = reinterpret_cast<P*>(dst + static_cast<int64_t>(row) * dim);
    for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) out[j] = in[j];
  }
}

template <typename T, int kVec>
__global__ void CombineRowsKernel(const T* __restrict__ rows,
                                  const int32_t* __restrict__ row_of_slot,
                                  int64_t tokens, int64_t top_k, int64_t dim,
                                  bool accumulate, T* __restrict__ out) {
  using P = Pack<T, kVec>;
  const int64_t packs = dim / kVec;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int32_t* slot_rows = row_of_slot + t * top_k;
    P* dst = reinterpret_cast<P*>(out + t * dim);
    for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) {
      float acc[kVec];
      if (accumulate) {
        const P p = dst[j];
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[v] = ToFloat(p.v[v]);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
      }
      for (int64_t k = 0; k < top_k; ++k) {  // k order: deterministic
        const int32_t row = slot_rows[k];
        if (row < 0) continue;
        const P p = reinterpret_cast<const P*>(
            rows + static_cast<int64_t>(row) * dim)[j];
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[v] += ToFloat(p.v[v]);
      }
      P o;
#pragma unroll
      for (int v = 0; v < kVec; ++v) o.v[v] = FromFloat<T>(acc[v]);
      dst[j] = o;
    }
  }
}

// ---------------------------------------------------------------------------
// Gated activation with the routing weight inside (between up and down).

template <typename T, typename Gate, int kVec>
__global__ void GatedActivationForwardKernel(const Gate gate,
                                             const T* __restrict__ h,
                                             const float* __restrict__ weight,
                                             int64_t rows, int64_t inter,
                                             T* __restrict__ a) {
  using P = Pack<T, kVec>;
  const int64_t packs_per_row = inter / kVec;
  const int64_t total = rows * packs_per_row;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       p < total; p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = p / packs_per_row, j = p - r * packs_per_row;
    const T* gate_row = h + r * 2 * inter;
    const P g = reinterpret_cast<const P*>(gate_row)[j];
    const P u = reinterpret_cast<const P*>(gate_row + inter)[j];
    const float w = weight[r];
    P o;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      o.v[v] = FromFloat<T>(gate.Forward(ToFloat(g.v[v]), ToFloat(u.v[v]), w));
    }
    reinterpret_cast<P*>(a + r * inter)[j] = o;
  }
}

template <typename T, typename Gate, int kVec>
__global__ void GatedActivationBackwardKernel(const Gate gate,
                                              const T* __restrict__ h,
                                              const float* __restrict__ weight,
                                              const T* __restrict__ da,
                                              int64_t rows, int64_t inter,
                                              T* __restrict__ dh,
                                              float* __restrict__ row_dweight) {
  using P = Pack<T, kVec>;
  __shared__ float scratch[32];
  const int64_t packs = inter / kVec;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gate_row = h + r * 2 * inter;
    T* dgate_row = dh + r * 2 * inter;
    const P* g_in = reinterpret_cast<const P*>(gate_row);
    const P* u_in = reinterpret_cast<const P*>(gate_row + inter);
    const P* da_in = reinterpret_cast<const P*>(da + r * inter);
    P* dg_out = reinterpret_cast<P*>(dgate_row);
    P* du_out = reinterpret_cast<P*>(dgate_row + inter);
    const float w = weight[r];
    float partial = 0.0f;
    for (int64_t j = threadIdx.x; j < packs; j += blockDim.x) {
      const P g = g_in[j], u = u_in[j], dav = da_in[j];
      P dg, du;
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        float w_term, dgv, duv;
        gate.Backward(ToFloat(g.v[v]), ToFloat(u.v[v]), ToFloat(dav.v[v]), w,
                      &w_term, &dgv, &duv);
        partial += w_term;
        dg.v[v] = FromFloat<T>(dgv);
        du.v[v] = FromFloat<T>(duv);
      }
      dg_out[j] = dg;
      du_out[j] = du;
    }
    const float sum = BlockSum(partial, scratch);
    if (threadIdx.x == 0) row_dweight[r] = sum;
  }
}

__global__ void SlotValuesKernel(const float* __restrict__ row_values,
                                 const int32_t* __restrict__ row_of_slot,
                                 int64_t slots, float* __restrict__ out) {
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       s < slots; s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t row = row_of_slot[s];
    out[s] = row < 0 ? 0.0f : row_values[row];
  }
}

__device__ __forceinline__ void* OperandPointer(const ExpertOperand& op,
                                                int32_t expert, int32_t row) {
  return const_cast<char*>(static_cast<const char*>(op.base)) +
         static_cast<int64_t>(row) * op.row_stride_bytes +
         static_cast<int64_t>(expert) * op.expert_stride_bytes;
}

__global__ void ExpertGemmPointersKernel(ExpertOperand a, ExpertOperand b,
                                         ExpertOperand c,
                                         const int32_t* nonempty_experts,
                                         const int32_t* offsets, int64_t groups,
                                         void** pointers) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < groups; j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = nonempty_experts[j];
    const int32_t row = offsets[e];
    pointers[j] = OperandPointer(a, e, row);
    pointers[groups + j] = OperandPointer(b, e, row);
    pointers[2 * groups + j] = OperandPointer(c, e, row);
  }
}

// ---------------------------------------------------------------------------
// Typed launch helpers.

template <typename T>
void GatherRowsTyped(const void* src, const int32_t* row_of_slot, int64_t slots,
                     int64_t top_k, int64_t dim, void* dst,
                     cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const int grid = GridFor(slots, 1);
  const T* in = static_cast<const T*>(src);
  T* out = static_cast<T*>(dst);
  if (dim % kVec == 0 && Aligned16(src) && Aligned16(dst)) {
    GatherRowsKernel<T, kVec>
        <<<grid, 128, 0, stream>>>(in, row_of_slot, slots, top_k, dim, out);
  } else {
    GatherRowsKernel<T, 1>
        <<<grid, 128, 0, stream>>>(in, row_of_slot, slots, top_k, dim, out);
  }
}

template <typename T>
void CombineRowsTyped(const void* rows, const int32_t* row_of_slot,
                      int64_t tokens, int64_t top_k, int64_t dim,
                      bool accumulate, void* out, cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const int grid = GridFor(tokens, 1);
  const T* in = static_cast<const T*>(rows);
  T* dst = static_cast<T*>(out);
  if (dim % kVec == 0 && Aligned16(rows) && Aligned16(out)) {
    CombineRowsKernel<T, kVec><<<grid, 128, 0, stream>>>(
        in, row_of_slot, tokens, top_k, dim, accumulate, dst);
  } else {
    CombineRowsKernel<T, 1><<<grid, 128, 0, stream>>>(
        in, row_of_slot, tokens, top_k, dim, accumulate, dst);
  }
}

template <typename T, typename Gate>
void ActivationForwardTyped(const Gate& gate, const void* h,
                            const float* weight, int64_t rows, int64_t inter,
                            void* a, cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const T* in = static_cast<const T*>(h);
  T* out = static_cast<T*>(a);
  if (inter % kVec == 0 && Aligned16(h) && Aligned16(a)) {
    GatedActivationForwardKernel<T, Gate, kVec>
        <<<GridFor(rows * (inter / kVec), 256), 256, 0, stream>>>(
            gate, in, weight, rows, inter, out);
  } else {
    GatedActivationForwardKernel<T, Gate, 1>
        <<<GridFor(rows * inter, 256), 256, 0, stream>>>(gate, in, weight,
                                                         rows, inter, out);
  }
}

template <typename T, typename Gate>
void ActivationBackwardTyped(const Gate& gate, const void* h,
                             const float* weight, const void* da, int64_t rows,
                             int64_t inter, void* dh, float* row_dweight,
                             cudaStream_t stream) {
  constexpr int kVec = kWideVec<T>;
  const T* h_in = static_cast<const T*>(h);
  const T* da_in = static_cast<const T*>(da);
  T* dh_out = static_cast<T*>(dh);
  const int grid = GridFor(rows, 1);
  if (inter % kVec == 0 && Aligned16(h) && Aligned16(da) && Aligned16(dh)) {
    GatedActivationBackwardKernel<T, Gate, kVec><<<grid, 128, 0, stream>>>(
        gate, h_in, weight, da_in, rows, inter, dh_out, row_dweight);
  } else {
    GatedActivationBackwardKernel<T, Gate, 1><<<grid, 128, 0, stream>>>(
        gate, h_in, weight, da_in, rows, inter, dh_out, row_dweight);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

cudaError_t LaunchRoutingCount(const int32_t* indices, const bool* token_mask,
                               int64_t tokens, int64_t top_k, int64_t experts,
                               int32_t* chunk_counts, uint32_t* status,
                               cudaStream_t stream) {
  // 0xFFFFFFFF: no bad index; atomicMin keeps the first one.
  cudaError_t err = cudaMemsetAsync(status, 0xFF, sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const int64_t slots = tokens * top_k;
  if (slots == 0) return cudaSuccess;
  RoutingCountKernel<<<static_cast<unsigned>(RoutingChunks(slots)),
                       kCountThreads, experts * sizeof(int32_t), stream>>>(
      indices, token_mask, slots, top_k, static_cast<int>(experts),
      chunk_counts, status);
  return cudaGetLastError();
}

cudaError_t LaunchRoutingScan(int32_t* chunk_counts, int64_t chunks,
                              int64_t experts, int32_t* expert_rows,
                              int32_t* offsets, int32_t* nonempty_experts,
                              cudaStream_t stream) {
  RoutingScanKernel<<<1, kScanThreads, experts * sizeof(int32_t), stream>>>(
      chunk_counts, chunks, static_cast<int>(experts), expert_rows, offsets,
      nonempty_experts);
  return cudaGetLastError();
}

cudaError_t LaunchRoutingPlace(const int32_t* indices, const bool* token_mask,
                               const float* weights, int64_t tokens,
                               int64_t top_k, int64_t experts,
                               const int32_t* chunk_bases,
                               const int32_t* offsets, int32_t* row_of_slot,
                               int32_t* row_token, float* row_weight,
                               cudaStream_t stream) {
  const int64_t slots = tokens * top_k;
  if (slots == 0) return cudaSuccess;
  RoutingPlaceKernel<<<static_cast<unsigned>(RoutingChunks(slots)),
                       kPlaceThreads, experts * sizeof(int32_t), stream>>>(
      indices, token_mask, weights, slots, top_k, static_cast<int>(experts),
      chunk_bases, offsets, row_of_slot, row_token, row_weight);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(DeviceDtype dtype, const void* src,
                             const int32_t* row_of_slot, int64_t tokens,
                             int64_t top_k, int64_t dim, void* dst,
                             cudaStream_t stream) {
  const int64_t slots = tokens * top_k;
  if (slots == 0 || dim == 0) return cudaSuccess;
  if (dtype == DeviceDtype::kFloat32) {
    GatherRowsTyped<float>(src, row_of_slot, slots, top_k, dim, dst, stream);
  } else {
    GatherRowsTyped<__nv_bfloat16>(src, row_of_slot, slots, top_k, dim, dst,
                                   stream);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCombineRows(DeviceDtype dtype, const void* rows,
                              const int32_t* row_of_slot, int64_t tokens,
                              int64_t top_k, int64_t dim, bool accumulate,
                              void* out, cudaStream_t stream) {
  if (tokens == 0 || dim == 0) return cudaSuccess;
  if (dtype == DeviceDtype::kFloat32) {
    CombineRowsTyped<float>(rows, row_of_slot, tokens, top_k, dim, accumulate,
                            out, stream);
  } else {
    CombineRowsTyped<__nv_bfloat16>(rows, row_of_slot, tokens, top_k, dim,
                                    accumulate, out, stream);
  }
  return cudaGetLastError();
}

// Runs `fn` with the gate object of `gate` and the element type of `dtype`.
template <typename Fn>
void WithGateAndType(DeviceDtype dtype, DeviceGate gate, GateParams params,
                     Fn&& fn) {
  const ClampedSwiGluGate clamped{params.alpha, params.limit};
  if (dtype == DeviceDtype::kFloat32) {
    switch (gate) {
      case DeviceGate::kSilu:
        return fn(float{}, ProductGate<SiluGate>{});
      case DeviceGate::kGeluTanh:
        return fn(float{}, ProductGate<GeluTanhGate>{});
      case DeviceGate::kClampedSilu:
        return fn(float{}, clamped);
    }
  } else {
    switch (gate) {
      case DeviceGate::kSilu:
        return fn(__nv_bfloat16{}, ProductGate<SiluGate>{});
      case DeviceGate::kGeluTanh:
        return fn(__nv_bfloat16{}, ProductGate<GeluTanhGate>{});
      case DeviceGate::kClampedSilu:
        return fn(__nv_bfloat16{}, clamped);
    }
  }
}

cudaError_t LaunchGatedActivationForward(DeviceDtype dtype, DeviceGate gate,
                                         GateParams params, const void* h,
                                         const float* row_weight, int64_t rows,
                                         int64_t inter, void* a,
                                         cudaStream_t stream) {
  if (rows == 0 || inter == 0) return cudaSuccess;
  WithGateAndType(dtype, gate, params, [&](auto type_tag, const auto& g) {
    using T = decltype(type_tag);
    ActivationForwardTyped<T>(g, h, row_weight, rows, inter, a, stream);
  });
  return cudaGetLastError();
}

cudaError_t LaunchGatedActivationBackward(
    DeviceDtype dtype, DeviceGate gate, GateParams params, const void* h,
    const float* row_weight, const void* da, int64_t rows, int64_t inter,
    void* dh, float* row_dweight, cudaStream_t stream) {
  if (rows == 0 || inter == 0) return cudaSuccess;
  WithGateAndType(dtype, gate, params, [&](auto type_tag, const auto& g) {
    using T = decltype(type_tag);
    ActivationBackwardTyped<T>(g, h, row_weight, da, rows, inter, dh,
                               row_dweight, stream);
  });
  return cudaGetLastError();
}

cudaError_t LaunchSlotValues(const float* row_values,
                             const int32_t* row_of_slot, int64_t slots,
                             float* out, cudaStream_t stream) {
  if (slots == 0) return cudaSuccess;
  SlotValuesKernel<<<GridFor(slots, 256), 256, 0, stream>>>(
      row_values, row_of_slot, slots, out);
  return cudaGetLastError();
}

cudaError_t LaunchExpertGemmPointers(ExpertOperand a, ExpertOperand b,
                                     ExpertOperand c,
                                     const int32_t* nonempty_experts,
                                     const int32_t* offsets, int64_t groups,
                                     void** pointers, cudaStream_t stream) {
  if (groups == 0) return cudaSuccess;
  ExpertGemmPointersKernel<<<GridFor(groups, 128), 128, 0, stream>>>(
      a, b, c, nonempty_experts, offsets, groups, pointers);
  return cudaGetLastError();
}

}  // namespace internal
}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
