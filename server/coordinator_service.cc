#include "server/coordinator_service.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/fingerprint.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "model/hf_config.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "model/native_spec.h"
#include "planner/activation_model.h"
#include "program/step_program.h"

namespace shardd {
namespace {

// The device of the ranks below `world` among the live workers: CUDA when
// every one of them reports a "cuda:N" device, CPU when any does not, and
// `fallback` when none is registered yet.
v1::WorkerDevice WorkersDevice(const std::vector<WorkerState>& workers,
                               int world, v1::WorkerDevice fallback) {
  int seen = 0;
  for (const WorkerState& w : workers) {
    if (!w.alive || w.rank < 0 || w.rank >= world) continue;
    if (!absl::StartsWith(w.device, "cuda")) return v1::WORKER_DEVICE_CPU;
    ++seen;
  }
  return seen > 0 ? v1::WORKER_DEVICE_CUDA : fallback;
}

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

WorkerRegistryOptions RegistryOptions(const CoordinatorServiceOptions& o,
                                      uint64_t generation) {
  WorkerRegistryOptions options;
  options.max_workers = o.max_workers;
  options.heartbeat_timeout = o.heartbeat_timeout;
  options.heartbeat_relay_group = o.heartbeat_relay_group;
  options.clock = o.clock;
  options.initial_epoch = generation << 32;
  return options;
}

// This run's generation: how many times a coordinator opened the state (0
// without a store, or when it cannot be recorded, which is logged).
uint64_t NextGeneration(JobJournal* journal) {
  if (journal == nullptr) return 0;
  absl::StatusOr<uint64_t> generation = journal->BumpGeneration();
  if (!generation.ok()) {
    SHARDD_LOG(ERROR) << "cannot record the coordinator's generation: "
                      << generation.status()
                      << "; membership epochs start at 0";
    return 0;
  }
  return *generation;
}

JobRunnerOptions JobOptions(const CoordinatorServiceOptions& o,
                            JobJournal* journal) {
  JobRunnerOptions options = o.jobs;
  options.journal = journal;
  return options;
}

// Bounds on a job's config; they keep the numbers far from overflow.
constexpr int32_t kMaxSteps = 100000000;
constexpr int64_t kMaxSeqLen = int64_t{1} << 24;
constexpr int64_t kMaxGlobalBatch = int64_t{1} << 32;
constexpr size_t kMaxDataPathBytes = 4096;
// TrainConfig.eval_batches: 0 means kDefaultEvalBatches.
constexpr int32_t kDefaultEvalBatches = 4;
constexpr int32_t kMaxEvalBatches = 1 << 20;

// The optimizer fields (as worker/exec/optimizer_options.cc checks them;
// 0 / "" mean the defaults).
absl::Status CheckOptimizerConfig(const v1::TrainConfig& config) {
  if (!config.optimizer().empty() && config.optimizer() != "adamw" &&
      config.optimizer() != "muon") {
    return absl::InvalidArgumentError(
        absl::StrCat("config.optimizer: must be one of adamw, muon, got \"",
                     config.optimizer(), "\""));
  }
  const double lr = config.muon_lr(), momentum = config.muon_momentum();
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.muon_lr: must be finite and > 0 (0: the default), got ", lr));
  }
  if (!std::isfinite(momentum) || momentum < 0 || momentum >= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.muon_momentum: must be in [0, 1) (0: the default), got ",
        momentum));
  }
  if (config.muon_ns_steps() < 0 || config.muon_ns_steps() > 100) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.muon_ns_steps: must be in [1, 100] (0: the default), got ",
        config.muon_ns_steps()));
  }
  return absl::OkStatus();
}

