// JobTable: the coordinator's state machine, driven with an explicit clock.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "coordinator/job_table.h"

namespace gradsync::coordinator {
namespace {

using std::chrono::milliseconds;

constexpr Millis kLease{1000};
constexpr Millis kJoinTimeout{5000};

class JobTableTest : public ::testing::Test {
 protected:
  JobTable table{JobTableOptions{kLease, kJoinTimeout}};
  TimePoint t0 = TimePoint{} + std::chrono::hours(1);

  std::string add_node(const std::string& host) {
    v1::NodeInfo info;
    info.set_hostname(host);
    auto id = table.register_node(info, t0);
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    return *id;
  }

  static JoinRequest req(const std::string& node, std::vector<uint32_t> ranks,
                         uint32_t world_size = 4, const std::string& token = "tok",
                         const std::string& job = "train") {
    JoinRequest r;
    r.node_id = node;
    r.job_id = job;
    r.token = token;
    r.world_size = world_size;
    r.ranks = std::move(ranks);
    for (uint32_t rank : r.ranks) r.endpoints.push_back("ep" + std::to_string(rank));
    return r;
  }

  // Events taken from the table, as "node:KIND" strings.
  std::vector<std::string> events() {
    std::vector<std::string> out;
    for (const auto& d : table.take_events()) {
      out.push_back(d.node_id + ":" + v1::Event::Kind_Name(d.event.kind()));
    }
    return out;
  }
};

TEST(CompressRanks, RangesOfThreeOrMore) {
  EXPECT_EQ(compress_ranks({}), "");
  EXPECT_EQ(compress_ranks({7, 2, 3, 4, 5}), "2-5,7");
  EXPECT_EQ(compress_ranks({2, 3}), "2,3");
  EXPECT_EQ(compress_ranks({0, 1, 2, 4, 5, 9}), "0-2,4,5,9");
}

// The GPU topology a daemon sends is kept for operators: one that breaks its bounds is refused
// with the node named, and nothing is registered.
TEST_F(JobTableTest, RegisterRefusesAGpuTopologyOutOfBounds) {
  v1::NodeInfo info;
  info.set_hostname("gpu-a");
  info.set_pid(42);
  info.mutable_gpu_topology()->add_gpus()->set_bus_id("0000:19:00.0");
  info.mutable_gpu_topology()->add_gpus()->set_bus_id("0000:1a:00.0");
  info.mutable_gpu_topology()->add_links("X");  // 1 of the 4 labels of 2 GPUs
  auto id = table.register_node(info, t0);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), Code::kInvalidArgument);
  EXPECT_NE(id.status().message().find("registration of node gpu-a (host gpu-a, pid 42) refused: gpu_topology: 1 link "
                                       "labels and 0 bandwidths for 2 GPUs"),
            std::string::npos)
      << id.status().message();
  info.clear_gpu_topology();
  EXPECT_TRUE(table.register_node(info, t0).ok());
}

// Each node's GPU topology reaches the job's daemons with the peer table (for planning the GPU
// channels) and operators with DescribeJob.
TEST_F(JobTableTest, PeerTableAndDescribeCarryEachNodesGpuTopology) {
  v1::NodeInfo info;
  info.set_hostname("gpu-a");
  v1::GpuTopology* topo = info.mutable_gpu_topology();
  topo->set_source("nvml");
  for (const char* bus : {"0000:19:00.0", "0000:3b:00.0"}) topo->add_gpus()->set_bus_id(bus);
  for (const char* l : {"X", "NV18", "NV18", "X"}) topo->add_links(l);
  for (uint32_t g : {0u, 450u, 450u, 0u}) topo->add_link_gbps(g);
  topo->add_rails(-1);
  topo->add_rails(-1);
  auto a = table.register_node(info, t0);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  const std::string b = add_node("cpu-b");
  ASSERT_TRUE(table.join(req(*a, {0, 1}, 3), t0).ok());
  ASSERT_TRUE(table.join(req(b, {2}, 3), t0).ok());
  auto pt = table.peer_table("train", 1);
  ASSERT_TRUE(pt.ok()) << pt.status().to_string();
  ASSERT_EQ(pt->topologies_size(), 2);
  std::map<std::string, v1::GpuTopology> by_node;
  for (const auto& t : pt->topologies()) by_node[t.node_id()] = t.gpu_topology();
  ASSERT_EQ(by_node.count(*a), 1u);
  EXPECT_EQ(by_node[*a].gpus_size(), 2);
  EXPECT_EQ(by_node[*a].links(1), "NV18");
  EXPECT_EQ(by_node[b].gpus_size(), 0);
  auto d = table.describe("train");
  ASSERT_TRUE(d.ok());
  int with_gpus = 0;
  for (const auto& n : d->nodes()) with_gpus += n.gpu_topology().gpus_size() == 2 ? 1 : 0;
  EXPECT_EQ(with_gpus, 1);
}

