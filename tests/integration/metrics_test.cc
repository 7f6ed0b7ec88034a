// Prometheus /metrics (issue 19): after 100 allreduces of 1 MiB on 2 ranks (one per daemon),
// each daemon's scrape shows its rank's 100 calls, 100 MiB and a histogram of 100 for the
// rank's path, and the coordinator's shows the job and its generation. Every scrape is
// checked by a text-format 0.0.4 parser here, and by `promtool check metrics` (Debian's
// prometheus package) where it is installed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// GET /metrics from 127.0.0.1:port; "" on failure. *content_type gets the header's value.
std::string scrape(int port, std::string* content_type) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string resp;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == ssize_t(req.size())) {
      char buf[65536];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) resp.append(buf, size_t(n));
    }
  }
  ::close(fd);
  auto end = resp.find("\r\n\r\n");
  // "HTTP/1.0 200 OK" (civetweb answers in the request's version)
  if (!std::regex_search(resp.substr(0, resp.find("\r\n")), std::regex("^HTTP/1\\.[01] 200 ")) ||
      end == std::string::npos) {
    return "";
  }
  std::smatch m;
  const std::string head = resp.substr(0, end);
  if (std::regex_search(head, m, std::regex("Content-Type: ([^\r]*)", std::regex::icase))) *content_type = m[1];
  return resp.substr(end + 4);
}

// A text-format 0.0.4 parse: every line a HELP, a TYPE or a sample of a declared family,
// each family's samples together, histogram buckets cumulative with +Inf equal to _count.
// Returns the samples ("name{labels}" -> value) and fills *errors.
std::map<std::string, double> parse(const std::string& text, std::vector<std::string>* errors) {
  std::map<std::string, double> out;
  std::map<std::string, std::string> types;
  std::set<std::string> closed;
  std::string current;
  const std::regex help("# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .*");
  const std::regex type("# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)");
  const std::regex sample(
      "([a-zA-Z_:][a-zA-Z0-9_:]*)(\\{([a-zA-Z_][a-zA-Z0-9_]*=\"([^\"\\\\\\n]|\\\\.)*\",?)*\\})? "
      "(-?[0-9.eE+-]+|\\+Inf|-Inf|NaN)");
  std::istringstream in(text);
  std::string line;
  std::map<std::string, double> last_bucket;  // series without le -> last cumulative value
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, help)) continue;
    if (std::regex_match(line, m, type)) {
      if (types.count(m[1])) errors->push_back("family declared twice: " + line);
      if (!current.empty()) closed.insert(current);
      current = m[1];
      types[current] = m[2];
      continue;
    }
    if (!std::regex_match(line, m, sample)) {
      errors->push_back("not a sample line: " + line);
      continue;
    }
    std::string name = m[1];
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          types.count(name.substr(0, name.size() - s.size())) &&
          types[name.substr(0, name.size() - s.size())] == "histogram") {
        family = name.substr(0, name.size() - s.size());
      }
    }
    if (family != current) errors->push_back("sample outside its family's block: " + line);
    const std::string key = line.substr(0, line.rfind(' '));
    const double value = std::strtod(line.substr(line.rfind(' ') + 1).c_str(), nullptr);
    if (out.count(key)) errors->push_back("duplicate series: " + key);
    out[key] = value;
    if (family != name && name.size() > 7 && name.compare(name.size() - 7, 7, "_bucket") == 0) {
      std::string series = std::regex_replace(key, std::regex(",?le=\"[^\"]*\""), "");
      if (last_bucket.count(series) && value < last_bucket[series]) errors->push_back("buckets not cumulative: " + key);
      last_bucket[series] = value;
    }
  }
  return out;
}

// The port in "metrics on http://H:PORT/metrics" in a process's log, or 0.
int metrics_port(Process& p) {
  if (!p.wait_for_output("/metrics", 20s)) return 0;
  std::smatch m;
  const std::string out = p.output();
  if (!std::regex_search(out, m, std::regex("metrics on http://[^ ]*:([0-9]+)/metrics"))) return 0;
  return std::atoi(std::string(m[1]).c_str());
}