// Checks a TrainConfig's ranges (as the workers will, so that a bad value
// fails here rather than on every rank) and sets microbatches 0 to 1, the
// step shape the job is planned for. The other zero values stay: the
// workers fill in the defaults documented on TrainConfig.
absl::StatusOr<v1::TrainConfig> NormalizeTrainConfig(v1::TrainConfig config) {
  if (config.steps() < 1 || config.steps() > kMaxSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.steps: must be in [1, ", kMaxSteps, "], got ", config.steps()));
  }
  if (config.global_batch() < 1 || config.global_batch() > kMaxGlobalBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.global_batch: sequences per step, must be in [1, ",
                     kMaxGlobalBatch, "], got ", config.global_batch()));
  }
  if (config.seq_len() < 1 || config.seq_len() > kMaxSeqLen) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.seq_len: must be in [1, ", kMaxSeqLen, "], got ",
                     config.seq_len()));
  }
  if (config.microbatches() < 0 || config.microbatches() > kMaxMicrobatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.microbatches: must be in [1, ", kMaxMicrobatches,
                     "] (0 means 1), got ", config.microbatches()));
  }
  if (config.microbatches() == 0) config.set_microbatches(1);
  if (config.data_path().size() > kMaxDataPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.data_path: longer than ", kMaxDataPathBytes, " bytes"));
  }
  if (config.eval_data_path().size() > kMaxDataPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.eval_data_path: longer than ", kMaxDataPathBytes, " bytes"));
  }
  if (config.eval_every() < 0 || config.eval_every() > kMaxSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.eval_every: steps between evaluations, must be in [0, ",
        kMaxSteps, "] (0: only after the last step), got ",
        config.eval_every()));
  }
  if (config.eval_batches() < 0 || config.eval_batches() > kMaxEvalBatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.eval_batches: global batches per evaluation, must be in [1, ",
        kMaxEvalBatches, "] (0: the default ", kDefaultEvalBatches, "), got ",
        config.eval_batches()));
  }
  if (config.eval_data_path().empty() &&
      (config.eval_every() > 0 || config.eval_batches() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.eval_data_path: required with eval_every (",
        config.eval_every(), ") or eval_batches (", config.eval_batches(),
        "): the token file the held-out loss is computed on"));
  }
  if (!config.eval_data_path().empty() && config.eval_batches() == 0) {
    config.set_eval_batches(kDefaultEvalBatches);
  }
  struct Value {
    const char* name;
    double value;
    const char* allowed;
    bool ok;
  };
  auto finite = [](double x) { return std::isfinite(x); };
  const Value values[] = {
      {"lr", config.lr(), "finite and >= 0 (0: the default)",
       finite(config.lr()) && config.lr() >= 0},
      {"beta1", config.beta1(), "in [0, 1) (0: the default)",
       finite(config.beta1()) && config.beta1() >= 0 && config.beta1() < 1},
      {"beta2", config.beta2(), "in [0, 1) (0: the default)",
       finite(config.beta2()) && config.beta2() >= 0 && config.beta2() < 1},
      {"eps", config.eps(), "finite and >= 0 (0: the default)",
       finite(config.eps()) && config.eps() >= 0},
      {"weight_decay", config.weight_decay(), "finite and >= 0",
       finite(config.weight_decay()) && config.weight_decay() >= 0},
      {"grad_clip", config.grad_clip(),
       "finite (0: the default, negative: no clipping)",
       finite(config.grad_clip())},
  };
  for (const Value& v : values) {
    if (!v.ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.", v.name, ": must be ", v.allowed, ", got ", v.value));
    }
  }
  SHARDD_RETURN_IF_ERROR(CheckOptimizerConfig(config));
  return config;
}

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
      journal_(options_.state != nullptr
                   ? std::make_unique<JobJournal>(options_.state)
                   : nullptr),
      generation_(NextGeneration(journal_.get())),
      workers_(RegistryOptions(options_, generation_)),
      kv_(options_.kv),
      barriers_(options_.barriers),
      jobs_(std::make_unique<JobRunner>(&workers_, options_.worker_clients,
                                        JobOptions(options_, journal_.get()))) {
  LoadStoredModels();
}

void CoordinatorService::LoadStoredModels() {
  if (options_.state == nullptr) return;
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> rows =
      options_.state->List("models");
  if (!rows.ok()) {
    SHARDD_LOG(ERROR) << "cannot read stored models from "
                      << options_.state->path() << ": " << rows.status();
    return;
  }
  absl::MutexLock lock(&mu_);
  for (const auto& [model_id, bytes] : *rows) {
    v1::StoredModelRecord record;
    if (!record.ParseFromString(bytes)) {
      // Never silently: the operator must see that a model is missing.
      SHARDD_LOG(ERROR) << "stored model " << model_id
                        << " does not parse; it is not loaded";
      continue;
    }
    StoredModel stored;
    stored.name = record.name();
    stored.options = std::move(*record.mutable_options());
    stored.summary = Summarize(record.spec());
    stored.spec = std::move(*record.mutable_spec());
    stored.plan = std::move(*record.mutable_plan());
    stored.bytes = stored.spec.ByteSizeLong() + stored.plan.ByteSizeLong();
    stored_bytes_ += stored.bytes;
    models_.emplace(model_id, std::move(stored));
    order_.push_back(model_id);
  }
  SHARDD_LOG(INFO) << "loaded " << order_.size() << " stored models from "
                   << options_.state->path();
}

CoordinatorService::~CoordinatorService() { Shutdown(); }

