#ifndef SHARDD_CLIENT_TRAIN_COMMAND_H_
#define SHARDD_CLIENT_TRAIN_COMMAND_H_

// `shardctl train`: submits the model (or takes a stored one) and a job,
// then follows the job's step events to the end, reconnecting to a
// coordinator that restarts, and prints progress (or one JSON line per
// step) and the summary.

#include <ostream>

#include "absl/status/status.h"
#include "client/shardctl_args.h"

namespace shardd {

// `tty`: the output is a terminal (the progress line is rewritten in
// place). Errors: those of reading --model, connecting, SubmitModel /
// GetPlan / SubmitStep / WatchStep (naming the job), ABORTED for a job that
// failed (its message names the step, the rank and the cause), and those of
// writing --loss-svg.
absl::Status RunTrain(const ShardctlArgs& args, bool tty, std::ostream& out);

}  // namespace shardd

#endif  // SHARDD_CLIENT_TRAIN_COMMAND_H_
