#include "client/plan_timeline.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardd {
namespace {

// Up to this many units the legend names each; beyond, it names the kinds.
constexpr int kMaxUnitsInLegend = 8;
// Per-unit layers cost units x events values; beyond this the chart stacks
// the two memory kinds only.
constexpr int64_t kMaxLayerValues = int64_t{8} << 20;

constexpr char kCompareColor[] = "#b01c2e";
constexpr char kPrimaryPeakColor[] = "#1d3f73";

const char* KindWord(v1::UnitKind kind) {
  switch (kind) {
    case v1::UNIT_ROOT:
      return "root";
    case v1::UNIT_LAYER:
      return "layers";
    case v1::UNIT_EXPERTS:
      return "experts";
    case v1::UNIT_DTYPE_ISLAND:
      return "dtype islands";
    case v1::UNIT_FLAT_BUCKET:
      return "flat buckets";
    default:
      return "other";
  }
}

// Parameters in blues and greens, gradients in oranges and reds; two shades
// per kind alternate between neighbouring units so their bands separate.
std::string UnitColor(v1::UnitKind kind, bool grads, int index) {
  const bool light = index % 2 == 1;
  switch (kind) {
    case v1::UNIT_ROOT:
      return grads ? "#a5461a" : "#24497e";
    case v1::UNIT_EXPERTS:
      if (grads) return light ? "#e8868c" : "#c8434b";
      return light ? "#7fcbc0" : "#3d9a8f";
    case v1::UNIT_DTYPE_ISLAND:
      return grads ? "#b08a2e" : "#7b5fae";
    default:  // Layers, flat buckets.
      if (grads) return light ? "#f4b06b" : "#e0812f";
      return light ? "#8db3e6" : "#4f84cc";
  }
}

std::string UnitName(const v1::ShardingPlan& plan, int unit) {
  if (unit < 0 || unit >= plan.units_size()) return "(none)";
  return plan.units(unit).name();
}

// The event the peak belongs to, or -1.
int PeakEvent(const v1::MemoryReport& memory) {
  const int e = memory.peak_event();
  return e >= 0 && e < memory.timeline_size() ? e : -1;
}

std::string PeakLabel(const v1::ShardingPlan& plan, bool with_strategy) {
  const v1::MemoryReport& memory = plan.memory();
  std::string label =
      absl::StrCat(with_strategy ? absl::StrCat(plan.strategy(), " ") : "",
                   "peak ", FormatChartBytes(memory.peak_unsharded_bytes()));
  const int e = PeakEvent(memory);
  if (e >= 0) {
    const v1::TimelineEvent& event = memory.timeline(e);
    absl::StrAppend(&label, ": ", event.phase());
    if (event.unit() >= 0) {
      absl::StrAppend(&label, ", ", event.op(), " ",
                      UnitName(plan, event.unit()));
    }
  }
  return label;
}

absl::Status NeedTimeline(const v1::ShardingPlan& plan) {
  if (plan.memory().timeline_size() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan of strategy '", plan.strategy(),
                     "' has no timeline (plan with include_timeline)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ChartSpec> PlanTimelineChart(const v1::ShardingPlan& plan,
                                            const std::string& model_name,
                                            const v1::ShardingPlan* compare) {
  if (absl::Status s = NeedTimeline(plan); !s.ok()) return s;
  if (compare != nullptr) {
    if (absl::Status s = NeedTimeline(*compare); !s.ok()) return s;
  }
  const v1::MemoryReport& memory = plan.memory();
  const int n = memory.timeline_size();
  const int units = plan.units_size();

  ChartSpec chart;
  chart.title = absl::StrCat(
      model_name, ": ", plan.strategy(),
      compare != nullptr ? absl::StrCat(" vs ", compare->strategy()) : "",
      ", world size ", plan.world_size());
  chart.subtitle = absl::StrFormat(
      "Live unsharded memory per rank over one step (dp_shard %d x "
      "dp_replicate %d, %d micro-batch%s, %d pass%s); persistent %s not "
      "drawn",
      plan.mesh().dp_shard(), plan.mesh().dp_replicate(),
      std::max(1, plan.step().microbatches()),
      std::max(1, plan.step().microbatches()) == 1 ? "" : "es",
      std::max(1, plan.step().passes()),
      std::max(1, plan.step().passes()) == 1 ? "" : "es",
      FormatChartBytes(memory.persistent_bytes()));
  if (memory.timeline_events() > n) {
    absl::StrAppend(&chart.subtitle, "; first ", n, " of ",
                    memory.timeline_events(), " events");
  }
  chart.x_label = "step-program command";
  chart.y_label = "bytes per rank";
  chart.y_unit = ChartUnit::kBytes;

  chart.areas.x.reserve(n);
  for (const v1::TimelineEvent& event : memory.timeline()) {
    chart.areas.x.push_back(event.command());
  }
  const bool per_unit =
      units > 0 && static_cast<int64_t>(units) * 2 * n <= kMaxLayerValues;
  if (per_unit) {
    // Each event follows one command on one unit: the change of the totals
    // since the previous event is that unit's.
    std::vector<std::vector<double>> params(units), grads(units);
    std::vector<double> live_params(units, 0), live_grads(units, 0);
    std::vector<bool> has_params(units, false), has_grads(units, false);
    int64_t last_params = 0, last_grads = 0;
    for (int u = 0; u < units; ++u) {
      params[u].assign(n, 0);
      grads[u].assign(n, 0);
    }
    std::vector<double> other(n, 0);
    double live_other = 0;
    for (int i = 0; i < n; ++i) {
      const v1::TimelineEvent& event = memory.timeline(i);
      const int64_t dp = event.live_param_bytes() - last_params;
      const int64_t dg = event.live_grad_bytes() - last_grads;
      last_params = event.live_param_bytes();
      last_grads = event.live_grad_bytes();
      const int u = event.unit();
      if (u >= 0 && u < units) {
        live_params[u] = std::max(0.0, live_params[u] + dp);
        live_grads[u] = std::max(0.0, live_grads[u] + dg);
      } else {
        live_other = std::max(0.0, live_other + dp + dg);
      }
      for (int v = 0; v < units; ++v) {
        if (live_params[v] > 0) {
          params[v][i] = live_params[v];
          has_params[v] = true;
        }
        if (live_grads[v] > 0) {
          grads[v][i] = live_grads[v];
          has_grads[v] = true;
        }
      }
      other[i] = live_other;
    }
    const bool name_units = units <= kMaxUnitsInLegend;
    for (int pass = 0; pass < 2; ++pass) {
      const bool is_grads = pass == 1;
      for (int u = 0; u < units; ++u) {
        if (!(is_grads ? has_grads[u] : has_params[u])) continue;
        const v1::FsdpUnit& unit = plan.units(u);
        const char* what = is_grads ? "unsharded grads" : "gathered params";
        StackLayer layer;
        layer.label = absl::StrCat(what, ": ", unit.name());
        layer.legend = name_units
                           ? layer.label
                           : absl::StrCat(what, ": ", KindWord(unit.kind()));
        layer.color = UnitColor(unit.kind(), is_grads, u);
        layer.values = std::move(is_grads ? grads[u] : params[u]);
        chart.areas.layers.push_back(std::move(layer));
      }
    }
    if (*std::max_element(other.begin(), other.end()) > 0) {
      chart.areas.layers.push_back(
          {"not attributed to a unit", "", "#999999", std::move(other)});
    }
  } else {
    StackLayer params{"gathered params", "", "#4f84cc", {}};
    StackLayer grads{"unsharded grads", "", "#e0812f", {}};
    for (const v1::TimelineEvent& event : memory.timeline()) {
      params.values.push_back(event.live_param_bytes());
      grads.values.push_back(event.live_grad_bytes());
    }
    chart.areas.layers.push_back(std::move(params));
    chart.areas.layers.push_back(std::move(grads));
  }

  if (const int e = PeakEvent(memory); e >= 0) {
    chart.peaks.push_back({PeakLabel(plan, compare != nullptr),
                           static_cast<double>(memory.timeline(e).command()),
                           static_cast<double>(memory.peak_unsharded_bytes()),
                           kPrimaryPeakColor});
  }
  if (compare != nullptr) {
    LineSeries line;
    line.label = absl::StrCat(compare->strategy(), " total");
    line.color = kCompareColor;
    for (const v1::TimelineEvent& event : compare->memory().timeline()) {
      line.points.push_back({static_cast<double>(event.command()),
                             static_cast<double>(event.live_param_bytes() +
                                                 event.live_grad_bytes())});
    }
    chart.lines.push_back(std::move(line));
    if (const int e = PeakEvent(compare->memory()); e >= 0) {
      chart.peaks.push_back(
          {PeakLabel(*compare, true),
           static_cast<double>(compare->memory().timeline(e).command()),
           static_cast<double>(compare->memory().peak_unsharded_bytes()),
           kCompareColor});
    }
  }
  return chart;
}

ChartSpec LossChart(const std::string& title,
                    const std::vector<std::pair<double, double>>& losses,
                    double entropy_rate,
                    const std::vector<std::pair<double, double>>& eval_losses) {
  ChartSpec chart;
  chart.title = title;
  chart.x_label = "step";
  chart.y_label = "loss (nats/token)";
  chart.y_unit = ChartUnit::kPlain;
  LineSeries line;
  line.label = "training loss";
  line.color = "#3b6fb6";
  line.steps = false;
  line.points = losses;
  chart.lines.push_back(std::move(line));
  if (!eval_losses.empty()) {
    LineSeries eval;
    eval.label = "held-out loss";
    eval.color = "#d9822b";
    eval.steps = false;
    eval.points = eval_losses;
    chart.lines.push_back(std::move(eval));
  }
  if (!losses.empty()) {
    chart.subtitle = absl::StrFormat(
        "%d steps: loss %.4f -> %.4f", static_cast<int>(losses.size()),
        losses.front().second, losses.back().second);
    if (!eval_losses.empty()) {
      absl::StrAppend(
          &chart.subtitle,
          absl::StrFormat("; held-out %.4f at step %d",
                          eval_losses.back().second,
                          static_cast<int>(eval_losses.back().first)));
    }
  }
  if (entropy_rate > 0) {
    chart.references.push_back(
        {absl::StrFormat("data entropy rate %.4f", entropy_rate), entropy_rate,
         "#4f9d58"});
  }
  return chart;
}

}  // namespace shardd
