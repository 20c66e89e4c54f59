#include "worker/memory/device_allocator.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace shardd {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// Every block is a multiple of this (and so aligned to it within a segment).
constexpr int64_t kRoundBytes = 512;
// Requests up to this size come from the small pool.
constexpr int64_t kSmallRequest = 1 * kMiB;
constexpr int64_t kSmallSegment = 2 * kMiB;
// Large-pool requests below this share 20 MiB segments...
constexpr int64_t kSharedLargeLimit = 10 * kMiB;
constexpr int64_t kSharedLargeSegment = 20 * kMiB;
// ...larger ones get a segment of their own, rounded to this.
constexpr int64_t kLargeSegmentRound = 2 * kMiB;
// Beyond any device: refused without asking the backend (and without
// overflowing the rounding arithmetic).
constexpr int64_t kMaxRequest = int64_t{1} << 60;

int64_t RoundUp(int64_t bytes, int64_t multiple) {
  return (bytes + multiple - 1) / multiple * multiple;
}

int64_t SegmentSize(int64_t rounded) {
  if (rounded <= kSmallRequest) return kSmallSegment;
  if (rounded < kSharedLargeLimit) return kSharedLargeSegment;
  return RoundUp(rounded, kLargeSegmentRound);
}

int KindIndex(MemoryKind kind) { return static_cast<int>(kind); }

}  // namespace

// A piece of a backend segment. Blocks of one segment form a doubly linked
// list in address order. Every block is either live (in live_) or free (in
// exactly one free list).
struct DeviceAllocator::Block {
  DeviceStream stream = nullptr;
  bool small = false;
  char* ptr = nullptr;
  int64_t size = 0;
  bool allocated = false;
  int64_t requested = 0;
  MemoryKind kind = MemoryKind::kWorkspace;
  Block* prev = nullptr;
  Block* next = nullptr;
};

bool DeviceAllocator::BlockLess::operator()(const Block* a,
                                            const Block* b) const {
  if (a->size != b->size) return a->size < b->size;
  return std::less<char*>()(a->ptr, b->ptr);
}

// HostMemoryBackend -----------------------------------------------------

HostMemoryBackend::HostMemoryBackend(int64_t capacity_bytes)
    : capacity_bytes_(capacity_bytes) {}

HostMemoryBackend::~HostMemoryBackend() {
  absl::MutexLock lock(&mu_);
  for (auto& [ptr, bytes] : blocks_) std::free(ptr);
}

absl::StatusOr<void*> HostMemoryBackend::Malloc(int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes must be positive, got ", bytes));
  }
  absl::MutexLock lock(&mu_);
  if (capacity_bytes_ >= 0 && bytes > capacity_bytes_ - bytes_in_use_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name(), ": ", bytes, " bytes requested, ",
        capacity_bytes_ - bytes_in_use_, " of ", capacity_bytes_, " free"));
  }
  void* ptr = std::aligned_alloc(kRoundBytes, RoundUp(bytes, kRoundBytes));
  if (ptr == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name(), ": aligned_alloc of ", bytes, " bytes failed"));
  }
  blocks_.emplace(ptr, bytes);
  bytes_in_use_ += bytes;
  ++mallocs_;
  return ptr;
}

absl::Status HostMemoryBackend::Free(void* ptr) {
  absl::MutexLock lock(&mu_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": Free of a pointer Malloc did not return"));
  }
  bytes_in_use_ -= it->second;
  blocks_.erase(it);
  std::free(ptr);
  ++frees_;
  return absl::OkStatus();
}

int64_t HostMemoryBackend::mallocs() const {
  absl::MutexLock lock(&mu_);
  return mallocs_;
}

int64_t HostMemoryBackend::frees() const {
  absl::MutexLock lock(&mu_);
  return frees_;
}

int64_t HostMemoryBackend::bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return bytes_in_use_;
}

// DeviceAllocator -------------------------------------------------------

DeviceAllocator::DeviceAllocator(DeviceMemoryBackend* backend,
                                 MemoryTracker* tracker)
    : DeviceAllocator(backend, tracker, Options()) {}

DeviceAllocator::DeviceAllocator(DeviceMemoryBackend* backend,
                                 MemoryTracker* tracker, Options options)
    : backend_(backend), tracker_(tracker), options_(options) {}

