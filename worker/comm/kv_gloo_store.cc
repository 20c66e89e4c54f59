#include "worker/comm/kv_gloo_store.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/comm/gloo_status.h"

namespace shardd {
namespace {

[[noreturn]] void ThrowStatus(const absl::Status& status,
                              absl::string_view operation,
                              const std::string& key) {
  throw GlooStatusError(absl::Status(
      status.code(), absl::StrCat("rendezvous store ", operation, " '", key,
                                  "': ", status.message())));
}

}  // namespace

KvGlooStore::KvGlooStore(KeyValueClient* client, absl::Duration timeout)
    : client_(client),
      timeout_(timeout > absl::ZeroDuration() ? timeout
                                              : absl::Milliseconds(1)) {}

void KvGlooStore::set(const std::string& key, const std::vector<char>& data) {
  const absl::Status status =
      client_->Set(key, std::string(data.begin(), data.end()));
  if (!status.ok()) ThrowStatus(status, "set", key);
}

std::vector<char> KvGlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = client_->Get(key, timeout_);
  if (!value.ok()) ThrowStatus(value.status(), "get", key);
  return std::vector<char>(value->begin(), value->end());
}

void KvGlooStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(0));
}

void KvGlooStore::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  absl::Duration limit = timeout_;
  if (timeout.count() > 0) {
    limit = std::min(limit, absl::Milliseconds(timeout.count()));
  }
  const absl::Time deadline = absl::Now() + limit;
  for (const std::string& key : keys) {
    // The key-value service has no "exists" call; a Get that returns the
    // value is the wait.
    const absl::Duration left =
        std::max(deadline - absl::Now(), absl::ZeroDuration());
    absl::StatusOr<std::string> value = client_->Get(key, left);
    if (!value.ok()) ThrowStatus(value.status(), "wait for", key);
  }
}

}  // namespace shardd
