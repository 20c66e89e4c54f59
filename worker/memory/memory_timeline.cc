#include "worker/memory/memory_timeline.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace shardd {

ChartSpec MeasuredTimelineChart(const std::vector<MemoryTimelinePoint>& points,
                                const v1::ShardingPlan& plan, int rank,
                                int64_t step) {
  ChartSpec chart;
  chart.title =
      absl::StrCat(plan.model_id(), ": ", plan.strategy(), ", world size ",
                   plan.world_size(), " (measured, rank ", rank, ")");
  chart.subtitle = absl::StrCat(
      "Live unsharded memory of step ", step,
      " after every allocation and free, as the worker's memory tracker "
      "counted it");
  chart.x_label = "allocation or free of gathered params / unsharded grads";
  chart.y_label = "bytes on this rank";
  StackLayer params{"gathered params", "", "#4f84cc", {}};
  StackLayer grads{"unsharded grads", "", "#e0812f", {}};
  double peak = -1;
  double peak_x = 0;
  // Point i holds from change i to change i + 1; a final zero-width point
  // closes the last interval.
  for (size_t i = 0; i < points.size(); ++i) {
    chart.areas.x.push_back(static_cast<double>(i));
    params.values.push_back(static_cast<double>(points[i].gathered_params));
    grads.values.push_back(static_cast<double>(points[i].unsharded_grads));
    const double total = static_cast<double>(points[i].gathered_params +
                                             points[i].unsharded_grads);
    if (total > peak) {
      peak = total;
      peak_x = static_cast<double>(i);
    }
  }
  chart.areas.x.push_back(static_cast<double>(points.size()));
  params.values.push_back(0);
  grads.values.push_back(0);
  chart.areas.layers.push_back(std::move(params));
  chart.areas.layers.push_back(std::move(grads));
  if (peak >= 0) {
    chart.peaks.push_back(
        {absl::StrCat("measured peak ", FormatChartBytes(peak)), peak_x, peak,
         "#1d3f73"});
  }
  if (plan.memory().peak_unsharded_bytes() > 0) {
    chart.references.push_back(
        {absl::StrCat("planned peak ",
                      FormatChartBytes(plan.memory().peak_unsharded_bytes())),
         static_cast<double>(plan.memory().peak_unsharded_bytes()), "#b01c2e"});
  }
  return chart;
}

void StepTimelineCapture::BeginStep() {
  if (svg_path_.empty() || written_) return;
  tracker_->StartTimeline(kMaxMeasuredTimelinePoints);
  recording_ = true;
}

absl::Status StepTimelineCapture::EndStep(const v1::ShardingPlan& plan,
                                          int rank, int64_t step) {
  if (!recording_) return absl::OkStatus();
  recording_ = false;
  const std::vector<MemoryTimelinePoint> points = tracker_->StopTimeline();
  written_ = true;  // One attempt: a failure is not retried every step.
  if (points.empty()) {
    return absl::FailedPreconditionError(
        "--memory_timeline_svg: the step changed no tracked unsharded "
        "memory on this worker's tracker");
  }
  absl::StatusOr<std::string> svg =
      RenderChartSvg(MeasuredTimelineChart(points, plan, rank, step));
  if (!svg.ok()) return svg.status();
  // Written whole under a temporary name, then renamed: a reader never
  // sees half a picture.
  const std::string tmp = absl::StrCat(svg_path_, ".tmp");
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (file) file << *svg;
    if (file) file.close();
    if (!file) {
      return absl::InternalError(
          absl::StrCat("--memory_timeline_svg: cannot write '", tmp, "'"));
    }
  }
  if (std::rename(tmp.c_str(), svg_path_.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("--memory_timeline_svg: cannot rename '", tmp, "' to '",
                     svg_path_, "'"));
  }
  return absl::OkStatus();
}

}  // namespace shardd
