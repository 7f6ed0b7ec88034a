// Fail together (issue 17): a failure one rank sees ends the job on every rank within about a
// second, with the reason and the rank at fault, or a statement that it is not known; a rank
// that makes one call more than its peers hears it at once; a daemon killed or paused past its
// lease leaves no rank waiting for its op timeout. Every trainer here runs with a 60 s op
// timeout, so only the failure handling can end their calls within the limits checked.
#include <signal.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

const Env kLongOpTimeout = {{"GRADSYNC_OP_TIMEOUT_MS", "60000"}};

double ms_between(SteadyTime a, SteadyTime b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

bool names_rank(const std::string& line, int rank) {
  return std::regex_search(line, std::regex("\\brank " + std::to_string(rank) + "\\b"));
}

// The error line a worker printed ("FAILED after ...").
std::string failure_line(Process& p) { return line_with(p.output(), "FAILED"); }

// The earliest and latest exit of `procs` (all must have exited).
std::pair<SteadyTime, SteadyTime> exit_span(const std::vector<Process*>& procs) {
  SteadyTime first = SteadyTime::max(), last = SteadyTime::min();
  for (Process* p : procs) {
    first = std::min(first, *p->exit_time());
    last = std::max(last, *p->exit_time());
  }
  return {first, last};
}

std::vector<Process*> pointers(std::vector<Process>& procs) {
  std::vector<Process*> out;
  for (auto& p : procs) out.push_back(&p);
  return out;
}

// `gradsyncctl jobs` on the cluster's coordinator.
std::string ctl_jobs(Cluster& c) {
  Process p = c.spawn("gradsyncctl", {binary("gradsyncctl"), "--coordinator", c.coordinator_address(), "jobs"});
  p.wait_for_exit(20s);
  return p.output();
}

// The state column of `job` in `gradsyncctl jobs`, or "" when it is not listed.
std::string job_state(const std::string& jobs, const std::string& job) {
  std::smatch m;
  if (std::regex_search(jobs, m, std::regex("(^|\\n)" + job + "\\s+[0-9]+\\s+(\\S+)"))) return m[2];
  return "";
}

// One rank makes one collective call more than the others, which finish and leave: it fails
// at once with MISMATCH naming a rank that left, not at its op timeout.
void expect_extra_call_named(Cluster& c, const JobSpec& spec, int extra) {
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(ranks.size(), size_t(spec.world));
  ASSERT_TRUE(wait_all_exit(ranks, 20s)) << c.report(ranks);
  // The others finished their calls, or were still in their last one when the extra call's
  // failure aborted the job: then they end ABORTED naming the rank with the extra call.
  for (int r = 0; r < spec.world; ++r) {
    if (r == extra || ranks[r].exit_status()->success()) continue;
    const std::string line = failure_line(ranks[r]);
    EXPECT_NE(line.find("ABORTED"), std::string::npos) << ranks[r].name() << ": " << line << c.report(ranks);
    EXPECT_TRUE(names_rank(line, extra)) << ranks[r].name() << ": " << line << c.report(ranks);
  }
  Process& odd = ranks[extra];
  const std::string line = failure_line(odd);
  std::printf("[extra-call] %s: %s\n", odd.name().c_str(), line.c_str());
  EXPECT_NE(odd.exit_status()->code, 0) << c.report(ranks);
  EXPECT_NE(line.find("MISMATCH"), std::string::npos) << line << c.report(ranks);
  EXPECT_NE(line.find("left the job"), std::string::npos) << line << c.report(ranks);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex("FAILED after ([0-9]+) ms"))) << line;
  EXPECT_LE(std::stod(m[1]), 1000.0) << "the extra call took " << m[1] << " ms to fail" << c.report(ranks);
}

TEST(ExtraCall, OnOneNodeIsAMismatchNamingTheRankThatLeft) {
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = "extra-local", .world = 3, .ranks_per_daemon = {3}, .args = {"calls", "5", "1"},
               .env = kLongOpTimeout};
  expect_extra_call_named(c, spec, 1);
}

