#include "worker/worker_runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/peft_adapters.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "layout/initial_values.h"
#include "model/lora.h"
#include "model/model_util.h"
#include "planner/sharding_planner.h"
#include "planner/strategy_registry.h"
#include "program/pass_layout.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/kv_gloo_store.h"
#include "worker/data/batch_sampler.h"
#include "worker/exec/step_runner.h"
#include "worker/model/moe_architecture.h"
#include "worker/shards/shard_checkpoint.h"
#include "worker/shards/shard_state_transfer.h"
#include "worker/worker_runtime_internal.h"

#ifdef SHARDD_WITH_CUDA
#include "kernels/cuda/cuda_status.h"
#include "worker/exec/device_step_runner.h"
#endif

namespace shardd {

bool DeviceStepsSupported() {
#ifdef SHARDD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::Status CheckDeviceUsable(int device) {
#ifdef SHARDD_WITH_CUDA
  return CheckCudaDevice(device);
#else
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA device ", device, ": this binary was built without CUDA"));
#endif
}

namespace {

// The plan must have been cut from `model`: same mesh arithmetic, every
// unit parameter present in the model with the same shape, same total.
absl::Status CheckPlanMatchesModel(const v1::ShardingPlan& plan,
                                   const v1::ModelSpec& model) {
  SHARDD_RETURN_IF_ERROR(ValidateModelSpec(model));
  const v1::MeshSpec& mesh = plan.mesh();
  if (mesh.dp_shard() < 1 || mesh.dp_replicate() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan.mesh: dp_shard and dp_replicate must be >= 1, got ",
                     mesh.dp_shard(), " and ", mesh.dp_replicate()));
  }
  if (mesh.tp() > 1 || mesh.cp() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.mesh: tp and cp must be 1, got ", mesh.tp(), " and ", mesh.cp()));
  }
  const int64_t world =
      static_cast<int64_t>(mesh.dp_shard()) * mesh.dp_replicate();
  if (plan.world_size() != world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.world_size: ", plan.world_size(), " is not dp_shard (",
        mesh.dp_shard(), ") x dp_replicate (", mesh.dp_replicate(), ")"));
  }
  if (plan.units_size() == 0) {
    return absl::InvalidArgumentError("plan.units: the plan has no units");
  }
  absl::flat_hash_map<std::string, const v1::TensorSpec*> params;
  for (const ParamRef& ref : ListParams(model)) params[ref.fqn] = ref.tensor;
  for (const v1::FsdpUnit& unit : plan.units()) {
    for (const v1::ParamLayout& param : unit.params()) {
      auto it = params.find(param.name());
      if (it == params.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan.units[", unit.index(), "] (", unit.name(), "): parameter ",
            param.name(), " is not in the model (plan and model differ)"));
      }
      if (!std::equal(param.global_shape().begin(), param.global_shape().end(),
                      it->second->shape().begin(), it->second->shape().end())) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan.units[", unit.index(), "] (", unit.name(),
                         "): parameter ", param.name(), " has shape ",
                         ShapeText(param.global_shape()), " in the plan but ",
                         ShapeText(it->second->shape()), " in the model"));
      }
    }
  }
  const int64_t total = Summarize(model).total_params();
  if (plan.total_params() != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan.total_params: ", plan.total_params(), " but the model has ",
        total, " parameters (plan and model differ)"));
  }
  return absl::OkStatus();
}

// Adds every counter of `from` to `to` (all collective kinds).
void AddCommunicatorStats(const CommunicatorStats& from,
                          CommunicatorStats* to) {
  for (auto [src, dst] :
       {std::make_pair(&from.all_gather, &to->all_gather),
        std::make_pair(&from.reduce_scatter, &to->reduce_scatter),
        std::make_pair(&from.all_reduce, &to->all_reduce),
        std::make_pair(&from.broadcast, &to->broadcast),
        std::make_pair(&from.barrier, &to->barrier),
        std::make_pair(&from.all_to_all, &to->all_to_all)}) {
    dst->calls += src->calls;
    dst->failures += src->failures;
    dst->bytes += src->bytes;
    dst->time += src->time;
  }
}

}  // namespace

absl::StatusOr<std::string> ResolveUnderRoot(const std::string& root,
                                             const std::string& relative,
                                             absl::string_view field) {
  const std::string allowed =
      "a relative path under the checkpoint root, without '.', '..' or "
      "empty components";
  if (relative.empty() || relative.front() == '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected ", allowed, ", got '", relative, "'"));
  }
  for (absl::string_view part : absl::StrSplit(relative, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": expected ", allowed, ", got '", relative, "'"));
    }
  }
  return absl::StrCat(root, "/", relative);
}

absl::Status CheckUnderRoot(const std::string& root, const std::string& path,
                            absl::string_view field) {
  std::error_code ec;
  const std::filesystem::path r = std::filesystem::weakly_canonical(root, ec);
  std::filesystem::path p;
  if (!ec) p = std::filesystem::weakly_canonical(path, ec);
  if (!ec) {
    auto [root_end, unused] =
        std::mismatch(r.begin(), r.end(), p.begin(), p.end());
    if (root_end == r.end()) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": '", path,
                   "' is not under this worker's --weights-root '", root, "'"));
}

