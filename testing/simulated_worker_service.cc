#include "testing/simulated_worker_service.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace shardd {
namespace testing_util {
namespace {

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                 const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

const grpc::Status kCrashed(grpc::StatusCode::UNAVAILABLE,
                            "simulated worker crashed");

}  // namespace

SimulatedWorkerService::SimulatedWorkerService(int workers)
    : crashed_(new std::atomic<bool>[workers]), held_(workers) {
  for (int i = 0; i < workers; ++i) {
    crashed_[i] = false;
    relays_.push_back(std::make_unique<HeartbeatRelay>());
  }
}

SimulatedWorkerService::~SimulatedWorkerService() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(5));
  }
}

absl::StatusOr<std::unique_ptr<SimulatedWorkerService>>
SimulatedWorkerService::Start(int workers) {
  std::unique_ptr<SimulatedWorkerService> service(
      new SimulatedWorkerService(workers));
  grpc::ServerBuilder builder;
  std::vector<int> ports(workers, 0);
  for (int i = 0; i < workers; ++i) {
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &ports[i]);
  }
  builder.RegisterService(service.get());
  builder.SetMaxReceiveMessageSize(256 << 20);
  service->server_ = builder.BuildAndStart();
  if (service->server_ == nullptr) {
    return absl::UnavailableError(
        "simulated workers: the server did not start");
  }
  for (int i = 0; i < workers; ++i) {
    if (ports[i] <= 0) {
      return absl::UnavailableError(
          absl::StrCat("simulated workers: port ", i, " did not bind"));
    }
    service->addresses_.push_back(absl::StrCat("127.0.0.1:", ports[i]));
    service->worker_of_[service->addresses_.back()] = i;
  }
  return service;
}

int SimulatedWorkerService::WorkerOf(
    grpc::CallbackServerContext* context) const {
  const grpc::string_ref authority = context->ExperimentalGetAuthority();
  auto it = worker_of_.find(std::string(authority.data(), authority.size()));
  return it == worker_of_.end() ? -1 : it->second;
}

SimulatedWorkerService::Received SimulatedWorkerService::received() {
  absl::MutexLock lock(&mu_);
  return received_;
}

grpc::ServerUnaryReactor* SimulatedWorkerService::LoadPlan(
    grpc::CallbackServerContext* context, const v1::LoadPlanRequest* request,
    v1::LoadPlanResponse* response) {
  const int i = WorkerOf(context);
  if (i < 0) {
    return Finish(context, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                        "no simulated worker at this port"));
  }
  if (crashed_[i]) return Finish(context, kCrashed);
  const int64_t bytes = static_cast<int64_t>(request->ByteSizeLong());
  absl::MutexLock lock(&mu_);
  ++received_.load_plans;
  received_.load_plan_bytes += bytes;
  received_.largest_load_plan = std::max(received_.largest_load_plan, bytes);
  if (request->has_plan()) ++received_.plans_sent;
  Held& held = held_[i];
  const uint64_t fingerprint = request->has_plan()
                                   ? request->plan().fingerprint()
                                   : request->plan_fingerprint();
  const bool keep = request->keep_state() && held.job == request->job_id() &&
                    held.fingerprint == fingerprint && held.steps >= 0;
  response->set_kept_step(keep ? held.steps : -1);
  if (!keep) held = {request->job_id(), fingerprint, 0};
  return Finish(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* SimulatedWorkerService::Execute(
    grpc::CallbackServerContext* context, const v1::ExecuteRequest* request,
    v1::ExecuteResponse* response) {
  const int i = WorkerOf(context);
  if (i < 0 || crashed_[i]) return Finish(context, kCrashed);
  absl::MutexLock lock(&mu_);
  ++received_.executes;
  const int64_t step = request->program().step();
  if (!request->program().eval()) held_[i].steps = step + 1;
  response->set_loss(2.0);
  response->set_tokens(16);
  response->set_step(held_[i].steps);
  response->set_grad_norm(1.0);
  return Finish(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* SimulatedWorkerService::GetStats(
    grpc::CallbackServerContext* context, const v1::GetStatsRequest* request,
    v1::GetStatsResponse* response) {
  const int i = WorkerOf(context);
  if (i < 0 || crashed_[i]) return Finish(context, kCrashed);
  absl::MutexLock lock(&mu_);
  response->set_job_id(held_[i].job);
  response->set_plan_fingerprint(held_[i].fingerprint);
  response->set_optimizer_steps(held_[i].steps);
  return Finish(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* SimulatedWorkerService::RelayHeartbeat(
    grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  const int i = WorkerOf(context);
  if (i < 0 || crashed_[i]) return Finish(context, kCrashed);
  absl::StatusOr<v1::HeartbeatResponse> answer = relays_[i]->Record(*request);
  if (answer.ok()) *response = *std::move(answer);
  return Finish(context, ToGrpcStatus(answer.status()));
}

}  // namespace testing_util
}  // namespace shardd
