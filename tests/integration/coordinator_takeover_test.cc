// Issue 17, acceptance 5: two coordinators elected through a real etcd (started here on free
// ports with a temporary data directory), two daemons given both addresses, a running 4-rank
// job. The leader is killed with -9 mid-job: the job goes on, the standby takes over within one
// etcd lease, `gradsyncctl describe` and `abort` of the running job work through the new
// leader, and a new job is accepted within 1 s of the takeover. Prints the measured times.
// Skips (with a message) where no `etcd` binary is installed; CI installs etcd-server.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "cluster.h"
#include "etcd_process.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;
using WallTime = std::chrono::system_clock::time_point;

// The wall-clock time of a log line "2026-12-02T05:41:59.087 I [coordinator] ..." holding `needle`.
std::optional<WallTime> logged_at(const std::string& text, const std::string& needle) {
  const std::string line = line_with(text, needle);
  std::tm tm{};
  int ms = 0;
  if (line.size() < 23 || !strptime(line.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) || std::sscanf(line.c_str() + 20, "%3d", &ms) != 1) {
    return std::nullopt;
  }
  return std::chrono::system_clock::from_time_t(timegm(&tm)) + std::chrono::milliseconds(ms);
}

long ms_between(WallTime a, WallTime b) {
  return long(std::chrono::duration_cast<std::chrono::milliseconds>(b - a).count());
}

TEST(CoordinatorTakeover, LeaderKilledMidJob) {
  if (!EtcdProcess::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server): skipping the takeover test";
  ::setenv("GRADSYNC_CLUSTER_SECRET", kTestClusterSecret, 0);
  ::setenv("GRADSYNC_OPERATOR_TOKEN", kTestOperatorToken, 0);
  EtcdProcess etcd;
  ASSERT_TRUE(etcd.ok()) << etcd.error();

  const std::string store = "etcd://" + etcd.address() + "/takeover-test";
  const std::string a = "127.0.0.1:" + std::to_string(free_loopback_port());
  const std::string b = "127.0.0.1:" + std::to_string(free_loopback_port());
  auto coordinator = [&](const std::string& name, const std::string& listen) {
    return Process::start({name,
                           {binary("gradsync-coordinator"), "--listen", listen, "--store", store,
                            "--election-ttl-s", "2", "--lease-ms", "5000"},
                           {},
                           etcd.dir() + "/" + name + ".log"});
  };
  Process leader = coordinator("coordinator-a", a);
  ASSERT_TRUE(leader.wait_for_output("serving as the leader", 20s)) << leader.output();
  Process standby = coordinator("coordinator-b", b);
  ASSERT_TRUE(standby.wait_for_output("standing by: the leader is " + a, 20s)) << standby.output();

  Cluster c({.daemons = 2, .external_coordinators = a + "," + b});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto report = [&](const std::vector<Process>& extra = {}) {
    return c.report(extra) + "===== coordinator-a =====\n" +
           leader.output() + "===== coordinator-b =====\n" + standby.output();
  };

  auto job = c.spawn_ranks("steady", 4, 2, {"paced", "1024"});
  for (auto& r : job) ASSERT_TRUE(r.wait_for_output("ITER 50", 30s)) << report(job);
  // The job's record (written when it became active) is in etcd well before this.
  std::this_thread::sleep_for(300ms);

  const WallTime killed = std::chrono::system_clock::now();
  leader.kill(SIGKILL);
  ASSERT_TRUE(leader.wait_for_exit(5s).has_value());
  // A new job started while there is no leader: its daemons' joins move to the new one.
  auto fresh = c.spawn_ranks("fresh", 2, 1, {"check", "0,1,1000"});

  ASSERT_TRUE(standby.wait_for_output("serving as the leader", 10s)) << report(job);
  const auto took_over = logged_at(standby.output(), "serving as the leader");
  ASSERT_TRUE(took_over.has_value()) << standby.output();
  const long takeover_ms = ms_between(killed, *took_over);

  EXPECT_EQ(all_succeeded(fresh, 30s), "") << report(fresh);
  const auto accepted = logged_at(standby.output(), "job=fresh gen=1 complete");
  ASSERT_TRUE(accepted.has_value()) << standby.output();
  const long accept_ms = ms_between(*took_over, *accepted);

  // The running job goes on: every rank gets 50 iterations further after the takeover.
  std::vector<std::string> next;
  for (auto& r : job) {
    std::string out = r.output();
    const size_t at = out.rfind("ITER ");
    const int last = at == std::string::npos ? 0 : std::atoi(out.c_str() + at + 5);
    ASSERT_TRUE(r.wait_for_output("ITER " + std::to_string(last + 100), 20s)) << report(job);
  }

  // describe and abort of the running job through the new leader (gradsyncctl finds it in the list).
  const std::string list = a + "," + b;
  Process describe = c.spawn("describe", {binary("gradsyncctl"), "--coordinator", list, "describe", "steady"});
  ASSERT_TRUE(describe.wait_for_exit(10s).has_value());
  EXPECT_TRUE(describe.exit_status()->success()) << describe.output();
  EXPECT_NE(describe.output().find("job steady generation 1: active, 4 of 4 ranks joined"), std::string::npos)
      << describe.output();
  const auto abort_at = std::chrono::steady_clock::now();
  Process abort = c.spawn("abort", {binary("gradsyncctl"), "--coordinator", list, "abort", "steady", "--reason",
                                    "takeover test"});
  ASSERT_TRUE(abort.wait_for_exit(10s).has_value());
  EXPECT_TRUE(abort.exit_status()->success()) << abort.output();
  ASSERT_TRUE(wait_all_exit(job, 10s)) << report(job);
  long abort_ms = 0;
  for (auto& r : job) {
    EXPECT_EQ(r.exit_status()->code, 1) << report(job);
    EXPECT_NE(r.output().find("aborted by an operator: takeover test"), std::string::npos) << r.output();
    abort_ms = std::max<long>(abort_ms, long(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                 *r.exit_time() - abort_at).count()));
  }
  // The daemons kept their node ids: the new leader registered nobody.
  EXPECT_EQ(standby.output().find("registered node="), std::string::npos) << standby.output();

  std::printf("takeover: leader killed -> standby serving %ld ms (etcd lease 2 s); new job accepted %ld ms after "
              "the takeover; abort through the new leader -> every rank out %ld ms\n",
              takeover_ms, accept_ms, abort_ms);
  EXPECT_LE(takeover_ms, 2000 + 1000) << "the standby took longer than one lease (2 s) plus 1 s of slack";
  EXPECT_LE(accept_ms, 1000) << report(fresh);
}

