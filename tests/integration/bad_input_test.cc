// Bad input is refused with a clear error before anything is sent (design §6): bad buffers
// and counts in the library, bad joins in the library, the daemon and the coordinator.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Both ranks make the same bad calls, then one good allreduce: had a refused call sent
// anything, the good one would see a stray slot or a sequence mismatch.
TEST(BadInput, RefusedCallsSendNothing) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto ranks = c.spawn_ranks("bad-calls", 2, 1, {"badinput"});
  std::string problems = all_succeeded(ranks, 60s);
  EXPECT_EQ(problems, "") << c.report(ranks);
  for (auto& r : ranks) {
    SCOPED_TRACE(r.name());
    const std::string out = r.output();
    EXPECT_TRUE(has(line_with(out, "refused null buffer count=5:"), "INVALID_ARGUMENT")) << out;
    EXPECT_TRUE(has(line_with(out, "refused count=SIZE_MAX/2:"), "INVALID_ARGUMENT")) << out;
    EXPECT_TRUE(has(line_with(out, "refused count=SIZE_MAX/2:"), "overflow")) << out;
    EXPECT_TRUE(has(out, "count=1000 inplace=0 ok")) << out;
  }
}

class BadJoin : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(c_.ok()) << c_.error() << c_.report(); }

  // One trainer on daemon `d` with `env` on top of a normal rank environment.
  Process start(const std::string& job, std::vector<std::string> args, Env env, int d = 0) {
    JobSpec spec;
    spec.job = job;
    spec.world = 2;
    Env full = c_.rank_env(spec, 0, d, 0, 1);
    for (const auto& [k, v] : env) full[k] = v;
    args.insert(args.begin(), binary("allreduce_worker"));
    return c_.spawn("trainer " + job + " " + args[1], args, full);
  }

  // The process fails its join promptly with `code`; returns its "join:" line.
  std::string expect_join_error(Process& p, const std::string& code) {
    auto st = p.wait_for_exit(20s);
    EXPECT_TRUE(st.has_value()) << p.name() << " still running" << c_.report({&p});
    if (!st) return "";
    EXPECT_EQ(st->code, 1) << st->describe() << c_.report({&p});
    std::string line = line_with(p.output(), "join:");
    EXPECT_TRUE(has(line, code)) << p.name() << ": expected " << code << ", got '" << line << "'"
                                 << c_.report({&p});
    return line;
  }

  Cluster c_{{.daemons = 2}};
};

TEST_F(BadJoin, WorldSizeZero) {
  Process api = start("ws0-api", {"check", "1"}, {{"WORLD_SIZE", "0"}, {"RANK", "0"}});
  expect_join_error(api, "INVALID_ARGUMENT");
  // The daemon refuses it on its own too (a client that skips the library's checks).
  Process raw = start("ws0-raw", {"rawjoin"}, {{"WORLD_SIZE", "0"}, {"RANK", "0"}});
  std::string line = expect_join_error(raw, "INVALID_ARGUMENT");
  EXPECT_TRUE(has(line, "world size")) << line;
  // Nothing reached the coordinator.
  EXPECT_FALSE(has(c_.coordinator().output(), "ws0-")) << c_.report();
  EXPECT_TRUE(c_.daemon(0).alive()) << c_.report();
}

TEST_F(BadJoin, RankOutOfRange) {
  for (const char* rank : {"2", "7", "-1"}) {
    SCOPED_TRACE(std::string("RANK=") + rank);
    Process api = start("rank-oob-api", {"check", "1"}, {{"WORLD_SIZE", "2"}, {"RANK", rank}});
    expect_join_error(api, "INVALID_ARGUMENT");
  }
  Process raw = start("rank-oob-raw", {"rawjoin"}, {{"WORLD_SIZE", "2"}, {"RANK", "2"}});
  std::string line = expect_join_error(raw, "INVALID_ARGUMENT");
  EXPECT_TRUE(has(line, "rank")) << line;
  EXPECT_FALSE(has(c_.coordinator().output(), "rank-oob-")) << c_.report();
  EXPECT_TRUE(c_.daemon(0).alive()) << c_.report();
}

// Sizes and names a trainer could use to make its daemon allocate without bound, or to put
// odd bytes into names of memfds and logs, are refused by the daemon before anything else.
TEST_F(BadJoin, SizesAndNamesOverTheLimits) {
  struct Case {
    const char* job;
    Env env;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"huge-world", {{"WORLD_SIZE", "2000000000"}, {"LOCAL_WORLD_SIZE", "1"}}, "exceeds the limit of 1048576"},
      {"huge-local", {{"WORLD_SIZE", "100000"}, {"LOCAL_WORLD_SIZE", "100000"}}, "exceeds the limit of 1024"},
      {"bad/id", {}, "job id has character code 47"},
      {"no-token", {{"GRADSYNC_JOB_TOKEN", ""}}, "a job over several nodes needs a job token"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.job);
    Process raw = start(k.job, {"rawjoin"}, k.env);
    std::string line = expect_join_error(raw, k.job == std::string("no-token") ? "PERMISSION_DENIED" : "INVALID_ARGUMENT");
    EXPECT_TRUE(has(line, k.needle)) << line;
  }
  EXPECT_FALSE(has(c_.coordinator().output(), "huge-")) << c_.report();
  EXPECT_TRUE(c_.daemon(0).alive()) << c_.report();
}