absl::StatusOr<int64_t> ModelVocabSize(const v1::ModelSpec& model) {
  int64_t vocab = 0;
  ForEachParam(model, [&](const ParamRef& ref) {
    if (vocab == 0 && ref.path.back()->kind() == v1::MODULE_EMBEDDING &&
        ref.tensor->shape_size() > 0) {
      vocab = ref.tensor->shape(0);
    }
  });
  if (vocab == 0) vocab = model.dims().vocab_size();
  if (vocab < 1) {
    return absl::InvalidArgumentError(
        "model: no vocabulary size (no MODULE_EMBEDDING parameter and no "
        "dims.vocab_size)");
  }
  return vocab;
}

WorkerRuntime::WorkerRuntime(WorkerRuntimeOptions options)
    : options_(std::move(options)) {}

WorkerRuntime::~WorkerRuntime() { Reset(); }

void WorkerRuntime::Reset() {
  absl::MutexLock lock(&mu_);
  retained_.reset();
  DropJobLocked();
  PublishJobLocked();
}

absl::Status WorkerRuntime::JobHealthLocked() const {
  if (!job_->failed.ok()) return job_->failed;
  return job_->steps->executor().health();
}

void WorkerRuntime::PublishJobLocked() {
  JobInfo info;
  if (job_ != nullptr) {
    info.job_id = job_->job_id;
    info.plan_fingerprint = job_->plan.fingerprint();
    info.optimizer_steps =
        job_->state_lost ? -1 : job_->steps->executor().optimizer_steps();
    info.step_failed = !JobHealthLocked().ok();
  } else if (retained_ != nullptr) {
    info.job_id = retained_->job_id;
    info.plan_fingerprint = retained_->plan_fingerprint;
    info.optimizer_steps = retained_->optimizer_steps;
    info.step_failed = true;
  }
  absl::MutexLock lock(&stats_mu_);
  live_job_ = std::move(info);
}

std::unique_ptr<WorkerRuntime::KeptState> WorkerRuntime::TakeKeptStateLocked(
    const std::string& job_id, uint64_t fingerprint) {
  if (job_ == nullptr) {
    if (retained_ != nullptr && retained_->job_id == job_id &&
        retained_->plan_fingerprint == fingerprint) {
      return std::move(retained_);
    }
    return nullptr;
  }
  if (job_->job_id != job_id || job_->plan.fingerprint() != fingerprint ||
      job_->state_lost) {
    return nullptr;
  }
  const StepExecutor* executor = &job_->steps->executor();
  // A failed executor is fine: its step committed fully or not at all, so
  // the masters and moments are those of its optimizer step count (on a
  // GPU: the host copy waits for the device, which a failed CUDA context
  // refuses; then the state is lost and the job restores a checkpoint).
  absl::StatusOr<ShardStateSnapshot> snapshot =
      CaptureShardState(*executor->shard_state());
  if (!snapshot.ok()) {
    SHARDD_LOG(WARNING) << "job " << job_id
                        << ": the shards could not be kept: "
                        << snapshot.status();
    return nullptr;
  }
  auto kept = std::make_unique<KeptState>();
  kept->job_id = job_id;
  kept->plan_fingerprint = fingerprint;
  kept->optimizer_steps = executor->optimizer_steps();
  kept->snapshot = *std::move(snapshot);
  return kept;
}

void WorkerRuntime::DropJobLocked() {
  if (job_ == nullptr) return;
  {
    absl::MutexLock lock(&stats_mu_);
    if (live_shard_group_ != nullptr) {
      AddCommunicatorStats(live_shard_group_->stats(), &retired_);
    }
    live_shard_group_ = nullptr;
    live_memory_ = nullptr;
  }
  job_.reset();
}

bool WorkerRuntime::has_plan() const {
  absl::MutexLock lock(&mu_);
  return job_ != nullptr;
}

uint64_t WorkerRuntime::plan_fingerprint() const {
  absl::MutexLock lock(&mu_);
  return job_ == nullptr ? 0 : job_->plan.fingerprint();
}

absl::Status WorkerRuntime::WithExecutor(
    absl::FunctionRef<void(const StepExecutor&)> fn) const {
  absl::MutexLock lock(&mu_);
  if (job_ == nullptr) {
    return WithErrorReason(
        absl::FailedPreconditionError("no plan loaded: call LoadPlan first"),
        kReasonPlanNotHeld);
  }
  const StepExecutor* executor = &job_->steps->executor();
  if (executor->host_shards() == nullptr) {
    return absl::FailedPreconditionError(
        "the job's steps run on a GPU: there is no CPU StepExecutor");
  }
  fn(*executor);
  return absl::OkStatus();
}

