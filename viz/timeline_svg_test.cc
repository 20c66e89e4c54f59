#include "viz/timeline_svg.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace shardd {
namespace {

// A minimal XML reader, enough to check that the output is well formed:
// a prolog, nested elements with quoted attributes, text, and the five
// predefined entities. Anything else is an error.
struct Element {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;  // Direct text content, entities decoded.
  std::vector<std::unique_ptr<Element>> children;

  std::string Attr(const std::string& key) const {
    auto it = attrs.find(key);
    return it == attrs.end() ? "" : it->second;
  }
  bool HasClass(const std::string& cls) const {
    for (absl::string_view c : absl::StrSplit(Attr("class"), ' ')) {
      if (c == cls) return true;
    }
    return false;
  }
};

class XmlReader {
 public:
  explicit XmlReader(const std::string& text) : s_(text) {}

  absl::StatusOr<std::unique_ptr<Element>> Document() {
    if (absl::StartsWith(s_, "<?xml")) {
      const size_t end = s_.find("?>");
      if (end == std::string::npos) return Error("unterminated prolog");
      pos_ = end + 2;
    }
    SkipSpace();
    auto root = std::make_unique<Element>();
    absl::Status s = ReadElement(root.get());
    if (!s.ok()) return s;
    SkipSpace();
    if (pos_ != s_.size()) return Error("content after the root element");
    return root;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " at ", pos_));
  }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           std::isspace(static_cast<unsigned char>(s_[pos_])))
      ++pos_;
  }
  std::string Name() {
    const size_t start = pos_;
    while (pos_ < s_.size() &&
           (std::isalnum(static_cast<unsigned char>(s_[pos_])) ||
            s_[pos_] == '-' || s_[pos_] == '_' || s_[pos_] == ':')) {
      ++pos_;
    }
    return s_.substr(start, pos_ - start);
  }
  // Decodes text up to `stop`, refusing raw '<' and unknown entities.
  absl::StatusOr<std::string> Text(char stop) {
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != stop) {
      const char c = s_[pos_];
      if (c == '<') return Error("raw '<' in text or attribute");
      if (c == '&') {
        const size_t semi = s_.find(';', pos_);
        if (semi == std::string::npos) return Error("unterminated entity");
        const std::string entity = s_.substr(pos_ + 1, semi - pos_ - 1);
        static const std::map<std::string, std::string> kEntities = {
            {"amp", "&"},
            {"lt", "<"},
            {"gt", ">"},
            {"quot", "\""},
            {"apos", "'"}};
        auto it = kEntities.find(entity);
        if (it == kEntities.end()) return Error("unknown entity " + entity);
        out += it->second;
        pos_ = semi + 1;
        continue;
      }
      if (stop == '"' && c == '"') break;
      out += c;
      ++pos_;
    }
    return out;
  }
  absl::Status ReadElement(Element* e) {
    if (pos_ >= s_.size() || s_[pos_] != '<') return Error("expected '<'");
    ++pos_;
    e->name = Name();
    if (e->name.empty()) return Error("empty element name");
    for (;;) {
      SkipSpace();
      if (pos_ >= s_.size()) return Error("unterminated tag");
      if (s_.compare(pos_, 2, "/>") == 0) {
        pos_ += 2;
        return absl::OkStatus();
      }
      if (s_[pos_] == '>') {
        ++pos_;
        break;
      }
      const std::string key = Name();
      if (key.empty()) return Error("bad attribute name");
      if (pos_ + 1 >= s_.size() || s_[pos_] != '=' || s_[pos_ + 1] != '"') {
        return Error("attribute " + key + " without a quoted value");
      }
      pos_ += 2;
      absl::StatusOr<std::string> value = Text('"');
      if (!value.ok()) return value.status();
      if (pos_ >= s_.size()) return Error("unterminated attribute");
      ++pos_;
      if (!e->attrs.emplace(key, *value).second) {
        return Error("duplicate attribute " + key);
      }
    }
    for (;;) {
      absl::StatusOr<std::string> text = Text('<');
      if (!text.ok()) return text.status();
      e->text += *text;
      if (pos_ >= s_.size()) return Error("unclosed element " + e->name);
      if (s_.compare(pos_, 2, "</") == 0) {
        pos_ += 2;
        const std::string closing = Name();
        if (closing != e->name) {
          return Error("</" + closing + "> closes <" + e->name + ">");
        }
        SkipSpace();
        if (pos_ >= s_.size() || s_[pos_] != '>') return Error("bad end tag");
        ++pos_;
        return absl::OkStatus();
      }
      auto child = std::make_unique<Element>();
      absl::Status s = ReadElement(child.get());
      if (!s.ok()) return s;
      e->children.push_back(std::move(child));
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

void Collect(const Element& e, const std::string& name, const std::string& cls,
             std::vector<const Element*>* out) {
  if (e.name == name && (cls.empty() || e.HasClass(cls))) out->push_back(&e);
  for (const auto& child : e.children) Collect(*child, name, cls, out);
}

std::vector<const Element*> Find(const Element& root, const std::string& name,
                                 const std::string& cls = "") {
  std::vector<const Element*> out;
  Collect(root, name, cls, &out);
  return out;
}

double Number(const std::string& text) {
  double v = 0;
  EXPECT_TRUE(absl::SimpleAtod(text, &v)) << "not a number: '" << text << "'";
  return v;
}

std::unique_ptr<Element> ParseOrDie(const std::string& svg) {
  absl::StatusOr<std::unique_ptr<Element>> doc = XmlReader(svg).Document();
  EXPECT_TRUE(doc.ok()) << doc.status();
  if (!doc.ok()) return std::make_unique<Element>();
  return *std::move(doc);
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

// Two units' gathered parameters and one gradient over 6 events.
ChartSpec MemoryChart() {
  ChartSpec chart;
  chart.title = "tiny_moe: default, world size 4";
  chart.subtitle = "live unsharded memory per rank";
  chart.x_label = "step-program command";
  chart.y_label = "bytes per rank";
  chart.areas.x = {0, 2, 5, 7, 9, 12};
  chart.areas.layers.push_back({"u0 params",
                                "gathered parameters",
                                "",
                                {0, 1 * kGiB, 1 * kGiB, 0, 0, 0}});
  chart.areas.layers.push_back({"u1 params",
                                "gathered parameters",
                                "",
                                {0, 0, 2 * kGiB, 2 * kGiB, 0, 0}});
  chart.areas.layers.push_back({"u1 grads",
                                "unsharded gradients",
                                "",
                                {0, 0, 0, 1 * kGiB, 1 * kGiB, 0}});
  chart.peaks.push_back({"peak 3 GiB", 5, 3 * kGiB, ""});
  return chart;
}

TEST(TimelineSvgTest, WellFormedWithAxesLegendAndTitle) {
  const ChartSpec chart = MemoryChart();
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok()) << svg.status();
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  EXPECT_EQ(root->name, "svg");
  EXPECT_EQ(root->Attr("xmlns"), "http://www.w3.org/2000/svg");
  EXPECT_EQ(root->Attr("width"), "1000");
  EXPECT_EQ(root->Attr("viewBox"), "0 0 1000 560");

  std::vector<const Element*> titles = Find(*root, "text", "title");
  ASSERT_EQ(titles.size(), 1u);
  EXPECT_EQ(titles[0]->text, chart.title);
  ASSERT_EQ(Find(*root, "text", "subtitle").size(), 1u);
  EXPECT_EQ(Find(*root, "text", "x-label")[0]->text, chart.x_label);
  EXPECT_EQ(Find(*root, "text", "y-label")[0]->text, chart.y_label);

  // One path per layer; the legend merges layers of one legend name.
  EXPECT_EQ(Find(*root, "path", "area").size(), 3u);
  std::vector<const Element*> entries = Find(*root, "g", "legend-entry");
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(Find(*entries[0], "text")[0]->text, "gathered parameters");
  EXPECT_EQ(Find(*entries[1], "text")[0]->text, "unsharded gradients");
  // Both parameter layers share the legend's color.
  std::vector<const Element*> areas = Find(*root, "path", "area");
  EXPECT_EQ(areas[0]->Attr("fill"), areas[1]->Attr("fill"));
  EXPECT_NE(areas[0]->Attr("fill"), areas[2]->Attr("fill"));

  // Byte ticks in GiB, from 0 up to at least the peak.
  std::vector<const Element*> y_ticks = Find(*root, "text", "y-tick");
  ASSERT_GE(y_ticks.size(), 3u);
  EXPECT_EQ(
      Number(std::string(absl::StripSuffix(y_ticks.front()->text, " GiB"))),
      0.0);
  for (const Element* tick : y_ticks) {
    EXPECT_TRUE(absl::EndsWith(tick->text, " GiB")) << tick->text;
  }
  EXPECT_GE(
      Number(std::string(absl::StripSuffix(y_ticks.back()->text, " GiB"))),
      3.0);
  std::vector<const Element*> x_ticks = Find(*root, "text", "x-tick");
  ASSERT_GE(x_ticks.size(), 3u);
  EXPECT_EQ(x_ticks.front()->text, "0");
}

TEST(TimelineSvgTest, AreasAreStackedSteps) {
  const ChartSpec chart = MemoryChart();
  absl::StatusOr<ChartFrame> frame = ChartFrameOf(chart);
  ASSERT_TRUE(frame.ok()) << frame.status();
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  std::vector<const Element*> areas = Find(*root, "path", "area");
  ASSERT_EQ(areas.size(), 3u);
  // u1's parameters sit on u0's over [5, 7) (top 3 GiB, bottom 1 GiB) and
  // alone over [7, 9) (top 2 GiB, bottom 0).
  const std::string d = areas[1]->Attr("d");
  auto point = [&](double x, double y) {
    double px = std::round(frame->PixelX(x) * 100) / 100;
    double py = std::round(frame->PixelY(y) * 100) / 100;
    auto fmt = [](double v) {
      std::string s = absl::StrCat(v);
      return s;
    };
    return absl::StrCat(fmt(px), " ", fmt(py));
  };
  EXPECT_TRUE(absl::StartsWith(d, absl::StrCat("M", point(5, 3 * kGiB)))) << d;
  EXPECT_TRUE(absl::StrContains(d, point(7, 3 * kGiB))) << d;
  EXPECT_TRUE(absl::StrContains(d, point(7, 2 * kGiB))) << d;
  EXPECT_TRUE(absl::StrContains(d, point(9, 2 * kGiB))) << d;
  EXPECT_TRUE(absl::StrContains(d, point(9, 0))) << d;
  EXPECT_TRUE(absl::StrContains(d, point(5, 1 * kGiB))) << d;
  EXPECT_FALSE(absl::StrContains(d, point(2, 0))) << d;
  EXPECT_TRUE(absl::EndsWith(d, "Z")) << d;
}

TEST(TimelineSvgTest, PeakMarkerSitsAtItsPointWithItsLabel) {
  const ChartSpec chart = MemoryChart();
  absl::StatusOr<ChartFrame> frame = ChartFrameOf(chart);
  ASSERT_TRUE(frame.ok());
  EXPECT_DOUBLE_EQ(frame->x_min, 0);
  EXPECT_DOUBLE_EQ(frame->x_max, 12);
  EXPECT_GE(frame->y_max, 3 * kGiB);
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  std::vector<const Element*> peaks = Find(*root, "g", "peak");
  ASSERT_EQ(peaks.size(), 1u);
  const Element& line = *Find(*peaks[0], "line")[0];
  EXPECT_NEAR(Number(line.Attr("x1")), frame->PixelX(5), 0.01);
  EXPECT_NEAR(Number(line.Attr("x2")), frame->PixelX(5), 0.01);
  EXPECT_NEAR(Number(line.Attr("y1")), frame->top, 0.01);
  EXPECT_NEAR(Number(line.Attr("y2")), frame->bottom, 0.01);
  const Element& dot = *Find(*peaks[0], "circle")[0];
  EXPECT_NEAR(Number(dot.Attr("cx")), frame->PixelX(5), 0.01);
  EXPECT_NEAR(Number(dot.Attr("cy")), frame->PixelY(3 * kGiB), 0.01);
  // The dot lies inside the plot, above the x axis.
  EXPECT_LT(Number(dot.Attr("cy")), frame->bottom);
  EXPECT_GE(Number(dot.Attr("cy")), frame->top);
  EXPECT_EQ(Find(*peaks[0], "text")[0]->text, "peak 3 GiB");
  // x = 5 of [0, 12] is in the left half: the label goes right of the line.
  EXPECT_EQ(Find(*peaks[0], "text")[0]->Attr("text-anchor"), "start");
}

TEST(TimelineSvgTest, EscapesEveryText) {
  ChartSpec chart = MemoryChart();
  chart.title = "a<b & \"c\" 'd'>";
  chart.subtitle = "x</text><script>";
  chart.x_label = "\x01tab\tok";
  chart.areas.layers[0].label = "u<0>";
  chart.areas.layers[0].legend = "params & co";
  chart.peaks[0].label = "<peak>";
  chart.lines.push_back({"line \"1\"", "", {{0, 1}, {12, 2}}});
  chart.references.push_back({"ref & <b>", 1, ""});
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  EXPECT_FALSE(absl::StrContains(*svg, "<b")) << "unescaped markup";
  EXPECT_FALSE(absl::StrContains(*svg, "<script")) << "unescaped markup";
  EXPECT_FALSE(absl::StrContains(*svg, "<peak")) << "unescaped markup";
  EXPECT_FALSE(absl::StrContains(*svg, "\x01"));
  EXPECT_TRUE(
      absl::StrContains(*svg, "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;"));
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  EXPECT_EQ(Find(*root, "text", "title")[0]->text, chart.title);
  EXPECT_EQ(Find(*root, "text", "subtitle")[0]->text, chart.subtitle);
  EXPECT_EQ(Find(*root, "text", "x-label")[0]->text, "tab\tok");
  EXPECT_EQ(Find(*Find(*root, "g", "peak")[0], "text")[0]->text, "<peak>");
  EXPECT_EQ(Find(*Find(*root, "path", "area")[0], "title")[0]->text, "u<0>");
  EXPECT_EQ(Find(*Find(*root, "g", "legend-entry")[0], "text")[0]->text,
            "params & co");
  EXPECT_EQ(XmlEscape("&<>\"'"), "&amp;&lt;&gt;&quot;&apos;");
}

TEST(TimelineSvgTest, CompareOverlayDrawsTheOtherTotalAndBothPeaks) {
  ChartSpec chart = MemoryChart();
  chart.title = "m: default vs diffusion_gemma";
  // The other strategy's total, longer than the first program.
  LineSeries other;
  other.label = "diffusion_gemma total";
  other.color = "#c8434b";
  other.points = {{0, 0}, {4, 2 * kGiB}, {10, 4 * kGiB}, {15, 0}};
  chart.lines.push_back(other);
  chart.peaks.push_back(
      {"diffusion_gemma peak 4 GiB", 10, 4 * kGiB, "#c8434b"});
  absl::StatusOr<ChartFrame> frame = ChartFrameOf(chart);
  ASSERT_TRUE(frame.ok());
  // The axes cover both: x to 15, y to at least 4 GiB.
  EXPECT_DOUBLE_EQ(frame->x_max, 15);
  EXPECT_GE(frame->y_max, 4 * kGiB);
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  std::unique_ptr<Element> root = ParseOrDie(*svg);

  std::vector<const Element*> lines = Find(*root, "path", "line");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]->Attr("stroke"), "#c8434b");
  EXPECT_EQ(lines[0]->Attr("fill"), "");  // Inherits fill="none".
  EXPECT_EQ(Find(*lines[0], "title")[0]->text, "diffusion_gemma total");
  // Steps: the value 2 GiB holds from x = 4 to x = 10, then rises.
  const std::string step =
      absl::StrCat(" L", std::round(frame->PixelX(10) * 100) / 100, " ",
                   std::round(frame->PixelY(2 * kGiB) * 100) / 100);
  EXPECT_TRUE(absl::StrContains(lines[0]->Attr("d"), step))
      << lines[0]->Attr("d") << " lacks " << step;
  // The lines are drawn after (over) the areas.
  EXPECT_LT(svg->find("class=\"area\""), svg->find("class=\"line\""));

  std::vector<const Element*> peaks = Find(*root, "g", "peak");
  ASSERT_EQ(peaks.size(), 2u);
  EXPECT_NEAR(Number(Find(*peaks[1], "line")[0]->Attr("x1")), frame->PixelX(10),
              0.01);
  EXPECT_NEAR(Number(Find(*peaks[1], "circle")[0]->Attr("cy")),
              frame->PixelY(4 * kGiB), 0.01);
  EXPECT_EQ(Find(*peaks[1], "text")[0]->text, "diffusion_gemma peak 4 GiB");
  // Labels do not sit on each other.
  EXPECT_NE(Find(*peaks[0], "text")[0]->Attr("y"),
            Find(*peaks[1], "text")[0]->Attr("y"));
  // Legend: two area entries and the line.
  std::vector<const Element*> entries = Find(*root, "g", "legend-entry");
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(Find(*entries[2], "text")[0]->text, "diffusion_gemma total");
  EXPECT_EQ(Find(*entries[2], "line").size(), 1u);
}