DeviceAllocator::~DeviceAllocator() {
  absl::MutexLock lock(&mu_);
  const absl::Status released = ReleaseCachedSegments();
  if (!released.ok()) {
    SHARDD_LOG(ERROR) << "device allocator: releasing cached segments: "
                      << released;
  }
  if (!live_.empty()) {
    SHARDD_LOG(ERROR) << "device allocator destroyed with " << live_.size()
                      << " live allocations (" << stats_.live_bytes
                      << " bytes); their " << stats_.reserved_bytes
                      << " reserved bytes are leaked";
  }
  // The tracker keeps the leaked live kinds; nothing is cached any more.
  if (tracker_ != nullptr) tracker_->Free(MemoryKind::kCached, tracked_cached_);
  tracked_cached_ = 0;
  for (auto& [stream, pools] : pools_) {
    for (Block* block : pools.small) delete block;
    for (Block* block : pools.large) delete block;
  }
  for (auto& [ptr, block] : live_) delete block;
}

int64_t DeviceAllocator::RoundedSize(int64_t bytes) {
  if (bytes <= 0) return 0;
  return RoundUp(bytes, kRoundBytes);
}

DeviceAllocator::FreeList& DeviceAllocator::PoolFor(DeviceStream stream,
                                                    bool small) {
  StreamPools& pools = pools_[stream];
  return small ? pools.small : pools.large;
}

absl::StatusOr<DeviceAllocator::Block*> DeviceAllocator::NewSegment(
    int64_t rounded, bool small, DeviceStream stream) {
  const int64_t segment = SegmentSize(rounded);
  absl::StatusOr<void*> memory = backend_->Malloc(segment);
  ++stats_.backend_mallocs;
  if (!memory.ok() &&
      memory.status().code() == absl::StatusCode::kResourceExhausted &&
      options_.release_cache_on_oom) {
    // Cached segments of other sizes or streams may be what is missing.
    const absl::Status released = ReleaseCachedSegments();
    if (!released.ok()) {
      SHARDD_LOG(WARNING) << "device allocator: releasing the cache after "
                             "running out of memory: "
                          << released;
    }
    SyncTrackerCached();
    memory = backend_->Malloc(segment);
    ++stats_.backend_mallocs;
  }
  if (!memory.ok()) {
    if (memory.status().code() == absl::StatusCode::kResourceExhausted) {
      ++stats_.failed_allocations;
      return absl::ResourceExhaustedError(absl::StrCat(
          "device allocator: a segment of ", segment, " bytes for a ", rounded,
          "-byte block is not available from ", backend_->name(), " (",
          stats_.reserved_bytes, " bytes reserved, ", stats_.live_bytes,
          " live): ", memory.status().message()));
    }
    return absl::Status(memory.status().code(),
                        absl::StrCat("device allocator: ", backend_->name(),
                                     ": ", memory.status().message()));
  }
  auto* block = new Block;
  block->stream = stream;
  block->small = small;
  block->ptr = static_cast<char*>(*memory);
  block->size = segment;
  stats_.reserved_bytes += segment;
  stats_.peak_reserved_bytes =
      std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  return block;
}

absl::StatusOr<void*> DeviceAllocator::Allocate(int64_t bytes, MemoryKind kind,
                                                DeviceStream stream) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes must be >= 0, got ", bytes));
  }
  if (kind == MemoryKind::kCached || kind == MemoryKind::kNumKinds) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind must name what the memory holds, got ",
                     MemoryKindName(kind), "; kCached is the allocator's"));
  }
  if (bytes == 0) return nullptr;
  if (bytes > kMaxRequest) {
    absl::MutexLock lock(&mu_);
    ++stats_.failed_allocations;
    return absl::ResourceExhaustedError(
        absl::StrCat("device allocator: ", bytes, " bytes exceed any device"));
  }
  const int64_t rounded = RoundedSize(bytes);
  const bool small = rounded <= kSmallRequest;

  absl::MutexLock lock(&mu_);
  FreeList& pool = PoolFor(stream, small);
  Block key;
  key.size = rounded;
  Block* block = nullptr;
  auto it = pool.lower_bound(&key);
  if (it != pool.end()) {
    block = *it;
    pool.erase(it);
    ++stats_.cache_hits;
  } else {
    absl::StatusOr<Block*> segment = NewSegment(rounded, small, stream);
    if (!segment.ok()) return segment.status();
    block = *segment;
  }

  // Keep the rest of the block for later requests when it is worth it: the
  // large pool never keeps pieces a small request would fit in.
  const int64_t remaining = block->size - rounded;
  if (small ? remaining >= kRoundBytes : remaining > kSmallRequest) {
    auto* rest = new Block;
    rest->stream = stream;
    rest->small = small;
    rest->ptr = block->ptr + rounded;
    rest->size = remaining;
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    block->size = rounded;
    pool.insert(rest);
  }

  block->allocated = true;
  block->requested = bytes;
  block->kind = kind;
  live_.emplace(block->ptr, block);

  ++stats_.allocations;
  stats_.live_bytes += bytes;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  stats_.allocated_bytes += block->size;
  int64_t& live_kind = stats_.live_by_kind[KindIndex(kind)];
  live_kind += bytes;
  int64_t& peak_kind = stats_.peak_by_kind[KindIndex(kind)];
  peak_kind = std::max(peak_kind, live_kind);
  if (tracker_ != nullptr) tracker_->Allocate(kind, bytes);
  SyncTrackerCached();
  return static_cast<void*>(block->ptr);
}

