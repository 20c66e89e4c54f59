#include "worker/exec/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/compute_pool.h"
#include "layout/shard_layout.h"
#include "worker/exec/optimizer_registry.h"
#include "worker/exec/step_checks.h"

namespace shardd {

// ---- The communication thread ----------------------------------------------

// Runs queued tasks one at a time, in FIFO order, on its own thread. Tickets
// number the tasks from 0; tasks finish in ticket order. After a task fails,
// every later task is skipped (the communicators are poisoned and the ranks
// out of step anyway), so a failure surfaces within one collective timeout.
class CpuBackend::CommThread {
 public:
  CommThread() : thread_([this] { Loop(); }) {}

  // Skips what is queued and waits for the running task.
  ~CommThread() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    thread_.join();
  }

  // `label` names the task in its error ("step 3 commands[12] (UNSHARD
  // u4)").
  int64_t Enqueue(std::string label, std::function<absl::Status()> fn) {
    absl::MutexLock lock(&mu_);
    const int64_t ticket = next_++;
    queue_.push_back(Task{ticket, std::move(label), std::move(fn)});
    cv_.SignalAll();
    return ticket;
  }

  // Blocks until task `ticket` finished (ran or was skipped). OK when it
  // ran and succeeded; the first failure when it failed or was skipped
  // because of one; CANCELLED when it was skipped by Cancel().
  absl::Status Wait(int64_t ticket) {
    absl::MutexLock lock(&mu_);
    while (done_ <= ticket) cv_.Wait(&mu_);
    if (!error_.ok() && ticket >= error_ticket_) return error_;
    if (ticket >= cancelled_from_) {
      return absl::CancelledError("skipped: the step was aborted");
    }
    return absl::OkStatus();
  }

  // Waits for everything queued so far.
  absl::Status Drain() {
    int64_t last;
    {
      absl::MutexLock lock(&mu_);
      last = next_ - 1;
    }
    return Wait(last);
  }

  // The first failure, without waiting.
  absl::Status error() const {
    absl::MutexLock lock(&mu_);
    return error_;
  }

  // Skips every task not started yet and waits for the running one.
  void CancelAndDrain() {
    {
      absl::MutexLock lock(&mu_);
      cancelled_from_ = std::min(cancelled_from_, started_);
    }
    Drain().IgnoreError();
  }

  // Forgets failures and cancellation once idle (for the next step).
  void Reset() {
    Drain().IgnoreError();
    absl::MutexLock lock(&mu_);
    error_ = absl::OkStatus();
    error_ticket_ = std::numeric_limits<int64_t>::max();
    cancelled_from_ = std::numeric_limits<int64_t>::max();
  }

 private:
  struct Task {
    int64_t ticket = 0;
    std::string label;
    std::function<absl::Status()> fn;
  };

  void Loop() {
    for (;;) {
      Task task;
      bool skip = false;
      {
        absl::MutexLock lock(&mu_);
        while (queue_.empty() && !stop_) cv_.Wait(&mu_);
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        started_ = task.ticket + 1;
        skip = stop_ || !error_.ok() || task.ticket >= cancelled_from_;
      }
      const absl::Status status = skip ? absl::OkStatus() : task.fn();
      absl::MutexLock lock(&mu_);
      if (!status.ok() && error_.ok()) {
        error_ = absl::AbortedError(absl::StrCat(
            task.label, ": collective failed: ",
            absl::StatusCodeToString(status.code()), ": ", status.message()));
        error_ticket_ = task.ticket;
      }
      done_ = task.ticket + 1;
      cv_.SignalAll();
    }
  }

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int64_t next_ ABSL_GUARDED_BY(mu_) = 0;     // Next ticket.
  int64_t started_ ABSL_GUARDED_BY(mu_) = 0;  // Tickets < started_ began.
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;     // Tickets < done_ finished.
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  int64_t error_ticket_ ABSL_GUARDED_BY(mu_) =
      std::numeric_limits<int64_t>::max();
  int64_t cancelled_from_ ABSL_GUARDED_BY(mu_) =
      std::numeric_limits<int64_t>::max();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // Last: starts after the fields above exist.
};

// ---- The model's view of the shards ----------------------------------------

// Parameters come only from gathered, waited units and gradients go only
// into allocated buffers (StepState's checks).
class CpuBackend::Params : public ParamSource {
 public:
  Params(ShardStore* store, const StepState* state)
      : store_(store), state_(state) {}