TEST(TimelineSvgTest, PlainUnitsAndReferenceLine) {
  ChartSpec chart;
  chart.title = "loss";
  chart.y_unit = ChartUnit::kPlain;
  LineSeries loss;
  loss.label = "loss";
  loss.steps = false;
  for (int i = 1; i <= 50; ++i) loss.points.push_back({double(i), 6.0 / i + 2});
  chart.lines.push_back(loss);
  chart.references.push_back({"entropy rate 2.10", 2.1, ""});
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok()) << svg.status();
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  for (const Element* tick : Find(*root, "text", "y-tick")) {
    EXPECT_FALSE(absl::StrContains(tick->text, "B")) << tick->text;
  }
  std::vector<const Element*> refs = Find(*root, "g", "reference");
  ASSERT_EQ(refs.size(), 1u);
  absl::StatusOr<ChartFrame> frame = ChartFrameOf(chart);
  ASSERT_TRUE(frame.ok());
  EXPECT_NEAR(Number(Find(*refs[0], "line")[0]->Attr("y1")), frame->PixelY(2.1),
              0.01);
  EXPECT_EQ(Find(*refs[0], "text")[0]->text, "entropy rate 2.10");
  // Not steps: one point per sample.
  const std::string d = Find(*root, "path", "line")[0]->Attr("d");
  EXPECT_EQ(std::count(d.begin(), d.end(), 'L'), 49);
}

