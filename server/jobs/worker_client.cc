#include "server/jobs/worker_client.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardd {

uint64_t CallCanceller::Add(std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) {
    cancel();
    return 0;
  }
  const uint64_t handle = next_handle_++;
  callbacks_.emplace(handle, std::move(cancel));
  return handle;
}

void CallCanceller::Remove(uint64_t handle) {
  if (handle == 0) return;
  // Callbacks run under mu_, so once this holds the lock none is running.
  absl::MutexLock lock(&mu_);
  callbacks_.erase(handle);
}

void CallCanceller::Cancel() {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return;
  cancelled_ = true;
  for (auto& [handle, cancel] : callbacks_) cancel();
  callbacks_.clear();
}

absl::StatusOr<v1::SaveShardsResponse> WorkerClient::SaveShards(
    const v1::SaveShardsRequest&, const WorkerCallOptions&) {
  return absl::UnimplementedError(
      absl::StrCat("SaveShards: not supported by the client of ", address()));
}

absl::StatusOr<v1::LoadShardsResponse> WorkerClient::LoadShards(
    const v1::LoadShardsRequest&, const WorkerCallOptions&) {
  return absl::UnimplementedError(
      absl::StrCat("LoadShards: not supported by the client of ", address()));
}

absl::StatusOr<v1::HealReplicasResponse> WorkerClient::HealReplicas(
    const v1::HealReplicasRequest&, const WorkerCallOptions&) {
  return absl::UnimplementedError(
      absl::StrCat("HealReplicas: not supported by the client of ", address()));
}

bool CallCanceller::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

}  // namespace shardd
