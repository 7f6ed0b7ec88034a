// The collectives suite across processes and two daemons (the proxy in the path): every type
// and op of every collective, through gradsync-bench's data check, which compares each
// rank's result with a float64/int64 reference of the whole reduction (#wrong must be 0).
#include <gtest/gtest.h>

#include "cluster.h"

namespace gradsync::testing {
namespace {

struct Case {
  const char* collective;
  const char* algo;
};

class CollectivesAcrossProcesses : public ::testing::TestWithParam<Case> {};

TEST_P(CollectivesAcrossProcesses, EveryTypeAndOpIsExactOrWithinTolerance) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = std::string("suite-") + GetParam().collective + "-" + GetParam().algo;
  spec.world = 4;
  spec.ranks_per_daemon = {2, 2};
  spec.program = "gradsync-bench";
  // Sizes from a few elements to several pipeline pieces; one checked call each.
  spec.args = {"-b", "8", "-e", "4M", "-f", "64", "-d", "all", "-c", "1", "-n", "1", "-w", "0",
               "--collective", GetParam().collective, "--algo", GetParam().algo};
  if (std::string(GetParam().collective) != "all_gather" &&
      std::string(GetParam().collective) != "broadcast") {
    spec.args.insert(spec.args.end(), {"-o", "all"});
  }
  auto ranks = c.spawn_ranks(spec);
  std::string failures = all_succeeded(ranks, Millis(240'000), "");
  EXPECT_EQ(failures, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("# Errors: 0 wrong elements, 0 failed runs"), std::string::npos)
      << ranks[0].output();
}

// --timing median (the CPU anchors' method: a barrier before each call, the median call) runs
// the same checked table; a bad value is refused before anything starts.
TEST(GradsyncBench, MedianTimingAcrossTwoDaemons) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "bench-median";
  spec.world = 2;
  spec.ranks_per_daemon = {1, 1};
  spec.program = "gradsync-bench";
  spec.args = {"-b", "1K", "-e", "1M", "-f", "32", "-c", "1", "-n", "5", "-w", "1", "--inplace", "0",
               "--timing", "median"};
  auto ranks = c.spawn_ranks(spec);
  ASSERT_EQ(all_succeeded(ranks, Millis(120'000), ""), "") << c.report(ranks);
  const std::string out = ranks[0].output();
  EXPECT_NE(out.find("# Errors: 0 wrong elements, 0 failed runs"), std::string::npos) << out;
  EXPECT_NE(out.find("     1048576 "), std::string::npos) << out;  // every size has its row

  Process bad = c.spawn("bad-timing", {binary("gradsync-bench"), "--timing", "fastest"});
  auto st = bad.wait_for_exit(Millis(10'000));
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->code, 2) << bad.output();
  EXPECT_NE(bad.output().find("--timing"), std::string::npos) << bad.output();
}

INSTANTIATE_TEST_SUITE_P(Suite, CollectivesAcrossProcesses,
                         ::testing::Values(Case{"allreduce", "ring"}, Case{"allreduce", "tree"},
                                           Case{"reduce_scatter", "ring"}, Case{"all_gather", "ring"},
                                           Case{"broadcast", "ring"}),
                         [](const auto& info) {
                           return std::string(info.param.collective) + "_" + info.param.algo;
                         });

}  // namespace
}  // namespace gradsync::testing