TEST_F(JobTableTest, RegisterGivesFreshIdsAndHeartbeatNeedsOne) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind("hostA-", 0), 0u) << a;
  EXPECT_TRUE(table.heartbeat(a, t0).ok());
  Status s = table.heartbeat("nobody-7", t0);
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_NE(s.message().find("RegisterNode"), std::string::npos) << s.message();
}

TEST_F(JobTableTest, JoinValidatesRequest) {
  std::string a = add_node("hostA");
  struct Case {
    JoinRequest r;
    const char* needle;
  };
  JoinRequest bad_eps = req(a, {0, 1});
  bad_eps.endpoints.pop_back();
  std::vector<Case> cases = {
      {req(a, {0}, 0), "world_size must be at least 1"},
      {req(a, {}), "no ranks"},
      {req(a, {4}), "rank 4 is out of range for world_size 4"},
      {req(a, {1, 1}), "rank 1 appears twice"},
      {bad_eps, "2 ranks but 1 endpoints"},
      {req(a, {0}, 4, "tok", ""), "job_id is empty"},
      {req(a, {0}, 4, "tok", "a/b"), "job id has character code 47 at 1"},
      {req(a, {0}, 4, "tok", std::string(129, 'j')), "job id of 129 bytes (at most 128)"},
      {req(a, {0}, 1u << 21), "exceeds the limit"},
      {req(a, {0}, 4, std::string(1025, 't')), "token longer than 1024 bytes"},
  };
  for (const auto& c : cases) {
    auto t = table.join(c.r, t0);
    ASSERT_FALSE(t.ok()) << c.needle;
    EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.needle), std::string::npos) << t.status().message();
  }
  EXPECT_EQ(table.join(req("ghost-1", {0}), t0).status().code(), Code::kNotFound);
  // Without a token anyone could join a job over several nodes; one node alone may go without.
  auto open = table.join(req(a, {0, 1}, 4, ""), t0);
  EXPECT_EQ(open.status().code(), Code::kPermissionDenied);
  EXPECT_NE(open.status().message().find("a job over several nodes needs a job token"), std::string::npos)
      << open.status().message();
  EXPECT_TRUE(table.list_jobs().empty()) << "a refused join must not create a job";
  EXPECT_TRUE(table.join(req(a, {0, 1}, 2, ""), t0).ok()) << "a one-node job needs no token";
}

TEST_F(JobTableTest, GenerationBecomesActiveWhenAllRanksJoin) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  auto ta = table.join(req(a, {0, 1}), t0);
  ASSERT_TRUE(ta.ok());
  EXPECT_FALSE(table.take_join_result(*ta).has_value()) << "still forming";
  EXPECT_EQ(table.peer_table("train", 0).status().code(), Code::kFailedPrecondition);
  auto tb = table.join(req(b, {2, 3}), t0);
  ASSERT_TRUE(tb.ok());
  for (JoinTicket t : {*ta, *tb}) {
    auto res = table.take_join_result(t);
    ASSERT_TRUE(res.has_value() && res->ok());
    EXPECT_EQ((*res)->generation, 1u);
    EXPECT_EQ((*res)->world_size, 4u);
  }
  EXPECT_EQ(events(), (std::vector<std::string>{a + ":JOB_READY", b + ":JOB_READY"}));
  auto jobs = table.list_jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].state(), "active");
  EXPECT_EQ(jobs[0].joined(), 4u);
}

