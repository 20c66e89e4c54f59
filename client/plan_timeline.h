#ifndef SHARDD_CLIENT_PLAN_TIMELINE_H_
#define SHARDD_CLIENT_PLAN_TIMELINE_H_

// Builds the charts shardctl draws (viz/timeline_svg.h) from plans and
// training results: the planner's live-memory timeline of one step, per
// unit, optionally overlaid with a second strategy's total; and the loss
// curve of a training job.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "viz/timeline_svg.h"
#include "proto/plan.pb.h"

namespace shardd {

// The live-memory timeline of `plan` (planned with include_timeline) over
// step-program commands: gathered parameters and unsharded gradients
// stacked per unit (a unit's share after each event is the change that
// event's command made to it), the peak marked. With `compare` (another
// plan of the same model, also with a timeline) its total is drawn as a
// line over the areas, with its own peak marked. `model_name` goes into the
// title.
// Errors: FAILED_PRECONDITION when a plan has no timeline (planned without
// include_timeline), naming the strategy.
absl::StatusOr<ChartSpec> PlanTimelineChart(const v1::ShardingPlan& plan,
                                            const std::string& model_name,
                                            const v1::ShardingPlan* compare);

// A loss curve: (step, loss) points, the held-out loss of the evaluations
// as a second line when there are any, and the data's entropy rate (the
// best reachable loss) as a reference line when > 0.
ChartSpec LossChart(
    const std::string& title,
    const std::vector<std::pair<double, double>>& losses, double entropy_rate,
    const std::vector<std::pair<double, double>>& eval_losses = {});

}  // namespace shardd

#endif  // SHARDD_CLIENT_PLAN_TIMELINE_H_
