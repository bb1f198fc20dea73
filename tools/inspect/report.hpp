// embedhead-inspect: the report -- three SVG figures (row-norm histogram, centroid-distance
// histogram, 2-D PCA scatter) and a summary, as one self-contained HTML page (inline SVG and CSS,
// no script, no external resource) or as separate .svg files.
//
// The figures are drawn by hand: a plot area with a frame, light grid lines at "nice" tick values
// (1, 2 or 5 times a power of ten), tick labels, axis labels, a title and a subtitle line that says
// what is shown (bins, scale, sampling). Under-trained candidates are orange (#E8590C) everywhere,
// the other tokens blue (#3B6EA8). Every element the browser test looks for has an id or a class:
// svg#fig-norms, svg#fig-centroid, svg#fig-pca, rect.bar, rect.bar-cand, circle.pt, circle.pt-cand.
#ifndef EMBEDHEAD_TOOLS_INSPECT_REPORT_HPP
#define EMBEDHEAD_TOOLS_INSPECT_REPORT_HPP

#include "text.hpp"

#include <embedhead/types.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace inspect {

using embedhead::Index;
using embedhead::RowMatrix;

inline constexpr const char* kBlue = "#3B6EA8";
inline constexpr const char* kOrange = "#E8590C";
inline constexpr const char* kInk = "#1F2933";
inline constexpr const char* kMuted = "#616E7C";
inline constexpr const char* kGrid = "#E4E7EB";
inline constexpr const char* kFont = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', Arial, sans-serif";

// Everything the report shows, filled in by main.cpp.
struct ReportData {
  std::string title;     // page and figure title prefix
  std::string subtitle;  // e.g. "model.safetensors - wte.weight [50257, 768] F32, tied"
  std::vector<std::pair<std::string, std::string>> facts;  // the summary table: label, value
  Eigen::VectorXd norms, distances;                        // [V]
  std::vector<Index> candidates;                           // top-N under-trained candidates, best first
  std::string candidate_rule;                              // how they were ranked
  std::vector<std::string> candidate_tokens;               // escaped token strings ("" without --vocab)
  std::vector<double> candidate_scores;
  std::string score_name;        // "magikarp", or empty when ranked by centroid distance
  RowMatrix<double> points;      // [n, 2] PCA coordinates of the shown tokens
  std::vector<Index> point_ids;  // [n] their ids
  double explained[2] = {0, 0};  // PC1, PC2 explained variance fractions
  Index V = 0;
  bool subsampled = false;
};

// ---- scales and ticks ----

// Tick values covering [lo, hi]: multiples of 1, 2 or 5 x 10^k, about `target` of them.
inline std::vector<double> nice_ticks(double lo, double hi, int target = 6) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * magnitude) {
      step = m * magnitude;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

// Tick label with as many decimals as the tick spacing needs.
inline std::string tick_label(double value, double step) {
  int decimals = 0;
  if (step > 0 && step < 1) decimals = std::min(8, static_cast<int>(std::ceil(-std::log10(step) - 1e-9)));
  if (std::abs(value) >= 1e5 && decimals == 0) return thousands(static_cast<long long>(std::llround(value)));
  return format("%.*f", decimals, value);
}

inline std::string number(double x) { return format("%.1f", x); }  // SVG coordinates

// Lower and upper bound of a data range, widened when it is a single value.
inline std::pair<double, double> data_range(const double* begin, const double* end) {
  double lo = *std::min_element(begin, end), hi = *std::max_element(begin, end);
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.05;
    lo -= pad;
    hi += pad;
  }
  return {lo, hi};
}

// ---- SVG pieces ----

struct Frame {
  double width, height, left, right, top, bottom;  // outer size and margins
  double x0() const { return left; }
  double x1() const { return width - right; }
  double y0() const { return height - bottom; }  // bottom of the plot area
  double y1() const { return top; }
};

