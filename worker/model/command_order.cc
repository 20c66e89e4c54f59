#include "worker/model/command_order.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardd {

using v1::Command;

absl::StatusOr<int64_t> CheckMicroBatch(int microbatch, int microbatches,
                                        const int32_t* inputs,
                                        const int32_t* targets, int64_t batch,
                                        int64_t seq, int64_t vocab) {
  if (microbatch < 0 || microbatch >= microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "microbatch: must be in [0, ", microbatches, "), got ", microbatch));
  }
  if (batch < 1 || seq < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch and seq: must be >= 1, got ", batch, " and ", seq));
  }
  if (inputs == nullptr || targets == nullptr) {
    return absl::InvalidArgumentError("inputs and targets: must not be null");
  }
  for (int64_t i = 0; i < batch * seq; ++i) {
    if (inputs[i] < 0 || inputs[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "]: token id ", inputs[i], " outside [0, ",
                       vocab, ")"));
    }
  }
  return CountTargets(targets, batch * seq, vocab, "targets");
}

absl::StatusOr<int64_t> CountTargets(const int32_t* targets, int64_t n,
                                     int64_t vocab, absl::string_view field) {
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] != -1 && (targets[i] < 0 || targets[i] >= vocab)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: token id ", targets[i],
                       " outside [0, ", vocab, ") (or -1 to ignore)"));
    }
    if (targets[i] != -1) ++counted;
  }
  return counted;
}

ModelCommandOrder::ModelCommandOrder(int passes, int no_grad_passes,
                                     int microbatches,
                                     std::vector<bool> layer_has_moe,
                                     bool per_microbatch)
    : ModelCommandOrder(PassLayout::For("", passes, no_grad_passes),
                        microbatches, std::move(layer_has_moe),
                        per_microbatch) {}

ModelCommandOrder::ModelCommandOrder(const PassLayout& passes,
                                     int microbatches,
                                     std::vector<bool> layer_has_moe,
                                     bool per_microbatch)
    : passes_(passes.passes()),
      layout_(passes),
      microbatches_(microbatches),
      layer_has_moe_(std::move(layer_has_moe)),
      per_microbatch_(per_microbatch),
      places_(static_cast<size_t>(passes.passes()) *
              (per_microbatch ? microbatches : 1)) {
  Reset();
}

const ModelCommandOrder::Place& ModelCommandOrder::At(int pass,
                                                      int microbatch) const {
  return places_[per_microbatch_
                     ? static_cast<size_t>(microbatch) * passes_ + pass
                     : static_cast<size_t>(pass)];
}

ModelCommandOrder::Place& ModelCommandOrder::At(int pass, int microbatch) {
  return const_cast<Place&>(
      static_cast<const ModelCommandOrder*>(this)->At(pass, microbatch));
}

void ModelCommandOrder::Reset() {
  for (Place& p : places_) {
    p = Place();
    p.layer_done.assign(layer_has_moe_.size(), false);
    p.experts_done.assign(layer_has_moe_.size(), false);
    p.stage.assign(layer_has_moe_.size(), 0);
  }
}

absl::Status ModelCommandOrder::Check(const Command& c,
                                      absl::string_view model) const {
  const int pass = c.pass();
  const int mb = c.microbatch();
  const int layers = static_cast<int>(layer_has_moe_.size());
  if (pass < 0 || pass >= passes_ || mb < 0 || mb >= microbatches_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "command pass ", pass, " / microbatch ", mb, " outside the step's ",
        passes_, " passes and ", microbatches_, " micro-batches"));
  }
  const bool exchange_part =
      c.part() == Command::DISPATCH || c.part() == Command::COMBINE;
  if ((c.part() == Command::LAYER || c.part() == Command::EXPERTS ||
       exchange_part) &&
      (c.layer() < 0 || c.layer() >= layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "command layer ", c.layer(), " outside [0, ", layers, ")"));
  }
  if (exchange_part && (!exchanged_ || !layer_has_moe_[c.layer()])) {
    return absl::InvalidArgumentError(absl::StrCat(
        Command::Op_Name(c.op()), " ", Command::Part_Name(c.part()),
        " of layer ", c.layer(),
        ": only a MoE layer under expert parallelism exchanges its rows"));
  }
  switch (c.op()) {
    case Command::FORWARD:
      return CheckForward(c);
    case Command::BACKWARD:
      if (!layout_.requires_grad(pass)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD of pass ", pass, ", which has no gradients"));
      }
      return CheckBackward(c);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(model, " runs FORWARD and BACKWARD, got op ",
                       Command::Op_Name(c.op())));
  }
}

