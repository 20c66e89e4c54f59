#include "common/metrics_registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardd {
namespace {

bool ValidName(absl::string_view name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (letter || (allow_colon && c == ':') || (i > 0 && digit)) continue;
    return false;
  }
  return true;
}

// HELP text escapes only backslash and newline; label values also escape
// the double quote (exposition format 0.0.4).
std::string Escape(absl::string_view text, bool quote) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

void AppendHeader(const MetricFamilyBase& family, std::string* out) {
  absl::StrAppend(out, "# HELP ", family.name(), " ",
                  Escape(family.help(), /*quote=*/false), "\n", "# TYPE ",
                  family.name(), " ", TypeName(family.type()), "\n");
}

}  // namespace

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  constexpr double kExactIntegers = 9007199254740992.0;  // 2^53
  if (value == std::trunc(value) && std::fabs(value) <= kExactIntegers) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f", value);
    // "-0" reads back as 0 but looks odd.
    return std::string(buf) == "-0" ? "0" : buf;
  }
  char buf[40];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  if (!(start > 0) || !(factor > 1)) return bounds;
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  return bounds;
}

MetricFamilyBase::MetricFamilyBase(std::string name, std::string help,
                                   std::vector<std::string> label_names,
                                   std::function<void()> on_invalid)
    : name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      on_invalid_(std::move(on_invalid)) {}

bool MetricFamilyBase::CheckLabels(const LabelValues& labels) const {
  if (labels.size() == label_names_.size()) return true;
  CountInvalid();
  return false;
}

void MetricFamilyBase::CountInvalid() const {
  if (on_invalid_) on_invalid_();
}

std::string MetricFamilyBase::LabelText(const LabelValues& labels,
                                        absl::string_view extra) const {
  if (labels.empty() && extra.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ",";
    absl::StrAppend(&out, label_names_[i], "=\"",
                    Escape(labels[i], /*quote=*/true), "\"");
  }
  if (!extra.empty()) {
    if (!labels.empty()) out += ",";
    out += std::string(extra);
  }
  out += "}";
  return out;
}

// --- CounterFamily ---

void CounterFamily::Add(const LabelValues& labels, double delta) {
  if (!CheckLabels(labels)) return;
  if (!(delta >= 0) || std::isinf(delta)) {
    CountInvalid();
    return;
  }
  absl::MutexLock lock(&mu_);
  values_[labels] += delta;
}

void CounterFamily::Set(const LabelValues& labels, double total) {
  if (!CheckLabels(labels)) return;
  absl::MutexLock lock(&mu_);
  values_[labels] = total;
}

double CounterFamily::Value(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0.0 : it->second;
}

void CounterFamily::RenderTo(std::string* out) const {
  AppendHeader(*this, out);
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, value] : values_) {
    absl::StrAppend(out, name(), LabelText(labels), " ",
                    FormatMetricValue(value), "\n");
  }
}

// --- GaugeFamily ---

void GaugeFamily::Set(const LabelValues& labels, double value) {
  if (!CheckLabels(labels)) return;
  absl::MutexLock lock(&mu_);
  values_[labels] = value;
}

void GaugeFamily::Add(const LabelValues& labels, double delta) {
  if (!CheckLabels(labels)) return;
  absl::MutexLock lock(&mu_);
  values_[labels] += delta;
}

void GaugeFamily::Clear() {
  absl::MutexLock lock(&mu_);
  values_.clear();
}

double GaugeFamily::Value(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0.0 : it->second;
}

void GaugeFamily::RenderTo(std::string* out) const {
  AppendHeader(*this, out);
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, value] : values_) {
    absl::StrAppend(out, name(), LabelText(labels), " ",
                    FormatMetricValue(value), "\n");
  }
}

// --- HistogramFamily ---

HistogramFamily::HistogramFamily(std::string name, std::string help,
                                 std::vector<std::string> label_names,
                                 std::function<void()> on_invalid,
                                 std::vector<double> bounds)
    : MetricFamilyBase(std::move(name), std::move(help), std::move(label_names),
                       std::move(on_invalid)),
      bounds_(std::move(bounds)) {}