inline std::string svg_open(const std::string& id, const Frame& f, const std::string& label) {
  return format(
             "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"%s\" class=\"figure\" viewBox=\"0 0 %.0f %.0f\" "
             "width=\"%.0f\" height=\"%.0f\" role=\"img\" aria-label=\"%s\" font-family=\"%s\">\n",
             id.c_str(), f.width, f.height, f.width, f.height, escape_xml(label).c_str(), kFont) +
         format("<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"#FFFFFF\"/>\n", f.width, f.height);
}

inline std::string svg_text(double x, double y, const std::string& text, const char* anchor, double size,
                            const char* fill, const char* extra = "") {
  return format("<text x=\"%s\" y=\"%s\" text-anchor=\"%s\" font-size=\"%.0f\" fill=\"%s\"%s>", number(x).c_str(),
                number(y).c_str(), anchor, size, fill, extra) +
         escape_xml(text) + "</text>\n";
}

inline std::string svg_titles(const Frame& f, const std::string& title, const std::string& subtitle) {
  return svg_text(f.left, 24, title, "start", 17, kInk, " font-weight=\"600\" class=\"fig-title\"") +
         svg_text(f.left, 43, subtitle, "start", 12, kMuted, " class=\"fig-subtitle\"");
}

// Axes: grid lines and labels at the ticks of a linear x scale and of a y scale given as
// (position value, label) pairs, the frame, and the axis labels.
template <typename XMap, typename YMap>
std::string svg_axes(const Frame& f, const std::vector<double>& xticks, XMap xmap,
                     const std::vector<std::pair<double, std::string>>& yticks, YMap ymap, const std::string& xlabel,
                     const std::string& ylabel, bool vertical_grid) {
  std::string s = "<g class=\"axes\">\n";
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1;
  for (const double t : xticks) {
    const double x = xmap(t);
    if (vertical_grid)
      s += format("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>\n", number(x).c_str(),
                  number(f.y1()).c_str(), number(x).c_str(), number(f.y0()).c_str(), kGrid);
    s += format("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>\n", number(x).c_str(),
                number(f.y0()).c_str(), number(x).c_str(), number(f.y0() + 5).c_str(), kMuted);
    s += svg_text(x, f.y0() + 19, tick_label(t, xstep), "middle", 11, kMuted, " class=\"tick\"");
  }
  for (const auto& [value, label] : yticks) {
    const double y = ymap(value);
    s += format("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>\n", number(f.x0()).c_str(),
                number(y).c_str(), number(f.x1()).c_str(), number(y).c_str(), kGrid);
    s += format("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>\n", number(f.x0() - 5).c_str(),
                number(y).c_str(), number(f.x0()).c_str(), number(y).c_str(), kMuted);
    s += svg_text(f.x0() - 8, y + 4, label, "end", 11, kMuted, " class=\"tick\"");
  }
  s += format("<rect x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" fill=\"none\" stroke=\"#9AA5B1\"/>\n",
              number(f.x0()).c_str(), number(f.y1()).c_str(), number(f.x1() - f.x0()).c_str(),
              number(f.y0() - f.y1()).c_str());
  s += svg_text((f.x0() + f.x1()) / 2, f.height - 10, xlabel, "middle", 13, kInk, " class=\"axis-label\"");
  const double ymid = (f.y0() + f.y1()) / 2;
  s += svg_text(16, ymid, ylabel, "middle", 13, kInk,
                format(" class=\"axis-label\" transform=\"rotate(-90 16 %s)\"", number(ymid).c_str()).c_str());
  return s + "</g>\n";
}

inline std::string svg_legend(double x, double y, const std::vector<std::pair<std::string, std::string>>& entries,
                              bool circles) {
  // entries: colour, label. A white box behind, so it stays readable over points.
  double width = 0;
  for (const auto& e : entries) width = std::max(width, 7.0 * static_cast<double>(e.second.size()));
  width += 34;
  const double height = 18.0 * static_cast<double>(entries.size()) + 8;
  std::string s = "<g class=\"legend\">\n";
  s += format(
      "<rect x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" rx=\"4\" fill=\"#FFFFFF\" fill-opacity=\"0.92\" "
      "stroke=\"#CBD2D9\"/>\n",
      number(x - width).c_str(), number(y).c_str(), number(width).c_str(), number(height).c_str());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const double cy = y + 13 + 18.0 * static_cast<double>(i);
    if (circles)
      s += format("<circle class=\"legend-mark\" cx=\"%s\" cy=\"%s\" r=\"5\" fill=\"%s\"/>\n",
                  number(x - width + 14).c_str(), number(cy).c_str(), entries[i].first.c_str());
    else
      s += format("<rect class=\"legend-mark\" x=\"%s\" y=\"%s\" width=\"12\" height=\"10\" fill=\"%s\"/>\n",
                  number(x - width + 8).c_str(), number(cy - 5).c_str(), entries[i].first.c_str());
    s += svg_text(x - width + 26, cy + 4, entries[i].second, "start", 12, kInk);
  }
  return s + "</g>\n";
}

