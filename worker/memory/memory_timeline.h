#ifndef SHARDD_WORKER_MEMORY_MEMORY_TIMELINE_H_
#define SHARDD_WORKER_MEMORY_MEMORY_TIMELINE_H_

// A worker's measured memory timeline of one step, drawn as an SVG
// (viz/timeline_svg.h) beside the planner's: the gathered parameters
// and unsharded gradients live after every allocation and free of the
// step (MemoryTracker::StartTimeline), stacked by kind, with the measured
// peak marked and the plan's predicted peak as a reference line. Enabled by
// the worker flag --memory_timeline_svg; the first step this worker runs
// is drawn, once.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "viz/timeline_svg.h"
#include "proto/plan.pb.h"
#include "worker/memory/memory_tracker.h"

namespace shardd {

// At most this many points are recorded (a step of many micro-batches has
// more changes; the picture then shows the first ones).
inline constexpr size_t kMaxMeasuredTimelinePoints = 200000;

// The chart of `points`, measured on `rank` in step `step` of `plan`.
ChartSpec MeasuredTimelineChart(const std::vector<MemoryTimelinePoint>& points,
                                const v1::ShardingPlan& plan, int rank,
                                int64_t step);

// Records one step of `tracker` and writes its chart to `svg_path`. Not
// thread-safe: the worker calls it under its runtime mutex. An empty path
// turns it off.
class StepTimelineCapture {
 public:
  StepTimelineCapture(std::string svg_path, MemoryTracker* tracker)
      : svg_path_(std::move(svg_path)), tracker_(tracker) {}

  // Starts recording, unless a step was written already.
  void BeginStep();
  // Stops recording and writes the picture of the step (then no more).
  // Errors: INTERNAL when the file cannot be written; FAILED_PRECONDITION
  // when nothing was recorded (e.g. a GPU step, tracked elsewhere).
  absl::Status EndStep(const v1::ShardingPlan& plan, int rank, int64_t step);

 private:
  const std::string svg_path_;
  MemoryTracker* const tracker_;
  bool recording_ = false;
  bool written_ = false;
};

}  // namespace shardd

#endif  // SHARDD_WORKER_MEMORY_MEMORY_TIMELINE_H_