  absl::StatusOr<const float*> Param(const std::string& name) override {
    SHARDD_RETURN_IF_ERROR(state_->CheckParamReadable(name));
    return store_->ParamView(name);
  }

  absl::Status AccumulateGrad(const std::string& name,
                              const float* values) override {
    SHARDD_RETURN_IF_ERROR(state_->CheckGradWritable(name));
    return store_->AccumulateGrad(name, values);
  }

 private:
  ShardStore* store_;
  const StepState* state_;
};

// ---- Creation ---------------------------------------------------------------

CpuBackend::CpuBackend(const v1::ShardingPlan& plan,
                       const StepExecutorOptions& options,
                       Communicator* shard_group, Communicator* replicas,
                       const SliceGroups& slice_groups,
                       const ExpertGroups& expert_groups,
                       MemoryTracker* tracker)
    : plan_(plan),
      options_(options),
      shard_group_(shard_group),
      replicas_(replicas),
      slice_groups_(slice_groups),
      expert_groups_(expert_groups),
      tracker_(tracker) {}

CpuBackend::~CpuBackend() {
  // Stop the queue before anything its tasks use goes away.
  comm_.reset();
}

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const StepExecutorOptions& options, Communicator* shard_group,
    Communicator* replicas, MemoryTracker* tracker,
    const SliceGroups& slice_groups, const ExpertGroups& expert_groups) {
  if (shard_group == nullptr || tracker == nullptr) {
    return absl::InvalidArgumentError(
        "shard_group and tracker: must not be null");
  }
  SHARDD_RETURN_IF_ERROR(CheckStepGroups(
      plan, options.shard_rank, options.replica_rank, *shard_group, replicas));
  SHARDD_RETURN_IF_ERROR(
      CheckExpertGroups(plan, options.shard_rank, expert_groups));
  SHARDD_RETURN_IF_ERROR(CheckStepOptions(
      options.collective_timeout, options.max_grad_norm, options.adamw));
  SHARDD_RETURN_IF_ERROR(
      CheckSliceGroups(plan, options.shard_rank, slice_groups));
  auto backend = absl::WrapUnique(new CpuBackend(plan, options, shard_group,
                                                 replicas, slice_groups,
                                                 expert_groups, tracker));
  SHARDD_ASSIGN_OR_RETURN(backend->exchange_,
                          ExchangeFor(plan, model, expert_groups.ep,
                                      options.collective_timeout));
  ShardStoreOptions store_options;
  store_options.shard_rank = options.shard_rank;
  store_options.seed = options.seed;
  store_options.initial_values = options.initial_values;
  store_options.collective_timeout = options.collective_timeout;
  store_options.trim_frozen_state =
      TrimsFrozenState(model.lora().rank() > 0, options.optimizer);
  SHARDD_ASSIGN_OR_RETURN(
      backend->store_, ShardStore::Create(plan, model, store_options, tracker));
  backend->model_spec_ = model;

  const v1::StepShape& step = plan.step();
  backend->model_options_ =
      ModelOptionsFor(step.microbatches(), step.passes(), step.no_grad_passes(),
                      options.self_conditioning_scale, options.diffusion);
  SHARDD_RETURN_IF_ERROR(backend->CreateModel(backend->model_options_));

  // The gradient norm's ranges: the store's layout.
  backend->queue_units_.resize(plan.units_size());
  for (int u = 0; u < plan.units_size(); ++u) {
    backend->queue_units_[u].ranges =
        backend->store_->layout(u).trainable_ranges;
  }
  backend->comm_ = std::make_unique<CommThread>();
  CommThread* comm = backend->comm_.get();
  backend->optimizer_shards_ = std::make_unique<HostOptimizerShards>(
      backend->store_.get(), tracker, shard_group, options.collective_timeout,
      [comm](const std::string& what,
             std::function<absl::Status()> collective) {
        return comm->Wait(comm->Enqueue(what, std::move(collective)));
      });
  SHARDD_ASSIGN_OR_RETURN(
      backend->optimizer_,
      CreateOptimizer(options.optimizer, options.adamw, plan, model,
                      *backend->optimizer_shards_));
  return backend;
}