// Two trainers on one daemon both claim rank 0 of a 2-rank job.
TEST_F(BadJoin, TwoTrainersClaimOneRank) {
  JobSpec spec;
  spec.job = "dup-rank";
  spec.world = 2;
  spec.ranks_per_daemon = {2};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "2000"}};
  spec.per_rank = [](int, Env& env) { env["RANK"] = "0"; };
  auto ranks = c_.spawn_ranks(spec);
  wait_all_exit(ranks, 20s);
  int already_exists = 0;
  for (auto& p : ranks) {
    ASSERT_TRUE(p.exit_status().has_value()) << p.name() << " still running" << c_.report(ranks);
    EXPECT_NE(p.exit_status()->code, 0) << p.name() << c_.report(ranks);
    std::string line = line_with(p.output(), "join:");
    if (has(line, "ALREADY_EXISTS")) {
      ++already_exists;
      EXPECT_TRUE(has(line, "rank 0")) << "does not name the rank: '" << line << "'";
    }
  }
  EXPECT_EQ(already_exists, 1) << c_.report(ranks);
  EXPECT_TRUE(c_.daemon(0).alive()) << c_.report(ranks);
}

// WORLD_SIZE beyond an int is an error, not truncated (4294967297 would become 1 and run);
// a job id too long for a memfd name is refused by the library with a clear error.
TEST_F(BadJoin, OutOfRangeEnvironmentAndLongJobId) {
  Process big = start("ws-big", {"check", "1"}, {{"WORLD_SIZE", "4294967297"}});
  std::string line = expect_join_error(big, "INVALID_ARGUMENT");
  EXPECT_TRUE(has(line, "WORLD_SIZE='4294967297' is not an integer")) << line;
  Process junk = start("rank-junk", {"check", "1"}, {{"RANK", "1x"}});
  line = expect_join_error(junk, "INVALID_ARGUMENT");
  EXPECT_TRUE(has(line, "RANK='1x' is not an integer")) << line;
  JobSpec spec;
  spec.job = std::string(300, 'j');
  spec.world = 2;
  Process long_id = c_.spawn("trainer long-id", {binary("allreduce_worker"), "check", "1"}, c_.rank_env(spec, 0, 0, 0, 1));
  line = expect_join_error(long_id, "INVALID_ARGUMENT");
  EXPECT_TRUE(has(line, "job id of 300 bytes")) << line;
  EXPECT_FALSE(has(line, "memfd")) << line;
  EXPECT_FALSE(has(c_.coordinator().output(), "ws-big")) << c_.report();
}

// Two local ranks of one node, the second with another token: both are refused at once (the
// first does not wait for its 60 s join deadline).
TEST_F(BadJoin, WrongTokenOnOneNodeRefusesBothRanksAtOnce) {
  JobSpec spec;
  spec.job = "tokens-local";
  spec.world = 2;
  spec.ranks_per_daemon = {2};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "60000"}};
  spec.per_rank = [](int rank, Env& env) { env["GRADSYNC_JOB_TOKEN"] = rank == 0 ? "a" : "b"; };
  auto ranks = c_.spawn_ranks(spec);
  ASSERT_TRUE(wait_all_exit(ranks, 10s)) << "a rank still waits for its join deadline" << c_.report(ranks);
  for (auto& p : ranks) {
    std::string line = line_with(p.output(), "join:");
    EXPECT_TRUE(has(line, "PERMISSION_DENIED")) << p.name() << ": " << line << c_.report(ranks);
    EXPECT_TRUE(has(line, "wrong token")) << line;
  }
}

// Rank 0 (node 0) joins with token "a", rank 1 (node 1) with "b": whichever comes second is
// refused by the coordinator, and so is the node already waiting, at once.
TEST_F(BadJoin, WrongToken) {
  JobSpec spec;
  spec.job = "tokens";
  spec.world = 2;
  spec.ranks_per_daemon = {1, 1};
  spec.args = {"check", "1"};
  spec.env = {{"GRADSYNC_JOIN_TIMEOUT_MS", "60000"}};
  spec.per_rank = [](int rank, Env& env) { env["GRADSYNC_JOB_TOKEN"] = rank == 0 ? "a" : "b"; };
  auto ranks = c_.spawn_ranks(spec);
  ASSERT_TRUE(wait_all_exit(ranks, 10s)) << "a rank still waits for its join deadline" << c_.report(ranks);
  int denied = 0;
  for (auto& p : ranks) {
    ASSERT_TRUE(p.exit_status().has_value()) << p.name() << " still running" << c_.report(ranks);
    EXPECT_NE(p.exit_status()->code, 0) << p.name() << c_.report(ranks);
    std::string line = line_with(p.output(), "join:");
    if (has(line, "PERMISSION_DENIED")) {
      ++denied;
      EXPECT_TRUE(has(line, "token")) << "does not mention the token: '" << line << "'";
      EXPECT_FALSE(has(line, "\"a\"") || has(line, "'a'") || has(line, "\"b\"") || has(line, "'b'"))
          << "the error leaks a token: '" << line << "'";
    }
  }
  EXPECT_EQ(denied, 2) << c_.report(ranks);
}

}  // namespace
}  // namespace gradsync::testing