namespace {

// A job's starting values: LoRA adapters from PEFT's files (--lora-from),
// the rest from a Hugging Face checkpoint (--init-from); what neither
// holds starts from the seeded initialisation.
class BaseAndAdapters : public InitialValues {
 public:
  BaseAndAdapters(const InitialValues* base, const InitialValues* adapters)
      : base_(base), adapters_(adapters) {}

  absl::Status Read(const std::string& name, const v1::TensorSpec& tensor,
                    int64_t begin, int64_t end, float* out) const override {
    const InitialValues* from = Source(name);
    if (from == nullptr) {
      return absl::InternalError(
          absl::StrCat("parameter '", name, "': no initial values"));
    }
    return from->Read(name, tensor, begin, end, out);
  }
  bool Provides(const std::string& name) const override {
    return Source(name) != nullptr;
  }

 private:
  const InitialValues* Source(const std::string& name) const {
    return IsLoraAdapter(name) ? adapters_ : base_;
  }
  const InitialValues* base_;
  const InitialValues* adapters_;
};

// LoadPlanRequest's plan, given or derived from the model and options.
absl::StatusOr<v1::ShardingPlan> RequestPlan(
    const v1::LoadPlanRequest& request) {
  if (request.has_plan() || !request.has_plan_options()) {
    return request.plan();
  }
  static const StrategyRegistry* const registry =
      StrategyRegistry::CreateWithBuiltins().release();
  absl::StatusOr<v1::ShardingPlan> plan =
      ShardingPlanner(registry).Plan(request.model(), request.plan_options());
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("plan_options: planning the model here: ",
                                     plan.status().message()));
  }
  if (plan->fingerprint() != request.plan_fingerprint()) {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "plan_options: this worker plans the model with fingerprint ",
            plan->fingerprint(), ", the coordinator's plan has ",
            request.plan_fingerprint(),
            " (another build?): send the plan itself")),
        kReasonPlanDerivationMismatch);
  }
  plan->set_model_id(request.model_id());
  return plan;
}

}  // namespace

absl::StatusOr<v1::LoadPlanResponse> WorkerRuntime::LoadPlan(
    const v1::LoadPlanRequest& request, KeyValueClient* kv) {
  SHARDD_ASSIGN_OR_RETURN(const v1::ShardingPlan plan, RequestPlan(request));
  // Everything that can be checked locally is checked before the current
  // job is dropped: a bad request changes nothing.
  SHARDD_RETURN_IF_ERROR(CheckPlanMatchesModel(plan, request.model()));
  const int world = plan.world_size();
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = plan.mesh().dp_replicate();
  if (request.rank() < 0 || request.rank() >= world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank: must be in [0, ", world, ") (the plan's world: ", dp_shard,
        " x ", dp_replicate, "), got ", request.rank()));
  }
  if (request.job_id().empty()) {
    return absl::InvalidArgumentError(
        "job_id: must be non-empty (it names the job's collective groups)");
  }
  if (request.collective_timeout_ms() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "collective_timeout_ms: must be >= 0 (0 = default ",
        absl::ToInt64Milliseconds(options_.default_collective_timeout),
        "), got ", request.collective_timeout_ms()));
  }
  SHARDD_ASSIGN_OR_RETURN(
      const v1::TrainConfig train,
      ResolveTrainConfig(request.train(), world, plan.step().microbatches()));
  SHARDD_ASSIGN_OR_RETURN(const int64_t vocab, ModelVocabSize(request.model()));

  auto job = std::make_unique<Job>();
  job->plan = plan;
  job->train = train;
  job->job_id = request.job_id();
  job->membership_epoch = request.membership_epoch();
  job->rank = request.rank();
  job->shard_rank = request.rank() % dp_shard;
  job->replica_rank = request.rank() / dp_shard;

  data::DataSourceOptions source_options;
  source_options.path = train.data_path();
  source_options.packing = !train.no_packing();
  source_options.offsets = train.data_order() == "strided"
                               ? data::OffsetMode::kStrided
                               : data::OffsetMode::kRandom;
  source_options.model_vocab_size = vocab;
  source_options.seed = train.seed();
  source_options.synthetic_order = train.synthetic_order();
  if (request.model().architecture() == kBlockDiffusionArchitecture &&
      plan.step().passes() == 3) {
    // An SFT dataset's rows split into prompt and canvas per example.
    const int64_t block = request.model().dims().canvas_length();
    source_options.diffusion.block = block;
    source_options.diffusion.canvas =
        DiffusionCanvasRows(block, train.diffusion().response_length());
  }
  SHARDD_ASSIGN_OR_RETURN(std::shared_ptr<const data::SequenceSource> source,
                          data::CreateDataSource(source_options));
  if (const absl::Status fits = source->CheckSequenceLength(train.seq_len());
      !fits.ok()) {
    return absl::Status(fits.code(),
                        absl::StrCat("train.data_path: ", fits.message()));
  }
  job->entropy_rate = source->BestLoss(train.seq_len());
  job->one_token_loss = source->OneTokenLoss(train.seq_len());
  data::BatchSamplerOptions sampler_options;
  sampler_options.global_batch = train.global_batch();
  sampler_options.seq_len = train.seq_len();
  sampler_options.microbatches = train.microbatches();
  sampler_options.ranks = world;
  sampler_options.model_vocab_size = vocab;
  SHARDD_ASSIGN_OR_RETURN(data::BatchSampler sampler,
                          data::BatchSampler::Create(source, sampler_options));
  job->sampler = std::make_unique<data::BatchSampler>(std::move(sampler));
  if (!train.eval_data_path().empty()) {
    // The same batches every evaluation: the file in order from its start.
    data::DataSourceOptions eval_options = source_options;
    eval_options.path = train.eval_data_path();
    eval_options.offsets = data::OffsetMode::kStrided;
    eval_options.synthetic_order = 0;
    absl::StatusOr<std::shared_ptr<const data::SequenceSource>> eval_source =
        data::CreateDataSource(eval_options);
    if (!eval_source.ok()) {
      return absl::Status(eval_source.status().code(),
                          absl::StrCat("train.eval_data_path: ",
                                       eval_source.status().message()));
    }
    SHARDD_ASSIGN_OR_RETURN(
        data::BatchSampler eval_sampler,
        data::BatchSampler::Create(*std::move(eval_source), sampler_options));
    job->eval_sampler =
        std::make_unique<data::BatchSampler>(std::move(eval_sampler));
  }

  if (world > 1 && kv == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "world size ", world,
        " needs the coordinator's key-value store for the collective "
        "rendezvous, and this worker has none (start it with --coordinator)"));
  }

  absl::MutexLock lock(&mu_);
  std::unique_ptr<KeptState> kept;
  if (request.keep_state()) {
    kept = TakeKeptStateLocked(request.job_id(), plan.fingerprint());
  }
  // Any other retained state belongs to a job this request replaces.
  retained_.reset();
  // Dropped before the rendezvous, as without keep_state: its
  // communicators close, so peers still blocked on them fail now.
  DropJobLocked();
  tracker_.ResetPeaks();
  absl::StatusOr<v1::LoadPlanResponse> response =
      BuildJobLocked(request, kv, std::move(job), &kept);
  if (!response.ok() && kept != nullptr) {
    SHARDD_LOG(WARNING) << "LoadPlan of job " << request.job_id()
                        << " failed; retaining its state of step "
                        << kept->optimizer_steps
                        << " for a later keep_state LoadPlan";
    retained_ = std::move(kept);
  }
  PublishJobLocked();
  return response;
}

