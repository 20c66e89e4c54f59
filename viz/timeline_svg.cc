#include "viz/timeline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardd {
namespace {

constexpr int kMinWidth = 320;
constexpr int kMinHeight = 200;
// Room around the plot: tick labels on the left, titles on top, x labels
// below, the legend on the right.
constexpr double kMarginLeft = 84;
constexpr double kMarginTop = 64;
constexpr double kMarginBottom = 56;
constexpr double kLegendWidth = 250;
constexpr double kLegendRowHeight = 18;
constexpr size_t kMaxLegendLabelChars = 30;
constexpr char kDefaultMarkColor[] = "#333333";
// Average advance of a bold 12 px sans-serif character, for label placement.
constexpr double kBoldCharWidth = 7.5;

// Colors picked in order for series without their own.
constexpr const char* kPalette[] = {"#3b6fb6", "#e0812f", "#4f9d58", "#c8434b",
                                    "#8065b0", "#8c6249", "#d66fae", "#7f7f7f",
                                    "#a9a936", "#36a5b8"};
constexpr size_t kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

// A coordinate or value with 2 decimals, never "-0.00".
std::string Num(double v) {
  if (std::fabs(v) < 0.005) return "0";
  std::string s = absl::StrFormat("%.2f", v);
  // Drop trailing zeros: "12.50" -> "12.5", "3.00" -> "3".
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// 1, 2, 2.5 or 5 times a power of ten, about range / target.
double NiceStep(double range, int target) {
  if (!(range > 0)) return 1;
  const double raw = range / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  double nice = 10;
  if (norm <= 1) {
    nice = 1;
  } else if (norm <= 2) {
    nice = 2;
  } else if (norm <= 2.5) {
    nice = 2.5;
  } else if (norm <= 5) {
    nice = 5;
  }
  return nice * magnitude;
}

// Decimals that show multiples of `step` exactly (step = k * 10^e, k in
// {1, 2, 2.5, 5}).
int DecimalsFor(double step) {
  int decimals = 0;
  double scaled = step;
  while (decimals < 6 && std::fabs(scaled - std::round(scaled)) >
                             1e-9 * std::max(1.0, scaled)) {
    scaled *= 10;
    ++decimals;
  }
  return decimals;
}

struct ByteUnit {
  double bytes;
  const char* name;
};

// The largest binary unit that `bytes` reaches (B below 1 KiB).
ByteUnit UnitFor(double bytes) {
  static constexpr ByteUnit kUnits[] = {
      {1099511627776.0, "TiB"},
      {1073741824.0, "GiB"},
      {1048576.0, "MiB"},
      {1024.0, "KiB"},
  };
  for (const ByteUnit& unit : kUnits) {
    if (bytes >= unit.bytes) return unit;
  }
  return {1.0, "B"};
}

std::string FormatFixed(double value, int decimals) {
  std::string s = absl::StrFormat("%.*f", decimals, value);
  // "-0.0" -> "0.0".
  if (!s.empty() && s[0] == '-' &&
      s.find_first_not_of("-0.") == std::string::npos) {
    s.erase(0, 1);
  }
  return s;
}

std::string TickLabel(double value, double step, ChartUnit unit,
                      const ByteUnit& byte_unit) {
  if (unit == ChartUnit::kBytes) {
    const double in_unit = value / byte_unit.bytes;
    return absl::StrCat(
        FormatFixed(in_unit, DecimalsFor(step / byte_unit.bytes)), " ",
        byte_unit.name);
  }
  return FormatFixed(value, DecimalsFor(step));
}

std::string LegendText(const std::string& label) {
  if (label.size() <= kMaxLegendLabelChars) return label;
  // Cut on a UTF-8 character boundary.
  size_t cut = kMaxLegendLabelChars - 1;
  while (cut > 0 && (static_cast<unsigned char>(label[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return absl::StrCat(label.substr(0, cut), "\xE2\x80\xA6");
}

class Palette {
 public:
  std::string Pick(const std::string& requested) {
    if (!requested.empty()) return requested;
    return kPalette[next_++ % kPaletteSize];
  }

 private:
  size_t next_ = 0;
};

// Appends points to an SVG path, skipping repeats of the previous point.
class PathBuilder {
 public:
  void Point(double x, double y) {
    if (has_last_ && x == last_x_ && y == last_y_) return;
    absl::StrAppend(&d_, has_last_ ? " L" : "M", Num(x), " ", Num(y));
    has_last_ = true;
    last_x_ = x;
    last_y_ = y;
  }
  void Close() { absl::StrAppend(&d_, " Z"); }
  const std::string& d() const { return d_; }
  bool empty() const { return d_.empty(); }

 private:
  std::string d_;
  bool has_last_ = false;
  double last_x_ = 0;
  double last_y_ = 0;
};

absl::Status CheckValue(double v, ChartUnit unit, absl::string_view what) {
  if (!std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": value is not finite"));
  }
  if (unit == ChartUnit::kBytes && v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative byte count ", v));
  }
  return absl::OkStatus();
}

absl::Status CheckX(const std::vector<double>& x, absl::string_view what) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": x[", i, "] is not finite"));
    }
    if (i > 0 && x[i] < x[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": x decreases at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

double ChartFrame::PixelX(double x) const {
  return left + (x - x_min) / (x_max - x_min) * (right - left);
}

double ChartFrame::PixelY(double y) const {
  return bottom - (y - y_min) / (y_max - y_min) * (bottom - top);
}

std::string XmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') {
          break;  // Not allowed in XML 1.0.
        }
        out += c;
    }
  }
  return out;
}

