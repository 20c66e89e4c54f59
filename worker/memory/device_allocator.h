#ifndef SHARDD_WORKER_MEMORY_DEVICE_ALLOCATOR_H_
#define SHARDD_WORKER_MEMORY_DEVICE_ALLOCATOR_H_

// A caching allocator for device memory, so the step loop never calls
// cudaMalloc or cudaFree (both synchronize the device) once the first step
// has reserved what the loop needs.
//
// How it caches (the scheme of PyTorch's CUDA caching allocator):
// - Requests are rounded up to 512 bytes. Requests of up to 1 MiB are carved
//   out of 2 MiB segments (the small pool); requests below 10 MiB out of
//   20 MiB segments; larger ones get a segment of their own rounded up to
//   2 MiB (both the large pool).
// - A free block big enough is reused (best fit: the smallest that fits) and
//   split when the rest is worth keeping (>= 512 bytes in the small pool,
//   > 1 MiB in the large pool). Freed blocks merge with free neighbours of
//   the same segment.
// - Free lists are per stream: a block freed by work on stream S is reused
//   only for requests on S, whose work runs after everything already queued
//   on S, so reuse needs no synchronization. A caller that used a block on
//   another stream must make S wait for that stream (cudaStreamWaitEvent)
//   before freeing it.
// - Memory goes back to the backend only in EmptyCache(), when the backend
//   runs out of memory (cached segments are released and the request
//   retried once; `release_cache_on_oom`), and in the destructor. Call
//   EmptyCache() between steps, never inside one.
//
// Accounting: every live allocation carries a MemoryKind, like a
// TrackedBuffer. With a MemoryTracker, live allocations are reported under
// their kind (requested bytes, so a plan's byte counts compare exactly) and
// everything reserved beyond that (free cached blocks and rounding) under
// kCached, as BufferCache does for host memory: the tracker's live_total
// plus its kCached bytes equals reserved_bytes(). Use a tracker of its own
// for device memory to keep host and device totals apart.
//
// The allocation functions come from a DeviceMemoryBackend: cudaMalloc /
// cudaFree in CudaMemoryBackend (worker/memory/cuda_memory_backend.h, CUDA builds
// only), host memory in HostMemoryBackend (tests, CPU runs). This file needs
// no CUDA headers. Thread-safe.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {

// An opaque stream handle: a cudaStream_t under CUDA (nullptr is the legacy
// default stream). The allocator only compares them.
using DeviceStream = void*;

// Raw device memory: what the caching allocator asks for segments from.
class DeviceMemoryBackend {
 public:
  virtual ~DeviceMemoryBackend() = default;
  // `bytes` > 0. Errors: RESOURCE_EXHAUSTED when out of memory; others as
  // the backend reports them.
  virtual absl::StatusOr<void*> Malloc(int64_t bytes) = 0;
  // `ptr` came from Malloc and is not in use any more.
  virtual absl::Status Free(void* ptr) = 0;
  // For messages, e.g. "cuda device 0".
  virtual std::string name() const = 0;
};

// Host memory standing in for device memory (512-byte aligned), with an
// optional capacity to simulate running out. Counts its calls. Thread-safe.
class HostMemoryBackend : public DeviceMemoryBackend {
 public:
  // `capacity_bytes` < 0 means unlimited.
  explicit HostMemoryBackend(int64_t capacity_bytes = -1);
  ~HostMemoryBackend() override;

  // Errors: RESOURCE_EXHAUSTED beyond the capacity or when the host has no
  // memory left.
  absl::StatusOr<void*> Malloc(int64_t bytes) override;
  // Errors: INVALID_ARGUMENT for a pointer Malloc did not return.
  absl::Status Free(void* ptr) override;
  std::string name() const override { return "host memory backend"; }

  int64_t mallocs() const;
  int64_t frees() const;
  int64_t bytes_in_use() const;

 private:
  const int64_t capacity_bytes_;
  mutable absl::Mutex mu_;
  std::unordered_map<void*, int64_t> blocks_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t mallocs_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t frees_ ABSL_GUARDED_BY(mu_) = 0;
};

struct DeviceAllocatorStats {
  static constexpr int kKinds = static_cast<int>(MemoryKind::kNumKinds);