// One coordinator on etcd, killed -9 and started again on the same port: it waits for its old
// lease to expire, loads the running job and the nodes, and serves them; a new job started as
// soon as it serves is accepted at once (issue 17 saw about 7 s of "Connection refused" there:
// the daemons' channels waited out gRPC's 30 s DNS re-resolution cooldown). With one
// coordinator a join made while it is down fails at once (failure_test), as before.
TEST(CoordinatorTakeover, RestartedCoordinatorLoadsRunningJobs) {
  if (!EtcdProcess::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server): skipping the restart test";
  ::setenv("GRADSYNC_CLUSTER_SECRET", kTestClusterSecret, 0);
  ::setenv("GRADSYNC_OPERATOR_TOKEN", kTestOperatorToken, 0);
  EtcdProcess etcd;
  ASSERT_TRUE(etcd.ok()) << etcd.error();
  const std::string address = "127.0.0.1:" + std::to_string(free_loopback_port());
  int started = 0;
  auto coordinator = [&] {
    return Process::start({"coordinator",
                           {binary("gradsync-coordinator"), "--listen", address, "--store",
                            "etcd://" + etcd.address() + "/restart-test", "--election-ttl-s", "2"},
                           {},
                           etcd.dir() + "/coordinator-" + std::to_string(++started) + ".log"});
  };
  Process first = coordinator();
  ASSERT_TRUE(first.wait_for_output("serving as the leader", 20s)) << first.output();
  Cluster c({.daemons = 2, .external_coordinators = address});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto job = c.spawn_ranks("steady", 4, 2, {"paced", "1024"});
  for (auto& r : job) ASSERT_TRUE(r.wait_for_output("ITER 50", 30s)) << c.report(job) << first.output();
  std::this_thread::sleep_for(300ms);

  first.kill(SIGKILL);
  ASSERT_TRUE(first.wait_for_exit(5s).has_value());
  std::this_thread::sleep_for(1s);  // the daemons' channels see the refused connections
  const WallTime restarted = std::chrono::system_clock::now();
  Process second = coordinator();
  ASSERT_TRUE(second.wait_for_output("serving as the leader", 10s)) << second.output();
  auto fresh = c.spawn_ranks("fresh", 2, 1, {"check", "0,1,1000"});
  EXPECT_NE(second.output().find("restored job=steady gen=1 (active, 4 rank(s) on 2 node(s))"), std::string::npos)
      << second.output();
  EXPECT_EQ(all_succeeded(fresh, 30s), "") << c.report(fresh) << second.output();
  const auto serving = logged_at(second.output(), "serving as the leader");
  const auto accepted = logged_at(second.output(), "job=fresh gen=1 complete");
  ASSERT_TRUE(serving && accepted) << second.output();

  Process abort = c.spawn("abort", {binary("gradsyncctl"), "--coordinator", address, "abort", "steady"});
  ASSERT_TRUE(abort.wait_for_exit(10s).has_value());
  EXPECT_TRUE(abort.exit_status()->success()) << abort.output();
  ASSERT_TRUE(wait_all_exit(job, 10s)) << c.report(job);
  for (auto& r : job) EXPECT_NE(r.output().find("aborted by an operator"), std::string::npos) << r.output();
  EXPECT_EQ(second.output().find("registered node="), std::string::npos) << second.output();
  std::printf("restart: started again -> serving %ld ms (waits out the dead one's 2 s lease); new job accepted "
              "%ld ms after it serves\n",
              ms_between(restarted, *serving), ms_between(*serving, *accepted));
  EXPECT_LE(ms_between(*serving, *accepted), 1000);
}

}  // namespace
}  // namespace gradsync::testing
