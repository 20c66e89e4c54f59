#include "server/kv_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace shardd {

KvStore::KvStore(KvStoreOptions options)
    : options_(std::move(options)), timer_(std::make_unique<TimerQueue>()) {}

KvStore::~KvStore() {
  // No deadline can fire after this.
  timer_.reset();
  std::vector<GetCallback> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [handle, waiter] : waiters_) {
      pending.push_back(std::move(waiter.done));
    }
    waiters_.clear();
    waiters_by_key_.clear();
  }
  for (GetCallback& done : pending) {
    done(absl::UnavailableError("kv store: the coordinator is shutting down"));
  }
}

absl::Status KvStore::CheckKey(const std::string& key) const {
  if (key.empty()) return absl::InvalidArgumentError("key: required");
  if (key.size() > options_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: ", key.size(), " bytes, the limit is ",
                     options_.max_key_bytes, " (max_key_bytes)"));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Put(const std::string& key, std::string value,
                          bool overwrite) {
  if (absl::Status status = CheckKey(key); !status.ok()) return status;
  if (value.size() > options_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes, the limit is ",
                     options_.max_value_bytes, " (max_value_bytes)"));
  }
  std::vector<GetCallback> woken;
  std::string copy;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    size_t old_bytes = 0;
    if (it != entries_.end()) {
      if (!overwrite) {
        return absl::AlreadyExistsError(absl::StrCat(
            "key '", key, "' is present; set overwrite to replace it"));
      }
      old_bytes = key.size() + it->second.size();
    } else if (entries_.size() >= options_.max_entries) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "kv store: holds ", entries_.size(), " keys, the limit is ",
          options_.max_entries, " (max_entries); delete keys that are done"));
    }
    const size_t new_bytes = key.size() + value.size();
    // total_bytes_ >= old_bytes, so this cannot underflow.
    if (total_bytes_ - old_bytes + new_bytes > options_.max_total_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "kv store: storing ", new_bytes, " bytes would exceed the limit of ",
          options_.max_total_bytes, " bytes (max_total_bytes; ", total_bytes_,
          " in use)"));
    }
    total_bytes_ = total_bytes_ - old_bytes + new_bytes;
    if (it != entries_.end()) {
      it->second = std::move(value);
    } else {
      it = entries_.emplace(key, std::move(value)).first;
    }
    auto waiting = waiters_by_key_.find(key);
    if (waiting != waiters_by_key_.end()) {
      const std::vector<uint64_t> handles = std::move(waiting->second);
      waiters_by_key_.erase(waiting);
      for (uint64_t handle : handles) {
        auto w = waiters_.find(handle);
        if (w == waiters_.end()) continue;
        timer_->Cancel(w->second.timer);
        woken.push_back(std::move(w->second.done));
        waiters_.erase(w);
      }
    }
    if (!woken.empty()) copy = it->second;
  }
  // Each woken Get gets its own copy of the value.
  for (GetCallback& done : woken) done(copy);
  return absl::OkStatus();
}

uint64_t KvStore::GetAsync(const std::string& key, absl::Duration wait,
                           GetCallback done) {
  if (absl::Status status = CheckKey(key); !status.ok()) {
    done(status);
    return 0;
  }
  absl::StatusOr<std::string> immediate;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) {
      immediate = it->second;
    } else if (wait <= absl::ZeroDuration()) {
      immediate = absl::NotFoundError(absl::StrCat(
          "key '", key, "' is not present (set wait_ms to wait for it)"));
    } else if (waiters_.size() >= options_.max_waiters) {
      immediate = absl::ResourceExhaustedError(absl::StrCat(
          "kv store: ", waiters_.size(), " Gets already wait, the limit is ",
          options_.max_waiters, " (max_waiters)"));
    } else {
      wait = std::min(wait, options_.max_wait);
      const uint64_t handle = next_handle_++;
      Waiter& waiter = waiters_[handle];
      waiter.key = key;
      waiter.done = std::move(done);
      waiter.timer = timer_->Schedule(
          absl::Now() + wait, [this, handle, wait] { Expire(handle, wait); });
      waiters_by_key_[key].push_back(handle);
      return handle;
    }
  }
  done(std::move(immediate));
  return 0;
}

KvStore::GetCallback KvStore::TakeWaiterLocked(uint64_t handle) {
  auto it = waiters_.find(handle);
  if (it == waiters_.end()) return nullptr;
  auto by_key = waiters_by_key_.find(it->second.key);
  if (by_key != waiters_by_key_.end()) {
    std::vector<uint64_t>& handles = by_key->second;
    handles.erase(std::remove(handles.begin(), handles.end(), handle),
                  handles.end());
    if (handles.empty()) waiters_by_key_.erase(by_key);
  }
  GetCallback done = std::move(it->second.done);
  waiters_.erase(it);
  return done;
}

void KvStore::Expire(uint64_t handle, absl::Duration wait) {
  GetCallback done;
  std::string key;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(handle);
    if (it == waiters_.end()) return;
    key = it->second.key;
    done = TakeWaiterLocked(handle);
  }
  done(absl::DeadlineExceededError(absl::StrCat(
      "key '", key, "' did not appear within ", absl::FormatDuration(wait))));
}

bool KvStore::CancelGet(uint64_t handle) {
  GetCallback done;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(handle);
    if (it == waiters_.end()) return false;
    timer_->Cancel(it->second.timer);
    done = TakeWaiterLocked(handle);
  }
  done(absl::CancelledError("kv store: the Get was cancelled"));
  return true;
}

absl::StatusOr<std::string> KvStore::Get(const std::string& key,
                                         absl::Duration wait) {
  absl::Notification finished;
  absl::StatusOr<std::string> result;
  GetAsync(key, wait, [&](absl::StatusOr<std::string> value) {
    result = std::move(value);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

int64_t KvStore::Delete(const std::string& key, bool prefix) {
  absl::MutexLock lock(&mu_);
  if (!prefix) {
    auto it = entries_.find(key);
    if (it == entries_.end()) return 0;
    total_bytes_ -= it->first.size() + it->second.size();
    entries_.erase(it);
    return 1;
  }
  int64_t deleted = 0;
  auto it = entries_.lower_bound(key);
  while (it != entries_.end() && absl::StartsWith(it->first, key)) {
    total_bytes_ -= it->first.size() + it->second.size();
    it = entries_.erase(it);
    ++deleted;
  }
  return deleted;
}

size_t KvStore::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

size_t KvStore::total_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

size_t KvStore::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace shardd