// `promtool check metrics` on `text`: "" when it accepts it or is not installed, else why.
std::string promtool(const std::string& text, const std::string& dir, bool* ran) {
  *ran = std::system("command -v promtool >/dev/null 2>&1") == 0;
  if (!*ran) return "";
  const std::string file = dir + "/scrape.txt";
  std::ofstream(file) << text;
  const std::string cmd = "promtool check metrics < " + file + " > " + file + ".out 2>&1";
  if (std::system(cmd.c_str()) == 0) return "";
  std::ifstream f(file + ".out");
  std::stringstream s;
  s << f.rdbuf();
  return "promtool check metrics failed: " + s.str();
}

TEST(Metrics, ScrapesShowCallsBytesHistogramsAndTheJob) {
  Cluster c({.daemons = 2,
             .coordinator_args = {"--metrics-listen", "127.0.0.1:0"},
             .daemon_args = {"--metrics-listen", "127.0.0.1:0"}});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  const int coordinator_port = metrics_port(c.coordinator());
  const int daemon_ports[2] = {metrics_port(c.daemon(0)), metrics_port(c.daemon(1))};
  ASSERT_GT(coordinator_port, 0) << c.report();
  ASSERT_GT(daemon_ports[0], 0) << c.report();
  ASSERT_GT(daemon_ports[1], 0) << c.report();

  // 100 allreduces of 262144 floats (1 MiB) on 2 ranks, one per daemon; no start-up tuning,
  // so the application's calls are all there is.
  auto ranks = c.spawn_ranks("metrics", 2, 1, {"loop", "262144", "100"}, {{"GRADSYNC_TUNE", "0"}});
  ASSERT_EQ(all_succeeded(ranks, 120s), "") << c.report(ranks);

  bool promtool_ran = false;
  for (int d = 0; d < 2; ++d) {
    SCOPED_TRACE("gradsyncd-" + std::to_string(d));
    std::string type;
    // The daemon tears the job down just after its ranks exit: wait for that (its counters stay).
    std::string text;
    for (int i = 0; i < 100; ++i) {
      text = scrape(daemon_ports[d], &type);
      if (text.find("gradsyncd_jobs{state=\"ready\"} 0") != std::string::npos) break;
      std::this_thread::sleep_for(100ms);
    }
    ASSERT_FALSE(text.empty()) << "no answer from gradsyncd-" << d << "'s /metrics" << c.report(ranks);
    EXPECT_EQ(type, "text/plain; version=0.0.4; charset=utf-8");
    std::vector<std::string> errors;
    auto samples = parse(text, &errors);
    EXPECT_TRUE(errors.empty()) << errors.front() << "\n" << text;
    const std::string series = "{job=\"metrics\",generation=\"1\",rank=\"" + std::to_string(d) +
                               "\",op=\"allreduce\",path=\"rank-sockets\",transport=\"tcp\"";
    EXPECT_EQ(samples["gradsync_collectives_total" + series + "}"], 100) << text;
    EXPECT_EQ(samples["gradsync_collective_bytes_total" + series + "}"], 100.0 * 1048576) << text;
    EXPECT_EQ(samples["gradsync_collective_seconds_count" + series + ",size=\"1MiB\"}"], 100) << text;
    EXPECT_EQ(samples["gradsync_collective_seconds_bucket" + series + ",size=\"1MiB\",le=\"+Inf\"}"], 100) << text;
    EXPECT_GT(samples["gradsync_collective_seconds_sum" + series + ",size=\"1MiB\"}"], 0) << text;
    EXPECT_EQ(samples["gradsyncd_jobs{state=\"ready\"}"], 0) << "the job is over" << text;
    EXPECT_EQ(samples.count("gradsyncd_errors_total{kind=\"rank_exit\",peer=\"rank " + std::to_string(d) + "\"}"), 0u)
        << text;
    const std::string why = promtool(text, c.dir(), &promtool_ran);
    EXPECT_EQ(why, "") << text;
    std::printf("[metrics] gradsyncd-%d: %zu samples, parser %s, promtool %s\n", d, samples.size(),
                errors.empty() ? "ok" : "FAILED", promtool_ran ? (why.empty() ? "ok" : "FAILED") : "not installed");
  }

  std::string type;
  std::string text;
  for (int i = 0; i < 100; ++i) {  // both daemons leave the job after their ranks exit
    text = scrape(coordinator_port, &type);
    if (text.find("gradsync_coordinator_jobs{state=\"finished\"} 1") != std::string::npos) break;
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_FALSE(text.empty()) << "no answer from the coordinator's /metrics" << c.report(ranks);
  EXPECT_EQ(type, "text/plain; version=0.0.4; charset=utf-8");
  std::vector<std::string> errors;
  auto samples = parse(text, &errors);
  EXPECT_TRUE(errors.empty()) << errors.front() << "\n" << text;
  EXPECT_EQ(samples["gradsync_coordinator_nodes"], 2) << text;
  EXPECT_EQ(samples["gradsync_coordinator_job_generation{job=\"metrics\",state=\"finished\"}"], 1) << text;
  EXPECT_EQ(samples["gradsync_coordinator_job_ranks{job=\"metrics\",of=\"world\"}"], 2) << text;
  EXPECT_EQ(samples["gradsync_coordinator_join_seconds_count{outcome=\"ok\"}"], 2) << text;
  EXPECT_EQ(samples["gradsync_coordinator_rpcs_total{method=\"JoinJob\",code=\"OK\"}"], 2) << text;
  EXPECT_GE(samples["gradsync_coordinator_rpcs_total{method=\"RegisterNode\",code=\"OK\"}"], 2) << text;
  const std::string why = promtool(text, c.dir(), &promtool_ran);
  EXPECT_EQ(why, "") << text;
  std::printf("[metrics] coordinator: %zu samples, parser %s, promtool %s\n", samples.size(),
              errors.empty() ? "ok" : "FAILED", promtool_ran ? (why.empty() ? "ok" : "FAILED") : "not installed");
}

// gradsyncctl top --once on a running job: both ranks with their path and a rate above zero.
TEST(Metrics, TopShowsRanksPathsAndRates) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto ranks = c.spawn_ranks("busy", 2, 1, {"loop", "4096", "100000000"}, {{"GRADSYNC_TUNE", "0"}});
  for (auto& r : ranks) ASSERT_TRUE(r.wait_for_output("LOOPING", 60s)) << c.report(ranks);
  Process top = c.spawn("gradsyncctl top", {binary("gradsyncctl"), "--coordinator", c.coordinator_address(), "top",
                                            "--once", "--interval-ms", "500"});
  auto st = top.wait_for_exit(15s);
  ASSERT_TRUE(st.has_value()) << c.report({&top});
  const std::string screen = top.output();
  std::printf("[top]\n%s\n", screen.c_str());
  EXPECT_TRUE(st->success()) << screen;
  EXPECT_NE(screen.find("job busy generation 1: active, 2/2 ranks"), std::string::npos) << screen;
  for (int r = 0; r < 2; ++r) {
    // "  RANK HOST PATH CALLS/S MB/S CALLS LAST"
    std::smatch m;
    const std::regex row("\\n +" + std::to_string(r) + " +[^ ]+ +rank-sockets +([0-9.]+) +([0-9.]+) +([0-9]+) ");
    ASSERT_TRUE(std::regex_search(screen, m, row)) << "no row for rank " << r << ":\n" << screen;
    EXPECT_GT(std::stod(m[1]), 0.0) << screen;
    EXPECT_GT(std::stod(m[2]), 0.0) << screen;
    EXPECT_GT(std::stoull(m[3]), 0u) << screen;
  }
}

}  // namespace
}  // namespace gradsync::testing
