#include "worker/memory/memory_tracker.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace shardd {
namespace {

int Index(MemoryKind kind) { return static_cast<int>(kind); }

bool InStep(MemoryKind kind) {
  return kind == MemoryKind::kGatheredParams ||
         kind == MemoryKind::kUnshardedGrads ||
         kind == MemoryKind::kActivations;
}

// 64-byte alignment suits SIMD loads and cache lines.
constexpr size_t kAlignment = 64;

}  // namespace

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kShardParams:
      return "shard_params";
    case MemoryKind::kShardGrads:
      return "shard_grads";
    case MemoryKind::kOptimizerState:
      return "optimizer_state";
    case MemoryKind::kGatheredParams:
      return "gathered_params";
    case MemoryKind::kUnshardedGrads:
      return "unsharded_grads";
    case MemoryKind::kWorkspace:
      return "workspace";
    case MemoryKind::kCached:
      return "cached";
    case MemoryKind::kActivations:
      return "activations";
    case MemoryKind::kNumKinds:
      break;
  }
  return "unknown";
}

void MemoryTracker::Allocate(MemoryKind kind, int64_t bytes) {
  if (bytes <= 0) return;
  absl::MutexLock lock(&mu_);
  state_.live[Index(kind)] += bytes;
  // Cached blocks are reserved, not in use: they stay out of the totals.
  if (kind != MemoryKind::kCached) state_.live_total += bytes;
  if (kind == MemoryKind::kGatheredParams ||
      kind == MemoryKind::kUnshardedGrads) {
    state_.live_unsharded += bytes;
  }
  if (InStep(kind)) state_.live_step += bytes;
  UpdatePeaksLocked();
  RecordLocked(kind);
}

void MemoryTracker::Free(MemoryKind kind, int64_t bytes) {
  if (bytes <= 0) return;
  absl::MutexLock lock(&mu_);
  int64_t& live = state_.live[Index(kind)];
  if (bytes > live) {
    ++over_frees_;
    bytes = live;
  }
  live -= bytes;
  if (kind != MemoryKind::kCached) state_.live_total -= bytes;
  if (kind == MemoryKind::kGatheredParams ||
      kind == MemoryKind::kUnshardedGrads) {
    state_.live_unsharded -= bytes;
  }
  if (InStep(kind)) state_.live_step -= bytes;
  RecordLocked(kind);
}

void MemoryTracker::RecordLocked(MemoryKind kind) {
  if (!recording_ || timeline_.size() >= max_points_) return;
  if (kind != MemoryKind::kGatheredParams &&
      kind != MemoryKind::kUnshardedGrads) {
    return;
  }
  timeline_.push_back({state_.live[Index(MemoryKind::kGatheredParams)],
                       state_.live[Index(MemoryKind::kUnshardedGrads)]});
}

void MemoryTracker::StartTimeline(size_t max_points) {
  absl::MutexLock lock(&mu_);
  recording_ = true;
  max_points_ = max_points;
  timeline_.clear();
}

std::vector<MemoryTimelinePoint> MemoryTracker::StopTimeline() {
  absl::MutexLock lock(&mu_);
  recording_ = false;
  return std::exchange(timeline_, {});
}

void MemoryTracker::UpdatePeaksLocked() {
  for (int i = 0; i < Index(MemoryKind::kNumKinds); ++i) {
    state_.peak[i] = std::max(state_.peak[i], state_.live[i]);
  }
  state_.peak_total = std::max(state_.peak_total, state_.live_total);
  state_.peak_unsharded =
      std::max(state_.peak_unsharded, state_.live_unsharded);
  state_.peak_step = std::max(state_.peak_step, state_.live_step);
}

void MemoryTracker::ResetPeaks() {
  absl::MutexLock lock(&mu_);
  state_.peak = state_.live;
  state_.peak_total = state_.live_total;
  state_.peak_unsharded = state_.live_unsharded;
  state_.peak_step = state_.live_step;
}

MemorySnapshot MemoryTracker::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

int64_t MemoryTracker::over_frees() const {
  absl::MutexLock lock(&mu_);
  return over_frees_;
}

BufferCache::~BufferCache() { Trim(); }

void* BufferCache::Take(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = free_.find(bytes);
  if (it == free_.end()) return nullptr;
  void* data = it->second;
  free_.erase(it);
  cached_bytes_ -= bytes;
  if (tracker_ != nullptr) tracker_->Free(MemoryKind::kCached, bytes);
  return data;
}

void BufferCache::Give(void* data, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  free_.emplace(bytes, data);
  cached_bytes_ += bytes;
  if (tracker_ != nullptr) tracker_->Allocate(MemoryKind::kCached, bytes);
}

void BufferCache::Trim() {
  absl::MutexLock lock(&mu_);
  for (auto& [bytes, data] : free_) {
    std::free(data);
    if (tracker_ != nullptr) tracker_->Free(MemoryKind::kCached, bytes);
  }
  free_.clear();
  cached_bytes_ = 0;
}

int64_t BufferCache::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

TrackedBuffer::TrackedBuffer(MemoryTracker* tracker, MemoryKind kind,
                             int64_t bytes, BufferCache* cache)
    : tracker_(tracker), kind_(kind), cache_(cache), bytes_(bytes) {
  if (bytes_ <= 0) {
    bytes_ = 0;
    return;
  }
  if (cache_ != nullptr) data_ = cache_->Take(bytes_);
  if (data_ == nullptr) {
    const size_t rounded = (static_cast<size_t>(bytes_) + kAlignment - 1) /
                           kAlignment * kAlignment;
    data_ = std::aligned_alloc(kAlignment, rounded);
    if (data_ == nullptr) throw std::bad_alloc();
  }
  if (tracker_ != nullptr) tracker_->Allocate(kind_, bytes_);
}

TrackedBuffer::~TrackedBuffer() { Reset(); }

TrackedBuffer::TrackedBuffer(TrackedBuffer&& other) noexcept
    : tracker_(other.tracker_),
      kind_(other.kind_),
      cache_(other.cache_),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

TrackedBuffer& TrackedBuffer::operator=(TrackedBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    tracker_ = other.tracker_;
    kind_ = other.kind_;
    cache_ = other.cache_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void TrackedBuffer::Reset() {
  if (data_ == nullptr) return;
  // Account the release before the cache counts the block as cached.
  if (tracker_ != nullptr) tracker_->Free(kind_, bytes_);
  if (cache_ != nullptr) {
    cache_->Give(data_, bytes_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace shardd