absl::StatusOr<v1::LoadPlanResponse> WorkerRuntime::BuildJobLocked(
    const v1::LoadPlanRequest& request, KeyValueClient* kv,
    std::unique_ptr<Job> job, std::unique_ptr<KeptState>* kept) {
  // The request's or the derived one (LoadPlan).
  const v1::ShardingPlan& plan = job->plan;
  const v1::TrainConfig& train = job->train;
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = plan.mesh().dp_replicate();
  const absl::Duration timeout =
      request.collective_timeout_ms() > 0
          ? absl::Milliseconds(request.collective_timeout_ms())
          : options_.default_collective_timeout;
  job->collective_timeout = timeout;
  const std::string base =
      absl::StrCat(request.job_id(), "/", request.membership_epoch(), "/");
  StepExecutorOptions executor_options;
  executor_options.shard_rank = job->shard_rank;
  executor_options.replica_rank = job->replica_rank;
  executor_options.seed = request.seed();
  executor_options.collective_timeout = timeout;
  executor_options.adamw = AdamWConfigOf(train);
  executor_options.lr_schedule = LrScheduleOf(train);
  executor_options.optimizer = OptimizerOptionsOf(train);
  executor_options.diffusion = DiffusionOptionsOf(train);
  executor_options.max_grad_norm =
      train.grad_clip() > 0 ? train.grad_clip() : 0;
  // Weights from a Hugging Face checkpoint, unless kept state replaces the
  // fresh shards anyway. Checked (headers, names, shapes) before any
  // collective group forms, so every rank refuses a bad checkpoint alike.
  std::unique_ptr<checkpoint::HfWeights> weights;
  std::unique_ptr<checkpoint::PeftAdapters> adapters;
  if (!train.lora_from().empty() && request.model().lora().rank() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", job->rank,
        ": train.lora_from: the model has no LoRA adapters (submit it with "
        "--lora-rank, --lora-alpha and --lora-targets)"));
  }
  if (!train.init_from().empty() && *kept == nullptr) {
    if (!options_.weights_root.empty()) {
      SHARDD_RETURN_IF_ERROR(CheckUnderRoot(
          options_.weights_root, train.init_from(), "train.init_from"));
    }
    // A LoRA model's base: the checkpoint holds no adapters.
    absl::StatusOr<std::unique_ptr<checkpoint::HfWeights>> opened =
        checkpoint::HfWeights::Open(train.init_from(),
                                    WithoutLoraAdapters(request.model()));
    if (!opened.ok()) {
      return absl::Status(
          opened.status().code(),
          absl::StrCat("rank ", job->rank,
                       ": train.init_from: ", opened.status().message()));
    }
    weights = *std::move(opened);
    const std::vector<std::string> unused = weights->UnusedTensors();
    if (!unused.empty()) {
      SHARDD_LOG(WARNING) << "rank " << job->rank << ": " << unused.size()
                          << " tensors of " << train.init_from()
                          << " are not parameters of the model (first: "
                          << unused.front() << ")";
    }
  }
  if (!train.lora_from().empty() && *kept == nullptr) {
    if (!options_.weights_root.empty()) {
      SHARDD_RETURN_IF_ERROR(CheckUnderRoot(
          options_.weights_root, train.lora_from(), "train.lora_from"));
    }
    // The base's per-expert scales (DiffusionGemma folds them into its
    // experts; the adapters of those scale with them).
    checkpoint::PeftAdapters::ExpertScaleFn scales;
    if (weights != nullptr) {
      const checkpoint::HfWeights* base = weights.get();
      scales = [base](const std::string& param) {
        return base->ExpertScales(param);
      };
    }
    absl::StatusOr<std::unique_ptr<checkpoint::PeftAdapters>> opened =
        checkpoint::PeftAdapters::Open(train.lora_from(), request.model(),
                                       scales);
    if (!opened.ok()) {
      return absl::Status(
          opened.status().code(),
          absl::StrCat("rank ", job->rank,
                       ": train.lora_from: ", opened.status().message()));
    }
    adapters = *std::move(opened);
  }
  BaseAndAdapters initial(weights.get(), adapters.get());
  if (weights != nullptr || adapters != nullptr) {
    executor_options.initial_values = &initial;
  }
  if (options_.device >= 0) {
#ifdef SHARDD_WITH_CUDA
    DeviceStepRunnerOptions device_options;
    device_options.device = options_.device;
    device_options.shard_rank = job->shard_rank;
    device_options.replica_rank = job->replica_rank;
    device_options.group_prefix = base;
    device_options.timeout = timeout;
    device_options.executor = executor_options;
    absl::StatusOr<std::unique_ptr<StepRunner>> runner =
        CreateDeviceStepRunner(plan, request.model(), device_options, kv);
    if (!runner.ok()) {
      return absl::Status(
          runner.status().code(),
          absl::StrCat("rank ", job->rank, ": device cuda:", options_.device,
                       ": ", runner.status().message()));
    }
    job->steps = *std::move(runner);
    SHARDD_ASSIGN_OR_RETURN(
        const int64_t kept_step,
        RestoreKeptState(*job, &job->steps->executor(), kept));
    return InstallJobLocked(std::move(job), kept_step);
#else
    return absl::FailedPreconditionError(absl::StrCat(
        "device cuda:", options_.device,
        ": this worker was built without CUDA (build with --config=cuda)"));
#endif
  }
  KvGlooStore store(kv, timeout);
  auto join = [&](const std::string& prefix, int rank,
                  int size) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    SHARDD_ASSIGN_OR_RETURN(
        std::unique_ptr<GlooCommunicator> comm,
        GlooCommunicator::Create(&store, prefix, rank, size,
                                 options_.bind_address, timeout));
    if (size > 1) {
      // Once everyone passed the barrier every rank's Create has returned,
      // so the group's rendezvous keys can go.
      SHARDD_RETURN_IF_ERROR(comm->Barrier(timeout));
      if (rank == 0) {
        const absl::Status deleted = kv->Delete(prefix + "/", true);
        if (!deleted.ok()) {
          SHARDD_LOG(WARNING) << "could not delete rendezvous keys " << prefix
                              << "/: " << deleted.ToString();
        }
      }
    }
    return std::unique_ptr<Communicator>(std::move(comm));
  };
  auto with_context = [&](const absl::Status& status, const std::string& what) {
    return absl::Status(
        status.code(),
        absl::StrCat("rank ", job->rank, ": joining ", what, " of job ",
                     job->job_id, " epoch ", job->membership_epoch, ": ",
                     status.message()));
  };
  {
    const std::string prefix = absl::StrCat(base, "shard", job->replica_rank);
    auto group = join(prefix, job->shard_rank, dp_shard);
    if (!group.ok()) {
      return with_context(group.status(), "shard group " + prefix);
    }
    job->shard_group = *std::move(group);
  }
  if (dp_replicate > 1) {
    const std::string prefix = absl::StrCat(base, "replica", job->shard_rank);
    auto group = join(prefix, job->replica_rank, dp_replicate);
    if (!group.ok()) {
      return with_context(group.status(), "replicate group " + prefix);
    }
    job->replicas = *std::move(group);
  }

  // Units resharded after forward to G ranks re-gather within groups of G
  // consecutive shard ranks (on one node when ranks fill nodes in order,
  // as FSDP2's reshard_after_forward=int intends).
  SliceGroups slice_groups;
  for (const v1::FsdpUnit& unit : plan.units()) {
    const v1::ReshardPolicy& policy = unit.reshard_after_forward();
    if (policy.policy_case() != v1::ReshardPolicy::kGroupSize) continue;
    const int g = policy.group_size();
    if (g <= 1 || g >= dp_shard || dp_shard % g != 0 ||
        job->slice_groups.count(g) != 0) {
      continue;
    }
    const std::string prefix = absl::StrCat(base, "slice", job->replica_rank,
                                            "/g", g, "/q", job->shard_rank / g);
    auto group = join(prefix, job->shard_rank % g, g);
    if (!group.ok()) {
      return with_context(group.status(), "slice group " + prefix);
    }
    slice_groups[g] = group->get();
    job->slice_groups[g] = *std::move(group);
  }

  // Expert parallelism: each block's ranks (consecutive shard ranks)
  // gather its experts; the ranks at the same place of every block
  // exchange the tokens.
  ExpertGroups expert_groups;
  if (plan.mesh().ep() > 1) {
    const int ep = plan.mesh().ep();
    const int g = dp_shard / ep;
    const int block = job->shard_rank / g;
    const int place = job->shard_rank % g;
    const std::string shard_prefix =
        absl::StrCat(base, "epshard", job->replica_rank, "/b", block);
    auto ep_shard = join(shard_prefix, place, g);
    if (!ep_shard.ok()) {
      return with_context(ep_shard.status(), "ep_shard group " + shard_prefix);
    }
    job->ep_shard_group = *std::move(ep_shard);
    const std::string ep_prefix =
        absl::StrCat(base, "ep", job->replica_rank, "/p", place);
    auto ep_group = join(ep_prefix, block, ep);
    if (!ep_group.ok()) {
      return with_context(ep_group.status(), "ep group " + ep_prefix);
    }
    job->ep_group = *std::move(ep_group);
    expert_groups = {job->ep_shard_group.get(), job->ep_group.get()};
  }

  SHARDD_ASSIGN_OR_RETURN(
      std::unique_ptr<StepExecutor> executor,
      StepExecutor::Create(plan, request.model(), executor_options,
                           job->shard_group.get(), job->replicas.get(),
                           &tracker_, slice_groups, expert_groups));
  SHARDD_ASSIGN_OR_RETURN(const int64_t kept_step,
                          RestoreKeptState(*job, executor.get(), kept));
  if (weights != nullptr) {
    const size_t ignored = weights->IgnoredTensors().size();
    SHARDD_LOG(INFO) << "rank " << job->rank << " initialised its shards from "
                     << weights->path() << " (" << weights->data_bytes_read()
                     << " bytes of tensor data read"
                     << (ignored == 0
                             ? std::string()
                             : absl::StrCat("; ", ignored,
                                            " tensors of parts shardd does not "
                                            "train, such as a vision tower, "
                                            "skipped"))
                     << ")";
  }
  job->steps = std::make_unique<StepRunner>(std::move(executor),
                                            job->shard_group.get(), &tracker_);
  return InstallJobLocked(std::move(job), kept_step);
}

