#include "program/unit_state.h"

#include "absl/strings/str_cat.h"

namespace shardd {

absl::Status CheckUnitCommand(const UnitState& s, int unit,
                              const v1::Command& c, bool trainable,
                              int dp_shard) {
  switch (c.op()) {
    case v1::Command::UNSHARD:
      if (s.gathered) {
        return absl::FailedPreconditionError(
            absl::StrCat("unit ", unit,
                         " is already gathered (UNSHARD needs a sharded "
                         "unit)"));
      }
      return absl::OkStatus();
    case v1::Command::WAIT_UNSHARD:
      if (!s.pending) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unit ", unit,
            " has no pending prefetched UNSHARD to wait for (a plain UNSHARD "
            "is complete when the next command runs)"));
      }
      return absl::OkStatus();
    case v1::Command::RESHARD: {
      if (!s.gathered) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unit ", unit, " is not gathered (RESHARD needs a gathered unit)"));
      }
      if (s.pending) {
        return absl::FailedPreconditionError(
            absl::StrCat("unit ", unit,
                         " has a pending prefetched all-gather: "
                         "WAIT_UNSHARD it first"));
      }
      const int g = c.group_size();
      if (g != 0 && (g <= 1 || g >= dp_shard || dp_shard % g != 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "group_size: must be 0 (free) or a divisor of "
            "mesh.dp_shard (",
            dp_shard, ") between 2 and ", dp_shard - 1, ", got ", g));
      }
      return absl::OkStatus();
    }
    case v1::Command::ALLOC_GRAD:
      if (!trainable) {
        return absl::FailedPreconditionError(
            absl::StrCat("ALLOC_GRAD of a unit without trainable parameters: "
                         "unit ",
                         unit,
                         " has no trainable parameters to hold a "
                         "gradient for"));
      }
      if (s.grad) {
        return absl::FailedPreconditionError(
            absl::StrCat("unit ", unit,
                         " already holds an unsharded gradient (it is already "
                         "allocated)"));
      }
      return absl::OkStatus();
    case v1::Command::REDUCE_SCATTER:
      if (!s.grad) {
        return absl::FailedPreconditionError(absl::StrCat(
            "unit ", unit,
            " holds no unsharded gradient: REDUCE_SCATTER needs an "
            "allocated unsharded gradient (ALLOC_GRAD)"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "op ", v1::Command::Op_Name(c.op()), " is not a unit command"));
  }
}

void ApplyUnitCommand(const v1::Command& c, UnitState* s) {
  switch (c.op()) {
    case v1::Command::UNSHARD:
      s->gathered = true;
      s->pending = c.prefetch();
      s->gather_slice_group = s->slice_group;
      s->slice_group = 0;
      return;
    case v1::Command::WAIT_UNSHARD:
      s->pending = false;
      return;
    case v1::Command::RESHARD:
      s->gathered = false;
      s->slice_group = c.group_size();
      return;
    case v1::Command::ALLOC_GRAD:
      s->grad = true;
      return;
    case v1::Command::REDUCE_SCATTER:
      s->grad = false;
      return;
    default:
      return;
  }
}

absl::Status CheckUnitDoneForOptimizer(const UnitState& s,
                                       const std::string& name) {
  // A post-forward slice counts as gathered: only a fully resharded unit
  // may take the update.
  if (s.gathered || s.slice_group != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(name,
                     " is still gathered: every unit must be resharded "
                     "before OPTIMIZER_STEP"));
  }
  if (s.grad) {
    return absl::FailedPreconditionError(
        absl::StrCat(name,
                     " still holds an unsharded gradient: every gradient "
                     "must be reduce-scattered before OPTIMIZER_STEP"));
  }
  return absl::OkStatus();
}

}  // namespace shardd