absl::Status CpuBackend::BeginStep(const v1::StepProgram& header,
                                   absl::Span<const data::MicroBatch> batches) {
  const MoeModelOptions wanted = ModelOptionsFor(
      header.microbatches(), header.passes(), header.no_grad_passes(),
      options_.self_conditioning_scale, options_.diffusion);
  if (!SameStepShape(wanted, model_options_)) {
    SHARDD_RETURN_IF_ERROR(CreateModel(wanted));
    model_options_ = wanted;
  }
  SHARDD_RETURN_IF_ERROR(SetStepBatches(model_.get(), batches));
  SHARDD_RETURN_IF_ERROR(SetStepExtras(
      header,
      std::max(1, plan_.mesh().dp_shard()) *
          std::max(1, plan_.mesh().dp_replicate()),
      batches, model_.get()));
  comm_->Reset();
  // A failed step may have left activations behind; count what is held.
  SyncActivations(model_->activation_bytes(), model_->activation_bytes());
  tracker_->ResetPeaks();
  stats_start_ = SnapshotCollectives(*shard_group_, replicas_, slice_groups_,
                                     expert_groups_);
  last_free_ticket_ = -1;
  peak_activation_bytes_ = 0;
  activation_trace_.clear();
  grad_norm_ = 0.0;
  clip_coefficient_ = 1.0;
  for (UnitQueue& run : queue_units_) {
    run.gather_ticket = -1;
    run.last_ticket = -1;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::CreateModel(const MoeModelOptions& options) {
  SHARDD_ASSIGN_OR_RETURN(model_, MoeModel::Create(model_spec_, options));
  SHARDD_RETURN_IF_ERROR(
      ApplyRecompute(plan_, model_->num_layers(), model_.get()));
  if (exchange_ != nullptr) {
    SHARDD_RETURN_IF_ERROR(
        model_->SetExpertExchange(exchange_.get(), EpCapacityBound(plan_)));
  }
  SyncActivations(0, 0);
  return absl::OkStatus();
}

void CpuBackend::SyncActivations(int64_t peak, int64_t live) {
  // Only a plan that models activations compares them with the tracker.
  if (!plan_.has_activations()) return;
  absl::MutexLock lock(&activations_mu_);
  if (peak > tracked_activations_) {
    tracker_->Allocate(MemoryKind::kActivations, peak - tracked_activations_);
  } else {
    tracker_->Free(MemoryKind::kActivations, tracked_activations_ - peak);
  }
  tracker_->Free(MemoryKind::kActivations, peak - live);
  tracked_activations_ = live;
}

absl::Status CpuBackend::PendingError(const std::string& label) {
  // The communication thread's errors already name their command.
  return comm_->error();
}

absl::Status CpuBackend::Run(const v1::Command& c, const std::string& label,
                             StepState* state, int64_t* optimizer_steps,
                             bool* clean) {
  // Errors of the queue name their command already; the store's and the
  // model's get the command and the rank.
  auto here = [&](const absl::Status& status) {
    return WithMessage(
        status, absl::StrCat(label, " on shard rank ", options_.shard_rank,
                             ": ", status.message()));
  };
  const int u = c.unit();
  ShardStore* store = store_.get();
  switch (c.op()) {
    case v1::Command::UNSHARD: {
      Communicator* group = GroupOf(u);
      const SliceGroups* slices = &slice_groups_;
      const int64_t ticket = comm_->Enqueue(label, [store, group, slices, u] {
        return store->Unshard(u, group, slices);
      });
      queue_units_[u].gather_ticket = ticket;
      queue_units_[u].last_ticket = ticket;
      // "An UNSHARD without prefetch completes before the next command."
      if (!c.prefetch()) {
        SHARDD_RETURN_IF_ERROR(comm_->Wait(ticket));
        DropSlice(u, label, state);
      }
      return absl::OkStatus();
    }
    case v1::Command::WAIT_UNSHARD:
      SHARDD_RETURN_IF_ERROR(comm_->Wait(queue_units_[u].gather_ticket));
      DropSlice(u, label, state);
      return absl::OkStatus();
    case v1::Command::RESHARD: {
      const int g = c.group_size();
      const int64_t ticket =
          comm_->Enqueue(label, [store, u, g] { return store->Reshard(u, g); });
      queue_units_[u].last_ticket = ticket;
      last_free_ticket_ = ticket;
      return absl::OkStatus();
    }
    case v1::Command::ALLOC_GRAD: {
      // The unit's own queued work (a reduce-scatter of its previous
      // gradient) must be done before the buffer is reused; with
      // exact_memory_order every queued free must have happened.
      const UnitQueue& run = queue_units_[u];
      const int64_t wait = options_.exact_memory_order
                               ? std::max(run.last_ticket, last_free_ticket_)
                               : run.last_ticket;
      SHARDD_RETURN_IF_ERROR(comm_->Wait(wait));
      const absl::Status status = store->AllocGrad(u);
      if (!status.ok()) return here(status);
      return absl::OkStatus();
    }
    case v1::Command::REDUCE_SCATTER: {
      Communicator* group = GroupOf(u);
      Communicator* replicas = replicas_;
      const int64_t ticket = comm_->Enqueue(label, [store, group, replicas, u] {
        return store->ReduceScatter(u, group, replicas);
      });
      queue_units_[u].last_ticket = ticket;
      last_free_ticket_ = ticket;
      return absl::OkStatus();
    }
    case v1::Command::FORWARD:
    case v1::Command::BACKWARD: {
      Params params(store, state);
      const absl::Status status = model_->Run(c, &params);
      if (plan_.has_activations()) {
        const int64_t peak = model_->command_activation_peak();
        const int64_t live = model_->activation_bytes();
        activation_trace_.push_back({peak, live});
        // The tracker sees the activations where the program has them:
        // after the collectives issued before this command took or freed
        // their buffers, before those issued after it (the queue's
        // order), so its peak of unsharded bytes plus activations is the
        // program's, as the plan replays it.
        comm_->Enqueue(label, [this, peak, live] {
          SyncActivations(peak, live);
          return absl::OkStatus();
        });
      }
      if (!status.ok()) return here(status);
      peak_activation_bytes_ =
          std::max(peak_activation_bytes_, model_->command_activation_peak());
      if (c.op() == v1::Command::FORWARD && c.part() == v1::Command::HEAD &&
          c.requires_grad()) {
        return ReduceRouterAuxStats(c.pass(), label);
      }
      return absl::OkStatus();
    }
    case v1::Command::OPTIMIZER_STEP:
      return OptimizerStep(label, optimizer_steps, clean);
    default:
      // Unreachable: StepState::Check refuses unknown ops.
      return here(absl::InternalError("unknown op"));
  }
}

absl::Status CpuBackend::OptimizerStep(const std::string& label,
                                       int64_t* optimizer_steps, bool* clean) {
  {
    const absl::Status drained = comm_->Drain();
    if (!drained.ok()) return drained;
  }
  // Global gradient norm over this rank's trainable elements, summed over
  // the shard group (replicas hold the same gradients).
  double local = 0.0;
  for (size_t u = 0; u < queue_units_.size(); ++u) {
    const float* grads = store_->shard(static_cast<int>(u)).grads;
    for (const auto& range : queue_units_[u].ranges) {
      local += kernels::SumOfSquares(grads + range.first,
                                     range.second - range.first);
    }
  }
  float total = static_cast<float>(local);
  Communicator* group = shard_group_;
  const absl::Duration timeout = options_.collective_timeout;
  const int64_t ticket =
      comm_->Enqueue(absl::StrCat(label, " gradient-norm all-reduce"),
                     [group, timeout, &total] {
                       return group->AllReduce(&total, 1, v1::FLOAT32,
                                               ReduceOp::kSum, timeout);
                     });
  {
    const absl::Status reduced = comm_->Wait(ticket);
    if (!reduced.ok()) return reduced;
  }
  const double norm = std::sqrt(static_cast<double>(total));
  if (!std::isfinite(norm)) {
    // Every rank sees the same norm, so all skip: the ranks stay in step and
    // the executor stays usable.
    const absl::Status error = absl::InternalError(
        absl::StrCat(label, ": the global gradient norm is not finite (", norm,
                     "); the update was skipped and the gradients dropped"));
    *clean = true;
    return error;
  }
  double coefficient = 1.0;
  if (options_.max_grad_norm > 0.0) {
    coefficient = kernels::ClipCoefficient(norm, options_.max_grad_norm);
  }
  // Clip first: every optimizer sees the clipped gradients.
  if (coefficient < 1.0) {
    for (size_t u = 0; u < queue_units_.size(); ++u) {
      float* grads = store_->shard(static_cast<int>(u)).grads;
      for (const auto& range : queue_units_[u].ranges) {
        kernels::ScaleInPlace(grads + range.first, range.second - range.first,
                              static_cast<float>(coefficient));
      }
    }
  }
  const int64_t step = *optimizer_steps + 1;
  const OptimizerStepContext op = OptimizerContextFor(options_, step, label);
  bool partly_applied = false;
  const absl::Status stepped = StepOptimizer(
      *optimizer_, optimizer_shards_.get(), op, &partly_applied);
  // The host arithmetic cannot fail (the options were checked).
  SHARDD_CHECK(!partly_applied) << stepped;
  SHARDD_RETURN_IF_ERROR(stepped);
  *optimizer_steps = step;
  ZeroShardGrads();
  grad_norm_ = norm;
  clip_coefficient_ = std::min(1.0, coefficient);
  return absl::OkStatus();
}

absl::Status CpuBackend::EndStep(const StepState& state,
                                 const std::string& optimizer_label,
                                 int64_t* optimizer_steps, StepResult* result,
                                 bool* clean) {
  // OPTIMIZER_STEP drained the queue and applied the update (an eval step
  // has none: this waits for its last reshard).
  SHARDD_RETURN_IF_ERROR(comm_->Drain());
  result->loss = model_->step_loss();
  result->tokens = model_->step_tokens();
  result->grad_norm = grad_norm_;
  result->clip_coefficient = clip_coefficient_;
  result->collectives = CollectivesBetween(
      stats_start_,
      SnapshotCollectives(*shard_group_, replicas_, slice_groups_,
                          expert_groups_));
  SetMemoryPeaks(tracker_->Snapshot(), result);
  result->peak_activation_bytes = peak_activation_bytes_;
  result->activation_trace = activation_trace_;
  return absl::OkStatus();
}

absl::Status CpuBackend::ReduceRouterAuxStats(int pass,
                                              const std::string& label) {
  MoeModel::RouterAuxStats* stats = model_->router_aux_stats(pass);
  if (stats == nullptr) return absl::OkStatus();
  // Queued behind this rank's earlier collectives, as every rank queues it
  // at the same command; the backward that reads the sums waits for them.
  Communicator* groups[] = {shard_group_, replicas_};
  const absl::Duration timeout = options_.collective_timeout;
  const int64_t ticket = comm_->Enqueue(
      absl::StrCat(label, " load-balancing statistics all-reduce"),
      [stats, groups, timeout]() -> absl::Status {
        for (Communicator* group : groups) {
          if (group == nullptr || group->world_size() == 1) continue;
          SHARDD_RETURN_IF_ERROR(group->AllReduce(
              stats->counts.data(), static_cast<int64_t>(stats->counts.size()),
              v1::INT64, ReduceOp::kSum, timeout));
          SHARDD_RETURN_IF_ERROR(group->AllReduce(
              stats->prob_sums.data(),
              static_cast<int64_t>(stats->prob_sums.size()), v1::FLOAT32,
              ReduceOp::kSum, timeout));
        }
        return absl::OkStatus();
      });
  return comm_->Wait(ticket);
}

void CpuBackend::DropSlice(int unit, const std::string& label,
                           StepState* state) {
  if (!state->TakeGatherFromSlice(unit)) return;
  ShardStore* store = store_.get();
  const int64_t ticket = comm_->Enqueue(label, [store, unit] {
    store->DropSlice(unit);
    return absl::OkStatus();
  });
  queue_units_[unit].last_ticket = ticket;
  last_free_ticket_ = ticket;
}

void CpuBackend::Abort(bool* clean) {
  comm_->CancelAndDrain();
  for (int unit = 0; unit < store_->num_units(); ++unit) {
    if (store_->gathered(unit)) store_->Reshard(unit).IgnoreError();
    store_->DropSlice(unit);
    // The ShardStore frees an unsharded gradient only by reduce-scattering
    // it: one left behind makes the executor unusable.
    if (store_->grad_allocated(unit)) *clean = false;
  }
  ZeroShardGrads();
  comm_->Reset();
}

void CpuBackend::ZeroShardGrads() {
  for (int u = 0; u < store_->num_units(); ++u) {
    const ShardStore::UnitShard shard = store_->shard(u);
    if (shard.grads != nullptr && shard.state_numel > 0) {
      kernels::FillZero(shard.grads, shard.state_numel * 4);
    }
  }
}

}  // namespace shardd
