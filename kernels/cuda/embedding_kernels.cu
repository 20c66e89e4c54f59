#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_math.h"
#include "kernels/cuda/embedding_kernels.h"

namespace shardd {
namespace kernels {
namespace cuda {
namespace {

constexpr int kCopyThreads = 128;
constexpr int kSortThreads = 1024;
constexpr int kAccumulateThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int GridFor(int64_t items) {
  return static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(items, 1), kMaxBlocks));
}

// One block per token (grid-stride): copies the row in `Unit`s (uint4 when
// rows are 16-byte multiples and aligned, else uint32 when 4-byte, else
// bytes).
template <typename Unit>
__global__ void GatherRowsKernel(const Unit* __restrict__ table,
                                 int64_t vocab_size, int64_t row_units,
                                 const int32_t* __restrict__ ids,
                                 int64_t num_tokens, Unit* __restrict__ out,
                                 int32_t* bad_id_count) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t id = ids[t];
    Unit* dst = out + t * row_units;
    if (id < 0 || id >= vocab_size) {
      for (int64_t u = threadIdx.x; u < row_units; u += blockDim.x) {
        dst[u] = Unit{};
      }
      if (threadIdx.x == 0 && bad_id_count != nullptr) {
        atomicAdd(bad_id_count, 1);
      }
      continue;
    }
    const Unit* src = table + static_cast<int64_t>(id) * row_units;
    for (int64_t u = threadIdx.x; u < row_units; u += blockDim.x) {
      dst[u] = src[u];
    }
  }
}

__device__ __forceinline__ int32_t BucketOf(int32_t id, int64_t vocab_size) {
  return id >= 0 && id < vocab_size ? id : static_cast<int32_t>(vocab_size);
}

// Exclusive scan of a block-wide per-thread value (kSortThreads threads).
__device__ int32_t BlockExclusiveScan(int32_t value, int32_t* shared) {
  const int tid = threadIdx.x;
  shared[tid] = value;
  __syncthreads();
  // Hillis-Steele inclusive scan; integers, so the order does not matter.
  for (int offset = 1; offset < kSortThreads; offset <<= 1) {
    const int32_t add = tid >= offset ? shared[tid - offset] : 0;
    __syncthreads();
    shared[tid] += add;
    __syncthreads();
  }
  const int32_t exclusive = shared[tid] - value;
  __syncthreads();
  return exclusive;
}

// A stable counting sort of the tokens by id, in one block: bucket b (b = id,
// or vocab_size for out-of-range ids) gets the positions
// [offset(b), offset(b) + count(b)) of sorted_tokens, in token order. Only
// integer atomics, so the result is deterministic.
__global__ void __launch_bounds__(kSortThreads)
    BucketTokensKernel(const int32_t* __restrict__ ids, int64_t num_tokens,
                       int64_t vocab_size, int32_t* __restrict__ buckets,
                       int32_t* __restrict__ sorted_tokens,
                       int32_t* bad_id_count) {
  __shared__ int32_t shared[kSortThreads];
  const int tid = threadIdx.x;
  const int64_t bucket_count = vocab_size + 1;
  for (int64_t b = tid; b < bucket_count; b += kSortThreads) buckets[b] = 0;
  __syncthreads();
  int32_t bad = 0;
  for (int64_t t = tid; t < num_tokens; t += kSortThreads) {
    const int32_t b = BucketOf(ids[t], vocab_size);
    if (b == vocab_size) ++bad;
    atomicAdd(&buckets[b], 1);
  }
  if (bad > 0 && bad_id_count != nullptr) atomicAdd(bad_id_count, bad);
  __syncthreads();

  // Counts -> exclusive offsets: each thread scans one contiguous chunk.
  const int64_t chunk = (bucket_count + kSortThreads - 1) / kSortThreads;
  const int64_t begin = min(tid * chunk, bucket_count);
  const int64_t end = min(begin + chunk, bucket_count);
  int32_t chunk_sum = 0;
  for (int64_t b = begin; b < end; ++b) chunk_sum += buckets[b];
  int32_t running = BlockExclusiveScan(chunk_sum, shared);
  for (int64_t b = begin; b < end; ++b) {
    const int32_t count = buckets[b];
    buckets[b] = running;
    running += count;
  }
  __syncthreads();

  // Place kSortThreads tokens at a time; a token's rank among equal ids of
  // its batch keeps token order, and the batch's last such token advances
  // the bucket's cursor.
  for (int64_t base = 0; base < num_tokens; base += kSortThreads) {
    const int64_t t = base + tid;
    const int32_t b = t < num_tokens ? BucketOf(ids[t], vocab_size) : -1;
    shared[tid] = b;
    __syncthreads();
    int32_t rank = 0;
    bool last = true;
    if (b >= 0) {
      for (int j = 0; j < kSortThreads; ++j) {
        if (shared[j] == b) {
          if (j < tid) ++rank;
          if (j > tid) last = false;
        }
      }
      sorted_tokens[buckets[b] + rank] = static_cast<int32_t>(t);
    }
    __syncthreads();
    if (b >= 0 && last) buckets[b] += rank + 1;
    __syncthreads();
  }
}