TEST(ExtraCall, AcrossNodesIsAMismatchNamingTheRankThatLeft) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = "extra-remote", .world = 2, .ranks_per_daemon = {1, 1}, .args = {"calls", "5", "0"},
               .env = kLongOpTimeout};
  expect_extra_call_named(c, spec, 0);
}

// Rank 1 calls an allreduce of another count: the rank that receives its data sees MISMATCH,
// and every rank of both nodes ends within 1 s of the first, with an error naming rank 1.
TEST(FailTogether, OneRanksMismatchEndsEveryRankNamingIt) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = "odd-call", .world = 4, .ranks_per_daemon = {2, 2}, .args = {"odd", "5", "1"},
               .env = kLongOpTimeout};
  auto ranks = c.spawn_ranks(spec);
  ASSERT_TRUE(wait_all_exit(ranks, 20s)) << c.report(ranks);
  auto [first, last] = exit_span(pointers(ranks));
  std::printf("[odd-call] every rank exited within %.1f ms of the first\n", ms_between(first, last));
  EXPECT_LE(ms_between(first, last), 1000.0) << c.report(ranks);
  bool mismatch_seen = false;
  for (auto& p : ranks) {
    const std::string line = failure_line(p);
    std::printf("[odd-call] %s: %s\n", p.name().c_str(), line.c_str());
    EXPECT_NE(p.exit_status()->code, 0) << c.report(ranks);
    EXPECT_TRUE(line.find("MISMATCH") != std::string::npos || line.find("ABORTED") != std::string::npos) << line;
    EXPECT_TRUE(names_rank(line, 1)) << "does not name rank 1: " << line << c.report(ranks);
    mismatch_seen |= line.find("count=4095") != std::string::npos;
  }
  EXPECT_TRUE(mismatch_seen) << "no rank's error shows the odd call" << c.report(ranks);
}

// Rank 2 stops (SIGSTOP) with a 3 s op timeout: every survivor ends within a second of the
// first timeout, and no error blames the neighbour that was itself waiting.
TEST(FailTogether, StoppedRankDeadlineBlamesNoWaitingNeighbour) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = "stopped", .world = 4, .ranks_per_daemon = {2, 2}, .args = {"loop", "65536", "100000"},
               .env = {{"GRADSYNC_OP_TIMEOUT_MS", "3000"}}};
  auto ranks = c.spawn_ranks(spec);
  for (auto& r : ranks) ASSERT_TRUE(r.wait_for_output("LOOPING", 60s)) << c.report(ranks);
  ranks[2].kill(SIGSTOP);
  std::vector<Process*> survivors{&ranks[0], &ranks[1], &ranks[3]};
  const bool all = wait_all_exit(survivors, 15s);
  ranks[2].kill(SIGKILL);
  ASSERT_TRUE(all) << c.report(ranks);
  auto [first, last] = exit_span(survivors);
  std::printf("[stopped] survivors exited within %.1f ms of the first\n", ms_between(first, last));
  EXPECT_LE(ms_between(first, last), 1000.0) << c.report(ranks);
  for (Process* p : survivors) {
    const std::string line = failure_line(*p);
    std::printf("[stopped] %s: %s\n", p->name().c_str(), line.c_str());
    // Either the stopped rank is named as the one waited for, or the error says the rank
    // at fault is not known; never "rank N is stuck" about a waiting rank.
    EXPECT_NE(line.find("not known"), std::string::npos) << line << c.report(ranks);
    EXPECT_EQ(line.find("may be stuck"), std::string::npos) << line;
  }
}

