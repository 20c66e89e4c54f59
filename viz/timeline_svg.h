#ifndef SHARDD_VIZ_TIMELINE_SVG_H_
#define SHARDD_VIZ_TIMELINE_SVG_H_

// A small SVG chart writer for shardd's pictures: the live-memory timeline
// of a training step (stacked areas per unit or memory kind, overlaid
// totals, peak markers) and loss curves. It takes plain data and returns
// the SVG text: no files, no protos, no transport. The output is a pure
// function of the input (fixed number formatting, no clocks, no hashing),
// and every text from the caller is XML-escaped.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardd {

// How the y axis labels its values.
enum class ChartUnit {
  kBytes,  // Binary units: B, KiB, MiB, GiB, TiB.
  kPlain,  // Numbers as they are (a loss).
};

// One band of a stack. values[i] holds from x[i] to x[i + 1].
struct StackLayer {
  std::string label;   // Tooltip (<title>) of the band.
  std::string legend;  // Legend entry it belongs to; empty: `label`.
  std::string color;   // CSS color; empty: the next palette color.
  std::vector<double> values;
};

// Stacked areas over a shared x axis, drawn as steps (a value holds until
// the next x, as live memory does between events).
struct StackedAreas {
  std::vector<double> x;           // Non-decreasing.
  std::vector<StackLayer> layers;  // Bottom first; values.size() == x.size().
};

struct LineSeries {
  std::string label;
  std::string color;  // Empty: the next palette color.
  std::vector<std::pair<double, double>> points;  // x non-decreasing.
  bool steps = true;  // Hold each y until the next x; false: straight.
  bool dashed = false;
};

// A labeled vertical line at x with a dot at (x, y): a peak.
struct PeakMarker {
  std::string label;
  double x = 0;
  double y = 0;
  std::string color;  // Empty: dark gray.
};

// A labeled horizontal line at y (a prediction, a bound).
struct ReferenceLine {
  std::string label;
  double y = 0;
  std::string color;  // Empty: dark gray.
};

struct ChartSpec {
  std::string title;
  std::string subtitle;  // A second, smaller title line; may be empty.
  std::string x_label;
  std::string y_label;
  ChartUnit y_unit = ChartUnit::kBytes;
  StackedAreas areas;
  std::vector<LineSeries> lines;  // Drawn over the areas.
  std::vector<PeakMarker> peaks;
  std::vector<ReferenceLine> references;
  int width = 1000;  // Pixels, at least 320 x 200.
  int height = 560;
};

// Where the data lands: the plot area in pixels and the axis ranges it
// shows. Exposed so tests can compute where a value is drawn.
struct ChartFrame {
  double left = 0, top = 0, right = 0, bottom = 0;
  double x_min = 0, x_max = 1;
  double y_min = 0, y_max = 1;
  // Tick spacing in data units (y: in bytes for kBytes).
  double x_step = 1, y_step = 1;
  double PixelX(double x) const;
  double PixelY(double y) const;
};

// The frame RenderChartSvg uses: x spans exactly the data's x range, y
// spans [0, a round number >= the largest value drawn] (the stack's tops,
// lines, peaks and references).
// Errors: INVALID_ARGUMENT when the size is below 320 x 200, a layer's
// values do not match x in length, x (of the stack or a line) decreases, a
// value is negative (bytes) or not finite, or there is no data at all.
absl::StatusOr<ChartFrame> ChartFrameOf(const ChartSpec& chart);

// The chart as a standalone SVG document: title and subtitle, axes with
// ticks and labels (bytes in KiB/MiB/GiB...), the stacked areas, the lines,
// the reference lines, the peak markers (class "peak", with the label), and
// a legend (one entry per distinct layer legend, line and reference).
// Errors: as ChartFrameOf.
absl::StatusOr<std::string> RenderChartSvg(const ChartSpec& chart);

// `text` with &, <, >, " and ' replaced by entities, and control characters
// other than tab and newline (not allowed in XML 1.0) dropped.
std::string XmlEscape(absl::string_view text);

// "0 B", "512 B", "1.5 KiB", "12 GiB": binary units, at most 2 decimals,
// trailing zeros dropped.
std::string FormatChartBytes(double bytes);

}  // namespace shardd

#endif  // SHARDD_VIZ_TIMELINE_SVG_H_