void CoordinatorService::Shutdown() { jobs_->Shutdown(); }

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
  if (request.options().lora().rank() != 0 ||
      request.options().lora().targets_size() > 0) {
    // The adapters are parameters of the model the plan is cut from.
    absl::Status lora = ApplyLora(request.options().lora(), &spec);
    if (!lora.ok()) {
      return absl::Status(lora.code(),
                          absl::StrCat("options.", lora.message()));
    }
  }
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
  stored.options = request.options();
  stored.summary = Summarize(spec);
  stored.spec = std::move(spec);
  stored.plan = std::move(plan);
  // Options are a few bytes next to the plan; not counted.
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
    if (options_.state != nullptr) {
      // Durable before acknowledged (and before other callers see it).
      v1::StoredModelRecord record;
      record.set_name(stored.name);
      *record.mutable_spec() = stored.spec;
      *record.mutable_options() = stored.options;
      *record.mutable_plan() = stored.plan;
      std::string bytes;
      if (!record.SerializeToString(&bytes)) {
        return absl::InternalError("cannot serialize the model record");
      }
      const absl::Status saved = options_.state->Put("models", model_id, bytes);
      if (!saved.ok()) {
        return absl::UnavailableError(absl::StrCat(
            "the model could not be stored durably: ", saved.message()));
      }
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
  response.set_insecure(options_.insecure_warning);
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
    info->set_insecure(worker.insecure);
  }
  for (const JobSummary& job : jobs_->ListJobs()) {
    v1::JobInfo* info = response.add_jobs();
    info->set_job_id(job.job_id);
    info->set_model_id(job.model_id);
    info->set_state(job.state);
    info->set_world_size(job.world_size);
    info->set_steps_done(job.steps_done);
    info->set_total_steps(job.total_steps);
    info->set_loss(job.last_loss);
    info->set_tokens_per_second(job.tokens_per_second);
    info->set_lr(job.last_lr);
    if (job.last_eval_loss.has_value()) {
      info->set_eval_loss(*job.last_eval_loss);
    }
    info->set_error(job.error);
    info->set_recoveries(job.recoveries);
    info->set_last_checkpoint(job.last_checkpoint);
    info->set_checkpoint_failures(job.checkpoint_failures);
    info->set_last_checkpoint_error(job.last_checkpoint_error);
  }
  const CheckpointCounters counters = jobs_->checkpoint_counters();
  response.set_checkpoint_failures_total(counters.failures);
  response.set_checkpoints_deleted_total(counters.deleted);
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
  worker.insecure = request.insecure();
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
  if (request.relayed_size() > kMaxRelayedHeartbeats) {
    return absl::InvalidArgumentError(absl::StrCat(
        "relayed: at most ", kMaxRelayedHeartbeats,
        " relayed heartbeats per call, got ", request.relayed_size()));
  }
  SHARDD_ASSIGN_OR_RETURN(
      uint64_t epoch,
      workers_.Heartbeat(request.rank(), request.incarnation()));
  v1::HeartbeatResponse response;
  response.set_coordinator_incarnation(incarnation_);
  // The relay's own beat went through, so it speaks for live workers: each
  // relayed beat counts as that worker's, and a refusal goes back by rank.
  for (const v1::RelayedHeartbeat& beat : request.relayed()) {
    absl::StatusOr<uint64_t> relayed =
        workers_.Heartbeat(beat.rank(), beat.incarnation());
    if (relayed.ok()) {
      epoch = std::max(epoch, *relayed);
      continue;
    }
    v1::RelayedHeartbeatError* error = response.add_relayed_errors();
    error->set_rank(beat.rank());
    error->set_code(static_cast<int>(relayed.status().code()));
    error->set_message(std::string(relayed.status().message()));
  }
  response.set_membership_epoch(epoch);
  if (std::optional<std::pair<int, std::string>> relay =
          workers_.RelayFor(request.rank())) {
    response.set_relay_rank(relay->first);
    response.set_relay_address(relay->second);
  }
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
    const v1::SubmitStepRequest& request) {
  if (request.model_id().empty()) {
    return absl::InvalidArgumentError(
        "model_id: required (the id SubmitModel returned)");
  }
  SHARDD_ASSIGN_OR_RETURN(v1::TrainConfig config,
                          NormalizeTrainConfig(request.config()));
  if (!options_.worker_clients) {
    return absl::FailedPreconditionError(
        "SubmitStep: this coordinator has no worker transport configured");
  }
  JobSpec job;
  job.model_id = request.model_id();
  v1::PlanOptions options;
  int world = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(request.model_id());
    if (it == models_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "model_id: no model '", request.model_id(), "' on this coordinator"));
    }
    job.model = it->second.spec;
    options = it->second.options;
    // The model's plan has the job's mesh (the step shape does not change
    // the world).
    world = it->second.plan.world_size();
  }
  const int64_t split = int64_t{world} * config.microbatches();
  if (world < 1 || config.global_batch() % split != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.global_batch: must be divisible by world size x "
        "microbatches (",
        world, " x ", config.microbatches(), " = ", split,
        ") so that every rank trains on the same number of sequences, got ",
        config.global_batch()));
  }
  const int64_t micro_batch = config.global_batch() / split;
  if (micro_batch > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.global_batch: ", micro_batch,
        " sequences per micro-batch and rank is more than the activation "
        "model counts"));
  }
  // The memory model depends on the step shape and the micro-batch: plan
  // for the ones the workers will run, with the activations the ranks will
  // hold (and the layers that recompute).
  options.set_microbatches(config.microbatches());
  options.set_defer_grad_sync(config.defer_grad_sync());
  options.set_include_timeline(false);
  options.set_micro_batch_size(static_cast<int32_t>(micro_batch));
  options.set_seq_len(config.seq_len());
  options.set_response_length(config.diffusion().response_length());
  // The activations the ranks will hold depend on their device: plan for
  // the workers registered now (GPU workers when every live one is).
  options.set_worker_device(
      WorkersDevice(workers_.List(), world, options.worker_device()));
  SHARDD_ASSIGN_OR_RETURN(job.plan,
                          PlanModel(request.model_id(), job.model, options));
  absl::StatusOr<v1::StepProgram> program = CompileStepProgram(job.plan);
  if (!program.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step program: ", program.status().message()));
  }
  job.program = *std::move(program);
  job.plan_options = options;
  if (!config.eval_data_path().empty()) {
    absl::StatusOr<v1::StepProgram> eval = CompileEvalProgram(job.plan);
    if (!eval.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("eval program: ", eval.status().message()));
    }
    job.eval_program = *std::move(eval);
  }
  job.config = std::move(config);
  SHARDD_ASSIGN_OR_RETURN(std::string job_id, jobs_->Submit(std::move(job)));
  SHARDD_LOG(INFO) << "job " << job_id << " queued: model "
                   << request.model_id() << " on " << world << " workers";
  v1::SubmitStepResponse response;
  response.set_job_id(job_id);
  response.set_world_size(world);
  return response;
}

