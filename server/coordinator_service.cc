#include "server/coordinator_service.h"

#include <algorithm>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/fingerprint.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "server/hf_config.h"
#include "server/model_util.h"
#include "server/native_spec.h"

namespace shardd {
namespace {

// Deterministic so that equal messages hash equally (map fields would
// otherwise serialize in any order).
std::string SerializeDeterministic(const google::protobuf::MessageLite& msg) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    msg.SerializeToCodedStream(&coded);
  }
  return out;
}

uint64_t RandomIncarnation() {
  std::random_device device;
  uint64_t value = 0;
  while (value == 0) {
    value = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  return value;
}

absl::Status NotYet(absl::string_view rpc, absl::string_view why) {
  return absl::UnimplementedError(
      absl::StrCat(rpc, ": not implemented yet (", why, ")"));
}

constexpr absl::string_view kWorkersIssue =
    "steps land with the workers issue, issue 3";

WorkerRegistryOptions RegistryOptions(const CoordinatorServiceOptions& o) {
  WorkerRegistryOptions options;
  options.max_workers = o.max_workers;
  options.heartbeat_timeout = o.heartbeat_timeout;
  options.clock = o.clock;
  return options;
}
constexpr absl::string_view kCheckpointIssue =
    "checkpoints land with the durability issue, issue 5";

}  // namespace

std::string ModelIdFor(const v1::ModelSpec& spec,
                       const v1::PlanOptions& options) {
  // An empty `dims` means the same as none (parsers differ in setting it);
  // presence matters elsewhere (options.mesh), so only this one is folded.
  std::string spec_bytes;
  if (spec.has_dims() && spec.dims().ByteSizeLong() == 0) {
    v1::ModelSpec canonical = spec;
    canonical.clear_dims();
    spec_bytes = SerializeDeterministic(canonical);
  } else {
    spec_bytes = SerializeDeterministic(spec);
  }
  const std::string option_bytes = SerializeDeterministic(options);
  // The spec's length goes first so that no (spec, options) split of the
  // same byte string collides.
  Fingerprint64 hash;
  hash.AddBytes(absl::StrCat(spec_bytes.size(), ":"));
  hash.AddBytes(spec_bytes);
  hash.AddBytes(option_bytes);
  return absl::StrFormat("m-%016x", hash.value());
}

CoordinatorService::CoordinatorService(const StrategyRegistry* registry,
                                       CoordinatorServiceOptions options)
    : registry_(registry),
      planner_(registry),
      options_([&options] {
        if (!options.clock) options.clock = [] { return absl::Now(); };
        return std::move(options);
      }()),
      incarnation_(options_.incarnation != 0 ? options_.incarnation
                                             : RandomIncarnation()),
      start_time_(options_.clock()),
      workers_(RegistryOptions(options_)),
      kv_(options_.kv),
      barriers_(options_.barriers) {}

absl::StatusOr<v1::ListStrategiesResponse> CoordinatorService::ListStrategies(
    const v1::ListStrategiesRequest& /*request*/) const {
  v1::ListStrategiesResponse response;
  for (v1::StrategyInfo& info : registry_->List()) {
    *response.add_strategies() = std::move(info);
  }
  for (const std::string& arch : SupportedArchitectures()) {
    response.add_supported_architectures(arch);
  }
  return response;
}

absl::StatusOr<v1::ModelSpec> CoordinatorService::ParseSource(
    const v1::SubmitModelRequest& request) const {
  auto too_large = [this](absl::string_view field, size_t size) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ": model description is ", size,
                     " bytes, the limit is ", options_.max_model_bytes));
  };
  switch (request.source_case()) {
    case v1::SubmitModelRequest::kHfConfigJson:
      if (request.hf_config_json().size() > options_.max_model_bytes) {
        return too_large("hf_config_json", request.hf_config_json().size());
      }
      return ModelSpecFromHfConfig(request.hf_config_json());
    case v1::SubmitModelRequest::kNativeSpecJson:
      if (request.native_spec_json().size() > options_.max_model_bytes) {
        return too_large("native_spec_json", request.native_spec_json().size());
      }
      return ModelSpecFromNativeJson(request.native_spec_json());
    case v1::SubmitModelRequest::kSpec: {
      const size_t size = request.spec().ByteSizeLong();
      if (size > options_.max_model_bytes) return too_large("spec", size);
      SHARDD_RETURN_IF_ERROR(ValidateModelSpec(request.spec()));
      return request.spec();
    }
    case v1::SubmitModelRequest::SOURCE_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      "source: one of hf_config_json, native_spec_json, spec is required");
}

absl::StatusOr<v1::ShardingPlan> CoordinatorService::PlanModel(
    const std::string& model_id, const v1::ModelSpec& spec,
    const v1::PlanOptions& options) const {
  SHARDD_ASSIGN_OR_RETURN(v1::ShardingPlan plan, planner_.Plan(spec, options));
  plan.set_model_id(model_id);
  return plan;
}