absl::Status DeviceAllocator::Free(void* ptr) {
  if (ptr == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    return absl::InvalidArgumentError(
        "device allocator: Free of a pointer that is not a live allocation "
        "(never allocated here, already freed, or not its start)");
  }
  Block* block = it->second;
  live_.erase(it);

  stats_.live_bytes -= block->requested;
  stats_.allocated_bytes -= block->size;
  stats_.live_by_kind[KindIndex(block->kind)] -= block->requested;
  if (tracker_ != nullptr) tracker_->Free(block->kind, block->requested);
  block->allocated = false;
  block->requested = 0;

  FreeList& pool = PoolFor(block->stream, block->small);
  if (Block* prev = block->prev; prev != nullptr && !prev->allocated) {
    pool.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next != nullptr && !next->allocated) {
    pool.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    delete next;
  }
  pool.insert(block);
  SyncTrackerCached();
  return absl::OkStatus();
}

absl::Status DeviceAllocator::ReleaseCachedSegments() {
  absl::Status first_error;
  for (auto& [stream, pools] : pools_) {
    for (FreeList* pool : {&pools.small, &pools.large}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* block = *it;
        // Only a free block that is a whole segment can go back.
        if (block->prev != nullptr || block->next != nullptr) {
          ++it;
          continue;
        }
        const absl::Status freed = backend_->Free(block->ptr);
        ++stats_.backend_frees;
        if (!freed.ok()) {
          if (first_error.ok()) first_error = freed;
          ++it;
          continue;
        }
        stats_.reserved_bytes -= block->size;
        it = pool->erase(it);
        delete block;
      }
    }
  }
  return first_error;
}

absl::Status DeviceAllocator::EmptyCache() {
  absl::MutexLock lock(&mu_);
  const absl::Status status = ReleaseCachedSegments();
  SyncTrackerCached();
  return status;
}

void DeviceAllocator::SyncTrackerCached() {
  const int64_t cached = stats_.reserved_bytes - stats_.live_bytes;
  if (tracker_ != nullptr) {
    if (cached > tracked_cached_) {
      tracker_->Allocate(MemoryKind::kCached, cached - tracked_cached_);
    } else if (cached < tracked_cached_) {
      tracker_->Free(MemoryKind::kCached, tracked_cached_ - cached);
    }
  }
  tracked_cached_ = cached;
}

void DeviceAllocator::ResetPeaks() {
  absl::MutexLock lock(&mu_);
  stats_.peak_live_bytes = stats_.live_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.peak_by_kind = stats_.live_by_kind;
}

DeviceAllocatorStats DeviceAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

// DeviceBuffer ----------------------------------------------------------

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(DeviceAllocator* allocator,
                                                    int64_t bytes,
                                                    MemoryKind kind,
                                                    DeviceStream stream) {
  if (allocator == nullptr) {
    return absl::InvalidArgumentError("allocator must not be null");
  }
  absl::StatusOr<void*> data = allocator->Allocate(bytes, kind, stream);
  if (!data.ok()) return data.status();
  DeviceBuffer buffer;
  buffer.allocator_ = allocator;
  buffer.data_ = *data;
  buffer.bytes_ = *data == nullptr ? 0 : bytes;
  buffer.kind_ = kind;
  buffer.stream_ = stream;
  return buffer;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : allocator_(other.allocator_),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      kind_(other.kind_),
      stream_(other.stream_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    allocator_ = other.allocator_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    kind_ = other.kind_;
    stream_ = other.stream_;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ == nullptr) return;
  const absl::Status status = allocator_->Free(data_);
  if (!status.ok()) SHARDD_LOG(ERROR) << "DeviceBuffer::Reset: " << status;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace shardd