std::string FormatChartBytes(double bytes) {
  if (!std::isfinite(bytes)) return "? B";
  const double magnitude = std::fabs(bytes);
  const ByteUnit unit = UnitFor(magnitude);
  if (unit.bytes == 1.0) return absl::StrCat(std::llround(bytes), " B");
  return absl::StrCat(Num(bytes / unit.bytes), " ", unit.name);
}

absl::StatusOr<ChartFrame> ChartFrameOf(const ChartSpec& chart) {
  if (chart.width < kMinWidth || chart.height < kMinHeight) {
    return absl::InvalidArgumentError(
        absl::StrCat("chart size ", chart.width, "x", chart.height,
                     " is below ", kMinWidth, "x", kMinHeight));
  }
  const StackedAreas& areas = chart.areas;
  if (absl::Status s = CheckX(areas.x, "areas"); !s.ok()) return s;
  bool has_x = false;
  double x_min = 0, x_max = 0, y_max = 0;
  auto see_x = [&](double x) {
    if (!has_x) {
      x_min = x_max = x;
      has_x = true;
    }
    x_min = std::min(x_min, x);
    x_max = std::max(x_max, x);
  };
  if (!areas.layers.empty()) {
    for (double x : areas.x) see_x(x);
  }
  std::vector<double> tops(areas.x.size(), 0.0);
  for (const StackLayer& layer : areas.layers) {
    if (layer.values.size() != areas.x.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer '", layer.label, "': ", layer.values.size(),
                       " values for ", areas.x.size(), " x positions"));
    }
    for (size_t i = 0; i < layer.values.size(); ++i) {
      if (absl::Status s =
              CheckValue(layer.values[i], chart.y_unit,
                         absl::StrCat("layer '", layer.label, "'"));
          !s.ok()) {
        return s;
      }
      tops[i] += layer.values[i];
      y_max = std::max(y_max, tops[i]);
    }
  }
  for (const LineSeries& line : chart.lines) {
    std::vector<double> xs;
    for (const auto& [x, y] : line.points) {
      xs.push_back(x);
      if (absl::Status s = CheckValue(y, chart.y_unit,
                                      absl::StrCat("line '", line.label, "'"));
          !s.ok()) {
        return s;
      }
      see_x(x);
      y_max = std::max(y_max, y);
    }
    if (absl::Status s = CheckX(xs, absl::StrCat("line '", line.label, "'"));
        !s.ok()) {
      return s;
    }
  }
  for (const PeakMarker& peak : chart.peaks) {
    if (!std::isfinite(peak.x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("peak '", peak.label, "': x is not finite"));
    }
    if (absl::Status s = CheckValue(peak.y, chart.y_unit,
                                    absl::StrCat("peak '", peak.label, "'"));
        !s.ok()) {
      return s;
    }
    see_x(peak.x);
    y_max = std::max(y_max, peak.y);
  }
  for (const ReferenceLine& ref : chart.references) {
    if (absl::Status s = CheckValue(
            ref.y, chart.y_unit, absl::StrCat("reference '", ref.label, "'"));
        !s.ok()) {
      return s;
    }
    y_max = std::max(y_max, ref.y);
  }
  if (!has_x) {
    return absl::InvalidArgumentError(
        "chart has no data (no layers, line points or peaks)");
  }

  ChartFrame frame;
  frame.left = kMarginLeft;
  frame.top = kMarginTop;
  frame.right = chart.width - kLegendWidth;
  frame.bottom = chart.height - kMarginBottom;
  frame.x_min = x_min;
  frame.x_max = x_max > x_min ? x_max : x_min + 1;
  frame.x_step = NiceStep(frame.x_max - frame.x_min, 8);
  // Lines may dip below zero for plain values (never bytes).
  double y_min = 0;
  if (chart.y_unit == ChartUnit::kPlain) {
    for (const LineSeries& line : chart.lines) {
      for (const auto& point : line.points)
        y_min = std::min(y_min, point.second);
    }
    for (const ReferenceLine& ref : chart.references) {
      y_min = std::min(y_min, ref.y);
    }
  }
  if (!(y_max > y_min)) y_max = y_min + 1;
  double y_step = 0;
  if (chart.y_unit == ChartUnit::kBytes) {
    const ByteUnit unit = UnitFor(y_max);
    y_step = NiceStep(y_max / unit.bytes, 6) * unit.bytes;
    // Whole bytes at least.
    y_step = std::max(y_step, 1.0);
  } else {
    y_step = NiceStep(y_max - y_min, 6);
  }
  frame.y_step = y_step;
  frame.y_min = std::floor(y_min / y_step) * y_step;
  // A little headroom above the largest value, for the peak dot.
  frame.y_max = std::ceil(y_max * 1.02 / y_step) * y_step;
  if (!(frame.y_max > frame.y_min)) frame.y_max = frame.y_min + y_step;
  return frame;
}