absl::StatusOr<int64_t> WorkerRuntime::RestoreKeptState(
    const Job& job, StepExecutor* executor, std::unique_ptr<KeptState>* kept) {
  if (*kept == nullptr) return -1;
  // Same job and fingerprint, so the same layout: a failure here is a bug.
  absl::Status restored =
      RestoreShardState((*kept)->snapshot, executor->shard_state());
  if (restored.ok()) {
    restored = executor->RestoreOptimizerSteps((*kept)->optimizer_steps);
  }
  if (!restored.ok()) {
    return absl::InternalError(
        absl::StrCat("rank ", job.rank, ": keeping the state of job ",
                     job.job_id, " failed: ", restored.ToString()));
  }
  const int64_t step = (*kept)->optimizer_steps;
  kept->reset();  // Free the snapshot now.
  return step;
}

absl::StatusOr<v1::LoadPlanResponse> WorkerRuntime::InstallJobLocked(
    std::unique_ptr<Job> job, int64_t kept_step) {
  const v1::ShardingPlan& plan = job->plan;
  const int dp_shard = plan.mesh().dp_shard();
  const int dp_replicate = plan.mesh().dp_replicate();
  v1::LoadPlanResponse response;
  response.set_shard_bytes(
      job->steps->memory()
          ->Snapshot()
          .live[static_cast<int>(MemoryKind::kShardParams)]);
  response.set_data_entropy_rate(job->entropy_rate);
  response.set_data_one_token_loss(job->one_token_loss);
  response.set_kept_step(kept_step);
  SHARDD_LOG(INFO) << "rank " << job->rank << " loaded plan "
                   << plan.fingerprint() << " (job " << job->job_id
                   << ", epoch " << job->membership_epoch << ", shard rank "
                   << job->shard_rank << "/" << dp_shard << ", replica rank "
                   << job->replica_rank << "/" << dp_replicate << ", "
                   << job->sampler->source().Describe() << ", "
                   << (kept_step >= 0
                           ? absl::StrCat("kept state of step ", kept_step)
                           : std::string("fresh shards"))
                   << ")";
  {
    absl::MutexLock stats_lock(&stats_mu_);
    live_shard_group_ = job->steps->shard_group();
    live_memory_ = job->steps->memory();
  }
  job_ = std::move(job);
  PublishJobLocked();
  return response;
}

