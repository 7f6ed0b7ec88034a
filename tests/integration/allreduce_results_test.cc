// Exact allreduce results through the real processes: coordinator, daemons (one "node" each,
// on loopback) and trainer processes. Inputs are small integer-valued floats, so the sum is
// exact in any order and the worker compares every element with ==.
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

TEST(AllreduceResults, FourRanksOnTwoDaemons) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  // 1048579 = 1 MiB of floats + 3: several slot-sized pipeline rounds and a ragged tail.
  auto ranks = c.spawn_ranks("exact-4", 4, 2, {"check", "0,1,3,1000,1048579"});
  std::string problems = all_succeeded(ranks, 120s);
  EXPECT_EQ(problems, "") << c.report(ranks);
  for (auto& r : ranks) {
    EXPECT_NE(r.output().find("count=1048579 inplace=0 ok"), std::string::npos) << r.name();
  }
  // Every rank left cleanly, so both daemons flush and tear the job down as finished (not
  // aborted), and the coordinator sees every node leave.
  for (int d = 0; d < 2; ++d) {
    EXPECT_TRUE(c.daemon(d).wait_for_output("job=exact-4 gen=1 torn down (finished)", 10s))
        << "gradsyncd-" << d << " did not finish the job cleanly" << c.report(ranks);
    EXPECT_EQ(c.daemon(d).output().find("aborted"), std::string::npos) << c.report(ranks);
  }
  EXPECT_TRUE(c.coordinator().wait_for_output("job=exact-4 gen=1 finished", 10s)) << c.report(ranks);
}

struct Placement {
  std::vector<int> ranks_per_daemon;  // one entry per daemon
  int world() const { return std::accumulate(ranks_per_daemon.begin(), ranks_per_daemon.end(), 0); }
};

void PrintTo(const Placement& p, std::ostream* os) {
  *os << "ranks per daemon {";
  for (size_t i = 0; i < p.ranks_per_daemon.size(); ++i) *os << (i ? "," : "") << p.ranks_per_daemon[i];
  *os << "}";
}

using WorldParam = std::tuple<Placement, std::string>;  // placement, GRADSYNC_ALGO

std::string param_name(const ::testing::TestParamInfo<WorldParam>& info) {
  const Placement& p = std::get<0>(info.param);
  std::string name = "world" + std::to_string(p.world()) + "_";
  for (size_t i = 0; i < p.ranks_per_daemon.size(); ++i) {
    name += (i ? "x" : "") + std::to_string(p.ranks_per_daemon[i]);
  }
  return name + "_" + std::get<1>(info.param);
}

class AllreduceWorlds : public ::testing::TestWithParam<WorldParam> {};

TEST_P(AllreduceWorlds, ExactForEveryCount) {
  const auto& [p, algo] = GetParam();
  Cluster c({.daemons = static_cast<int>(p.ranks_per_daemon.size())});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  JobSpec spec;
  spec.job = "exact-" + param_name({GetParam(), 0});
  spec.world = p.world();
  spec.ranks_per_daemon = p.ranks_per_daemon;
  spec.args = {"check", "0,1,2,3,7,1000,65537"};
  spec.env = {{"GRADSYNC_ALGO", algo}};
  auto ranks = c.spawn_ranks(spec);
  std::string problems = all_succeeded(ranks, 120s);
  EXPECT_EQ(problems, "") << c.report(ranks);
}

// One and two daemons, even and uneven splits; both algorithms.
INSTANTIATE_TEST_SUITE_P(
    Placements, AllreduceWorlds,
    ::testing::Combine(::testing::Values(Placement{{1}}, Placement{{2}}, Placement{{1, 1}},
                                         Placement{{2, 1}}, Placement{{1, 2}}, Placement{{3, 2}},
                                         Placement{{5}}),
                       ::testing::Values(std::string("ring"), std::string("tree"))),
    param_name);

}  // namespace
}  // namespace gradsync::testing