// ---- the figures ----

// Histogram of `values` [V] with the candidates' own histogram drawn over it in orange (same bins,
// same scale; each orange bar is at most as tall as the blue one behind it). The y axis switches
// to a log scale (of 1 + count) when the tallest bin holds 100 or more tokens, so a handful of
// under-trained tokens stays visible next to tens of thousands of ordinary ones.
inline std::string histogram_svg(const std::string& id, const std::string& title, const std::string& xlabel,
                                 const Eigen::VectorXd& values, const std::vector<Index>& highlight,
                                 const std::string& highlight_label) {
  const Frame f{540, 380, 66, 18, 62, 48};
  const Index V = values.size();
  const int bins = static_cast<int>(
      std::clamp<Index>(static_cast<Index>(std::sqrt(static_cast<double>(V)) * 1.5), 10, 48));
  const auto [lo, hi] = data_range(values.data(), values.data() + V);
  const double width = (hi - lo) / bins;
  const auto bin_of = [&, lo = lo](double v) { return std::clamp(static_cast<int>((v - lo) / width), 0, bins - 1); };
  std::vector<long long> count(static_cast<std::size_t>(bins), 0), marked(static_cast<std::size_t>(bins), 0);
  for (Index v = 0; v < V; ++v) ++count[static_cast<std::size_t>(bin_of(values(v)))];
  for (const Index v : highlight) ++marked[static_cast<std::size_t>(bin_of(values(v)))];
  const long long top = *std::max_element(count.begin(), count.end());
  const bool log_scale = top >= 100;

  // y: count -> pixel. Log scale: log10(1 + c), ticks at 0, 1, 10, 100, ...
  const double ymax = log_scale ? std::log10(1.0 + static_cast<double>(top)) * 1.05 : static_cast<double>(top) * 1.08;
  const auto yval = [&](double c) { return log_scale ? std::log10(1.0 + c) : c; };
  const auto ymap = [&](double c) { return f.y0() - yval(c) / ymax * (f.y0() - f.y1()); };
  std::vector<std::pair<double, std::string>> yticks;
  if (log_scale) {
    // No "0" label: at the foot of a log axis it would crowd the "1" just above it.
    for (double c = 1; yval(c) <= ymax; c *= 10) yticks.push_back({c, thousands(static_cast<long long>(c))});
  } else {
    const auto t = nice_ticks(0, static_cast<double>(top) * 1.08, 5);
    const double step = t.size() > 1 ? t[1] - t[0] : 1;
    for (const double c : t)
      if (step >= 1 || c == std::floor(c)) yticks.push_back({c, tick_label(c, std::max(step, 1.0))});
  }
  const auto xmap = [&, lo = lo, hi = hi](double x) { return f.x0() + (x - lo) / (hi - lo) * (f.x1() - f.x0()); };

  std::string s = svg_open(id, f, title);
  std::string subtitle = thousands(V) + " tokens in " + std::to_string(bins) + " bins";
  subtitle += log_scale ? "; y axis: log scale" : "; y axis: linear";
  s += svg_titles(f, title, subtitle);
  s += svg_axes(f, nice_ticks(lo, hi, 8), xmap, yticks, ymap, xlabel, log_scale ? "tokens (log scale)" : "tokens",
                false);
  s += "<g class=\"bars\">\n";
  for (int b = 0; b < bins; ++b) {
    const auto c = count[static_cast<std::size_t>(b)];
    if (c == 0) continue;
    const double x = xmap(lo + b * width) + 0.5,
                 w = std::max(1.0, xmap(lo + (b + 1) * width) - xmap(lo + b * width) - 1);
    s += format(
        "<rect class=\"bar\" x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" fill=\"%s\"><title>%s tokens in "
        "[%.4g, %.4g)</title></rect>\n",
        number(x).c_str(), number(ymap(static_cast<double>(c))).c_str(), number(w).c_str(),
        number(f.y0() - ymap(static_cast<double>(c))).c_str(), kBlue, thousands(c).c_str(), lo + b * width,
        lo + (b + 1) * width);
  }
  for (int b = 0; b < bins; ++b) {
    const auto c = marked[static_cast<std::size_t>(b)];
    if (c == 0) continue;
    const double x = xmap(lo + b * width) + 0.5,
                 w = std::max(1.0, xmap(lo + (b + 1) * width) - xmap(lo + b * width) - 1);
    s += format(
        "<rect class=\"bar-cand\" x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" fill=\"%s\"><title>%lld "
        "candidates in this bin</title></rect>\n",
        number(x).c_str(), number(ymap(static_cast<double>(c))).c_str(), number(w).c_str(),
        number(f.y0() - ymap(static_cast<double>(c))).c_str(), kOrange, c);
  }
  s += "</g>\n";
  if (!highlight.empty()) s += svg_legend(f.x1(), 6, {{kBlue, "all tokens"}, {kOrange, highlight_label}}, false);
  return s + "</svg>\n";
}

