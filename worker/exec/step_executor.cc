#include "worker/exec/step_executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "common/error_info.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "program/step_program.h"
#include "worker/exec/step_checks.h"

namespace shardd {

// ---- The communication thread ----------------------------------------------

// Runs queued tasks one at a time, in FIFO order, on its own thread. Tickets
// number the tasks from 0; tasks finish in ticket order. After a task fails,
// every later task is skipped (the communicators are poisoned and the ranks
// out of step anyway), so a failure surfaces within one collective timeout.
class StepExecutor::CommThread {
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
class StepExecutor::Params : public ParamSource {
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

namespace {

// Sorted, merged [begin, end) ranges.
std::vector<std::pair<int64_t, int64_t>> Merge(
    std::vector<std::pair<int64_t, int64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& r : ranges) {
    if (r.first >= r.second) continue;
    if (!out.empty() && r.first <= out.back().second) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace

StepExecutor::StepExecutor(const v1::ShardingPlan& plan,
                           const StepExecutorOptions& options,
                           Communicator* shard_group, Communicator* replicas,
                           const SliceGroups& slice_groups,
                           MemoryTracker* tracker)
    : plan_(plan),
      options_(options),
      shard_group_(shard_group),
      replicas_(replicas),
      slice_groups_(slice_groups),
      tracker_(tracker),
      state_(&plan_) {}

StepExecutor::~StepExecutor() {
  // Stop the queue before anything its tasks use goes away.
  comm_.reset();
}

StepCollectives CollectivesBetween(const CollectiveStatsSnapshot& start,
                                   const CollectiveStatsSnapshot& end) {
  auto delta = [](const CollectiveStats& a, const CollectiveStats& b) {
    CollectiveStats d;
    d.calls = b.calls - a.calls;
    d.bytes = b.bytes - a.bytes;
    d.time = b.time - a.time;
    return d;
  };
  StepCollectives c;
  const CollectiveStats gathers =
      delta(start.shard.all_gather, end.shard.all_gather);
  const CollectiveStats scatters =
      delta(start.shard.reduce_scatter, end.shard.reduce_scatter);
  const CollectiveStats norms =
      delta(start.shard.all_reduce, end.shard.all_reduce);
  const CollectiveStats replicas =
      delta(start.replicas.all_reduce, end.replicas.all_reduce);
  c.all_gathers = gathers.calls;
  c.all_gather_bytes = gathers.bytes;
  c.reduce_scatters = scatters.calls;
  c.reduce_scatter_bytes = scatters.bytes;
  c.norm_all_reduces = norms.calls;
  c.norm_all_reduce_bytes = norms.bytes;
  c.replica_all_reduces = replicas.calls;
  c.replica_all_reduce_bytes = replicas.bytes;
  absl::Duration time =
      gathers.time + scatters.time + norms.time + replicas.time;
  for (const auto& [size, now] : end.slices) {
    auto it = start.slices.find(size);
    const CollectiveStats slice = delta(
        it != start.slices.end() ? it->second.all_gather : CollectiveStats(),
        now.all_gather);
    c.all_gathers += slice.calls;
    c.slice_all_gathers += slice.calls;
    c.all_gather_bytes += slice.bytes;
    time += slice.time;
  }
  c.seconds = absl::ToDoubleSeconds(time);
  return c;
}

void SetMemoryPeaks(const MemorySnapshot& memory, StepResult* result) {
  result->peak_unsharded_bytes = memory.peak_unsharded;
  result->peak_gathered_param_bytes =
      memory.peak[static_cast<int>(MemoryKind::kGatheredParams)];
  result->peak_unsharded_grad_bytes =
      memory.peak[static_cast<int>(MemoryKind::kUnshardedGrads)];
  result->peak_workspace_bytes =
      memory.peak[static_cast<int>(MemoryKind::kWorkspace)];
}

void FillStepResult(const StepState& state, int64_t optimizer_steps,
                    const CollectiveStatsSnapshot& start,
                    const CollectiveStatsSnapshot& end,
                    const MemorySnapshot& memory, int64_t peak_activation_bytes,
                    StepResult* result) {
  result->step = state.step();
  result->seconds = absl::ToDoubleSeconds(absl::Now() - state.step_start());
  result->optimizer_steps = optimizer_steps;
  result->commands = state.commands();
  result->collectives = CollectivesBetween(start, end);
  SetMemoryPeaks(memory, result);
  result->peak_activation_bytes = peak_activation_bytes;
}

absl::StatusOr<std::unique_ptr<StepExecutor>> StepExecutor::Create(
    const v1::ShardingPlan& plan, const v1::ModelSpec& model,
    const StepExecutorOptions& options, Communicator* shard_group,
    Communicator* replicas, MemoryTracker* tracker,
    const SliceGroups& slice_groups) {
  if (shard_group == nullptr || tracker == nullptr) {
    return absl::InvalidArgumentError(
        "shard_group and tracker: must not be null");
  }
  SHARDD_RETURN_IF_ERROR(CheckStepGroups(
      plan, options.shard_rank, options.replica_rank, *shard_group, replicas));
  SHARDD_RETURN_IF_ERROR(CheckStepOptions(
      options.collective_timeout, options.max_grad_norm, options.adamw));
  SHARDD_RETURN_IF_ERROR(
      CheckSliceGroups(plan, options.shard_rank, slice_groups));
  auto executor = absl::WrapUnique(new StepExecutor(
      plan, options, shard_group, replicas, slice_groups, tracker));
  ShardStoreOptions store_options;
  store_options.shard_rank = options.shard_rank;
  store_options.seed = options.seed;
  store_options.collective_timeout = options.collective_timeout;
  SHARDD_ASSIGN_OR_RETURN(
      executor->store_,
      ShardStore::Create(plan, model, store_options, tracker));
  executor->model_spec_ = model;

  absl::MutexLock lock(&executor->mu_);
  const v1::StepShape& step = plan.step();
  executor->model_options_ =
      ModelOptionsFor(step.microbatches(), step.passes(), step.no_grad_passes(),
                      options.self_conditioning_scale);
  SHARDD_ASSIGN_OR_RETURN(executor->model_,
                          MoeModel::Create(model, executor->model_options_));

  const int r = options.shard_rank;
  executor->queue_units_.resize(plan.units_size());
  for (int u = 0; u < plan.units_size(); ++u) {
    const v1::FsdpUnit& unit = plan.units(u);
    UnitQueue& run = executor->queue_units_[u];
    const int64_t shard = unit.shard_numel();
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const v1::ParamLayout& param : unit.params()) {
      if (param.frozen() || param.numel() <= 0) continue;
      if (plan.flat_buckets()) {
        // This rank holds bucket elements [r*S, (r+1)*S).
        const int64_t own = r * shard;
        const int64_t begin = std::max(own, param.unsharded_offset());
        const int64_t end =
            std::min(own + shard, param.unsharded_offset() + param.numel());
        if (begin < end) ranges.emplace_back(begin - own, end - own);
      } else {
        // Rows [r*rpr, min((r+1)*rpr, dim0)); the rest of the local shard
        // is padding.
        const int64_t dim0 =
            param.global_shape_size() > 0 ? param.global_shape(0) : 0;
        if (dim0 <= 0) continue;
        const int64_t row_numel = param.numel() / dim0;
        const int64_t rows_per_rank = param.rows_per_rank();
        const int64_t valid = std::max<int64_t>(
            0, std::min(rows_per_rank, dim0 - r * rows_per_rank));
        const int64_t begin = param.shard_offset();
        ranges.emplace_back(begin, begin + valid * row_numel);
      }
    }
    run.ranges = Merge(std::move(ranges));
    for (const auto& range : run.ranges) {
      if (range.first < 0 || range.second > shard) {
        return absl::InvalidArgumentError(
            absl::StrCat("units[", u, "] (", unit.name(),
                         "): a parameter's elements fall outside shard_numel (",
                         shard, ")"));
      }
    }
  }
  executor->comm_ = std::make_unique<CommThread>();
  return executor;
}

// ---- Steps ------------------------------------------------------------------

int64_t StepExecutor::optimizer_steps() const {
  absl::MutexLock lock(&mu_);
  return optimizer_steps_;
}

absl::Status StepExecutor::RestoreOptimizerSteps(int64_t steps) {
  if (steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer steps ", steps, " must be >= 0"));
  }
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckBetweenSteps("restore optimizer steps"));
  optimizer_steps_ = steps;
  return absl::OkStatus();
}

absl::Status StepExecutor::health() const {
  absl::MutexLock lock(&mu_);
  return state_.failed();
}

absl::Status StepExecutor::BeginStep(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckHeader(header));
  return BeginStepLocked(header, batches);
}

absl::Status StepExecutor::BeginStepLocked(
    const v1::StepProgram& header, absl::Span<const data::MicroBatch> batches) {
  SHARDD_RETURN_IF_ERROR(CheckStepBatches(header, batches));
  const MoeModelOptions wanted = ModelOptionsFor(
      header.microbatches(), header.passes(), header.no_grad_passes(),
      options_.self_conditioning_scale);
  if (!SameStepShape(wanted, model_options_)) {
    SHARDD_ASSIGN_OR_RETURN(model_, MoeModel::Create(model_spec_, wanted));
    model_options_ = wanted;
  }
  model_->ResetStep();
  for (size_t m = 0; m < batches.size(); ++m) {
    const data::MicroBatch& b = batches[m];
    const absl::Status set =
        model_->SetBatch(static_cast<int>(m), b.inputs.data(), b.targets.data(),
                         b.rows, b.seq_len);
    if (!set.ok()) {
      return absl::Status(set.code(),
                          absl::StrCat("batches[", m, "]: ", set.message()));
    }
  }

  comm_->Reset();
  tracker_->ResetPeaks();
  stats_start_ = SnapshotCollectives(*shard_group_, replicas_, slice_groups_);
  state_.Begin(header);
  last_free_ticket_ = -1;
  peak_activation_bytes_ = 0;
  grad_norm_ = 0.0;
  clip_coefficient_ = 1.0;
  for (UnitQueue& run : queue_units_) {
    run.gather_ticket = -1;
    run.last_ticket = -1;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> StepExecutor::Execute(
    const v1::StepProgram& program,
    absl::Span<const data::MicroBatch> batches) {
  absl::MutexLock lock(&mu_);
  SHARDD_RETURN_IF_ERROR(state_.CheckHeader(program));
  SHARDD_RETURN_IF_ERROR(state_.ValidateOnce(program));
  SHARDD_RETURN_IF_ERROR(BeginStepLocked(program, batches));
  for (const v1::Command& command : program.commands()) {
    bool rejected = false;
    const absl::Status status = RunCommandLocked(command, &rejected);
    if (status.ok()) continue;
    // A validated program is never rejected; if it is, stop the step.
    if (rejected) AbortStepLocked(status, /*clean=*/!state_.touched());
    return status;
  }
  return EndStepLocked();
}

absl::Status StepExecutor::ExecuteCommand(const v1::Command& command) {
  absl::MutexLock lock(&mu_);
  if (!state_.failed().ok()) return state_.failed();
  if (!state_.in_step()) {
    return absl::FailedPreconditionError(
        "no step in progress: BeginStep before ExecuteCommand");
  }
  bool rejected = false;
  return RunCommandLocked(command, &rejected);
}

absl::StatusOr<StepResult> StepExecutor::EndStep() {
  absl::MutexLock lock(&mu_);
  if (!state_.failed().ok()) return state_.failed();
  return EndStepLocked();
}

absl::Status StepExecutor::RunCommandLocked(const v1::Command& c,
                                            bool* rejected) {
  *rejected = false;
  const std::string label = state_.Label(c);
  // After the command started: the step cannot go on.
  auto fail = [&](const absl::Status& status) {
    AbortStepLocked(status, /*clean=*/false);
    return status;
  };
  auto fail_here = [&](const absl::Status& status) {
    return fail(WithMessage(
        status, absl::StrCat(label, " on shard rank ", options_.shard_rank,
                             ": ", status.message())));
  };

  // A collective queued earlier may have failed meanwhile.
  {
    const absl::Status async = comm_->error();
    if (!async.ok()) return fail(async);
  }
  {
    const absl::Status fits =
        state_.Check(c, [this](int g) { return slice_groups_.count(g) > 0; });
    if (!fits.ok()) {
      *rejected = true;
      return WithMessage(fits, absl::StrCat(label, ": ", fits.message()));
    }
  }
  state_.Accept(c);
  const int u = c.unit();
  ShardStore* store = store_.get();
  switch (c.op()) {
    case v1::Command::UNSHARD: {
      Communicator* group = shard_group_;
      const SliceGroups* slices = &slice_groups_;
      const int64_t ticket = comm_->Enqueue(label, [store, group, slices, u] {
        return store->Unshard(u, group, slices);
      });
      queue_units_[u].gather_ticket = ticket;
      queue_units_[u].last_ticket = ticket;
      // "An UNSHARD without prefetch completes before the next command."
      if (!c.prefetch()) {
        const absl::Status status = comm_->Wait(ticket);
        if (!status.ok()) return fail(status);
        DropSliceLocked(u, label);
      }
      return absl::OkStatus();
    }
    case v1::Command::WAIT_UNSHARD: {
      const absl::Status status = comm_->Wait(queue_units_[u].gather_ticket);
      if (!status.ok()) return fail(status);
      DropSliceLocked(u, label);
      return absl::OkStatus();
    }
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
      absl::Status status = comm_->Wait(wait);
      if (!status.ok()) return fail(status);
      status = store->AllocGrad(u);
      if (!status.ok()) return fail_here(status);
      return absl::OkStatus();
    }
    case v1::Command::REDUCE_SCATTER: {
      Communicator* group = shard_group_;
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
      Params params(store, &state_);
      const absl::Status status = model_->Run(c, &params);
      if (!status.ok()) return fail_here(status);
      peak_activation_bytes_ =
          std::max(peak_activation_bytes_, model_->activation_bytes());
      return absl::OkStatus();
    }
    case v1::Command::OPTIMIZER_STEP:
      return OptimizerStepLocked(label);
    default:
      // Unreachable: StepState::Check refuses unknown ops.
      return fail_here(absl::InternalError("unknown op"));
  }
}

absl::Status StepExecutor::OptimizerStepLocked(const std::string& label) {
  {
    const absl::Status drained = comm_->Drain();
    if (!drained.ok()) {
      AbortStepLocked(drained, /*clean=*/false);
      return drained;
    }
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
    if (!reduced.ok()) {
      AbortStepLocked(reduced, /*clean=*/false);
      return reduced;
    }
  }
  const double norm = std::sqrt(static_cast<double>(total));
  if (!std::isfinite(norm)) {
    // Every rank sees the same norm, so all skip: the ranks stay in step and
    // the executor stays usable.
    const absl::Status error = absl::InternalError(
        absl::StrCat(label, ": the global gradient norm is not finite (", norm,
                     "); the update was skipped and the gradients dropped"));
    AbortStepLocked(error, /*clean=*/true);
    return error;
  }
  double coefficient = 1.0;
  if (options_.max_grad_norm > 0.0) {
    coefficient = kernels::ClipCoefficient(norm, options_.max_grad_norm);
  }
  const int64_t step = optimizer_steps_ + 1;
  for (size_t u = 0; u < queue_units_.size(); ++u) {
    const ShardStore::UnitShard shard = store_->shard(static_cast<int>(u));
    for (const auto& range : queue_units_[u].ranges) {
      const int64_t n = range.second - range.first;
      if (coefficient < 1.0) {
        kernels::ScaleInPlace(shard.grads + range.first, n,
                              static_cast<float>(coefficient));
      }
      const absl::Status status = kernels::AdamWStep(
          shard.params + range.first, shard.grads + range.first,
          shard.exp_avg + range.first, shard.exp_avg_sq + range.first, n, step,
          options_.adamw);
      // The range is still in cache: refresh its compute-dtype copy now.
      if (status.ok()) {
        store_->RefreshComputeShard(static_cast<int>(u), range.first, n);
      }
      if (!status.ok()) {
        // Unreachable: Create checked the configuration and the ranges.
        const absl::Status error = absl::InternalError(
            absl::StrCat(label,
                         ": AdamW failed after part of the shards "
                         "were updated: ",
                         status.message()));
        AbortStepLocked(error, /*clean=*/false);
        return error;
      }
    }
  }
  optimizer_steps_ = step;
  ZeroShardGrads();
  grad_norm_ = norm;
  clip_coefficient_ = std::min(1.0, coefficient);
  state_.set_stepped();
  return absl::OkStatus();
}

absl::StatusOr<StepResult> StepExecutor::EndStepLocked() {
  SHARDD_RETURN_IF_ERROR(state_.CheckEndStep());
  if (!state_.stepped()) {
    const absl::Status error = state_.EndedEarly();
    AbortStepLocked(error, /*clean=*/!state_.touched());
    return error;
  }
  {
    const absl::Status drained = comm_->Drain();
    if (!drained.ok()) {
      AbortStepLocked(drained, /*clean=*/false);
      return drained;
    }
  }
  StepResult result;
  result.loss = model_->step_loss();
  result.tokens = model_->step_tokens();
  result.grad_norm = grad_norm_;
  result.clip_coefficient = clip_coefficient_;
  FillStepResult(state_, optimizer_steps_, stats_start_,
                 SnapshotCollectives(*shard_group_, replicas_, slice_groups_),
                 tracker_->Snapshot(), peak_activation_bytes_, &result);
  state_.End();
  return result;
}

void StepExecutor::DropSliceLocked(int unit, const std::string& label) {
  if (!state_.TakeGatherFromSlice(unit)) return;
  ShardStore* store = store_.get();
  const int64_t ticket = comm_->Enqueue(label, [store, unit] {
    store->DropSlice(unit);
    return absl::OkStatus();
  });
  queue_units_[unit].last_ticket = ticket;
  last_free_ticket_ = ticket;
}

void StepExecutor::AbortStepLocked(const absl::Status& error, bool clean) {
  comm_->CancelAndDrain();
  for (int unit = 0; unit < store_->num_units(); ++unit) {
    if (store_->gathered(unit)) store_->Reshard(unit).IgnoreError();
    store_->DropSlice(unit);
    // The ShardStore frees an unsharded gradient only by reduce-scattering
    // it: one left behind makes the executor unusable.
    if (store_->grad_allocated(unit)) clean = false;
  }
  state_.ClearUnits();
  ZeroShardGrads();
  comm_->Reset();
  state_.Fail(error, clean, options_.shard_rank, options_.replica_rank);
}

void StepExecutor::ZeroShardGrads() {
  for (int u = 0; u < store_->num_units(); ++u) {
    const ShardStore::UnitShard shard = store_->shard(u);
    if (shard.grads != nullptr && shard.numel > 0) {
      std::memset(shard.grads, 0, static_cast<size_t>(shard.numel) * 4);
    }
  }
}

}  // namespace shardd