// gradsyncd of node 1 is killed -9 while its ranks and node 0's are in large allreduces: node
// 0's ranks, including the one with no connection to node 1, end naming the lost daemon, and
// the coordinator shows the job aborted, not active, once they are gone. Nothing can come from
// the dead daemon: over rank sockets its ranks, which lose their connection to it, tell their
// peers on node 0 through the data path (`named`: "lost the connection to gradsyncd"); through
// the proxy, node 0's daemon finds node 1's port refusing connections ("refuses connections").
// Either way without the 500 ms a broken connection waits for a reason from elsewhere.
void killed_daemon_trial(const std::string& job, const std::vector<std::string>& daemon_args, const std::string& named) {
  Cluster c({.daemons = 2, .daemon_args = daemon_args});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = job, .world = 4, .ranks_per_daemon = {2, 2}, .args = {"loop", "1048576", "100000"},
               .env = kLongOpTimeout};
  auto ranks = c.spawn_ranks(spec);
  for (auto& r : ranks) ASSERT_TRUE(r.wait_for_output("LOOPING", 60s)) << c.report(ranks);
  const SteadyTime killed_at = std::chrono::steady_clock::now();
  c.daemon(1).kill(SIGKILL);
  ASSERT_TRUE(wait_all_exit(ranks, 15s)) << c.report(ranks);
  for (int r = 0; r < 4; ++r) {
    Process& p = ranks[size_t(r)];
    const double ms = ms_between(killed_at, *p.exit_time());
    const std::string line = failure_line(p);
    std::printf("[%s] %s exited %.1f ms after the kill: %s\n", job.c_str(), p.name().c_str(), ms, line.c_str());
    EXPECT_NE(p.exit_status()->code, 0) << c.report(ranks);
    EXPECT_EQ(p.exit_status()->signal, 0) << c.report(ranks);
    // The exit, not the error: unmapping the job's memory and scheduling on a small machine
    // shared with other tests (once 2.4 s at load 16); the chaos runs measure the errors' times.
    EXPECT_LE(ms, 3000.0) << p.name() << c.report(ranks);
    if (r < 2) EXPECT_NE(line.find(named), std::string::npos) << p.name() << ": " << line << c.report(ranks);
  }
  std::string jobs;
  const auto until = std::chrono::steady_clock::now() + 3s;
  do {
    jobs = ctl_jobs(c);
    if (job_state(jobs, job) == "aborted") break;
    std::this_thread::sleep_for(100ms);
  } while (std::chrono::steady_clock::now() < until);
  EXPECT_EQ(job_state(jobs, job), "aborted") << jobs << c.report(ranks);
  EXPECT_TRUE(c.daemon(0).alive());
}

TEST(FailTogether, KilledDaemonEndsTheOtherNodesRanksAtOnce) {
  killed_daemon_trial("daemon-kill", {}, "lost the connection to gradsyncd");
}

TEST(FailTogether, KilledDaemonEndsTheOtherNodesRanksAtOnceThroughTheProxy) {
  killed_daemon_trial("daemon-kill-proxy", {"--proxy-tcp"}, "refuses connections");
}

// gradsyncd of node 1 is paused (SIGSTOP) past its lease of 1 s, then resumed: no rank of the
// job is left waiting; every one has ended with an error within 2 s of the resume.
TEST(FailTogether, DaemonPausedPastItsLeaveLeavesNoRankWaiting) {
  Cluster c({.daemons = 2, .lease_ms = 1000});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec{.job = "daemon-pause", .world = 4, .ranks_per_daemon = {2, 2}, .args = {"loop", "65536", "1000000"},
               .env = kLongOpTimeout};
  auto ranks = c.spawn_ranks(spec);
  for (auto& r : ranks) ASSERT_TRUE(r.wait_for_output("LOOPING", 60s)) << c.report(ranks);
  c.daemon(1).kill(SIGSTOP);
  std::this_thread::sleep_for(3s);
  c.daemon(1).kill(SIGCONT);
  const SteadyTime resumed = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_all_exit(ranks, 10s)) << c.report(ranks);
  for (auto& p : ranks) {
    const std::string line = failure_line(p);
    std::printf("[daemon-pause] %s exited %.1f ms after the resume: %s\n", p.name().c_str(),
                ms_between(resumed, *p.exit_time()), line.c_str());
    EXPECT_NE(p.exit_status()->code, 0) << c.report(ranks);
    EXPECT_LE(ms_between(resumed, *p.exit_time()), 2000.0) << c.report(ranks);
    EXPECT_TRUE(line.find("ABORTED") != std::string::npos || line.find("UNAVAILABLE") != std::string::npos)
        << line << c.report(ranks);
  }
  // The resumed daemon serves the next job.
  auto next = c.spawn_ranks("after-pause", 4, 2, {"check", "0,1,1000"});
  EXPECT_EQ(all_succeeded(next, 60s), "") << c.report(next);
}

}  // namespace
}  // namespace gradsync::testing
