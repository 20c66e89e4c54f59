#include "server/step_model.h"

// The step schedule this file replays (one rank; all ranks are symmetric).
//
// Units. The root (UNIT_ROOT) holds everything outside the other units;
// Megatron-FSDP buckets outside any layer (UNIT_FLAT_BUCKET with
// layer_index < 0) are treated as roots too. Chain units are the other
// top-level units (parent == -1: decoder layers, flat buckets) in plan order.
// Nested units (parent >= 0: experts, dtype islands) run inside their parent,
// in plan order, and unshard lazily (they are never prefetch targets).
//
// Per micro-batch m (sync = !defer_grad_sync || m is the last one):
//   Forward, for each pass p (passes [0, no_grad_passes) build no graph):
//     - root: unshard if not gathered (it never reshards after forward), then
//       its nested units run forward (see below);
//     - each chain unit u in order: unshard u if not gathered, then issue its
//       forward_prefetch list (each target is all-gathered now and counted
//       live from this moment); each nested child c of u: unshard c if not
//       gathered, forward, reshard-after-forward by c's policy; then u
//       reshards after forward by its policy:
//         reshard=true        frees the gathered buffer;
//         reshard=false       keeps it (no re-gather later);
//         group_size G        keeps gathered/G bytes (FSDP2
//                             SHARDED_POST_FORWARD); a later unshard is an
//                             all-gather of the full buffer over G ranks and
//                             frees that slice. G == 1 acts as false and
//                             G == dp_shard as true, as in FSDP2.
//   Backward (there is always at least one pass with gradients):
//     - the root's backward starts it (LM head, final norm): the root's
//       unsharded gradient buffer is allocated first and lives until the very
//       end, where the root is reduce-scattered and resharded;
//     - the grad passes in reverse, each walking its chain units in reverse:
//       unshard u if not gathered, issue its backward_prefetch list; nested
//       children of u in reverse: unshard if needed, allocate the child's
//       gradient buffer, post-backward of the child; then allocate u's
//       gradient buffer and run u's post-backward; after the chain, the
//       root's nested units in reverse the same way.
//     - post-backward (FSDP2 fires it once per forward call of a unit, so a
//       unit used in several grad passes runs it once per pass):
//         sync:     reduce-scatter the unsharded gradient (the buffer is
//                   freed; the sharded gradient accumulates), plus one HSDP
//                   all-reduce of the sharded gradient when dp_replicate > 1,
//                   then reshard the parameters (reshard_after_backward);
//         deferred: nothing: the unsharded gradient stays and accumulates
//                   (in the reduce dtype, across passes and micro-batches)
//                   and the parameters stay gathered, so the next
//                   micro-batch's forward needs no all-gather for them (its
//                   reshard-after-forward policy still applies).
//   After the last micro-batch: the optimizer step (no unsharded memory).
//
// Byte counts (per rank). Gathered parameters: gathered_numel * compute
// dtype. Unsharded gradient: trainable gathered numel * reduce dtype.
// Trainable shard numel is exact for dim-0 layouts (the padded local_numel
// of every non-frozen parameter); for flat ranges, where a rank's share of
// each parameter differs, it is shard_numel scaled by trainable_numel /
// numel (rounded up), which is exact when nothing is frozen. The trainable
// gathered numel is that times dp_shard. Memory is the state after each op;
// the short overlap of an all-gather with the slice it replaces is not
// modelled.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace shardd {
namespace {

using v1::FsdpUnit;
using v1::ShardingPlan;

enum class ParamState { kSharded, kGathered, kPostForward };
enum class ForwardPolicy { kKeep, kFree, kPartial };

struct UnitModel {
  std::string name;
  bool is_root = false;
  ForwardPolicy policy = ForwardPolicy::kFree;
  int64_t gathered_bytes = 0;      // Unsharded params, compute dtype.
  int64_t post_forward_bytes = 0;  // Kept by a group-size reshard.
  int64_t grad_bytes = 0;          // Unsharded grads, reduce dtype.
  int64_t shard_grad_bytes = 0;    // Sharded grads, reduce dtype.
  int64_t shard_param_bytes = 0;   // Master shard, param dtype.
  int64_t trainable_shard_numel = 0;
  std::vector<int> children;
  std::vector<int> forward_prefetch;
  std::vector<int> backward_prefetch;
  // Replay state.
  ParamState state = ParamState::kSharded;
  bool grad_live = false;
};

absl::Status InvalidUnit(int index, absl::string_view field,
                         absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("units[", index, "].", field, ": ", what));
}

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo,
                        int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be between ", lo, " and ", hi, ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status ValidateStep(const v1::StepShape& step) {
  SHARDD_RETURN_IF_ERROR(CheckRange("step.microbatches", step.microbatches(), 1,
                                    kMaxMicrobatches));
  SHARDD_RETURN_IF_ERROR(
      CheckRange("step.passes", step.passes(), 1, kMaxPasses));
  SHARDD_RETURN_IF_ERROR(CheckRange(
      "step.no_grad_passes", step.no_grad_passes(), 0, step.passes() - 1));
  SHARDD_RETURN_IF_ERROR(CheckRange("step.forward_prefetch_depth",
                                    step.forward_prefetch_depth(), 0,
                                    kMaxPrefetchDepth));
  SHARDD_RETURN_IF_ERROR(CheckRange("step.backward_prefetch_depth",
                                    step.backward_prefetch_depth(), 0,
                                    kMaxPrefetchDepth));
  return absl::OkStatus();
}