void HistogramFamily::Observe(const LabelValues& labels, double value) {
  if (!CheckLabels(labels)) return;
  if (std::isnan(value)) {
    CountInvalid();
    return;
  }
  // First bound >= value (le is inclusive); past the end: +Inf.
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  Snapshot& s = values_[labels];
  if (s.bucket_counts.empty()) s.bucket_counts.assign(bounds_.size() + 1, 0);
  ++s.bucket_counts[bucket];
  ++s.count;
  s.sum += value;
}

void HistogramFamily::Set(const LabelValues& labels, const Snapshot& snapshot) {
  if (!CheckLabels(labels)) return;
  if (snapshot.bucket_counts.size() != bounds_.size() + 1) {
    CountInvalid();
    return;
  }
  absl::MutexLock lock(&mu_);
  values_[labels] = snapshot;
}

HistogramFamily::Snapshot HistogramFamily::Get(
    const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  if (it != values_.end()) return it->second;
  Snapshot empty;
  empty.bucket_counts.assign(bounds_.size() + 1, 0);
  return empty;
}

void HistogramFamily::RenderTo(std::string* out) const {
  AppendHeader(*this, out);
  absl::MutexLock lock(&mu_);
  for (const auto& [labels, s] : values_) {
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += s.bucket_counts[i];
      const std::string le =
          i < bounds_.size() ? FormatMetricValue(bounds_[i]) : "+Inf";
      absl::StrAppend(out, name(), "_bucket",
                      LabelText(labels, absl::StrCat("le=\"", le, "\"")), " ",
                      cumulative, "\n");
    }
    absl::StrAppend(out, name(), "_sum", LabelText(labels), " ",
                    FormatMetricValue(s.sum), "\n");
    absl::StrAppend(out, name(), "_count", LabelText(labels), " ", s.count,
                    "\n");
  }
}

// --- MetricsRegistry ---

std::function<void()> MetricsRegistry::InvalidCallCounter() {
  return [this] { invalid_calls_.fetch_add(1); };
}

absl::Status MetricsRegistry::CheckNew(
    const std::string& name,
    const std::vector<std::string>& label_names) const {
  if (!ValidName(name, /*allow_colon=*/true)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric name '", name, "': expected [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  std::set<std::string> seen;
  for (const std::string& label : label_names) {
    if (!ValidName(label, /*allow_colon=*/false) || label.rfind("__", 0) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": label name '", label,
                       "': expected [a-zA-Z_][a-zA-Z0-9_]* not starting "
                       "with __"));
    }
    if (!seen.insert(label).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("metric ", name, ": label '", label, "' repeated"));
    }
  }
  for (const auto& family : families_) {
    if (family->name() == name) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric ", name, " is already registered"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CounterFamily*> MetricsRegistry::AddCounter(
    const std::string& name, const std::string& help,
    const std::vector<std::string>& label_names) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  auto* family =
      new CounterFamily(name, help, label_names, InvalidCallCounter());
  families_.emplace_back(family);
  return family;
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::AddGauge(
    const std::string& name, const std::string& help,
    const std::vector<std::string>& label_names) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  auto* family = new GaugeFamily(name, help, label_names, InvalidCallCounter());
  families_.emplace_back(family);
  return family;
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::AddHistogram(
    const std::string& name, const std::string& help,
    const std::vector<std::string>& label_names, std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckNew(name, label_names); !s.ok()) return s;
  if (std::find(label_names.begin(), label_names.end(), "le") !=
      label_names.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("histogram ", name, ": 'le' is reserved for buckets"));
  }
  if (bounds.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("histogram ", name, ": no bucket bounds"));
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram ", name,
          ": bucket bounds must be finite and strictly increasing"));
    }
  }
  auto* family = new HistogramFamily(name, help, label_names,
                                     InvalidCallCounter(), std::move(bounds));
  families_.emplace_back(family);
  return family;
}

void MetricsRegistry::AddCollector(std::function<void()> collector) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Render() {
  absl::MutexLock render_lock(&render_mu_);
  std::vector<std::function<void()>> collectors;
  std::vector<const MetricFamilyBase*> families;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
    for (const auto& family : families_) families.push_back(family.get());
  }
  // Without mu_: collectors set values, which may count invalid calls.
  for (const auto& collector : collectors) collector();
  std::string out;
  for (const MetricFamilyBase* family : families) family->RenderTo(&out);
  return out;
}

}  // namespace shardd