// Scatter of the tokens on the top two principal directions; candidates on top, in orange.
inline std::string scatter_svg(const ReportData& r, const std::string& title) {
  const Frame f{1100, 640, 72, 24, 62, 50};
  const Index n = r.points.rows();
  std::vector<char> is_candidate(static_cast<std::size_t>(n), 0);
  {
    std::vector<Index> sorted = r.candidates;
    std::sort(sorted.begin(), sorted.end());
    for (Index i = 0; i < n; ++i)
      is_candidate[static_cast<std::size_t>(i)] = std::binary_search(sorted.begin(), sorted.end(),
                                                                     r.point_ids[static_cast<std::size_t>(i)]);
  }
  std::vector<double> xs(static_cast<std::size_t>(n)), ys(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) {
    xs[static_cast<std::size_t>(i)] = r.points(i, 0);
    ys[static_cast<std::size_t>(i)] = r.points(i, 1);
  }
  // Plain variables, not structured bindings: the lambdas below capture them, which C++17 (and
  // clang 14) does not allow for a binding.
  double xlo, xhi, ylo, yhi;
  std::tie(xlo, xhi) = data_range(xs.data(), xs.data() + n);
  std::tie(ylo, yhi) = data_range(ys.data(), ys.data() + n);
  const double xpad = (xhi - xlo) * 0.04, ypad = (yhi - ylo) * 0.06;
  xlo -= xpad;
  xhi += xpad;
  ylo -= ypad;
  yhi += ypad;
  const auto xmap = [&](double x) { return f.x0() + (x - xlo) / (xhi - xlo) * (f.x1() - f.x0()); };
  const auto ymap = [&](double y) { return f.y0() - (y - ylo) / (yhi - ylo) * (f.y0() - f.y1()); };
  const auto yt = nice_ticks(ylo, yhi, 6);
  std::vector<std::pair<double, std::string>> yticks;
  for (const double t : yt) yticks.push_back({t, tick_label(t, yt.size() > 1 ? yt[1] - yt[0] : 1)});

  std::string s = svg_open("fig-pca", f, title);
  std::string subtitle = r.subsampled
                             ? "a deterministic sample of " + thousands(n) + " of " + thousands(r.V) +
                                   " tokens (every candidate included), projected on the top two principal directions"
                             : "all " + thousands(r.V) + " tokens, projected on the top two principal directions";
  s += svg_titles(f, title, subtitle);
  s += svg_axes(f, nice_ticks(xlo, xhi, 8), xmap, yticks, ymap,
                format("PC1 (%.1f%% of variance)", 100 * r.explained[0]),
                format("PC2 (%.1f%% of variance)", 100 * r.explained[1]), true);
  // Smaller, more transparent dots as the cloud gets denser.
  const double radius = n > 5000 ? 1.6 : n > 1000 ? 2.2 : 3.0;
  const double opacity = n > 5000 ? 0.45 : 0.6;
  s += format("<g class=\"points\" fill=\"%s\" fill-opacity=\"%.2f\">\n", kBlue, opacity);
  for (Index i = 0; i < n; ++i)
    if (!is_candidate[static_cast<std::size_t>(i)])
      s += format("<circle class=\"pt\" cx=\"%s\" cy=\"%s\" r=\"%.1f\"/>\n",
                  number(xmap(xs[static_cast<std::size_t>(i)])).c_str(),
                  number(ymap(ys[static_cast<std::size_t>(i)])).c_str(), radius);
  s += "</g>\n";
  s += format("<g class=\"candidates\" fill=\"%s\" stroke=\"#7A2E05\" stroke-width=\"0.8\">\n", kOrange);
  for (Index i = 0; i < n; ++i)
    if (is_candidate[static_cast<std::size_t>(i)]) {
      const Index id = r.point_ids[static_cast<std::size_t>(i)];
      std::string tip = "id " + std::to_string(id);
      const auto it = std::find(r.candidates.begin(), r.candidates.end(), id);
      const auto rank = static_cast<std::size_t>(it - r.candidates.begin());
      if (rank < r.candidate_tokens.size() && !r.candidate_tokens[rank].empty())
        tip += " '" + r.candidate_tokens[rank] + "'";
      tip += ", candidate #" + std::to_string(rank + 1);
      s += format("<circle class=\"pt pt-cand\" cx=\"%s\" cy=\"%s\" r=\"%.1f\"><title>",
                  number(xmap(xs[static_cast<std::size_t>(i)])).c_str(),
                  number(ymap(ys[static_cast<std::size_t>(i)])).c_str(), radius + 2.2) +
           escape_xml(tip) + "</title></circle>\n";
    }
  s += "</g>\n";
  s += svg_legend(
      f.x1(), 6,
      {{kBlue, "tokens (" + thousands(n - static_cast<Index>(std::count(is_candidate.begin(), is_candidate.end(), 1))) +
                   " shown)"},
       {kOrange, "top " + std::to_string(r.candidates.size()) + " under-trained candidates"}},
      true);
  return s + "</svg>\n";
}