// a * b / c rounded up, without overflow for non-negative int64 inputs.
int64_t MulDivCeil(int64_t a, int64_t b, int64_t c) {
  const __int128 p = static_cast<__int128>(a) * b;
  return static_cast<int64_t>((p + c - 1) / c);
}

int64_t TrainableShardNumel(const FsdpUnit& unit) {
  bool dim0 = unit.params_size() > 0;
  int64_t exact = 0;
  for (const v1::ParamLayout& param : unit.params()) {
    if (param.shard_dim() != 0) {
      dim0 = false;
      break;
    }
    if (!param.frozen()) exact += param.local_numel();
  }
  if (dim0) return exact;
  if (unit.numel() <= 0 || unit.trainable_numel() >= unit.numel()) {
    return unit.numel() <= 0 ? 0 : unit.shard_numel();
  }
  return MulDivCeil(unit.shard_numel(), unit.trainable_numel(), unit.numel());
}

// Checked a * b for non-negative values.
absl::Status MulBytes(int index, absl::string_view field, int64_t numel,
                      int64_t bytes, int64_t* out) {
  if (numel > 0 && bytes > INT64_MAX / numel) {
    return InvalidUnit(index, field, "byte count overflows int64");
  }
  *out = numel * bytes;
  return absl::OkStatus();
}

