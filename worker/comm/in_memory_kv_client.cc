#include "worker/comm/in_memory_kv_client.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardd {

absl::Status InMemoryKeyValueClient::Set(const std::string& key,
                                         const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("key must not be empty");
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  ++set_calls_;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKeyValueClient::Get(
    const std::string& key, absl::Duration timeout) {
  if (key.empty()) return absl::InvalidArgumentError("key must not be empty");
  absl::MutexLock lock(&mu_);
  auto present = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return values_.count(key) > 0;
  };
  if (timeout > absl::ZeroDuration()) {
    mu_.AwaitWithTimeout(absl::Condition(&present), timeout);
  }
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "key '", key, "' not set within ", absl::FormatDuration(timeout)));
  }
  return it->second;
}

absl::Status InMemoryKeyValueClient::Delete(const std::string& key,
                                            bool prefix) {
  absl::MutexLock lock(&mu_);
  if (!prefix) {
    values_.erase(key);
    return absl::OkStatus();
  }
  for (auto it = values_.lower_bound(key);
       it != values_.end() && absl::StartsWith(it->first, key);) {
    it = values_.erase(it);
  }
  return absl::OkStatus();
}

int InMemoryKeyValueClient::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(values_.size());
}

int InMemoryKeyValueClient::set_calls() const {
  absl::MutexLock lock(&mu_);
  return set_calls_;
}

}  // namespace shardd