absl::Status WorkerRuntime::CheckJobLocked(uint64_t fingerprint) const {
  if (job_ == nullptr) {
    return WithErrorReason(
        absl::FailedPreconditionError("no plan loaded: call LoadPlan first"),
        kReasonPlanNotHeld);
  }
  if (fingerprint != job_->plan.fingerprint()) {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "stale plan: worker holds fingerprint ", job_->plan.fingerprint(),
            ", program names ", fingerprint)),
        kReasonPlanNotHeld);
  }
  const absl::Status health = JobHealthLocked();
  if (!health.ok()) {
    return WithErrorReason(
        absl::FailedPreconditionError(absl::StrCat(
            "rank ", job_->rank, ": job ", job_->job_id, " epoch ",
            job_->membership_epoch,
            " failed in an earlier step; LoadPlan again with a new "
            "membership_epoch to continue (",
            health.message(), ")")),
        kReasonStepFailedEarlier);
  }
  return absl::OkStatus();
}

absl::Status WorkerRuntime::FetchBatchesLocked(
    int64_t step, int microbatches, bool eval,
    std::vector<data::MicroBatch>* batches) const {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: must be >= 0, got ", step));
  }
  const data::BatchSampler* sampler =
      eval ? job_->eval_sampler.get() : job_->sampler.get();
  if (sampler == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "program.eval: job ", job_->job_id,
        " has no evaluation data (train.eval_data_path is empty)"));
  }
  const int job_m = job_->train.microbatches();
  if (microbatches != job_m) {
    return absl::InvalidArgumentError(
        absl::StrCat("program.microbatches: ", microbatches,
                     " differs from the job's train config (", job_m, ")"));
  }
  batches->resize(job_m);
  int64_t step_counted = 0, canvas_counted = 0;
  if (sampler->source().masked()) {
    SHARDD_ASSIGN_OR_RETURN(step_counted,
                            sampler->CountedTargets(step, &canvas_counted));
  }
  for (int m = 0; m < job_m; ++m) {
    SHARDD_RETURN_IF_ERROR(sampler->Fill(step, job_->rank, m, &(*batches)[m]));
    (*batches)[m].step_counted = step_counted;
    (*batches)[m].step_canvas_counted = canvas_counted;
  }
  return absl::OkStatus();
}