absl::StatusOr<std::string> RenderChartSvg(const ChartSpec& chart) {
  absl::StatusOr<ChartFrame> framed = ChartFrameOf(chart);
  if (!framed.ok()) return framed.status();
  const ChartFrame& f = *framed;
  const ByteUnit byte_unit = UnitFor(f.y_max);
  Palette palette;

  std::string svg;
  absl::StrAppend(&svg, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
  absl::StrAppend(&svg, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"",
                  chart.width, "\" height=\"", chart.height,
                  "\" viewBox=\"0 0 ", chart.width, " ", chart.height,
                  "\" font-family=\"DejaVu Sans, Helvetica, Arial, "
                  "sans-serif\" font-size=\"12\">\n");
  absl::StrAppend(&svg, "<title>", XmlEscape(chart.title), "</title>\n");
  absl::StrAppend(&svg, "<rect class=\"background\" x=\"0\" y=\"0\" width=\"",
                  chart.width, "\" height=\"", chart.height,
                  "\" fill=\"#ffffff\"/>\n");
  absl::StrAppend(&svg, "<text class=\"title\" x=\"", Num(f.left),
                  "\" y=\"26\" font-size=\"17\" font-weight=\"bold\">",
                  XmlEscape(chart.title), "</text>\n");
  if (!chart.subtitle.empty()) {
    absl::StrAppend(&svg, "<text class=\"subtitle\" x=\"", Num(f.left),
                    "\" y=\"46\" font-size=\"12\" fill=\"#555555\">",
                    XmlEscape(chart.subtitle), "</text>\n");
  }

  // Grid and y ticks.
  std::vector<double> y_ticks;
  for (int i = 0;; ++i) {
    const double y = f.y_min + i * f.y_step;
    if (y > f.y_max + f.y_step * 1e-9 || i > 100) break;
    y_ticks.push_back(y);
  }
  std::vector<double> x_ticks;
  const double first_x = std::ceil(f.x_min / f.x_step - 1e-9) * f.x_step;
  for (int i = 0;; ++i) {
    const double x = first_x + i * f.x_step;
    if (x > f.x_max + f.x_step * 1e-9 || i > 100) break;
    x_ticks.push_back(x);
  }
  absl::StrAppend(&svg, "<g class=\"grid\" stroke=\"#e4e4e4\">\n");
  for (double y : y_ticks) {
    absl::StrAppend(&svg, "<line x1=\"", Num(f.left), "\" y1=\"",
                    Num(f.PixelY(y)), "\" x2=\"", Num(f.right), "\" y2=\"",
                    Num(f.PixelY(y)), "\"/>\n");
  }
  absl::StrAppend(&svg, "</g>\n");

  // Legend entries, collected while drawing.
  struct LegendEntry {
    std::string label;
    std::string color;
    enum { kArea, kLine, kDashed, kMark } kind;
  };
  std::vector<LegendEntry> legend;
  auto add_legend = [&legend](const std::string& label,
                              const std::string& color, auto kind) {
    for (const LegendEntry& e : legend) {
      if (e.label == label) return;
    }
    legend.push_back({label, color, kind});
  };

  // Stacked areas: one closed step polygon per run of positive values, so
  // a unit that is live for a few commands costs a few points.
  const StackedAreas& areas = chart.areas;
  const size_t n = areas.x.size();
  std::vector<double> base(n, 0.0);
  // crispEdges: no antialiasing seams between neighbouring bands.
  absl::StrAppend(&svg, "<g class=\"areas\" shape-rendering=\"crispEdges\">\n");
  for (const StackLayer& layer : areas.layers) {
    const std::string& legend_label =
        layer.legend.empty() ? layer.label : layer.legend;
    std::string color;
    for (const LegendEntry& e : legend) {
      if (e.label == legend_label) color = e.color;
    }
    if (!layer.color.empty()) color = layer.color;
    if (color.empty()) color = palette.Pick("");
    add_legend(legend_label, color, LegendEntry::kArea);
    std::string paths;
    size_t i = 0;
    while (i < n) {
      // Interval i spans [x[i], x[i + 1]); the last one has no width.
      if (layer.values[i] <= 0 || i + 1 >= n) {
        ++i;
        continue;
      }
      size_t end = i;
      while (end + 1 < n && layer.values[end] > 0) ++end;
      // Intervals [i, end) are positive.
      PathBuilder path;
      for (size_t k = i; k < end; ++k) {
        const double top = f.PixelY(base[k] + layer.values[k]);
        path.Point(f.PixelX(areas.x[k]), top);
        path.Point(f.PixelX(areas.x[k + 1]), top);
      }
      for (size_t k = end; k-- > i;) {
        const double bottom = f.PixelY(base[k]);
        path.Point(f.PixelX(areas.x[k + 1]), bottom);
        path.Point(f.PixelX(areas.x[k]), bottom);
      }
      path.Close();
      absl::StrAppend(&paths, path.d(), " ");
      i = end;
    }
    if (!paths.empty()) {
      paths.pop_back();
      absl::StrAppend(&svg, "<path class=\"area\" fill=\"", XmlEscape(color),
                      "\" d=\"", paths, "\"><title>", XmlEscape(layer.label),
                      "</title></path>\n");
    }
    for (size_t k = 0; k < n; ++k) base[k] += layer.values[k];
  }
  absl::StrAppend(&svg, "</g>\n");

  // Lines.
  absl::StrAppend(&svg, "<g class=\"lines\" fill=\"none\">\n");
  for (const LineSeries& line : chart.lines) {
    const std::string color = palette.Pick(line.color);
    add_legend(line.label, color,
               line.dashed ? LegendEntry::kDashed : LegendEntry::kLine);
    PathBuilder path;
    for (size_t k = 0; k < line.points.size(); ++k) {
      const auto& [x, y] = line.points[k];
      path.Point(f.PixelX(x), f.PixelY(y));
      if (line.steps && k + 1 < line.points.size()) {
        path.Point(f.PixelX(line.points[k + 1].first), f.PixelY(y));
      }
    }
    if (path.empty()) continue;
    absl::StrAppend(&svg, "<path class=\"line\" stroke=\"", XmlEscape(color),
                    "\" stroke-width=\"1.8\"",
                    line.dashed ? " stroke-dasharray=\"6 3\"" : "",
                    " stroke-linejoin=\"round\" d=\"", path.d(), "\"><title>",
                    XmlEscape(line.label), "</title></path>\n");
  }
  absl::StrAppend(&svg, "</g>\n");

  // Reference lines, labeled at the right end.
  absl::StrAppend(&svg, "<g class=\"references\">\n");
  for (const ReferenceLine& ref : chart.references) {
    const std::string color =
        ref.color.empty() ? std::string(kDefaultMarkColor) : ref.color;
    const double y = f.PixelY(ref.y);
    absl::StrAppend(&svg, "<g class=\"reference\"><line x1=\"", Num(f.left),
                    "\" y1=\"", Num(y), "\" x2=\"", Num(f.right), "\" y2=\"",
                    Num(y), "\" stroke=\"", XmlEscape(color),
                    "\" stroke-width=\"1.2\" stroke-dasharray=\"2 3\"/>",
                    "<text x=\"", Num(f.left + 6), "\" y=\"", Num(y + 14),
                    "\" fill=\"", XmlEscape(color),
                    "\" stroke=\"#ffffff\" stroke-width=\"3\" "
                    "paint-order=\"stroke\">",
                    XmlEscape(ref.label), "</text></g>\n");
  }
  absl::StrAppend(&svg, "</g>\n");

  // Axes, ticks and labels.
  absl::StrAppend(&svg, "<g class=\"axes\" stroke=\"#333333\">\n");
  absl::StrAppend(&svg, "<line class=\"x-axis\" x1=\"", Num(f.left), "\" y1=\"",
                  Num(f.bottom), "\" x2=\"", Num(f.right), "\" y2=\"",
                  Num(f.bottom), "\"/>\n");
  absl::StrAppend(&svg, "<line class=\"y-axis\" x1=\"", Num(f.left), "\" y1=\"",
                  Num(f.top), "\" x2=\"", Num(f.left), "\" y2=\"",
                  Num(f.bottom), "\"/>\n");
  for (double y : y_ticks) {
    const double py = f.PixelY(y);
    absl::StrAppend(&svg, "<line x1=\"", Num(f.left - 5), "\" y1=\"", Num(py),
                    "\" x2=\"", Num(f.left), "\" y2=\"", Num(py), "\"/>\n");
  }
  for (double x : x_ticks) {
    const double px = f.PixelX(x);
    absl::StrAppend(&svg, "<line x1=\"", Num(px), "\" y1=\"", Num(f.bottom),
                    "\" x2=\"", Num(px), "\" y2=\"", Num(f.bottom + 5),
                    "\"/>\n");
  }
  absl::StrAppend(&svg, "</g>\n");
  absl::StrAppend(&svg, "<g class=\"tick-labels\" fill=\"#333333\">\n");
  for (double y : y_ticks) {
    absl::StrAppend(&svg, "<text class=\"y-tick\" x=\"", Num(f.left - 8),
                    "\" y=\"", Num(f.PixelY(y) + 4), "\" text-anchor=\"end\">",
                    XmlEscape(TickLabel(y, f.y_step, chart.y_unit, byte_unit)),
                    "</text>\n");
  }
  for (double x : x_ticks) {
    absl::StrAppend(&svg, "<text class=\"x-tick\" x=\"", Num(f.PixelX(x)),
                    "\" y=\"", Num(f.bottom + 19), "\" text-anchor=\"middle\">",
                    FormatFixed(x, DecimalsFor(f.x_step)), "</text>\n");
  }
  absl::StrAppend(&svg, "</g>\n");
  absl::StrAppend(&svg, "<text class=\"x-label\" x=\"",
                  Num((f.left + f.right) / 2), "\" y=\"", Num(f.bottom + 42),
                  "\" text-anchor=\"middle\">", XmlEscape(chart.x_label),
                  "</text>\n");
  absl::StrAppend(&svg,
                  "<text class=\"y-label\" x=\"0\" y=\"0\" "
                  "text-anchor=\"middle\" transform=\"translate(16 ",
                  Num((f.top + f.bottom) / 2), ") rotate(-90)\">",
                  XmlEscape(chart.y_label), "</text>\n");

  // Peaks: a dashed vertical line, a dot at the value, the label near the
  // top (stacked when there are several), on the roomier side of the line.
  absl::StrAppend(&svg, "<g class=\"peaks\">\n");
  for (size_t i = 0; i < chart.peaks.size(); ++i) {
    const PeakMarker& peak = chart.peaks[i];
    const std::string color =
        peak.color.empty() ? std::string(kDefaultMarkColor) : peak.color;
    const double px = f.PixelX(peak.x);
    const double py = f.PixelY(peak.y);
    // Right of the line unless the label (estimated from its length) would
    // leave the plot there and has more room on the left.
    const double label_width =
        kBoldCharWidth * static_cast<double>(peak.label.size());
    const bool right_half =
        px + 6 + label_width > f.right && px - f.left > f.right - px;
    // Kept inside the plot when neither side has room.
    double label_x = right_half ? px - 6 : px + 6;
    if (!right_half && label_x + label_width > f.right) {
      label_x = std::max(f.left + 4, f.right - label_width);
    }
    const double label_y = f.top + 14 + 16 * static_cast<double>(i);
    absl::StrAppend(
        &svg, "<g class=\"peak\"><line x1=\"", Num(px), "\" y1=\"", Num(f.top),
        "\" x2=\"", Num(px), "\" y2=\"", Num(f.bottom), "\" stroke=\"",
        XmlEscape(color), "\" stroke-width=\"1.2\" stroke-dasharray=\"5 3\"/>",
        "<circle cx=\"", Num(px), "\" cy=\"", Num(py), "\" r=\"4\" fill=\"",
        XmlEscape(color), "\" stroke=\"#ffffff\" stroke-width=\"1.5\"/>",
        "<text x=\"", Num(label_x), "\" y=\"", Num(label_y),
        "\" text-anchor=\"", right_half ? "end" : "start",
        "\" font-weight=\"bold\" fill=\"", XmlEscape(color),
        "\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\">",
        XmlEscape(peak.label), "</text></g>\n");
  }
  absl::StrAppend(&svg, "</g>\n");

  // Legend, right of the plot; entries that do not fit are counted.
  for (const ReferenceLine& ref : chart.references) {
    add_legend(ref.label,
               ref.color.empty() ? std::string(kDefaultMarkColor) : ref.color,
               LegendEntry::kMark);
  }
  const double legend_x = f.right + 18;
  const size_t rows = static_cast<size_t>(std::max(
      1.0, std::floor((chart.height - 12 - f.top) / kLegendRowHeight)));
  const size_t shown =
      legend.size() <= rows ? legend.size() : std::max<size_t>(rows, 1) - 1;
  absl::StrAppend(&svg, "<g class=\"legend\">\n");
  for (size_t i = 0; i < shown; ++i) {
    const LegendEntry& e = legend[i];
    const double y = f.top + kLegendRowHeight * static_cast<double>(i);
    absl::StrAppend(&svg, "<g class=\"legend-entry\">");
    if (e.kind == LegendEntry::kArea) {
      absl::StrAppend(&svg, "<rect x=\"", Num(legend_x), "\" y=\"", Num(y - 9),
                      "\" width=\"14\" height=\"11\" fill=\"",
                      XmlEscape(e.color), "\"/>");
    } else {
      absl::StrAppend(
          &svg, "<line x1=\"", Num(legend_x), "\" y1=\"", Num(y - 3.5),
          "\" x2=\"", Num(legend_x + 14), "\" y2=\"", Num(y - 3.5),
          "\" stroke=\"", XmlEscape(e.color), "\" stroke-width=\"2\"",
          e.kind == LegendEntry::kDashed ? " stroke-dasharray=\"4 2\""
          : e.kind == LegendEntry::kMark ? " stroke-dasharray=\"2 2\""
                                         : "",
          "/>");
    }
    absl::StrAppend(&svg, "<text x=\"", Num(legend_x + 20), "\" y=\"", Num(y),
                    "\">", XmlEscape(LegendText(e.label)), "</text></g>\n");
  }
  if (shown < legend.size()) {
    const double y = f.top + kLegendRowHeight * static_cast<double>(shown);
    absl::StrAppend(&svg, "<text class=\"legend-more\" x=\"",
                    Num(legend_x + 20), "\" y=\"", Num(y),
                    "\" fill=\"#555555\">and ", legend.size() - shown,
                    " more</text>\n");
  }
  absl::StrAppend(&svg, "</g>\n</svg>\n");
  return svg;
}

}  // namespace shardd
