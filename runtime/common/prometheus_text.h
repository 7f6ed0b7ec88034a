// Prometheus text exposition format 0.0.4: families (HELP, TYPE, then their samples together),
// label values escaped, histograms as _bucket{le}/_sum/_count. What gradsyncd and the
// coordinator serve on /metrics (common/metrics_server.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gradsync::prom {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Text {
 public:
  // Declares a family ("counter", "gauge", "histogram"); samples may then be added in any order.
  void family(const std::string& name, const std::string& type, const std::string& help);
  void sample(const std::string& name, const Labels& labels, double value);
  // A histogram sample set: `counts[i]` observations in (bounds[i-1], bounds[i]], the last one
  // above every bound (+Inf); `sum` in the histogram's unit.
  void histogram(const std::string& name, const Labels& labels, const std::vector<double>& bounds,
                 const std::vector<uint64_t>& counts, double sum);
  // Every family in declaration order, each with its samples.
  std::string str() const;

 private:
  struct Family {
    std::string type, help;
    std::vector<std::string> lines;
  };
  Family& of(const std::string& name);
  std::vector<std::string> order_;
  std::map<std::string, Family> families_;
};

// "a=\"x\",b=\"y\"" with \\, \" and \n escaped.
std::string render_labels(const Labels& labels);
// A value as Prometheus writes it: integers without a fraction, +Inf, NaN.
std::string render_value(double v);

}  // namespace gradsync::prom