TEST_F(JobTableTest, RingKeepsRanksOfOneNodeAdjacent) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  std::string c = add_node("hostC");
  ASSERT_TRUE(table.join(req(a, {1, 3}, 5), t0).ok());
  ASSERT_TRUE(table.join(req(c, {4}, 5), t0).ok());
  ASSERT_TRUE(table.join(req(b, {2, 0}, 5), t0).ok());
  auto pt = table.peer_table("train", 1);
  ASSERT_TRUE(pt.ok()) << pt.status().to_string();
  std::vector<uint32_t> ring(pt->ring().begin(), pt->ring().end());
  EXPECT_EQ(ring, (std::vector<uint32_t>{0, 2, 1, 3, 4}));
  ASSERT_EQ(pt->peers_size(), 5);
  for (uint32_t r = 0; r < 5; ++r) {
    EXPECT_EQ(pt->peers(r).rank(), r);
    EXPECT_EQ(pt->peers(r).endpoint(), "ep" + std::to_string(r));
  }
  EXPECT_EQ(pt->peers(3).hostname(), "hostA");
  auto d = table.describe("train");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ring_size(), 5);
  EXPECT_EQ(d->nodes_size(), 3);
  EXPECT_EQ(table.peer_table("nope", 0).status().code(), Code::kNotFound);
}

TEST_F(JobTableTest, RankPathsAreKeptForDescribe) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  ASSERT_TRUE(table.join(req(a, {0}, 2), t0).ok());
  v1::RankPath p;
  p.set_rank(0);
  p.set_path("gpudirect-rdma");
  p.set_why("mlx5_0 port 1, dma-buf");
  EXPECT_EQ(table.report_path(a, "train", 2, p).code(), Code::kFailedPrecondition) << "not the generation";
  ASSERT_TRUE(table.report_path(a, "train", 1, p).ok()) << "a forming generation takes reports";
  ASSERT_TRUE(table.join(req(b, {1}, 2), t0).ok());
  p.set_rank(1);
  p.set_path("host-staged");
  auto foreign = table.report_path(a, "train", 1, p);
  EXPECT_EQ(foreign.code(), Code::kPermissionDenied);
  EXPECT_NE(foreign.message().find("rank 1 is not held by"), std::string::npos) << foreign.message();
  ASSERT_TRUE(table.report_path(b, "train", 1, p).ok());
  EXPECT_EQ(table.report_path("ghost-9", "train", 1, p).code(), Code::kNotFound);
  EXPECT_EQ(table.report_path(b, "nope", 1, p).code(), Code::kNotFound);
  auto d = table.describe("train");
  ASSERT_TRUE(d.ok());
  ASSERT_EQ(d->paths_size(), 2);
  EXPECT_EQ(d->paths(0).rank(), 0u);
  EXPECT_EQ(d->paths(0).path(), "gpudirect-rdma");
  EXPECT_EQ(d->paths(0).why(), "mlx5_0 port 1, dma-buf");
  EXPECT_EQ(d->paths(1).path(), "host-staged");
}

TEST_F(JobTableTest, TokenSizeAndRankConflicts) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  // A wrong token or world size fails the forming generation for the node already in, at once
  // (not at its join deadline).
  auto first = table.join(req(a, {0, 1}), t0);
  ASSERT_TRUE(first.ok());
  auto wrong_token = table.join(req(b, {2, 3}, 4, "other"), t0);
  EXPECT_EQ(wrong_token.status().code(), Code::kPermissionDenied);
  EXPECT_NE(wrong_token.status().message().find("wrong token for job train"), std::string::npos);
  auto told = table.take_join_result(*first);
  ASSERT_TRUE(told.has_value());
  EXPECT_EQ(told->status().code(), Code::kPermissionDenied);
  EXPECT_NE(told->status().message().find("refused for every node"), std::string::npos) << told->status().message();
  auto second = table.join(req(a, {0, 1}), t0);
  ASSERT_TRUE(second.ok());
  auto wrong_size = table.join(req(b, {2, 3}, 8), t0);
  EXPECT_EQ(wrong_size.status().code(), Code::kInvalidArgument);
  told = table.take_join_result(*second);
  ASSERT_TRUE(told.has_value());
  EXPECT_EQ(told->status().code(), Code::kInvalidArgument);
  // A rank claimed twice is refused for the late node only.
  ASSERT_TRUE(table.join(req(a, {0, 1}), t0).ok());
  auto taken = table.join(req(b, {1, 2}), t0);
  EXPECT_EQ(taken.status().code(), Code::kAlreadyExists);
  EXPECT_NE(taken.status().message().find("rank 1"), std::string::npos);
  EXPECT_NE(taken.status().message().find("hostA"), std::string::npos) << taken.status().message();
  ASSERT_TRUE(table.join(req(b, {2, 3}), t0).ok());
  auto late = table.join(req(b, {3}), t0);  // generation active: every rank is held
  EXPECT_EQ(late.status().code(), Code::kAlreadyExists);
  EXPECT_NE(late.status().message().find("active"), std::string::npos);
}