// Builds the per-unit model and checks the plan's unit graph.
absl::Status BuildUnits(const ShardingPlan& plan, int dp_shard,
                        std::vector<UnitModel>* units, std::vector<int>* chain,
                        std::vector<int>* roots) {
  const int n = plan.units_size();
  units->assign(n, UnitModel());
  for (int i = 0; i < n; ++i) {
    const FsdpUnit& u = plan.units(i);
    UnitModel& m = (*units)[i];
    m.name = u.name();
    // Megatron-FSDP buckets outside any layer play the root's part.
    m.is_root = u.parent() < 0 &&
                (u.kind() == v1::UNIT_ROOT ||
                 (u.kind() == v1::UNIT_FLAT_BUCKET && u.layer_index() < 0));
    if (u.shard_numel() < 0 || u.numel() < 0 || u.trainable_numel() < 0) {
      return InvalidUnit(i, "shard_numel", "sizes must be >= 0");
    }
    if (u.shard_numel() > INT64_MAX / dp_shard ||
        u.gathered_numel() != u.shard_numel() * dp_shard) {
      return InvalidUnit(
          i, "gathered_numel",
          absl::StrCat("must equal shard_numel * mesh.dp_shard (",
                       u.shard_numel(), " * ", dp_shard, "), got ",
                       u.gathered_numel()));
    }
    if (u.parent() != -1 && (u.parent() <= i || u.parent() >= n)) {
      return InvalidUnit(
          i, "parent",
          absl::StrCat("must be -1 or the index of a later unit (nested "
                       "units come before their parent), got ",
                       u.parent()));
    }
    if (u.kind() == v1::UNIT_ROOT && u.parent() != -1) {
      return InvalidUnit(i, "parent", "the root unit cannot be nested");
    }
    v1::MixedPrecision precision = u.precision();
    if (precision.param_dtype() == v1::DTYPE_UNSPECIFIED) {
      precision.set_param_dtype(plan.precision().param_dtype());
    }
    if (precision.compute_dtype() == v1::DTYPE_UNSPECIFIED) {
      precision.set_compute_dtype(plan.precision().compute_dtype());
    }
    if (precision.reduce_dtype() == v1::DTYPE_UNSPECIFIED) {
      precision.set_reduce_dtype(plan.precision().reduce_dtype());
    }
    const int64_t param_size = DTypeBytes(precision.param_dtype());
    const int64_t compute_size = DTypeBytes(precision.compute_dtype());
    const int64_t reduce_size = DTypeBytes(precision.reduce_dtype());
    if (param_size <= 0 || compute_size <= 0 || reduce_size <= 0) {
      return InvalidUnit(i, "precision",
                         "param, compute and reduce dtypes must be set (on "
                         "the unit or the plan)");
    }
    m.trainable_shard_numel = TrainableShardNumel(u);
    if (m.trainable_shard_numel > u.shard_numel()) {
      return InvalidUnit(i, "params",
                         "trainable local elements exceed shard_numel");
    }
    SHARDD_RETURN_IF_ERROR(MulBytes(i, "gathered_numel", u.gathered_numel(),
                                    compute_size, &m.gathered_bytes));
    SHARDD_RETURN_IF_ERROR(MulBytes(i, "trainable_numel",
                                    m.trainable_shard_numel * dp_shard,
                                    reduce_size, &m.grad_bytes));
    SHARDD_RETURN_IF_ERROR(MulBytes(i, "trainable_numel",
                                    m.trainable_shard_numel, reduce_size,
                                    &m.shard_grad_bytes));
    SHARDD_RETURN_IF_ERROR(MulBytes(i, "shard_numel", u.shard_numel(),
                                    param_size, &m.shard_param_bytes));

    const v1::ReshardPolicy& policy = u.reshard_after_forward();
    switch (policy.policy_case()) {
      case v1::ReshardPolicy::kGroupSize: {
        const int g = policy.group_size();
        if (g < 1 || dp_shard % g != 0) {
          return InvalidUnit(
              i, "reshard_after_forward.group_size",
              absl::StrCat("must be >= 1 and divide mesh.dp_shard (", dp_shard,
                           "), got ", g));
        }
        // As in FSDP2: 1 means keep everything, dp_shard means free.
        if (g == 1) {
          m.policy = ForwardPolicy::kKeep;
        } else if (g == dp_shard) {
          m.policy = ForwardPolicy::kFree;
        } else {
          m.policy = ForwardPolicy::kPartial;
          m.post_forward_bytes = m.gathered_bytes / g;
        }
        break;
      }
      case v1::ReshardPolicy::kReshard:
        m.policy =
            policy.reshard() ? ForwardPolicy::kFree : ForwardPolicy::kKeep;
        break;
      case v1::ReshardPolicy::POLICY_NOT_SET:
        // Unset means "do not reshard" (the proto3 zero value).
        m.policy = ForwardPolicy::kKeep;
        break;
    }
    if (m.is_root) m.policy = ForwardPolicy::kKeep;

    for (int target : u.forward_prefetch()) {
      if (target < 0 || target >= n || target == i) {
        return InvalidUnit(i, "forward_prefetch",
                           absl::StrCat("unit index out of range: ", target));
      }
      m.forward_prefetch.push_back(target);
    }
    for (int target : u.backward_prefetch()) {
      if (target < 0 || target >= n || target == i) {
        return InvalidUnit(i, "backward_prefetch",
                           absl::StrCat("unit index out of range: ", target));
      }
      m.backward_prefetch.push_back(target);
    }
  }
  for (int i = 0; i < n; ++i) {
    const int parent = plan.units(i).parent();
    if (parent >= 0) {
      (*units)[parent].children.push_back(i);
    } else if ((*units)[i].is_root) {
      roots->push_back(i);
    } else {
      chain->push_back(i);
    }
  }
  return absl::OkStatus();
}