absl::Status WorkerRuntime::StepError(const absl::Status& status) const {
  if (status.ok()) return status;
  return absl::Status(
      status.code(),
      absl::StrCat("rank ", job_->rank, " (job ", job_->job_id, " epoch ",
                   job_->membership_epoch, "): ", status.message()));
}

v1::ExecuteResponse WorkerRuntime::ToResponse(const StepResult& r) const {
  v1::ExecuteResponse response;
  response.set_loss(r.loss);
  response.set_tokens(r.tokens);
  response.set_seconds(r.seconds);
  response.set_step(r.optimizer_steps);
  response.set_grad_norm(r.grad_norm);
  response.set_lr(r.lr);
  response.set_peak_unsharded_bytes(r.peak_unsharded_bytes);
  response.set_peak_activation_bytes(
      r.activation_trace.empty() ? 0 : r.peak_activation_bytes);
  response.set_peak_workspace_bytes(r.peak_workspace_bytes);
  response.set_all_gathers(r.collectives.all_gathers);
  response.set_reduce_scatters(r.collectives.reduce_scatters);
  // Comparable with the plan's CommReport: the HSDP replica all-reduces
  // only, not the one small gradient-norm all-reduce per step.
  response.set_all_reduces(r.collectives.replica_all_reduces);
  response.set_all_gather_bytes(r.collectives.all_gather_bytes);
  response.set_reduce_scatter_bytes(r.collectives.reduce_scatter_bytes);
  response.set_all_to_alls(r.collectives.all_to_alls);
  response.set_all_to_all_bytes(r.collectives.all_to_all_bytes);
  return response;
}

absl::StatusOr<v1::ExecuteResponse> WorkerRuntime::Execute(
    const v1::ExecuteRequest& request) {
  const v1::StepProgram& program = request.program();
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(CheckJobLocked(program.plan_fingerprint()));
  absl::Cleanup publish = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    PublishJobLocked();
  };
  std::vector<data::MicroBatch> batches;
  SHARDD_RETURN_IF_ERROR(FetchBatchesLocked(
      program.step(), program.microbatches(), program.eval(), &batches));
  // The memory timeline and the step metrics are the training steps'.
  if (!program.eval()) timeline_capture_.BeginStep();
  absl::StatusOr<StepResult> result =
      job_->steps->executor().Execute(program, batches);
  if (!result.ok()) {
    const absl::Status error = StepError(result.status());
    SHARDD_LOG(WARNING) << "Execute failed: " << error.ToString();
    return error;
  }
  if (program.eval()) return ToResponse(*result);
  DrawTimelineLocked(program.step());
  if (options_.on_step) options_.on_step(*result);
  return ToResponse(*result);
}