TEST_F(JobTableTest, JoinDeadlineListsMissingRanks) {
  std::string a = add_node("hostA");
  JoinRequest r = req(a, {0, 1, 6}, 8);
  r.timeout = Millis(500);
  auto t = table.join(r, t0);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(table.heartbeat(a, t0 + milliseconds(400)).ok());
  table.tick(t0 + milliseconds(499));
  EXPECT_FALSE(table.take_join_result(*t).has_value());
  table.tick(t0 + milliseconds(500));
  auto res = table.take_join_result(*t);
  ASSERT_TRUE(res.has_value());
  EXPECT_EQ(res->status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(res->status().message().find("ranks that never joined: 2-5,7"), std::string::npos)
      << res->status().message();
  EXPECT_EQ(table.list_jobs()[0].state(), "aborted");
  EXPECT_EQ(events(), (std::vector<std::string>{a + ":JOB_ABORTED"}));
  // The next join opens generation 2.
  auto again = table.join(req(a, {0}, 1), t0 + milliseconds(600));
  ASSERT_TRUE(again.ok());
  auto ok = table.take_join_result(*again);
  ASSERT_TRUE(ok.has_value() && ok->ok());
  EXPECT_EQ((*ok)->generation, 2u);
}

TEST_F(JobTableTest, ServerDefaultJoinTimeoutApplies) {
  std::string a = add_node("hostA");
  auto t = table.join(req(a, {0}), t0);
  ASSERT_TRUE(t.ok());
  for (Millis at{0}; at < kJoinTimeout; at += kLease / 2) {
    ASSERT_TRUE(table.heartbeat(a, t0 + at).ok());
    table.tick(t0 + at);
  }
  EXPECT_FALSE(table.take_join_result(*t).has_value());
  ASSERT_TRUE(table.heartbeat(a, t0 + kJoinTimeout).ok());
  table.tick(t0 + kJoinTimeout);
  auto res = table.take_join_result(*t);
  ASSERT_TRUE(res.has_value());
  EXPECT_EQ(res->status().code(), Code::kDeadlineExceeded);
}

TEST_F(JobTableTest, WithdrawReleasesRanks) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  auto ta = table.join(req(a, {0, 1}, 4, "first"), t0);
  ASSERT_TRUE(ta.ok());
  table.withdraw(*ta, "cancelled");
  EXPECT_EQ(table.list_jobs()[0].joined(), 0u);
  // Nobody holds the generation now: a new first joiner sets token and size afresh.
  auto tb = table.join(req(b, {0, 1}, 2, "second"), t0);
  ASSERT_TRUE(tb.ok());
  auto res = table.take_join_result(*tb);
  ASSERT_TRUE(res.has_value() && res->ok());
  EXPECT_EQ((*res)->generation, 1u);
}

TEST_F(JobTableTest, SameNodeRetrySupersedesItsPendingJoin) {
  std::string a = add_node("hostA");
  auto first = table.join(req(a, {0, 1}), t0);
  auto retry = table.join(req(a, {0, 1}), t0);
  ASSERT_TRUE(first.ok() && retry.ok());
  auto old = table.take_join_result(*first);
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->status().code(), Code::kAborted);
  EXPECT_FALSE(table.take_join_result(*retry).has_value());
  EXPECT_EQ(table.list_jobs()[0].joined(), 2u);
}

TEST_F(JobTableTest, LeaseExpiryAbortsJobsAndTellsSurvivors) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  ASSERT_TRUE(table.join(req(a, {0, 1}), t0).ok());
  ASSERT_TRUE(table.join(req(b, {3, 2}), t0).ok());
  events();
  ASSERT_TRUE(table.heartbeat(a, t0 + kLease / 2).ok());
  table.tick(t0 + kLease - milliseconds(1));
  EXPECT_TRUE(table.has_node(b));
  table.tick(t0 + kLease);
  EXPECT_FALSE(table.has_node(b));
  EXPECT_TRUE(table.has_node(a));
  EXPECT_EQ(table.take_removed_nodes(), std::vector<std::string>{b});
  auto evs = table.take_events();
  ASSERT_EQ(evs.size(), 2u) << "only the survivor hears about it";
  EXPECT_EQ(evs[0].node_id, a);
  EXPECT_EQ(evs[0].event.kind(), v1::Event::NODE_LOST);
  EXPECT_EQ(evs[1].event.kind(), v1::Event::JOB_ABORTED);
  EXPECT_EQ(evs[1].event.failed_rank(), 2);
  EXPECT_EQ(evs[1].event.failed_node(), b);
  const std::string& reason = evs[1].event.reason();
  EXPECT_NE(reason.find("node " + b + " (host hostB) lost: no heartbeat for 1000 ms"),
            std::string::npos)
      << reason;
  EXPECT_NE(reason.find("ranks 2,3"), std::string::npos) << reason;
  EXPECT_EQ(table.heartbeat(b, t0 + kLease).code(), Code::kNotFound);
}