inline std::string norms_svg(const ReportData& r) {
  return histogram_svg("fig-norms", "Row norms", "||E[v]||", r.norms, r.candidates,
                       "top " + std::to_string(r.candidates.size()) + " candidates");
}
inline std::string centroid_svg(const ReportData& r) {
  return histogram_svg("fig-centroid", "Distance to the centroid", "||E[v] - mean of rows||", r.distances, r.candidates,
                       "top " + std::to_string(r.candidates.size()) + " candidates");
}
inline std::string pca_svg(const ReportData& r) { return scatter_svg(r, "Tokens on the top two principal directions"); }

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write '" + path + "': " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
}

// The standalone figures: <prefix>-norms.svg, <prefix>-centroid.svg, <prefix>-pca.svg.
inline std::vector<std::string> write_svgs(const ReportData& r, const std::string& prefix) {
  const std::string header = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  std::vector<std::string> paths = {prefix + "-norms.svg", prefix + "-centroid.svg", prefix + "-pca.svg"};
  write_file(paths[0], header + norms_svg(r));
  write_file(paths[1], header + centroid_svg(r));
  write_file(paths[2], header + pca_svg(r));
  return paths;
}

inline std::string report_html(const ReportData& r) {
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += "<title>" + escape_xml(r.title) + "</title>\n";
  h += "<style>\n"
       "body{margin:0;background:#F5F7FA;color:#1F2933;font-family:system-ui,-apple-system,'Segoe UI','DejaVu "
       "Sans',Arial,sans-serif;}\n"
       "main{max-width:1160px;margin:0 auto;padding:24px 20px 40px;}\n"
       "h1{font-size:26px;margin:0 0 4px;font-weight:650;}\n"
       "h2{font-size:18px;margin:28px 0 10px;font-weight:600;}\n"
       ".sub{color:#616E7C;margin:0 0 18px;font-size:14px;word-break:break-all;}\n"
       ".cards{display:grid;grid-template-columns:repeat(6,1fr);gap:10px;margin-bottom:18px;}\n"
       ".card{background:#fff;border:1px solid #E4E7EB;border-radius:8px;padding:10px 12px;}\n"
       ".card .k{font-size:12px;color:#616E7C;text-transform:uppercase;letter-spacing:.04em;}\n"
       ".card .v{font-size:20px;font-weight:600;margin-top:2px;font-variant-numeric:tabular-nums;}\n"
       ".row{display:flex;gap:16px;}\n"
       ".row figure{flex:1 1 0;min-width:0;}\n"
       "figure{margin:0 0 16px;background:#fff;border:1px solid #E4E7EB;border-radius:8px;padding:6px;}\n"
       "figure svg{display:block;width:100%;height:auto;}\n"
       "figcaption{font-size:13px;color:#616E7C;padding:2px 8px 6px;max-width:1100px;}\n"
       "table{border-collapse:collapse;background:#fff;font-size:14px;font-variant-numeric:tabular-nums;}\n"
       "th,td{padding:5px 12px;border-bottom:1px solid #E4E7EB;text-align:left;}\n"
       "th{background:#EEF1F5;font-weight:600;}\n"
       "td.n{text-align:right;}\n"
       "code{font-family:ui-monospace,'DejaVu Sans Mono',monospace;background:#EEF1F5;padding:0 "
       "4px;border-radius:3px;}\n"
       ".tables{display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start;}\n"
       "</style>\n</head>\n<body>\n<main>\n";
  h += "<h1 id=\"title\">" + escape_xml(r.title) + "</h1>\n";
  h += "<p class=\"sub\">" + escape_xml(r.subtitle) + "</p>\n";

  // Key facts as cards: the first six facts.
  h += "<div class=\"cards\">\n";
  for (std::size_t i = 0; i < r.facts.size() && i < 6; ++i)
    h += "<div class=\"card\"><div class=\"k\">" + escape_xml(r.facts[i].first) + "</div><div class=\"v\">" +
         escape_xml(r.facts[i].second) + "</div></div>\n";
  h += "</div>\n";

  const std::string cand = std::to_string(r.candidates.size());
  h += "<div class=\"row\">\n<figure>\n" + norms_svg(r) + "<figcaption>Euclidean norm of every row. Orange: the top " +
       cand + " under-trained candidates.</figcaption>\n</figure>\n";
  h += "<figure>\n" + centroid_svg(r) +
       "<figcaption>Distance of every row from the mean row. Rows that training never moved stay near "
       "their initialisation, close to the centroid.</figcaption>\n</figure>\n</div>\n";
  h += "<figure>\n" + pca_svg(r) + "<figcaption>";
  h += r.subsampled ? "Subsampled for size: " + thousands(r.points.rows()) + " of " + thousands(r.V) +
                          " tokens, chosen by a fixed-seed shuffle (the same on every run), plus every candidate. "
                    : "Every token is shown. ";
  h += format("Axes: the top two principal directions of the centred rows (%.1f%% and %.1f%% of the total variance).",
              100 * r.explained[0], 100 * r.explained[1]);
  h += "</figcaption>\n</figure>\n";

  h += "<div class=\"tables\">\n<div>\n<h2>Summary</h2>\n<table id=\"summary\">\n";
  for (const auto& [k, v] : r.facts) h += "<tr><th>" + escape_xml(k) + "</th><td>" + escape_xml(v) + "</td></tr>\n";
  h += "</table>\n</div>\n<div>\n<h2>Under-trained candidates</h2>\n";
  h += "<p class=\"sub\">" + escape_xml(r.candidate_rule) + "</p>\n";
  const bool score_column = !r.score_name.empty();
  h += "<table id=\"candidates\">\n<tr><th>rank</th><th>id</th><th>token</th>" +
       (score_column ? "<th>" + escape_xml(r.score_name) + "</th>" : std::string()) +
       "<th>norm</th><th>centroid distance</th></tr>\n";
  for (std::size_t i = 0; i < r.candidates.size(); ++i) {
    const Index id = r.candidates[i];
    const std::string token = i < r.candidate_tokens.size() ? r.candidate_tokens[i] : "";
    h += format("<tr><td class=\"n\">%zu</td><td class=\"n\">%lld</td><td>", i + 1, static_cast<long long>(id)) +
         (token.empty() ? std::string() : "<code>" + escape_xml(token) + "</code>") + "</td>" +
         (score_column ? format("<td class=\"n\">%.4g</td>", r.candidate_scores[i]) : std::string()) +
         format("<td class=\"n\">%.4g</td><td class=\"n\">%.4g</td></tr>\n", r.norms(id), r.distances(id));
  }
  h += "</table>\n</div>\n</div>\n";
  h += "<p class=\"sub\" style=\"margin-top:24px\">Written by embedhead-inspect. Self-contained: inline SVG and CSS, "
       "no scripts, no external resources.</p>\n";
  h += "</main>\n</body>\n</html>\n";
  return h;
}

}  // namespace inspect

#endif  // EMBEDHEAD_TOOLS_INSPECT_REPORT_HPP
