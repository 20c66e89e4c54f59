#ifndef SHARDD_COMMON_METRICS_TEXT_PARSER_H_
#define SHARDD_COMMON_METRICS_TEXT_PARSER_H_

// Test helper: reads Prometheus text exposition format 0.0.4 back into
// samples, strictly (a malformed line is an error), so tests can check what
// MetricsRegistry::Render and the /metrics endpoints produce.

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardd {

struct ParsedSample {
  std::string name;  // With _bucket/_sum/_count for histograms.
  std::map<std::string, std::string> labels;  // Unescaped values.
  double value = 0.0;
};

struct ParsedMetrics {
  std::map<std::string, std::string> help;  // Family -> unescaped text.
  std::map<std::string, std::string> type;  // Family -> "counter", ...
  std::vector<ParsedSample> samples;

  // The value of the sample with exactly these labels, if any.
  std::optional<double> Find(
      const std::string& name,
      const std::map<std::string, std::string>& labels = {}) const;
  // The sum over every sample of `name` whose labels include `match`.
  double Sum(const std::string& name,
             const std::map<std::string, std::string>& match = {}) const;
  // How many samples `name` has.
  int Count(const std::string& name) const;
};

// Errors: INVALID_ARGUMENT naming the line (bad metric or label name, bad
// escape, unterminated quotes, unparsable value, a TYPE other than counter,
// gauge, histogram, summary or untyped, a sample whose family has a TYPE
// line only after it, or a repeated HELP/TYPE).
absl::StatusOr<ParsedMetrics> ParseMetricsText(const std::string& text);

}  // namespace shardd

#endif  // SHARDD_COMMON_METRICS_TEXT_PARSER_H_