absl::StatusOr<v1::SubmitModelResponse> CoordinatorService::SubmitModel(
    const v1::SubmitModelRequest& request) {
  SHARDD_ASSIGN_OR_RETURN(v1::ModelSpec spec, ParseSource(request));
  const std::string model_id = ModelIdFor(spec, request.options());

  v1::SubmitModelResponse response;
  response.set_model_id(model_id);
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model_id);
    if (it != models_.end()) {
      *response.mutable_summary() = it->second.summary;
      *response.mutable_plan() = it->second.plan;
      return response;
    }
    if (static_cast<int>(models_.size()) >= options_.max_models) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "models: the coordinator already stores ", models_.size(),
          " models, the limit is ", options_.max_models));
    }
  }

  // Planning runs outside the lock; a concurrent submission of the same
  // content computes the same plan, and the first one stored wins.
  SHARDD_ASSIGN_OR_RETURN(v1::ShardingPlan plan,
                          PlanModel(model_id, spec, request.options()));
  StoredModel stored;
  stored.name = request.name();
  stored.summary = Summarize(spec);
  stored.spec = std::move(spec);
  stored.plan = std::move(plan);
  stored.bytes = stored.spec.ByteSizeLong() + stored.plan.ByteSizeLong();

  absl::MutexLock lock(&mu_);
  auto it = models_.find(model_id);
  if (it == models_.end()) {
    if (static_cast<int>(models_.size()) >= options_.max_models) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "models: the coordinator already stores ", models_.size(),
          " models, the limit is ", options_.max_models));
    }
    // stored_bytes_ never exceeds the limit, so the subtraction is safe.
    if (stored.bytes > options_.max_stored_bytes - stored_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "models: storing this model and plan (", stored.bytes,
          " bytes) would exceed the limit of ", options_.max_stored_bytes,
          " bytes for stored models (", stored_bytes_, " in use)"));
    }
    stored_bytes_ += stored.bytes;
    it = models_.emplace(model_id, std::move(stored)).first;
    order_.push_back(model_id);
  }
  *response.mutable_summary() = it->second.summary;
  *response.mutable_plan() = it->second.plan;
  return response;
}

absl::StatusOr<v1::GetPlanResponse> CoordinatorService::GetPlan(
    const v1::GetPlanRequest& request) const {
  if (request.model_id().empty()) {
    return absl::InvalidArgumentError(
        "model_id: required (the id SubmitModel returned)");
  }
  if (request.has_options() && !request.replan()) {
    return absl::InvalidArgumentError(
        "options: set replan=true to plan with new options; without it the "
        "stored plan is returned");
  }
  v1::GetPlanResponse response;
  v1::ModelSpec spec;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(request.model_id());
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "model_id: no model '", request.model_id(), "' on this coordinator"));
    }
    *response.mutable_summary() = it->second.summary;
    if (!request.replan()) {
      *response.mutable_plan() = it->second.plan;
      return response;
    }
    spec = it->second.spec;
  }
  SHARDD_ASSIGN_OR_RETURN(
      *response.mutable_plan(),
      PlanModel(request.model_id(), spec, request.options()));
  return response;
}

absl::StatusOr<v1::GetStatusResponse> CoordinatorService::GetStatus(
    const v1::GetStatusRequest& /*request*/) const {
  v1::GetStatusResponse response;
  response.set_coordinator_incarnation(incarnation_);
  response.set_uptime_ms(
      absl::ToInt64Milliseconds(options_.clock() - start_time_));
  absl::MutexLock lock(&mu_);
  for (const std::string& id : order_) {
    const StoredModel& stored = models_.at(id);
    v1::ModelInfo* info = response.add_models();
    info->set_model_id(id);
    info->set_name(stored.name);
    info->set_architecture(stored.spec.architecture());
    info->set_strategy(stored.plan.strategy());
    info->set_total_params(stored.summary.total_params());
    info->set_world_size(stored.plan.world_size());
  }
  const absl::Time now = options_.clock();
  for (const WorkerState& worker : workers_.List()) {
    v1::WorkerInfo* info = response.add_workers();
    info->set_rank(worker.rank);
    info->set_address(worker.address);
    info->set_device(worker.device);
    info->set_alive(worker.alive);
    info->set_last_heartbeat_ms_ago(
        absl::ToInt64Milliseconds(now - worker.last_heartbeat));
  }
  return response;
}

