#ifndef SHARDD_COMMON_METRICS_REGISTRY_H_
#define SHARDD_COMMON_METRICS_REGISTRY_H_

// Counters, gauges and histograms with labels, rendered in the Prometheus
// text exposition format 0.0.4 (what a /metrics endpoint serves, see
// metrics_http_server.h).
//
//   MetricsRegistry registry;
//   SHARDD_ASSIGN_OR_RETURN(CounterFamily* steps,
//       registry.AddCounter("shardd_worker_steps_total", "Steps run.", {}));
//   steps->Increment({});
//   // Values owned elsewhere are copied in at scrape time:
//   registry.AddCollector([&] { live->Set({"params"}, tracker.live()); });
//   std::string text = registry.Render();
//
// A family has a fixed list of label names; every sample call passes one
// value per name, in the same order. A call with another number of values
// is a programming error: it is ignored and counted in invalid_calls().
//
// Thread-safe: every method may be called concurrently. Collectors run one
// at a time, inside Render.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardd {

using LabelValues = std::vector<std::string>;

enum class MetricType { kCounter, kGauge, kHistogram };

// What families share: name, help, label names, and the registry's count of
// malformed calls.
class MetricFamilyBase {
 public:
  virtual ~MetricFamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  virtual MetricType type() const = 0;
  // Appends the family's HELP, TYPE and sample lines to `out`.
  virtual void RenderTo(std::string* out) const = 0;

 protected:
  MetricFamilyBase(std::string name, std::string help,
                   std::vector<std::string> label_names,
                   std::function<void()> on_invalid);
  // True when `labels` has one value per label name; else counts the call.
  bool CheckLabels(const LabelValues& labels) const;
  // Counts a malformed call in the registry's invalid_calls().
  void CountInvalid() const;
  // `{a="x",b="y"}` (empty without labels), with `extra` (e.g. le="1")
  // appended when non-empty.
  std::string LabelText(const LabelValues& labels,
                        absl::string_view extra = "") const;

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::function<void()> on_invalid_;
};

// A monotonically increasing total (e.g. steps run).
class CounterFamily final : public MetricFamilyBase {
 public:
  // Adds `delta`; negative or non-finite deltas are ignored (and counted as
  // invalid calls).
  void Add(const LabelValues& labels, double delta) ABSL_LOCKS_EXCLUDED(mu_);
  void Increment(const LabelValues& labels) { Add(labels, 1.0); }
  // Mirrors a total kept elsewhere (read at scrape time). The caller
  // guarantees it never decreases while the process runs.
  void Set(const LabelValues& labels, double total) ABSL_LOCKS_EXCLUDED(mu_);
  // The current value (0 for labels never set).
  double Value(const LabelValues& labels) const ABSL_LOCKS_EXCLUDED(mu_);

  MetricType type() const override { return MetricType::kCounter; }
  void RenderTo(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class MetricsRegistry;
  using MetricFamilyBase::MetricFamilyBase;

  mutable absl::Mutex mu_;
  std::map<LabelValues, double> values_ ABSL_GUARDED_BY(mu_);
};

// A value that goes up and down (e.g. live workers).
class GaugeFamily final : public MetricFamilyBase {
 public:
  void Set(const LabelValues& labels, double value) ABSL_LOCKS_EXCLUDED(mu_);
  void Add(const LabelValues& labels, double delta) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every label set, so that a collector can publish exactly the
  // current ones (e.g. the jobs the coordinator still keeps).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  double Value(const LabelValues& labels) const ABSL_LOCKS_EXCLUDED(mu_);

  MetricType type() const override { return MetricType::kGauge; }
  void RenderTo(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class MetricsRegistry;
  using MetricFamilyBase::MetricFamilyBase;

  mutable absl::Mutex mu_;
  std::map<LabelValues, double> values_ ABSL_GUARDED_BY(mu_);
};

// Observations counted into fixed buckets (e.g. step seconds).
class HistogramFamily final : public MetricFamilyBase {
 public:
  // NaN observations are ignored (and counted as invalid calls).
  void Observe(const LabelValues& labels, double value)
      ABSL_LOCKS_EXCLUDED(mu_);

  struct Snapshot {
    // Non-cumulative counts, one per bound, plus the +Inf bucket last.
    std::vector<uint64_t> bucket_counts;
    uint64_t count = 0;
    double sum = 0.0;
  };
  // Zeros (with every bucket) for labels never observed.
  Snapshot Get(const LabelValues& labels) const ABSL_LOCKS_EXCLUDED(mu_);
  // Replaces the series with `snapshot`, for collectors that keep their own
  // counts (one bucket per bound plus +Inf, as Get returns; a snapshot of
  // another size is ignored and counted as an invalid call).
  void Set(const LabelValues& labels, const Snapshot& snapshot)
      ABSL_LOCKS_EXCLUDED(mu_);
  const std::vector<double>& bounds() const { return bounds_; }

  MetricType type() const override { return MetricType::kHistogram; }
  void RenderTo(std::string* out) const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class MetricsRegistry;
  HistogramFamily(std::string name, std::string help,
                  std::vector<std::string> label_names,
                  std::function<void()> on_invalid, std::vector<double> bounds);

  const std::vector<double> bounds_;  // Finite, strictly increasing.
  mutable absl::Mutex mu_;
  std::map<LabelValues, Snapshot> values_ ABSL_GUARDED_BY(mu_);
};

// `count` bucket bounds start, start*factor, ... (start > 0, factor > 1).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// A value as the text format writes it: integers without a fraction or
// exponent (up to 2^53), "+Inf", "-Inf", "NaN", else the shortest decimal
// that reads back exactly.
std::string FormatMetricValue(double value);

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Registers a family; the registry owns it and the pointer stays valid for
  // the registry's lifetime.
  // Errors: INVALID_ARGUMENT (a name not matching [a-zA-Z_:][a-zA-Z0-9_:]*, a
  // label name not matching [a-zA-Z_][a-zA-Z0-9_]* or starting with "__",
  // a repeated label name, "le" on a histogram, histogram bounds not finite
  // and strictly increasing or empty), ALREADY_EXISTS (the name is taken).
  absl::StatusOr<CounterFamily*> AddCounter(
      const std::string& name, const std::string& help,
      const std::vector<std::string>& label_names) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<GaugeFamily*> AddGauge(
      const std::string& name, const std::string& help,
      const std::vector<std::string>& label_names) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<HistogramFamily*> AddHistogram(
      const std::string& name, const std::string& help,
      const std::vector<std::string>& label_names, std::vector<double> bounds)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Runs at the start of every Render (in registration order), to copy
  // values owned elsewhere into families. It must not call Render or
  // AddCollector.
  void AddCollector(std::function<void()> collector) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs the collectors, then writes every family in registration order:
  // "# HELP", "# TYPE", then one line per sample, label sets sorted.
  std::string Render() ABSL_LOCKS_EXCLUDED(render_mu_, mu_);

  // Sample calls ignored for a wrong number of label values or a bad value.
  int64_t invalid_calls() const { return invalid_calls_.load(); }

 private:
  // Validates the name and label names. Errors: as AddCounter.
  absl::Status CheckNew(const std::string& name,
                        const std::vector<std::string>& label_names) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::function<void()> InvalidCallCounter();

  // Serializes Render, so collectors never run concurrently.
  absl::Mutex render_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<MetricFamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
  // Atomic: families count into it while holding their own mutex.
  std::atomic<int64_t> invalid_calls_{0};
};

}  // namespace shardd

#endif  // SHARDD_COMMON_METRICS_REGISTRY_H_