TEST(TimelineSvgTest, Deterministic) {
  absl::StatusOr<std::string> a = RenderChartSvg(MemoryChart());
  absl::StatusOr<std::string> b = RenderChartSvg(MemoryChart());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
}

TEST(TimelineSvgTest, ManyLegendEntriesAreCounted) {
  ChartSpec chart;
  chart.title = "many";
  chart.areas.x = {0, 1};
  for (int i = 0; i < 60; ++i) {
    chart.areas.layers.push_back({absl::StrCat("unit ", i), "", "", {1, 0}});
  }
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  const size_t shown = Find(*root, "g", "legend-entry").size();
  EXPECT_LT(shown, 60u);
  std::vector<const Element*> more = Find(*root, "text", "legend-more");
  ASSERT_EQ(more.size(), 1u);
  EXPECT_EQ(more[0]->text, absl::StrCat("and ", 60 - shown, " more"));
}

TEST(TimelineSvgTest, RejectsBadInput) {
  ChartSpec chart = MemoryChart();
  chart.areas.layers[0].values.pop_back();
  EXPECT_EQ(RenderChartSvg(chart).status().code(),
            absl::StatusCode::kInvalidArgument);

  chart = MemoryChart();
  chart.areas.x[3] = 1;  // Decreases.
  EXPECT_EQ(RenderChartSvg(chart).status().code(),
            absl::StatusCode::kInvalidArgument);

  chart = MemoryChart();
  chart.areas.layers[1].values[2] = -1;
  EXPECT_EQ(RenderChartSvg(chart).status().code(),
            absl::StatusCode::kInvalidArgument);

  chart = MemoryChart();
  chart.peaks[0].y = std::nan("");
  EXPECT_EQ(RenderChartSvg(chart).status().code(),
            absl::StatusCode::kInvalidArgument);

  chart = MemoryChart();
  chart.width = 100;
  EXPECT_EQ(RenderChartSvg(chart).status().code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(RenderChartSvg(ChartSpec()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TimelineSvgTest, ByteFormats) {
  EXPECT_EQ(FormatChartBytes(0), "0 B");
  EXPECT_EQ(FormatChartBytes(512), "512 B");
  EXPECT_EQ(FormatChartBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatChartBytes(12 * kGiB), "12 GiB");
  EXPECT_EQ(FormatChartBytes(3.25 * 1024 * 1024), "3.25 MiB");

  // A KiB-sized chart labels its axis in KiB.
  ChartSpec chart;
  chart.title = "small";
  chart.areas.x = {0, 1, 2};
  chart.areas.layers.push_back({"a", "", "", {0, 300 * 1024.0, 0}});
  absl::StatusOr<std::string> svg = RenderChartSvg(chart);
  ASSERT_TRUE(svg.ok());
  std::unique_ptr<Element> root = ParseOrDie(*svg);
  std::vector<const Element*> ticks = Find(*root, "text", "y-tick");
  ASSERT_FALSE(ticks.empty());
  EXPECT_TRUE(absl::EndsWith(ticks.back()->text, " KiB")) << ticks.back()->text;
}

}  // namespace
}  // namespace shardd