  // Requested bytes of live allocations, and their peak.
  int64_t live_bytes = 0;
  int64_t peak_live_bytes = 0;
  // The same allocations in rounded block bytes.
  int64_t allocated_bytes = 0;
  // Segments held from the backend, and their peak.
  int64_t reserved_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  // Live requested bytes by kind (kCached stays 0 here), and their peaks.
  std::array<int64_t, kKinds> live_by_kind{};
  std::array<int64_t, kKinds> peak_by_kind{};
  // Allocate calls that returned memory; of those, served from the cache.
  int64_t allocations = 0;
  int64_t cache_hits = 0;
  // Allocate calls that failed because the backend had no memory.
  int64_t failed_allocations = 0;
  // Calls into the backend (cudaMalloc / cudaFree under CUDA).
  int64_t backend_mallocs = 0;
  int64_t backend_frees = 0;
};

class DeviceAllocator {
 public:
  struct Options {
    // On RESOURCE_EXHAUSTED from the backend, release the cached segments
    // and retry once.
    bool release_cache_on_oom = true;
  };

  // `backend` must outlive the allocator. `tracker` may be null; it must
  // outlive the allocator too.
  DeviceAllocator(DeviceMemoryBackend* backend, MemoryTracker* tracker);
  DeviceAllocator(DeviceMemoryBackend* backend, MemoryTracker* tracker,
                  Options options);
  // Returns the cached segments to the backend. Segments that still hold
  // live allocations are leaked with an error log (freeing them would leave
  // dangling device pointers).
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // `bytes` of memory for work on `stream`, accounted as `kind`. 0 bytes
  // returns nullptr. The pointer is 512-byte aligned relative to the
  // backend's segment (cudaMalloc segments are at least 256-byte aligned).
  // Errors: INVALID_ARGUMENT for negative bytes or kind kCached/kNumKinds;
  // RESOURCE_EXHAUSTED (with the allocator's reserved and live bytes in the
  // message) when the backend has no memory even after releasing the cache;
  // other backend errors as returned.
  absl::StatusOr<void*> Allocate(int64_t bytes, MemoryKind kind,
                                 DeviceStream stream);

  // Returns `ptr` to the free list of the stream it was allocated for.
  // nullptr is ignored. Errors: INVALID_ARGUMENT for a pointer that is not
  // a live allocation of this allocator (unknown, interior, or freed).
  absl::Status Free(void* ptr);

  // Returns every segment with no live allocation to the backend. Errors:
  // the first backend error (the other segments are still released).
  absl::Status EmptyCache();

  // Starts new peaks from the current values (e.g. at a step start).
  void ResetPeaks();
  DeviceAllocatorStats stats() const;
  // Rounded size of the block a request of `bytes` occupies.
  static int64_t RoundedSize(int64_t bytes);

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeList = std::set<Block*, BlockLess>;
  struct StreamPools {
    FreeList small;
    FreeList large;
  };

  absl::StatusOr<Block*> NewSegment(int64_t rounded, bool small,
                                    DeviceStream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  FreeList& PoolFor(DeviceStream stream, bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees every whole free segment; returns the first backend error.
  absl::Status ReleaseCachedSegments() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports the current kCached bytes to the tracker.
  void SyncTrackerCached() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DeviceMemoryBackend* const backend_;
  MemoryTracker* const tracker_;
  const Options options_;

  mutable absl::Mutex mu_;
  std::map<DeviceStream, StreamPools> pools_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<void*, Block*> live_ ABSL_GUARDED_BY(mu_);
  DeviceAllocatorStats stats_ ABSL_GUARDED_BY(mu_);
  // What the tracker currently holds as kCached from this allocator.
  int64_t tracked_cached_ ABSL_GUARDED_BY(mu_) = 0;
};

// Device memory from a DeviceAllocator for the lifetime of the object, like
// TrackedBuffer for host memory. Move-only. Must not outlive the allocator.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Errors: as DeviceAllocator::Allocate.
  static absl::StatusOr<DeviceBuffer> Allocate(DeviceAllocator* allocator,
                                               int64_t bytes, MemoryKind kind,
                                               DeviceStream stream);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Returns the memory to the allocator now; the object stays usable and
  // empty. A failure to return it is a programming error and is logged.
  void Reset();
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  int64_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  DeviceStream stream() const { return stream_; }
  bool empty() const { return data_ == nullptr; }

 private:
  DeviceAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  MemoryKind kind_ = MemoryKind::kWorkspace;
  DeviceStream stream_ = nullptr;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MEMORY_DEVICE_ALLOCATOR_H_
