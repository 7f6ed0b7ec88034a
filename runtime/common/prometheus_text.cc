#include "common/prometheus_text.h"

#include <cmath>
#include <cstdio>

namespace gradsync::prom {

std::string render_labels(const Labels& labels) {
  std::string s;
  for (const auto& [k, v] : labels) {
    if (!s.empty()) s += ',';
    s += k + "=\"";
    for (char c : v) {
      if (c == '\\') s += "\\\\";
      else if (c == '"') s += "\\\"";
      else if (c == '\n') s += "\\n";
      else s += c;
    }
    s += '"';
  }
  return s;
}

std::string render_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

Text::Family& Text::of(const std::string& name) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    order_.push_back(name);
    it = families_.emplace(name, Family{"untyped", "", {}}).first;
  }
  return it->second;
}

void Text::family(const std::string& name, const std::string& type, const std::string& help) {
  Family& f = of(name);
  f.type = type;
  f.help = help;
}

void Text::sample(const std::string& name, const Labels& labels, double value) {
  std::string l = render_labels(labels);
  of(name).lines.push_back(name + (l.empty() ? "" : "{" + l + "}") + " " + render_value(value));
}

void Text::histogram(const std::string& name, const Labels& labels, const std::vector<double>& bounds,
                     const std::vector<uint64_t>& counts, double sum) {
  Family& f = of(name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    cumulative += i < counts.size() ? counts[i] : 0;
    Labels with = labels;
    with.emplace_back("le", i < bounds.size() ? render_value(bounds[i]) : "+Inf");
    f.lines.push_back(name + "_bucket{" + render_labels(with) + "} " + render_value(double(cumulative)));
  }
  std::string l = render_labels(labels);
  std::string braces = l.empty() ? "" : "{" + l + "}";
  f.lines.push_back(name + "_sum" + braces + " " + render_value(sum));
  f.lines.push_back(name + "_count" + braces + " " + render_value(double(cumulative)));
}

std::string Text::str() const {
  std::string s;
  for (const auto& name : order_) {
    const Family& f = families_.at(name);
    if (!f.help.empty()) s += "# HELP " + name + " " + f.help + "\n";
    s += "# TYPE " + name + " " + f.type + "\n";
    for (const auto& line : f.lines) s += line + "\n";
  }
  return s;
}

}  // namespace gradsync::prom
