// The flight recorder (issue 19): a 4-rank job on 2 daemons where rank 2 stops calling after
// collective 57. `gradsyncctl trace JOB`, run at once, must come back within 5 s naming rank 2
// as behind, collective 58 as the one it never entered, and ranks 0, 1 and 3 as waiting in it
// for rank 2, with each rank's last entries; each daemon writes its ranks' recorders to its log
// directory. After rank 2 is killed, the daemons' dumps of the abort are there too.
#include <signal.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// The dump files (trace-*.txt) in `dir` whose text contains `needle`.
std::vector<std::string> dumps_with(const std::string& dir, const std::string& needle) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("trace-", 0) != 0) continue;
    std::ifstream f(e.path());
    std::stringstream text;
    text << f.rdbuf();
    if (text.str().find(needle) != std::string::npos) out.push_back(e.path().string());
  }
  return out;
}

TEST(FlightRecorder, TraceNamesTheRankThatStoppedAndWhoWaitsForIt) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "stuck";
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  // Rank 2 makes collectives 0..57 (58 calls; no start-up tuning, so the numbers are the
  // calls'); the others enter 58 and wait there until the test kills rank 2.
  spec.args = {"stall", "1024", "58", "2"};
  spec.env = {{"GRADSYNC_TUNE", "0"}, {"GRADSYNC_OP_TIMEOUT_MS", "120000"}};
  spec.stdin_pipe = true;
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(ranks.size(), 4u);
  ASSERT_TRUE(ranks[2].wait_for_output("STALLED", 60s)) << c.report(ranks);
  for (int r : {0, 1, 3}) {
    ASSERT_TRUE(ranks[r].wait_for_output("ENTERING 58", 20s)) << ranks[r].name() << c.report(ranks);
  }
  std::this_thread::sleep_for(200ms);  // into the collective's first wait

  const auto t0 = std::chrono::steady_clock::now();
  Process ctl = c.spawn("gradsyncctl trace",
                        {binary("gradsyncctl"), "--coordinator", c.coordinator_address(), "trace", "stuck", "--last", "3"});
  auto st = ctl.wait_for_exit(10s);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(st.has_value()) << "gradsyncctl trace still running after 10 s" << c.report({&ctl});
  const std::string out = ctl.output();
  std::printf("[trace] gradsyncctl trace took %.2f s:\n%s\n", secs, out.c_str());
  ::testing::Test::RecordProperty("trace_seconds", std::to_string(secs));
  EXPECT_TRUE(st->success()) << st->describe() << out;
  EXPECT_LT(secs, 5.0) << out;
  EXPECT_NE(out.find("flight recorders of 4 rank(s)"), std::string::npos) << out << c.report(ranks);
  EXPECT_NE(out.find("rank 2 is behind: last entered #57 allreduce count=1024 float32 sum"), std::string::npos)
      << out;
  EXPECT_NE(out.find("never entered collective #58"), std::string::npos) << out;
  EXPECT_NE(out.find("ranks 0, 1, 3 wait in collective #58 for rank 2"), std::string::npos) << out;
  // Each rank's last entries: rank 2's ends with 57 done; the others' with 58 started.
  EXPECT_NE(out.find("rank 2 (host"), std::string::npos) << out;
  EXPECT_NE(out.find("#57 allreduce count=1024 float32 sum"), std::string::npos) << out;
  EXPECT_NE(out.find("#58 allreduce count=1024 float32 sum"), std::string::npos) << out;
  EXPECT_NE(out.find(": started"), std::string::npos) << out;
  EXPECT_NE(out.find("waiting for rank"), std::string::npos) << out;
  // gradsyncctl top shows the same job: every rank, its path, 58 calls done, rank 0 inside #58.
  Process top = c.spawn("gradsyncctl top", {binary("gradsyncctl"), "--coordinator", c.coordinator_address(), "top",
                                            "--once", "--interval-ms", "200", "stuck"});
  auto top_st = top.wait_for_exit(15s);
  ASSERT_TRUE(top_st.has_value()) << "gradsyncctl top --once still running" << c.report({&top});
  const std::string screen = top.output();
  std::printf("[top]\n%s\n", screen.c_str());
  EXPECT_TRUE(top_st->success()) << screen;
  EXPECT_NE(screen.find("job stuck generation 1: active, 4/4 ranks"), std::string::npos) << screen;
  EXPECT_NE(line_with(screen, "#57 allreduce done").find("rank-sockets"), std::string::npos) << screen;
  EXPECT_NE(line_with(screen, "#58 allreduce started (waiting for").find(" 58 "), std::string::npos) << screen;
  // top asks quietly: still only the trace's two dumps.

  // On demand: both daemons wrote their ranks' recorders to the log directory (here the
  // sockets' directory, the default).
  EXPECT_EQ(dumps_with(c.dir(), "gradsyncctl trace (on demand)").size(), 2u) << out;

  // A crash: the daemons abort the job and dump the recorders with the reason.
  ranks[2].kill(SIGKILL);
  ranks[2].wait_for_exit(5s);
  std::vector<Process*> survivors{&ranks[0], &ranks[1], &ranks[3]};
  EXPECT_TRUE(wait_all_exit(survivors, 20s)) << c.report(ranks);
  std::vector<std::string> crash;
  for (int i = 0; i < 100 && crash.size() < 2; ++i) {
    // One daemon saw its rank die, the other heard it from the coordinator ("aborted by node ...").
    crash = dumps_with(c.dir(), "written because: the job was aborted: ");
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_EQ(crash.size(), 2u) << "expected one dump of the abort per daemon" << c.report(ranks);
  bool has_rank2 = false;
  for (const auto& path : crash) {
    std::ifstream f(path);
    std::stringstream text;
    text << f.rdbuf();
    EXPECT_NE(text.str().find("rank 2 (pid"), std::string::npos) << "the abort's reason names rank 2: " << text.str();
    if (text.str().find("rank 2 (host") != std::string::npos) {
      has_rank2 = true;
      EXPECT_NE(text.str().find("process no longer connected"), std::string::npos) << text.str();
      EXPECT_NE(text.str().find("#57 allreduce"), std::string::npos) << text.str();
    }
  }
  EXPECT_TRUE(has_rank2) << "no dump holds the dead rank's recorder";
}

}  // namespace
}  // namespace gradsync::testing