TEST_F(JobTableTest, LostNodeFailsWaitingJoiners) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  auto ta = table.join(req(a, {0}, 3), t0);
  auto tb = table.join(req(b, {1}, 3), t0);
  ASSERT_TRUE(ta.ok() && tb.ok());
  ASSERT_TRUE(table.heartbeat(a, t0 + kLease).ok());
  table.tick(t0 + kLease);  // b silent since t0
  auto res = table.take_join_result(*ta);
  ASSERT_TRUE(res.has_value());
  EXPECT_EQ(res->status().code(), Code::kAborted);
  EXPECT_NE(res->status().message().find("node " + b + " (host hostB) lost"), std::string::npos)
      << res->status().message();
  EXPECT_EQ(table.list_jobs()[0].state(), "aborted");
  EXPECT_EQ(table.list_jobs()[0].reason().find("node " + b), 0u);
}

TEST_F(JobTableTest, AbortIsIdempotentAndFailsWaiters) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  auto ta = table.join(req(a, {0}, 3), t0);
  ASSERT_TRUE(ta.ok());
  ASSERT_TRUE(table.join(req(b, {1}, 3), t0).ok());
  ASSERT_TRUE(table.abort(a, "train", 0, "trainer crashed", 1).ok());
  auto res = table.take_join_result(*ta);
  ASSERT_TRUE(res.has_value());
  EXPECT_EQ(res->status().code(), Code::kAborted);
  EXPECT_NE(res->status().message().find("trainer crashed"), std::string::npos);
  auto evs = table.take_events();
  ASSERT_EQ(evs.size(), 2u) << "every member, the sender included";
  EXPECT_EQ(evs[0].event.failed_node(), b);
  EXPECT_TRUE(table.abort("", "train", 1, "again", -1).ok());
  EXPECT_TRUE(table.take_events().empty());
  EXPECT_EQ(table.abort("", "nope", 0, "", -1).code(), Code::kNotFound);
  EXPECT_EQ(table.abort("", "train", 9, "", -1).code(), Code::kNotFound);
}

TEST_F(JobTableTest, LeavingEveryNodeFinishesTheGeneration) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  ASSERT_TRUE(table.join(req(a, {0}, 2), t0).ok());
  ASSERT_TRUE(table.join(req(b, {1}, 2), t0).ok());
  events();
  ASSERT_TRUE(table.leave(a, "train", 1).ok());
  EXPECT_EQ(table.list_jobs()[0].state(), "active") << "leaving does not abort others";
  EXPECT_TRUE(events().empty());
  ASSERT_TRUE(table.leave(b, "train", 1).ok());
  EXPECT_EQ(table.list_jobs()[0].state(), "finished");
  EXPECT_EQ(events(), (std::vector<std::string>{a + ":JOB_FINISHED", b + ":JOB_FINISHED"}));
  EXPECT_TRUE(table.peer_table("train", 1).ok()) << "a finished table is still complete";
  // The next join opens generation 2.
  auto next = table.join(req(a, {0}, 1), t0);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ((*table.take_join_result(*next))->generation, 2u);
}

TEST_F(JobTableTest, RestartedDaemonReplacesItsOldRegistration) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  ASSERT_TRUE(table.join(req(a, {0}, 2), t0).ok());
  ASSERT_TRUE(table.join(req(b, {1}, 2), t0).ok());
  events();
  std::string a2 = add_node("hostA");
  EXPECT_FALSE(table.has_node(a));
  EXPECT_TRUE(table.has_node(a2));
  EXPECT_EQ(events(), (std::vector<std::string>{b + ":NODE_LOST", b + ":JOB_ABORTED"}));
}

}  // namespace
}  // namespace gradsync::coordinator
