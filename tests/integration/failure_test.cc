// Failure detection (design §6): a dead peer is reported to every survivor, by rank, long
// before any operation timeout; a dead coordinator ends pending joins; a join deadline names
// the ranks that never came. Daemons survive all of it and serve the next job.
#include <signal.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

double ms_between(SteadyTime a, SteadyTime b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// True if `line` names `rank` as a rank ("rank 3", "ranks 2,3", "ranks 1-3" style lists).
bool names_rank(const std::string& line, int rank) {
  const std::regex re("\\branks?[^0-9;]*([0-9]+[-,])*" + std::to_string(rank) + "\\b");
  return std::regex_search(line, re);
}

// Kills one rank of a running 4-rank job (2 daemons x 2 ranks) in the middle of large
// allreduces. With a 60 s op timeout, only failure detection can end the survivors' calls
// within the 10 s this test allows.
TEST(PeerDeath, EverySurvivorNamesTheDeadRankAndDaemonsServeTheNextJob) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "kill-loop";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  spec.args = {"loop", "4194304", "1000"};  // 16 MiB per allreduce: always something in flight
  spec.env = {{"GRADSYNC_OP_TIMEOUT_MS", "60000"}};
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(ranks.size(), 4u);
  for (auto& r : ranks) {
    ASSERT_TRUE(r.wait_for_output("LOOPING", 60s)) << r.name() << " never looped" << c.report(ranks);
  }

  constexpr int kVictim = 2;
  const SteadyTime killed_at = std::chrono::steady_clock::now();
  ranks[kVictim].kill(SIGKILL);
  std::vector<Process*> survivors;
  for (int r = 0; r < 4; ++r) {
    if (r != kVictim) survivors.push_back(&ranks[r]);
  }
  wait_all_exit(survivors, 10s);
  ranks[kVictim].wait_for_exit(5s);

  double worst = 0;
  for (Process* p : survivors) {
    SCOPED_TRACE(p->name());
    ASSERT_TRUE(p->exit_status().has_value())
        << p->name() << " still running 10 s after rank 2 was killed" << c.report(ranks);
    const double latency = ms_between(killed_at, *p->exit_time());
    worst = std::max(worst, latency);
    std::printf("[detection] %s exited %.1f ms after rank %d was killed (%s)\n", p->name().c_str(),
                latency, kVictim, p->exit_status()->describe().c_str());
    ::testing::Test::RecordProperty("detection_ms_" + p->name().substr(5), std::to_string(latency));
    EXPECT_LE(latency, 10'000.0);
    EXPECT_NE(p->exit_status()->code, 0) << p->exit_status()->describe() << c.report(ranks);
    EXPECT_EQ(p->exit_status()->signal, 0) << "a survivor crashed" << c.report(ranks);
    const std::string line = line_with(p->output(), "FAILED");
    EXPECT_TRUE(names_rank(line, kVictim))
        << "the error does not name the dead rank " << kVictim << ": '" << line << "'" << c.report(ranks);
  }
  ::testing::Test::RecordProperty("detection_ms_worst", std::to_string(worst));
  EXPECT_TRUE(c.daemon(0).alive()) << c.report(ranks);
  EXPECT_TRUE(c.daemon(1).alive()) << c.report(ranks);
  EXPECT_TRUE(c.coordinator().alive()) << c.report(ranks);

  // The same daemons run a fresh job.
  auto next = c.spawn_ranks("after-kill", 4, 2, {"check", "0,1,1000"});
  std::string problems = all_succeeded(next, 60s);
  EXPECT_EQ(problems, "") << c.report(next);
}

// Two of four ranks are blocked in join (the other two never come) when the coordinator dies.
TEST(CoordinatorDeath, PendingJoinsFailPromptlyAsUnavailable) {
  // Debug logging makes the coordinator say when a node's join arrived.
  Cluster c({.daemons = 2, .coordinator_args = {"--log-level", "debug"}});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "orphaned";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  spec.skip = {2, 3};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "60000"}};
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(ranks.size(), 2u);
  // "job=orphaned gen=1 node=node0-1 joined ranks 0,1 (2/4 in)"
  ASSERT_TRUE(c.coordinator().wait_for_output("(2/4 in)", 20s))
      << "the daemon's join never reached the coordinator" << c.report(ranks);

  const SteadyTime killed_at = std::chrono::steady_clock::now();
  c.kill_coordinator();
  wait_all_exit(ranks, 10s);
  for (auto& p : ranks) {
    SCOPED_TRACE(p.name());
    ASSERT_TRUE(p.exit_status().has_value())
        << p.name() << " still blocked in join 10 s after the coordinator died" << c.report(ranks);
    const double latency = ms_between(killed_at, *p.exit_time());
    std::printf("[coordinator-death] %s exited %.1f ms after the coordinator was killed\n",
                p.name().c_str(), latency);
    ::testing::Test::RecordProperty("coordinator_death_ms_" + p.name().substr(5), std::to_string(latency));
    EXPECT_NE(p.exit_status()->code, 0) << c.report(ranks);
    EXPECT_EQ(p.exit_status()->signal, 0) << c.report(ranks);
    const std::string line = line_with(p.output(), "join:");
    EXPECT_NE(line.find("UNAVAILABLE"), std::string::npos) << "'" << line << "'" << c.report(ranks);
    EXPECT_TRUE(std::regex_search(line, std::regex("coordinator.*(unreachable|unavailable)", std::regex::icase)))
        << "the error does not say the coordinator is unreachable: '" << line << "'" << c.report(ranks);
  }
  EXPECT_TRUE(c.daemon(0).alive()) << c.report(ranks);
  EXPECT_TRUE(c.daemon(1).alive()) << c.report(ranks);
}