absl::Status ModelCommandOrder::CheckForward(const Command& c) const {
  const int pass = c.pass();
  const Place& a = At(pass, c.microbatch());
  const int l = c.layer();
  switch (c.part()) {
    case Command::EMBED:
      if (pass > 0 && !At(pass - 1, c.microbatch()).head_done) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD EMBED of pass ", pass, " before pass ",
                         pass - 1, "'s HEAD"));
      }
      return absl::OkStatus();
    case Command::LAYER:
      if (!a.embedded ||
          (l > 0 && !(a.layer_done[l - 1] &&
                      (a.experts_done[l - 1] || !layer_has_moe_[l - 1])))) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD LAYER ", l, " out of order in pass ", pass));
      }
      return absl::OkStatus();
    case Command::DISPATCH:
      if (!a.layer_done[l] || a.experts_done[l] || a.stage[l] != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD DISPATCH ", l, " must follow FORWARD LAYER ", l));
      }
      return absl::OkStatus();
    case Command::EXPERTS:
      if (!layer_has_moe_[l]) {
        return absl::InvalidArgumentError(
            absl::StrCat("FORWARD EXPERTS of layer ", l, ", which has none"));
      }
      if (exchanged_ && a.stage[l] != 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD EXPERTS ", l, " must follow FORWARD DISPATCH ", l));
      }
      if (!a.layer_done[l] || a.experts_done[l]) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD EXPERTS ", l, " must follow FORWARD LAYER ", l));
      }
      return absl::OkStatus();
    case Command::COMBINE:
      if (a.stage[l] != 2) {
        return absl::FailedPreconditionError(absl::StrCat(
            "FORWARD COMBINE ", l, " must follow FORWARD EXPERTS ", l));
      }
      return absl::OkStatus();
    case Command::HEAD: {
      const int last = static_cast<int>(layer_has_moe_.size()) - 1;
      if (!a.layer_done[last] ||
          (layer_has_moe_[last] && !a.experts_done[last])) {
        return absl::FailedPreconditionError(
            absl::StrCat("FORWARD HEAD before the last layer in pass ", pass));
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("FORWARD of part ", Command::Part_Name(c.part())));
  }
}

absl::Status ModelCommandOrder::CheckBackward(const Command& c) const {
  const int pass = c.pass();
  const Place& a = At(pass, c.microbatch());
  const int l = c.layer();
  switch (c.part()) {
    case Command::HEAD:
      if (!a.head_done || a.head_backward_done) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD HEAD of pass ", pass, " without its forward"));
      }
      return absl::OkStatus();
    case Command::COMBINE:
      if (!a.head_backward_done || a.next_backward_layer != l ||
          !a.experts_done[l] || a.stage[l] != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD COMBINE ", l, " out of order in pass ", pass));
      }
      return absl::OkStatus();
    case Command::EXPERTS:
      if (!layer_has_moe_[l] || !a.head_backward_done ||
          a.next_backward_layer != l || !a.experts_done[l] ||
          a.stage[l] != (exchanged_ ? 3 : 0)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EXPERTS ", l, " out of order in pass ", pass,
            exchanged_ ? " (BACKWARD COMBINE comes first)" : ""));
      }
      return absl::OkStatus();
    case Command::DISPATCH:
      if (a.stage[l] != 4) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD DISPATCH ", l, " must follow BACKWARD EXPERTS ", l));
      }
      return absl::OkStatus();
    case Command::LAYER:
      if (!a.head_backward_done || a.next_backward_layer != l ||
          !a.layer_done[l] || (layer_has_moe_[l] && a.experts_done[l])) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD LAYER ", l, " out of order in pass ", pass,
            layer_has_moe_[l] ? " (BACKWARD EXPERTS comes first)" : ""));
      }
      return absl::OkStatus();
    case Command::EMBED:
      if (!a.head_backward_done || a.next_backward_layer != -1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "BACKWARD EMBED of pass ", pass, " before every layer's backward"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("BACKWARD of part ", Command::Part_Name(c.part())));
  }
}

void ModelCommandOrder::Commit(const Command& c) {
  Place& a = At(c.pass(), c.microbatch());
  const int last = static_cast<int>(layer_has_moe_.size()) - 1;
  const int l = c.layer();
  if (c.op() == Command::FORWARD) {
    switch (c.part()) {
      case Command::EMBED:
        // A new forward of the pass replaces the old one.
        a.embedded = true;
        a.head_done = a.head_backward_done = false;
        a.next_backward_layer = last;
        a.layer_done.assign(a.layer_done.size(), false);
        a.experts_done.assign(a.experts_done.size(), false);
        a.stage.assign(a.stage.size(), 0);
        return;
      case Command::LAYER:
        a.layer_done[l] = true;
        a.experts_done[l] = false;
        a.stage[l] = 0;
        return;
      case Command::DISPATCH:
        a.stage[l] = 1;
        return;
      case Command::EXPERTS:
        if (exchanged_) {
          a.stage[l] = 2;
        } else {
          a.experts_done[l] = true;
        }
        return;
      case Command::COMBINE:
        a.stage[l] = 0;
        a.experts_done[l] = true;
        return;
      case Command::HEAD:
        a.head_done = true;
        a.head_backward_done = false;
        return;
      default:
        return;
    }
  }
  switch (c.part()) {
    case Command::HEAD:
      a.head_backward_done = true;
      a.next_backward_layer = last;
      return;
    case Command::COMBINE:
      a.stage[l] = 3;
      return;
    case Command::EXPERTS:
      if (exchanged_) {
        a.stage[l] = 4;
      } else {
        a.experts_done[l] = false;  // Consumed: LAYER backward comes next.
      }
      return;
    case Command::DISPATCH:
      a.stage[l] = 0;
      a.experts_done[l] = false;
      return;
    case Command::LAYER:
      a.layer_done[l] = false;
      a.next_backward_layer = l - 1;
      return;
    case Command::EMBED:
      a.head_backward_done = false;
      return;
    default:
      return;
  }
}

}  // namespace shardd