absl::StatusOr<v1::RegisterWorkerResponse> CoordinatorService::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  WorkerRegistration worker;
  worker.address = request.address();
  worker.incarnation = request.incarnation();
  worker.device = request.device();
  worker.hostname = request.hostname();
  worker.requested_rank = request.requested_rank();
  SHARDD_ASSIGN_OR_RETURN(RegisterResult result, workers_.Register(worker));
  if (!result.retry) {
    SHARDD_LOG(INFO) << "worker " << request.address() << " (incarnation "
                     << request.incarnation() << ", " << request.device()
                     << ") registered as rank " << result.rank
                     << ", membership epoch " << result.membership_epoch;
  }
  v1::RegisterWorkerResponse response;
  response.set_rank(result.rank);
  response.set_world_size(result.world_size);
  response.set_coordinator_incarnation(incarnation_);
  response.set_heartbeat_interval_ms(std::max<int64_t>(
      1, absl::ToInt64Milliseconds(workers_.heartbeat_interval())));
  response.set_membership_epoch(result.membership_epoch);
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> CoordinatorService::Heartbeat(
    const v1::HeartbeatRequest& request) {
  SHARDD_ASSIGN_OR_RETURN(
      uint64_t epoch,
      workers_.Heartbeat(request.rank(), request.incarnation()));
  v1::HeartbeatResponse response;
  response.set_coordinator_incarnation(incarnation_);
  response.set_membership_epoch(epoch);
  return response;
}

absl::Status CoordinatorService::CheckWorkersReady(int world_size) {
  return workers_.CheckRanksAlive(world_size);
}

absl::StatusOr<v1::PutResponse> CoordinatorService::Put(
    const v1::PutRequest& request) {
  SHARDD_RETURN_IF_ERROR(
      kv_.Put(request.key(), request.value(), request.overwrite()));
  return v1::PutResponse();
}

uint64_t CoordinatorService::GetAsync(const v1::GetRequest& request,
                                      GetCallback done) {
  return kv_.GetAsync(
      request.key(),
      absl::Milliseconds(std::max<int64_t>(0, request.wait_ms())),
      [done = std::move(done)](absl::StatusOr<std::string> value) {
        if (!value.ok()) {
          done(value.status());
          return;
        }
        v1::GetResponse response;
        response.set_value(*std::move(value));
        done(std::move(response));
      });
}

void CoordinatorService::CancelGet(uint64_t handle) { kv_.CancelGet(handle); }

absl::StatusOr<v1::GetResponse> CoordinatorService::Get(
    const v1::GetRequest& request) {
  absl::Notification finished;
  absl::StatusOr<v1::GetResponse> result;
  GetAsync(request, [&](absl::StatusOr<v1::GetResponse> response) {
    result = std::move(response);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::StatusOr<v1::DeleteResponse> CoordinatorService::Delete(
    const v1::DeleteRequest& request) {
  v1::DeleteResponse response;
  response.set_deleted(kv_.Delete(request.key(), request.prefix()));
  return response;
}

uint64_t CoordinatorService::BarrierAsync(const v1::BarrierRequest& request,
                                          BarrierCallback done) {
  if (request.timeout_ms() < 0) {
    done(absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: must be >= 0 (0 waits up to ",
                     absl::FormatDuration(options_.barriers.max_timeout),
                     "), got ", request.timeout_ms())));
    return 0;
  }
  return barriers_.ArriveAsync(request.barrier_id(), request.participants(),
                               request.caller(),
                               absl::Milliseconds(request.timeout_ms()),
                               [done = std::move(done)](absl::Status status) {
                                 if (!status.ok()) {
                                   done(status);
                                   return;
                                 }
                                 done(v1::BarrierResponse());
                               });
}

void CoordinatorService::CancelBarrier(uint64_t handle) {
  barriers_.Cancel(handle);
}

absl::StatusOr<v1::BarrierResponse> CoordinatorService::Barrier(
    const v1::BarrierRequest& request) {
  absl::Notification finished;
  absl::StatusOr<v1::BarrierResponse> result;
  BarrierAsync(request, [&](absl::StatusOr<v1::BarrierResponse> response) {
    result = std::move(response);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::StatusOr<v1::SubmitStepResponse> CoordinatorService::SubmitStep(
    const v1::SubmitStepRequest& /*request*/) {
  return NotYet("SubmitStep", kWorkersIssue);
}

absl::Status CoordinatorService::StartWatchStep(
    const v1::WatchStepRequest& /*request*/) {
  return NotYet("WatchStep", kWorkersIssue);
}

absl::StatusOr<v1::SaveCheckpointResponse> CoordinatorService::SaveCheckpoint(
    const v1::SaveCheckpointRequest& /*request*/) {
  return NotYet("SaveCheckpoint", kCheckpointIssue);
}

absl::StatusOr<v1::LoadCheckpointResponse> CoordinatorService::LoadCheckpoint(
    const v1::LoadCheckpointRequest& /*request*/) {
  return NotYet("LoadCheckpoint", kCheckpointIssue);
}

absl::StatusOr<v1::ListCheckpointsResponse> CoordinatorService::ListCheckpoints(
    const v1::ListCheckpointsRequest& /*request*/) {
  return NotYet("ListCheckpoints", kCheckpointIssue);
}

}  // namespace shardd