class StepReplay {
 public:
  StepReplay(const ShardingPlan& plan, bool include_timeline,
             std::vector<UnitModel> units, std::vector<int> chain,
             std::vector<int> roots, v1::MemoryReport* memory,
             v1::CommReport* comm)
      : step_(plan.step()),
        hsdp_(plan.mesh().dp_replicate() > 1),
        include_timeline_(include_timeline),
        units_(std::move(units)),
        chain_(std::move(chain)),
        roots_(std::move(roots)),
        memory_(memory),
        comm_(comm) {}

  void Run() {
    const int microbatches = step_.microbatches();
    for (int mb = 0; mb < microbatches; ++mb) {
      microbatch_ = mb;
      sync_ = !step_.defer_grad_sync() || mb == microbatches - 1;
      phase_ = "forward";
      for (int p = 0; p < step_.passes(); ++p) {
        pass_ = p;
        for (int r : roots_) {
          Unshard(r, "unshard");
          for (int c : units_[r].children) Forward(c);
        }
        for (int u : chain_) Forward(u);
      }
      phase_ = "backward";
      pass_ = -1;
      for (int r : roots_) {
        Unshard(r, "unshard");
        AllocGrad(r);
      }
      for (int p = step_.passes() - 1; p >= step_.no_grad_passes(); --p) {
        grad_pass_ = p;
        for (auto it = chain_.rbegin(); it != chain_.rend(); ++it) {
          Backward(*it);
        }
        for (auto r = roots_.rbegin(); r != roots_.rend(); ++r) {
          const std::vector<int>& kids = units_[*r].children;
          for (auto c = kids.rbegin(); c != kids.rend(); ++c) Backward(*c);
        }
      }
      grad_pass_ = -1;
      for (auto r = roots_.rbegin(); r != roots_.rend(); ++r) PostBackward(*r);
    }
    phase_ = "optimizer";
    Emit("step", -1);
  }

  int events() const { return events_; }

 private:
  void Forward(int u) {
    Unshard(u, "unshard");
    for (int target : units_[u].forward_prefetch) Unshard(target, "prefetch");
    for (int c : units_[u].children) Forward(c);
    ReshardAfterForward(u);
  }

  void Backward(int u) {
    Unshard(u, "unshard");
    for (int target : units_[u].backward_prefetch) Unshard(target, "prefetch");
    const std::vector<int>& kids = units_[u].children;
    for (auto c = kids.rbegin(); c != kids.rend(); ++c) Backward(*c);
    AllocGrad(u);
    PostBackward(u);
  }

  void Unshard(int u, const char* op) {
    UnitModel& m = units_[u];
    if (m.state == ParamState::kGathered) return;
    if (m.state == ParamState::kPostForward) {
      live_params_ -= m.post_forward_bytes;
    }
    m.state = ParamState::kGathered;
    live_params_ += m.gathered_bytes;
    comm_->set_all_gathers(comm_->all_gathers() + 1);
    comm_->set_all_gather_bytes(comm_->all_gather_bytes() + m.gathered_bytes);
    Emit(op, u);
  }

  void ReshardAfterForward(int u) {
    UnitModel& m = units_[u];
    if (m.state != ParamState::kGathered || m.policy == ForwardPolicy::kKeep) {
      return;
    }
    live_params_ -= m.gathered_bytes;
    if (m.policy == ForwardPolicy::kPartial) {
      m.state = ParamState::kPostForward;
      live_params_ += m.post_forward_bytes;
    } else {
      m.state = ParamState::kSharded;
    }
    Emit("reshard", u);
  }

  void AllocGrad(int u) {
    UnitModel& m = units_[u];
    if (m.grad_bytes == 0) return;
    if (!m.grad_live) {
      m.grad_live = true;
      live_grads_ += m.grad_bytes;
    }
    Emit("grad", u);
  }