// Checks that every process of `ranks` failed its join with DEADLINE_EXCEEDED naming `missing`,
// no sooner than the join timeout and within `limit` of `start`.
void expect_join_deadline(Cluster& c, std::vector<Process>& ranks, SteadyTime start, Millis timeout,
                          Millis limit, int missing) {
  wait_all_exit(ranks, limit);
  for (auto& p : ranks) {
    SCOPED_TRACE(p.name());
    ASSERT_TRUE(p.exit_status().has_value()) << p.name() << " still joining" << c.report(ranks);
    const double took = ms_between(start, *p.exit_time());
    std::printf("[join-deadline] %s failed after %.1f ms (join timeout %lld ms)\n", p.name().c_str(),
                took, static_cast<long long>(timeout.count()));
    EXPECT_GE(took, static_cast<double>(timeout.count()) * 0.9);
    // The join timeout is the user's deadline: allow scheduling noise, not seconds of slack.
    EXPECT_LE(took, static_cast<double>(timeout.count()) + 2000.0)
        << p.name() << " failed " << took - static_cast<double>(timeout.count())
        << " ms after its join timeout";
    EXPECT_NE(p.exit_status()->code, 0) << c.report(ranks);
    const std::string line = line_with(p.output(), "join:");
    EXPECT_NE(line.find("DEADLINE_EXCEEDED"), std::string::npos) << "'" << line << "'" << c.report(ranks);
    EXPECT_TRUE(names_rank(line, missing))
        << "the error does not name the missing rank " << missing << ": '" << line << "'" << c.report(ranks);
  }
}

// Rank 3 would be the only rank of the third node, which never joins.
TEST(JoinDeadline, MissingNodeIsNamed) {
  Cluster c({.daemons = 3});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "three-of-four";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 1, 1};
  spec.skip = {3};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "2000"}};
  const SteadyTime start = std::chrono::steady_clock::now();
  auto ranks = c.spawn_ranks(spec);
  expect_join_deadline(c, ranks, start, 2000ms, 12s, 3);
}

// Rank 3 would share node 1 with rank 2 (LOCAL_WORLD_SIZE=2): node 1 never completes its
// local set, so rank 2 waits in its daemon while ranks 0 and 1 wait at the coordinator.
TEST(JoinDeadline, MissingLocalRankIsNamed) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "three-of-four-local";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  spec.skip = {3};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "2000"}};
  const SteadyTime start = std::chrono::steady_clock::now();
  auto ranks = c.spawn_ranks(spec);
  expect_join_deadline(c, ranks, start, 2000ms, 12s, 3);
}

}  // namespace
}  // namespace gradsync::testing

namespace gradsync::testing {
namespace {

// Communicator::abort on one rank ends the job on every rank, naming the rank and reason.
TEST(UserAbort, OneRankAbortsTheJobEverywhere) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto ranks = c.spawn_ranks("user-abort", 4, 2, {"abort"}, {{"GRADSYNC_OP_TIMEOUT_MS", "60000"}});
  std::string failures = all_succeeded(ranks, Millis(10'000), "ABORT-SEEN");
  EXPECT_EQ(failures, "") << c.report(ranks);
  EXPECT_TRUE(c.daemon(0).alive());
  EXPECT_TRUE(c.daemon(1).alive());
}

}  // namespace
}  // namespace gradsync::testing
