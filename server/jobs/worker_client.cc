#include "server/jobs/worker_client.h"

#include <thread>
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

namespace {

// Runs `call` (a blocking client call) on a detached thread: the caller
// waits for `done`, which is the last thing the thread does with any of
// its arguments.
template <typename Response, typename Call>
void OnThread(Call call, Response* response, WorkerClient::DoneCallback done) {
  std::thread([call = std::move(call), response,
               done = std::move(done)]() mutable {
    absl::StatusOr<Response> result = call();
    if (result.ok()) *response = *std::move(result);
    done(result.status());
  }).detach();
}

}  // namespace

void WorkerClient::LoadPlanAsync(const v1::LoadPlanRequest& request,
                                 const WorkerCallOptions& options,
                                 v1::LoadPlanResponse* response,
                                 DoneCallback done) {
  OnThread([this, &request, options] { return LoadPlan(request, options); },
           response, std::move(done));
}

void WorkerClient::ExecuteAsync(const v1::ExecuteRequest& request,
                                const WorkerCallOptions& options,
                                v1::ExecuteResponse* response,
                                DoneCallback done) {
  OnThread([this, &request, options] { return Execute(request, options); },
           response, std::move(done));
}

bool CallCanceller::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

}  // namespace shardd
