#ifndef SHARDD_KERNELS_CPU_COMPUTE_POOL_H_
#define SHARDD_KERNELS_CPU_COMPUTE_POOL_H_

// The threads a CPU worker's kernels split their work over, one pool per
// process. The kernels own their threading: OpenBLAS is held at one thread
// (its idle threads would otherwise spin in sched_yield while the rest of
// the step runs on one core), and GEMMs are split over this pool by
// kernels::Sgemm (gemm.h) like every other loop. See docs/performance.md.
//
// Size: SHARDD_CPU_THREADS, else OPENBLAS_NUM_THREADS, else the CPUs the
// process may run on (its affinity mask), read once on first use;
// SetComputeThreads changes it. Results do not depend on it (ParallelFor).

#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardd {
namespace kernels {

inline constexpr char kComputeThreadsEnv[] = "SHARDD_CPU_THREADS";
inline constexpr int kMaxComputeThreads = 256;

// The pool's thread count, the calling thread included (>= 1).
int ComputeThreads();

// The size the environment asks for: SHARDD_CPU_THREADS, else
// OPENBLAS_NUM_THREADS, else the CPUs in the process's affinity mask.
// Errors: INVALID_ARGUMENT naming the variable when one that is set is not
// an integer in [1, kMaxComputeThreads] (the pool itself then falls back to
// the affinity mask; a worker refuses to start).
absl::StatusOr<int> ComputeThreadsFromEnvironment();

// Resizes the pool (the calling thread counts as one), for start-up, tests
// and benchmarks: no kernel may be running on any thread meanwhile. Errors:
// INVALID_ARGUMENT for n outside [1, kMaxComputeThreads], naming the
// allowed range.
absl::Status SetComputeThreads(int n);

// Calls fn(begin, end) on the chunks [0, grain), [grain, 2 grain), ... of
// [0, n) (the last one shorter), spread over the pool; returns when all are
// done. The chunk boundaries depend on n and grain only, never on the thread
// count, so a kernel that reduces within a chunk and combines the chunks in
// order gives the same bits at every thread count. Chunks run in any order
// and concurrently: fn must only write what its chunk owns. Runs inline
// (chunk by chunk, in order) with one thread, one chunk, or when called from
// inside another ParallelFor or while another thread holds the pool.
// n <= 0 does nothing; grain < 1 counts as 1.
void ParallelFor(int64_t n, int64_t grain,
                 absl::FunctionRef<void(int64_t, int64_t)> fn);

// memset(data, 0, bytes) over the pool, in kElementGrain * 4-byte chunks
// (so the first touch of fresh pages is shared out too).
void FillZero(void* data, int64_t bytes);

// True inside a chunk that ParallelFor runs on the pool (nested calls run
// inline).
bool InParallelRegion();

// The threads work split here would run on: 1 inside a parallel region,
// else ComputeThreads().
int UsableThreads();

// Elements per chunk of the kernels' element-wise loops (256 KiB of fp32).
inline constexpr int64_t kElementGrain = int64_t{1} << 16;

// Rows per chunk for rows of `row_elements` elements: about kElementGrain
// elements, at least one row.
inline int64_t RowGrain(int64_t row_elements) {
  return row_elements >= kElementGrain ? 1 : kElementGrain / row_elements;
}

}  // namespace kernels
}  // namespace shardd

#endif  // SHARDD_KERNELS_CPU_COMPUTE_POOL_H_