absl::StatusOr<v1::ExecuteResponse> WorkerRuntime::RunCommand(
    const v1::RunCommandRequest& request) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(CheckJobLocked(request.plan_fingerprint()));
  absl::Cleanup publish = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    PublishJobLocked();
  };
  Job& job = *job_;
  StepExecutor& executor = job.steps->executor();
  if (request.begin_step()) {
    const v1::StepShape& shape = job.plan.step();
    v1::StepProgram header;
    header.set_plan_fingerprint(request.plan_fingerprint());
    header.set_step(request.step());
    header.set_microbatches(shape.microbatches());
    header.set_passes(shape.passes());
    header.set_no_grad_passes(shape.no_grad_passes());
    header.set_defer_grad_sync(shape.defer_grad_sync());
    std::vector<data::MicroBatch> batches;
    SHARDD_RETURN_IF_ERROR(FetchBatchesLocked(
        request.step(), header.microbatches(), /*eval=*/false, &batches));
    SHARDD_RETURN_IF_ERROR(StepError(executor.BeginStep(header, batches)));
    timeline_capture_.BeginStep();
    job.step_open = true;
    job.step = request.step();
    job.next_index = 0;
  }
  const bool has_command =
      request.command().op() != v1::Command::OP_UNSPECIFIED;
  if ((has_command || request.end_step()) && !job.step_open) {
    return absl::FailedPreconditionError(
        "no step in progress: send begin_step first");
  }
  if ((has_command || request.end_step()) && request.step() != job.step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", request.step(), " is not the open step ", job.step));
  }
  if (has_command) {
    if (request.index() != job.next_index) {
      return absl::FailedPreconditionError(absl::StrCat(
          "out of program order: step ", job.step, " expects command index ",
          job.next_index, ", got ", request.index()));
    }
    const absl::Status status = executor.ExecuteCommand(request.command());
    if (!status.ok()) {
      // A rejected command leaves the step open; a failed one ends it (the
      // executor then refuses more commands with its own error).
      if (!executor.health().ok()) job.step_open = false;
      const absl::Status error = StepError(status);
      SHARDD_LOG(WARNING) << "RunCommand failed: " << error.ToString();
      return error;
    }
    ++job.next_index;
  }
  v1::ExecuteResponse response;
  if (request.end_step()) {
    job.step_open = false;
    absl::StatusOr<StepResult> result = executor.EndStep();
    if (!result.ok()) return StepError(result.status());
    DrawTimelineLocked(job.step);
    if (options_.on_step) options_.on_step(*result);
    response = ToResponse(*result);
  }
  return response;
}

void WorkerRuntime::DrawTimelineLocked(int64_t step) {
  const absl::Status drawn =
      timeline_capture_.EndStep(job_->plan, job_->rank, step);
  if (!drawn.ok()) {
    SHARDD_LOG(WARNING) << "memory timeline: " << drawn.ToString();
  }
}

v1::GetStatsResponse WorkerRuntime::GetStats() const {
  v1::GetStatsResponse response;
  absl::MutexLock lock(&stats_mu_);
  response.set_job_id(live_job_.job_id);
  response.set_plan_fingerprint(live_job_.plan_fingerprint);
  response.set_optimizer_steps(live_job_.optimizer_steps);
  response.set_step_failed(live_job_.step_failed);
  const MemorySnapshot memory =
      (live_memory_ != nullptr ? live_memory_ : &tracker_)->Snapshot();
  response.set_live_bytes(memory.live_total);
  response.set_peak_bytes(memory.peak_total);
  CommunicatorStats total = retired_;
  if (live_shard_group_ != nullptr) {
    const CommunicatorStats s = live_shard_group_->stats();
    total.all_gather.calls += s.all_gather.calls;
    total.all_gather.bytes += s.all_gather.bytes;
    total.reduce_scatter.calls += s.reduce_scatter.calls;
    total.reduce_scatter.bytes += s.reduce_scatter.bytes;
  }
  response.set_all_gathers(total.all_gather.calls);
  response.set_reduce_scatters(total.reduce_scatter.calls);
  response.set_all_gather_bytes(total.all_gather.bytes);
  response.set_reduce_scatter_bytes(total.reduce_scatter.bytes);
  return response;
}

CommunicatorStats WorkerRuntime::CollectiveTotals() const {
  absl::MutexLock lock(&stats_mu_);
  CommunicatorStats total = retired_;
  if (live_shard_group_ != nullptr) {
    AddCommunicatorStats(live_shard_group_->stats(), &total);
  }
  return total;
}

MemorySnapshot WorkerRuntime::MemoryUsage() const {
  absl::MutexLock lock(&stats_mu_);
  return (live_memory_ != nullptr ? live_memory_ : &tracker_)->Snapshot();
}

}  // namespace shardd