// One block per sorted position (grid-stride); a block at the start of an
// id's run adds the run's dout rows to the table row, in token order.
template <typename T>
__global__ void AccumulateRunsKernel(const T* __restrict__ dout,
                                     const int32_t* __restrict__ ids,
                                     const int32_t* __restrict__ sorted_tokens,
                                     int64_t num_tokens, int64_t vocab_size,
                                     int64_t dim, float* __restrict__ dtable,
                                     int64_t padding_id) {
  for (int64_t p = blockIdx.x; p < num_tokens; p += gridDim.x) {
    const int32_t id = ids[sorted_tokens[p]];
    if (id < 0 || id >= vocab_size) continue;  // the bad ids sort last
    if (id == padding_id) continue;  // nn.Embedding's padding_idx
    if (p > 0 && ids[sorted_tokens[p - 1]] == id) continue;
    int64_t run_end = p + 1;
    while (run_end < num_tokens && ids[sorted_tokens[run_end]] == id) {
      ++run_end;
    }
    float* row = dtable + static_cast<int64_t>(id) * dim;
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      float acc = row[d];
      for (int64_t q = p; q < run_end; ++q) {
        acc += LoadAsFloat(dout + static_cast<int64_t>(sorted_tokens[q]) * dim +
                           d);
      }
      row[d] = acc;
    }
  }
}

template <typename T>
cudaError_t LaunchBackward(const T* dout, const int32_t* ids,
                           int64_t num_tokens, int64_t vocab_size, int64_t dim,
                           float* dtable, int32_t* buckets,
                           int32_t* sorted_tokens, int32_t* bad_id_count,
                           int64_t padding_id, cudaStream_t stream) {
  BucketTokensKernel<<<1, kSortThreads, 0, stream>>>(
      ids, num_tokens, vocab_size, buckets, sorted_tokens, bad_id_count);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  AccumulateRunsKernel<T>
      <<<GridFor(num_tokens), kAccumulateThreads, 0, stream>>>(
          dout, ids, sorted_tokens, num_tokens, vocab_size, dim, dtable,
          padding_id);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchEmbeddingForward(const void* table, int64_t vocab_size,
                                   int64_t row_bytes, const int32_t* ids,
                                   int64_t num_tokens, void* out,
                                   int32_t* bad_id_count, cudaStream_t stream) {
  const int grid = GridFor(num_tokens);
  if (row_bytes % 16 == 0 && Aligned16(table) && Aligned16(out)) {
    GatherRowsKernel<uint4><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const uint4*>(table), vocab_size, row_bytes / 16, ids,
        num_tokens, static_cast<uint4*>(out), bad_id_count);
  } else if (row_bytes % 4 == 0 &&
             reinterpret_cast<uintptr_t>(table) % 4 == 0 &&
             reinterpret_cast<uintptr_t>(out) % 4 == 0) {
    GatherRowsKernel<uint32_t><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const uint32_t*>(table), vocab_size, row_bytes / 4, ids,
        num_tokens, static_cast<uint32_t*>(out), bad_id_count);
  } else {
    GatherRowsKernel<unsigned char><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const unsigned char*>(table), vocab_size, row_bytes, ids,
        num_tokens, static_cast<unsigned char*>(out), bad_id_count);
  }
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingBackward(const float* dout, const int32_t* ids,
                                    int64_t num_tokens, int64_t vocab_size,
                                    int64_t dim, float* dtable,
                                    int32_t* buckets, int32_t* sorted_tokens,
                                    int32_t* bad_id_count, int64_t padding_id,
                                    cudaStream_t stream) {
  return LaunchBackward(dout, ids, num_tokens, vocab_size, dim, dtable, buckets,
                        sorted_tokens, bad_id_count, padding_id, stream);
}

cudaError_t LaunchEmbeddingBackward(const uint16_t* dout, const int32_t* ids,
                                    int64_t num_tokens, int64_t vocab_size,
                                    int64_t dim, float* dtable,
                                    int32_t* buckets, int32_t* sorted_tokens,
                                    int32_t* bad_id_count, int64_t padding_id,
                                    cudaStream_t stream) {
  return LaunchBackward(dout, ids, num_tokens, vocab_size, dim, dtable, buckets,
                        sorted_tokens, bad_id_count, padding_id, stream);
}

}  // namespace cuda
}  // namespace kernels
}  // namespace shardd
