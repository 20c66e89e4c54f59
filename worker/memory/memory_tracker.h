#ifndef SHARDD_WORKER_MEMORY_MEMORY_TRACKER_H_
#define SHARDD_WORKER_MEMORY_MEMORY_TRACKER_H_

// Live and peak bytes of every buffer a worker allocates, by kind. The kinds
// the planner's step model predicts (gathered parameters and unsharded
// gradients) are tracked separately from persistent state and compute
// workspace, so a worker can compare its measured unsharded peak with the
// plan's `peak_unsharded_bytes` exactly. Thread-safe.

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardd {

enum class MemoryKind {
  kShardParams = 0,  // Master shards.
  kShardGrads,       // Sharded gradients.
  kOptimizerState,   // AdamW moments.
  kGatheredParams,   // All-gather buffers (unsharded parameters).
  kUnshardedGrads,   // Unsharded gradient buffers before reduce-scatter.
  kWorkspace,        // Compute copies, activations, scratch.
  kCached,           // Freed blocks a BufferCache keeps for reuse.
  // A model's saved activations (what a forward keeps for its backward),
  // the plan's ActivationModel.
  kActivations,
  kNumKinds,
};

const char* MemoryKindName(MemoryKind kind);

struct MemorySnapshot {
  std::array<int64_t, static_cast<int>(MemoryKind::kNumKinds)> live{};
  std::array<int64_t, static_cast<int>(MemoryKind::kNumKinds)> peak{};
  // In use: every kind but kCached (reserved for reuse, reported apart).
  int64_t live_total = 0;
  int64_t peak_total = 0;
  // Gathered params + unsharded grads: what the planner predicts.
  int64_t live_unsharded = 0;
  int64_t peak_unsharded = 0;
  // Unsharded bytes plus activations: the plan's peak_step_bytes.
  int64_t live_step = 0;
  int64_t peak_step = 0;
};

// Live unsharded bytes right after one change of either kind (a point of a
// measured memory timeline, MemoryTracker::StartTimeline).
struct MemoryTimelinePoint {
  int64_t gathered_params = 0;
  int64_t unsharded_grads = 0;
};

class MemoryTracker {
 public:
  void Allocate(MemoryKind kind, int64_t bytes);
  // Freeing more than is live is a programming error; it is clamped at zero
  // and counted in `over_frees()` so tests can catch it.
  void Free(MemoryKind kind, int64_t bytes);
  // Starts new peaks from the current live values (e.g. at a step start).
  void ResetPeaks();
  MemorySnapshot Snapshot() const;
  int64_t over_frees() const;

  // Measured timeline: from now on, every allocation or free of gathered
  // parameters or unsharded gradients appends the live bytes of both kinds
  // (the first `max_points`; later changes are not stored). Restarts an
  // ongoing recording.
  void StartTimeline(size_t max_points);
  // Stops recording and returns the points (empty when none was started).
  std::vector<MemoryTimelinePoint> StopTimeline();

 private:
  void RecordLocked(MemoryKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void UpdatePeaksLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  MemorySnapshot state_ ABSL_GUARDED_BY(mu_);
  int64_t over_frees_ ABSL_GUARDED_BY(mu_) = 0;
  bool recording_ ABSL_GUARDED_BY(mu_) = false;
  size_t max_points_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<MemoryTimelinePoint> timeline_ ABSL_GUARDED_BY(mu_);
};

// Keeps freed blocks for reuse by size, like a caching allocator: a buffer
// that is gathered and freed every step then costs no fresh pages (and no
// page faults) after the first step. Cached blocks are accounted as kCached,
// so "live" kinds stay exactly what is in use and kCached is what is
// reserved on top. Thread-safe. Must outlive the buffers that use it.
class BufferCache {
 public:
  explicit BufferCache(MemoryTracker* tracker) : tracker_(tracker) {}
  ~BufferCache();
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;

  // A cached block of exactly `bytes`, or null.
  void* Take(int64_t bytes);
  // Keeps `data` (from Take or the aligned allocator) for a later Take.
  void Give(void* data, int64_t bytes);
  // Frees every cached block.
  void Trim();
  int64_t cached_bytes() const;

 private:
  MemoryTracker* tracker_;
  mutable absl::Mutex mu_;
  std::multimap<int64_t, void*> free_ ABSL_GUARDED_BY(mu_);
  int64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// A heap buffer whose bytes are accounted to a tracker for its lifetime.
class TrackedBuffer {
 public:
  TrackedBuffer() = default;
  // With a non-null `cache` the memory comes from and returns to it.
  TrackedBuffer(MemoryTracker* tracker, MemoryKind kind, int64_t bytes,
                BufferCache* cache = nullptr);
  ~TrackedBuffer();
  TrackedBuffer(TrackedBuffer&& other) noexcept;
  TrackedBuffer& operator=(TrackedBuffer&& other) noexcept;
  TrackedBuffer(const TrackedBuffer&) = delete;
  TrackedBuffer& operator=(const TrackedBuffer&) = delete;

  // Frees the memory now (the object stays usable and empty).
  void Reset();
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }

 private:
  MemoryTracker* tracker_ = nullptr;
  MemoryKind kind_ = MemoryKind::kWorkspace;
  BufferCache* cache_ = nullptr;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MEMORY_MEMORY_TRACKER_H_