absl::StatusOr<StepWatch> CoordinatorService::WatchStep(
    const v1::WatchStepRequest& request) {
  if (request.job_id().empty()) {
    return absl::InvalidArgumentError(
        "job_id: required (the id SubmitStep returned)");
  }
  if (request.from_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_step: must be >= 0 (0 replays every event), got ",
                     request.from_step()));
  }
  StepWatch watch;
  SHARDD_ASSIGN_OR_RETURN(watch.log, jobs_->Events(request.job_id()));
  watch.start_index = watch.log->StartIndex(request.from_step());
  return watch;
}

void CoordinatorService::SaveCheckpointAsync(
    const v1::SaveCheckpointRequest& request, SaveCheckpointCallback done) {
  if (request.job_id().empty()) {
    return done(absl::InvalidArgumentError(
        "job_id: required (the running job to checkpoint)"));
  }
  jobs_->RequestSave(
      request.job_id(),
      [done = std::move(done)](absl::StatusOr<CheckpointResult> result) {
        if (!result.ok()) return done(result.status());
        v1::SaveCheckpointResponse response;
        response.set_checkpoint(result->checkpoint);
        response.set_step(result->step);
        done(std::move(response));
      });
}

void CoordinatorService::LoadCheckpointAsync(
    const v1::LoadCheckpointRequest& request, LoadCheckpointCallback done) {
  if (request.job_id().empty()) {
    return done(absl::InvalidArgumentError(
        "job_id: required (the running job to roll back)"));
  }
  jobs_->RequestLoad(
      request.job_id(), request.checkpoint(),
      [done = std::move(done)](absl::StatusOr<CheckpointResult> result) {
        if (!result.ok()) return done(result.status());
        v1::LoadCheckpointResponse response;
        response.set_step(result->step);
        done(std::move(response));
      });
}

absl::StatusOr<v1::ListCheckpointsResponse> CoordinatorService::ListCheckpoints(
    const v1::ListCheckpointsRequest& request) {
  if (options_.jobs.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "ListCheckpoints: this coordinator has no checkpoint directory "
        "(start it with --checkpoint-dir or --data-dir)");
  }
  SHARDD_ASSIGN_OR_RETURN(
      std::vector<v1::CheckpointInfo> found,
      ListJobCheckpoints(options_.jobs.checkpoint_dir, request.job_id()));
  v1::ListCheckpointsResponse response;
  for (v1::CheckpointInfo& info : found) {
    *response.add_checkpoints() = std::move(info);
  }
  return response;
}

}  // namespace shardd