  void PostBackward(int u) {
    if (!sync_) return;
    UnitModel& m = units_[u];
    if (m.grad_live) {
      m.grad_live = false;
      live_grads_ -= m.grad_bytes;
      comm_->set_reduce_scatters(comm_->reduce_scatters() + 1);
      comm_->set_reduce_scatter_bytes(comm_->reduce_scatter_bytes() +
                                      m.grad_bytes);
      if (hsdp_) {
        comm_->set_all_reduces(comm_->all_reduces() + 1);
        comm_->set_all_reduce_bytes(comm_->all_reduce_bytes() +
                                    m.shard_grad_bytes);
      }
      Emit("reduce_scatter", u);
    }
    if (m.state != ParamState::kSharded) {
      live_params_ -= m.state == ParamState::kGathered ? m.gathered_bytes
                                                       : m.post_forward_bytes;
      m.state = ParamState::kSharded;
      Emit("reshard", u);
    }
  }

  void Emit(const char* op, int unit) {
    const int index = events_++;
    const int64_t total = live_params_ + live_grads_;
    if (total > memory_->peak_unsharded_bytes()) {
      memory_->set_peak_unsharded_bytes(total);
      memory_->set_peak_param_bytes(live_params_);
      memory_->set_peak_grad_bytes(live_grads_);
      memory_->set_peak_event(index);
      std::string where = absl::StrCat(phase_, ", micro-batch ", microbatch_);
      if (pass_ >= 0) absl::StrAppend(&where, ", pass ", pass_);
      if (grad_pass_ >= 0) absl::StrAppend(&where, ", pass ", grad_pass_);
      if (unit >= 0) absl::StrAppend(&where, ", unit ", units_[unit].name);
      absl::StrAppend(&where, ", after ", op);
      memory_->set_peak_where(std::move(where));
    }
    if (include_timeline_ && index < kMaxTimelineEvents) {
      v1::TimelineEvent* event = memory_->add_timeline();
      event->set_microbatch(microbatch_);
      event->set_pass(pass_);
      event->set_phase(phase_);
      event->set_op(op);
      event->set_unit(unit);
      event->set_live_param_bytes(live_params_);
      event->set_live_grad_bytes(live_grads_);
    }
  }

  const v1::StepShape step_;
  const bool hsdp_;
  const bool include_timeline_;
  std::vector<UnitModel> units_;
  const std::vector<int> chain_;
  const std::vector<int> roots_;
  v1::MemoryReport* memory_;
  v1::CommReport* comm_;

  int microbatch_ = 0;
  int pass_ = 0;
  int grad_pass_ = -1;
  const char* phase_ = "forward";
  bool sync_ = true;
  int64_t live_params_ = 0;
  int64_t live_grads_ = 0;
  int events_ = 0;
};

}  // namespace

absl::Status ModelStep(bool include_timeline, v1::ShardingPlan* plan) {
  if (plan == nullptr) return absl::InvalidArgumentError("plan: must be set");
  SHARDD_RETURN_IF_ERROR(ValidateStep(plan->step()));
  const int dp_shard = plan->mesh().dp_shard();
  if (dp_shard < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh.dp_shard: must be >= 1, got ", dp_shard));
  }
  std::vector<UnitModel> units;
  std::vector<int> chain;
  std::vector<int> roots;
  SHARDD_RETURN_IF_ERROR(BuildUnits(*plan, dp_shard, &units, &chain, &roots));

  v1::MemoryReport memory;
  for (const UnitModel& m : units) {
    memory.set_sharded_param_bytes(memory.sharded_param_bytes() +
                                   m.shard_param_bytes);
    memory.set_grad_bytes(memory.grad_bytes() + m.shard_grad_bytes);
    // AdamW: exp_avg and exp_avg_sq in fp32 for every trainable element.
    memory.set_optimizer_bytes(memory.optimizer_bytes() +
                               2 * m.trainable_shard_numel * 4);
  }
  memory.set_persistent_bytes(memory.sharded_param_bytes() +
                              memory.grad_bytes() + memory.optimizer_bytes());

  v1::CommReport comm;
  StepReplay replay(*plan, include_timeline, std::move(units), std::move(chain),
                    std::move(roots), &memory, &comm);
  replay.Run();
  memory.set_timeline_events(replay.events());
  memory.set_peak_total_bytes(memory.persistent_bytes() +
                              memory.peak_unsharded_bytes());
  *plan->mutable_memory() = std::move(memory);
  *plan->mutable_comm() = std::move(comm);
  return absl::OkStatus();
}

}  // namespace shardd
