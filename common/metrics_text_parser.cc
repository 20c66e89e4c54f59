#include "common/metrics_text_parser.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace shardd {
namespace {

bool NameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         c == ':' || (!first && c >= '0' && c <= '9');
}

// Reads a name at the front of `*s`; empty when there is none.
std::string TakeName(absl::string_view* s) {
  size_t n = 0;
  while (n < s->size() && NameChar((*s)[n], n == 0)) ++n;
  std::string name(s->substr(0, n));
  s->remove_prefix(n);
  return name;
}

absl::StatusOr<std::string> Unescape(absl::string_view text, bool quote) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      out += text[i];
      continue;
    }
    if (++i == text.size()) return absl::InvalidArgumentError("trailing \\");
    switch (text[i]) {
      case '\\':
        out += '\\';
        break;
      case 'n':
        out += '\n';
        break;
      case '"':
        if (!quote) return absl::InvalidArgumentError("\\\" in HELP");
        out += '"';
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unknown escape \\", std::string(1, text[i])));
    }
  }
  return out;
}

absl::StatusOr<double> ParseValue(absl::string_view text) {
  if (text == "+Inf") return HUGE_VAL;
  if (text == "-Inf") return -HUGE_VAL;
  if (text == "NaN") return std::nan("");
  const std::string copy(text);
  char* end = nullptr;
  const double value = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size()) {
    return absl::InvalidArgumentError(absl::StrCat("bad value '", text, "'"));
  }
  return value;
}

// The family a sample belongs to: its name, or the name without a
// histogram suffix when that family is a histogram.
std::string FamilyOf(const std::string& name,
                     const std::map<std::string, std::string>& type) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    if (absl::EndsWith(name, suffix)) {
      const std::string base = name.substr(0, name.size() - strlen(suffix));
      auto it = type.find(base);
      if (it != type.end() && it->second == "histogram") return base;
    }
  }
  return name;
}

absl::Status ParseSampleLine(absl::string_view line, ParsedMetrics* out) {
  ParsedSample sample;
  sample.name = TakeName(&line);
  if (sample.name.empty()) return absl::InvalidArgumentError("no metric name");
  if (!line.empty() && line[0] == '{') {
    line.remove_prefix(1);
    while (true) {
      if (!line.empty() && line[0] == '}') {
        line.remove_prefix(1);
        break;
      }
      const std::string label = TakeName(&line);
      if (label.empty() || line.size() < 2 || line[0] != '=' ||
          line[1] != '"') {
        return absl::InvalidArgumentError("bad label");
      }
      line.remove_prefix(2);
      size_t end = 0;
      while (end < line.size() && line[end] != '"') {
        end += line[end] == '\\' ? 2 : 1;
      }
      if (end >= line.size()) {
        return absl::InvalidArgumentError("unterminated label value");
      }
      absl::StatusOr<std::string> value =
          Unescape(line.substr(0, end), /*quote=*/true);
      if (!value.ok()) return value.status();
      if (!sample.labels.emplace(label, *value).second) {
        return absl::InvalidArgumentError("repeated label " + label);
      }
      line.remove_prefix(end + 1);
      if (!line.empty() && line[0] == ',') line.remove_prefix(1);
    }
  }
  if (line.empty() || line[0] != ' ') {
    return absl::InvalidArgumentError("expected a space before the value");
  }
  line.remove_prefix(1);
  // An optional timestamp follows the value; the registry writes none.
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() > 2) return absl::InvalidArgumentError("trailing text");
  absl::StatusOr<double> value = ParseValue(parts[0]);
  if (!value.ok()) return value.status();
  sample.value = *value;
  const std::string family = FamilyOf(sample.name, out->type);
  if (out->type.count(family) == 0 && out->help.count(family) != 0) {
    return absl::InvalidArgumentError("sample before its TYPE line");
  }
  out->samples.push_back(std::move(sample));
  return absl::OkStatus();
}

absl::Status ParseCommentLine(absl::string_view line, ParsedMetrics* out,
                              std::set<std::string>* sampled) {
  line.remove_prefix(1);
  if (!line.empty() && line[0] == ' ') line.remove_prefix(1);
  const bool help = absl::StartsWith(line, "HELP ");
  const bool type = absl::StartsWith(line, "TYPE ");
  if (!help && !type) return absl::OkStatus();  // A plain comment.
  line.remove_prefix(5);
  const std::string name = TakeName(&line);
  if (name.empty()) return absl::InvalidArgumentError("no metric name");
  std::string text;
  if (!line.empty()) {
    if (line[0] != ' ') return absl::InvalidArgumentError("bad metric name");
    line.remove_prefix(1);
    text = std::string(line);
  }
  if (help) {
    absl::StatusOr<std::string> unescaped = Unescape(text, /*quote=*/false);
    if (!unescaped.ok()) return unescaped.status();
    if (!out->help.emplace(name, *unescaped).second) {
      return absl::InvalidArgumentError("repeated HELP for " + name);
    }
    return absl::OkStatus();
  }
  static const std::set<std::string> kTypes = {"counter", "gauge", "histogram",
                                               "summary", "untyped"};
  if (kTypes.count(text) == 0) {
    return absl::InvalidArgumentError("unknown TYPE " + text);
  }
  if (sampled->count(name) != 0) {
    return absl::InvalidArgumentError("TYPE after samples of " + name);
  }
  if (!out->type.emplace(name, text).second) {
    return absl::InvalidArgumentError("repeated TYPE for " + name);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParsedMetrics> ParseMetricsText(const std::string& text) {
  ParsedMetrics out;
  std::set<std::string> sampled;  // Families seen in samples.
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    if (line.empty()) continue;
    absl::Status status;
    if (line[0] == '#') {
      status = ParseCommentLine(line, &out, &sampled);
    } else {
      status = ParseSampleLine(line, &out);
      if (status.ok()) {
        sampled.insert(FamilyOf(out.samples.back().name, out.type));
      }
    }
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", number, " '", line, "': ", status.message()));
    }
  }
  return out;
}

std::optional<double> ParsedMetrics::Find(
    const std::string& name,
    const std::map<std::string, std::string>& labels) const {
  for (const ParsedSample& sample : samples) {
    if (sample.name == name && sample.labels == labels) return sample.value;
  }
  return std::nullopt;
}

double ParsedMetrics::Sum(
    const std::string& name,
    const std::map<std::string, std::string>& match) const {
  double sum = 0.0;
  for (const ParsedSample& sample : samples) {
    if (sample.name != name) continue;
    bool matches = true;
    for (const auto& [key, value] : match) {
      auto it = sample.labels.find(key);
      if (it == sample.labels.end() || it->second != value) matches = false;
    }
    if (matches) sum += sample.value;
  }
  return sum;
}

int ParsedMetrics::Count(const std::string& name) const {
  int count = 0;
  for (const ParsedSample& sample : samples) count += sample.name == name;
  return count;
}

}  // namespace shardd
