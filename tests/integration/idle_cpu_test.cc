// Waiting must not burn CPU (design §2: "a machine with two cores and six processes must not
// starve"): a coordinator, two daemons and four trainers, one of them blocked in an
// allreduce the others have not entered yet, together use under 5% of one core.
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// utime + stime of a process (all its threads), in clock ticks; fields 14 and 15 of
// /proc/PID/stat.
std::optional<long long> cpu_ticks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  // The command name (field 2) is in parentheses and may contain spaces: skip past it.
  auto close = stat.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoll(field);
    if (i == 15) stime = std::stoll(field);
  }
  return utime + stime;
}

// On-CPU time of every thread of a process in ns (first field of each
// /proc/PID/task/TID/schedstat): finer than the 10 ms ticks, printed for the report.
long long cpu_ns(pid_t pid) {
  long long total = 0;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    long long ns = 0;
    if (in >> ns) total += ns;
  }
  return total;
}

TEST(IdleCpu, WaitingProcessesStayUnderFivePercentOfOneCore) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "idle";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  spec.args = {"idle"};
  spec.stdin_pipe = true;
  spec.env = {{"GRADSYNC_OP_TIMEOUT_MS", "120000"}};
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(ranks.size(), 4u);
  for (auto& r : ranks) {
    ASSERT_TRUE(r.wait_for_output("JOINED", 30s)) << r.name() << c.report(ranks);
  }

  std::vector<Process*> all = {&c.coordinator(), &c.daemon(0), &c.daemon(1)};
  for (auto& r : ranks) all.push_back(&r);
  const long hz = ::sysconf(_SC_CLK_TCK);
  constexpr auto kWindow = 3s;

  std::vector<long long> before, before_ns;
  for (Process* p : all) {
    auto t = cpu_ticks(p->pid());
    ASSERT_TRUE(t.has_value()) << p->name() << " is gone" << c.report(ranks);
    before.push_back(*t);
    before_ns.push_back(cpu_ns(p->pid()));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(kWindow);  // the measurement window, not a synchronisation
  std::vector<long long> after, after_ns;
  for (Process* p : all) {
    auto t = cpu_ticks(p->pid());
    ASSERT_TRUE(t.has_value()) << p->name() << " exited during the idle window" << c.report(ranks);
    after.push_back(*t);
    after_ns.push_back(cpu_ns(p->pid()));
  }
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  double total = 0, total_precise = 0;
  std::printf("[idle-cpu] window %.2f s, %ld ticks/s; %% of one core from utime+stime "
              "(schedstat, ns-precise, in brackets)\n", wall_s, hz);
  for (size_t i = 0; i < all.size(); ++i) {
    const double pct = 100.0 * static_cast<double>(after[i] - before[i]) / static_cast<double>(hz) / wall_s;
    const double precise = 100.0 * static_cast<double>(after_ns[i] - before_ns[i]) / 1e9 / wall_s;
    total += pct;
    total_precise += precise;
    std::printf("[idle-cpu] %-14s pid %-7d %5.2f%%  [%6.3f%%]\n", all[i]->name().c_str(),
                all[i]->pid(), pct, precise);
    std::string key = "idle_cpu_percent_" + all[i]->name();
    for (char& ch : key) ch = (ch == ' ' || ch == '-') ? '_' : ch;
    ::testing::Test::RecordProperty(key, std::to_string(pct));
  }
  std::printf("[idle-cpu] total                      %5.2f%%  [%6.3f%%]\n", total, total_precise);
  ::testing::Test::RecordProperty("idle_cpu_percent_total", std::to_string(total));
  ::testing::Test::RecordProperty("idle_cpu_percent_total_schedstat", std::to_string(total_precise));
  EXPECT_LT(total, 5.0) << "7 idle processes used " << total << "% of one core";
  // Rank 0 was blocked in its allreduce the whole time.
  EXPECT_EQ(ranks[0].output().find("PASS"), std::string::npos) << c.report(ranks);

  // Let the others in: the allreduce completes everywhere.
  for (auto& r : ranks) r.close_stdin();
  std::string problems = all_succeeded(ranks, 60s);
  EXPECT_EQ(problems, "") << c.report(ranks);
}

}  // namespace
}  // namespace gradsync::testing
