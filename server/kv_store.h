#ifndef SHARDD_SERVER_KV_STORE_H_
#define SHARDD_SERVER_KV_STORE_H_

// The coordinator's key-value store for collective rendezvous (Gloo's store,
// NCCL unique ids). Gets may wait for a key; waiting never blocks a thread:
// GetAsync parks a callback that a Put, the deadline (on a timer thread),
// CancelGet or the destructor completes.
//
// Thread-safe. Callbacks run outside the store's lock, on the thread that
// completes them (the caller of GetAsync, Put, CancelGet or the destructor,
// or the timer thread), so they must be quick and must not block.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/timer_queue.h"

namespace shardd {

struct KvStoreOptions {
  // Most keys stored at once.
  size_t max_entries = size_t{1} << 20;
  // Largest value (an NCCL unique id is 128 bytes; Gloo addresses are
  // small; this leaves room for larger rendezvous blobs).
  size_t max_value_bytes = size_t{16} << 20;
  size_t max_key_bytes = 4096;
  // Most bytes of keys and values together.
  size_t max_total_bytes = size_t{1} << 30;
  // Most Gets waiting at once.
  size_t max_waiters = size_t{1} << 16;
  // Longer waits are cut to this.
  absl::Duration max_wait = absl::Hours(1);
};

class KvStore {
 public:
  using GetCallback = std::function<void(absl::StatusOr<std::string>)>;

  explicit KvStore(KvStoreOptions options = {});
  // Completes every waiting Get with UNAVAILABLE.
  ~KvStore();

  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // Stores `value` under `key` and completes the Gets waiting for it.
  // Errors: INVALID_ARGUMENT (empty key, key longer than max_key_bytes,
  // value longer than max_value_bytes), ALREADY_EXISTS (key present and
  // overwrite false), RESOURCE_EXHAUSTED (max_entries or max_total_bytes
  // reached; the message names the limit).
  absl::Status Put(const std::string& key, std::string value, bool overwrite)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Looks `key` up and calls `done` exactly once:
  // - at once with the value when present; with NOT_FOUND when absent and
  //   `wait` <= 0; with INVALID_ARGUMENT (empty or over-long key) or
  //   RESOURCE_EXHAUSTED (max_waiters Gets already wait);
  // - otherwise later: with the value when a Put stores the key, with
  //   DEADLINE_EXCEEDED once `wait` (at most max_wait) passed, with
  //   CANCELLED after CancelGet, or with UNAVAILABLE when the store is
  //   destroyed.
  // Returns a handle for CancelGet, or 0 when `done` already ran.
  uint64_t GetAsync(const std::string& key, absl::Duration wait,
                    GetCallback done) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends a waiting Get with CANCELLED. Returns false when it had already
  // completed (then nothing happens).
  bool CancelGet(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);

  // Blocking GetAsync, for tests and non-gRPC callers. Errors: as GetAsync.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Deletes `key`, or with `prefix` every key starting with it (an empty
  // prefix deletes everything). Returns how many keys were deleted; waiting
  // Gets keep waiting. Errors: none.
  int64_t Delete(const std::string& key, bool prefix) ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t total_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Waiter {
    std::string key;
    GetCallback done;
    uint64_t timer = 0;
  };

  // Removes waiter `handle` (from both indexes) and returns its callback;
  // empty when it is not waiting.
  GetCallback TakeWaiterLocked(uint64_t handle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The timer's callback: ends waiter `handle` with DEADLINE_EXCEEDED.
  void Expire(uint64_t handle, absl::Duration wait) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckKey(const std::string& key) const;

  const KvStoreOptions options_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::string> entries_ ABSL_GUARDED_BY(mu_);
  // Sum of key and value sizes in entries_.
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Handle -> waiting Get.
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  // Key -> handles of the Gets waiting for it.
  std::map<std::string, std::vector<uint64_t>> waiters_by_key_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;

  // Fires deadlines. Reset first in the destructor so that no timer
  // callback runs while the store is torn down.
  std::unique_ptr<TimerQueue> timer_;
};

}  // namespace shardd

#endif  // SHARDD_SERVER_KV_STORE_H_
