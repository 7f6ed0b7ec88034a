// JobTable: the coordinator's state machine, driven with an explicit clock.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "coordinator/job_table.h"
#include "coordinator/leases.h"
#include "daemon/peer_layout.h"

namespace gradsync::coordinator {
namespace {

using std::chrono::milliseconds;

constexpr Millis kLease{1000};
constexpr Millis kJoinTimeout{5000};

class JobTableTest : public ::testing::Test {
 protected:
  JobTable table{JobTableOptions{kLease, kJoinTimeout}};
  Leases leases{kLease};  // the service keeps them beside the table, as here
  TimePoint t0 = TimePoint{} + std::chrono::hours(1);

  std::string add_node(const std::string& host) {
    v1::NodeInfo info;
    info.set_hostname(host);
    auto id = table.register_node(info, t0);
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    leases.add(*id, t0);
    return *id;
  }

  // What the service's ticker does.
  void tick(TimePoint now) {
    for (const auto& [id, silent] : leases.expire(now)) table.lose_node(id, leases.expiry_reason(silent));
    table.tick(now);
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
  auto pt = table.peer_table("train", 1, b);
  ASSERT_TRUE(pt.ok()) << pt.status().to_string();
  // Two distinct topologies, and each node's through the runs.
  ASSERT_EQ(pt->shapes_size(), 2);
  auto layout = expand_layout(*pt);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const v1::GpuTopology& of_a = pt->shapes(int(layout->node_shape[layout->rank_node[0]]));
  const v1::GpuTopology& of_b = pt->shapes(int(layout->node_shape[layout->rank_node[2]]));
  EXPECT_EQ(of_a.gpus_size(), 2);
  EXPECT_EQ(of_a.links(1), "NV18");
  EXPECT_EQ(of_b.gpus_size(), 0);
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
  EXPECT_TRUE(leases.renew(a, t0));
  EXPECT_FALSE(leases.renew("nobody-7", t0));
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
  EXPECT_EQ(table.peer_table("train", 0, a).status().code(), Code::kFailedPrecondition);
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
  auto pt = table.peer_table("train", 1, c);
  ASSERT_TRUE(pt.ok()) << pt.status().to_string();
  auto layout = expand_layout(*pt);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  EXPECT_EQ(layout->ring, (std::vector<uint32_t>{0, 2, 1, 3, 4}));
  EXPECT_EQ(layout->rank_node, (std::vector<uint32_t>{0, 1, 0, 1, 2}));
  EXPECT_EQ(pt->node_index(), 2u);
  // c holds rank 4 (last in the ring): its ring neighbours 3 and 0, its tree-0 parent
  // (position 1: rank 2), tree 1 children (positions 3, 2 of the mirror: ranks 1, 3).
  std::map<uint32_t, v1::PeerEntry> got;
  for (const auto& p : pt->peers()) got[p.rank()] = p;
  for (uint32_t r : {0u, 1u, 2u, 3u, 4u}) {
    ASSERT_EQ(got.count(r), 1u) << r;
    EXPECT_EQ(got[r].endpoint(), "ep" + std::to_string(r));
  }
  EXPECT_EQ(got[3].hostname(), "hostA");
  auto d = table.describe("train");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ring_size(), 5);
  EXPECT_EQ(d->nodes_size(), 3);
  EXPECT_EQ(table.peer_table("nope", 0, a).status().code(), Code::kNotFound);
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
  ASSERT_TRUE(leases.renew(a, t0 + milliseconds(400)));
  tick(t0 + milliseconds(499));
  EXPECT_FALSE(table.take_join_result(*t).has_value());
  tick(t0 + milliseconds(500));
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
    ASSERT_TRUE(leases.renew(a, t0 + at));
    tick(t0 + at);
  }
  EXPECT_FALSE(table.take_join_result(*t).has_value());
  ASSERT_TRUE(leases.renew(a, t0 + kJoinTimeout));
  tick(t0 + kJoinTimeout);
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
  ASSERT_TRUE(leases.renew(a, t0 + kLease / 2));
  tick(t0 + kLease - milliseconds(1));
  EXPECT_TRUE(table.has_node(b));
  tick(t0 + kLease);
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
  EXPECT_FALSE(leases.renew(b, t0 + kLease));
}

TEST_F(JobTableTest, LostNodeFailsWaitingJoiners) {
  std::string a = add_node("hostA");
  std::string b = add_node("hostB");
  auto ta = table.join(req(a, {0}, 3), t0);
  auto tb = table.join(req(b, {1}, 3), t0);
  ASSERT_TRUE(ta.ok() && tb.ok());
  ASSERT_TRUE(leases.renew(a, t0 + kLease));
  tick(t0 + kLease);  // b silent since t0
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
  EXPECT_TRUE(table.peer_table("train", 1, a).ok()) << "a finished table is still complete";
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


// A registration whose answer the daemon never saw is retried with the same incarnation: it
// gets the same id and nothing is lost. A new incarnation is a restarted daemon.
TEST_F(JobTableTest, RetriedRegistrationKeepsItsIdAndANewIncarnationReplacesIt) {
  v1::NodeInfo info;
  info.set_hostname("hostA");
  info.set_incarnation(77);
  auto first = table.register_node(info, t0);
  auto retry = table.register_node(info, t0);
  ASSERT_TRUE(first.ok() && retry.ok());
  EXPECT_EQ(*first, *retry);
  EXPECT_TRUE(table.take_removed_nodes().empty());
  info.set_incarnation(78);
  auto restarted = table.register_node(info, t0);
  ASSERT_TRUE(restarted.ok());
  EXPECT_NE(*restarted, *first);
  EXPECT_EQ(table.take_removed_nodes(), std::vector<std::string>{*first});
}

// What one node receives does not grow with the job: at 512 nodes x 8 ranks a node gets its
// own 8 entries and its channels' peers (ring neighbours, tree parents and children), one
// run and one shape, on one page.
TEST_F(JobTableTest, APeerTableHoldsWhatTheNodeNeedsNotTheJob) {
  constexpr uint32_t kNodes = 512, kPer = 8, kWorld = kNodes * kPer;
  std::vector<std::string> ids;
  for (uint32_t n = 0; n < kNodes; ++n) {
    ids.push_back(add_node("h" + std::to_string(n)));
    std::vector<uint32_t> ranks;
    for (uint32_t r = 0; r < kPer; ++r) ranks.push_back(n * kPer + r);
    ASSERT_TRUE(table.join(req(ids.back(), ranks, kWorld), t0).ok());
  }
  size_t most = 0;
  for (uint32_t n : {0u, 1u, 100u, 511u}) {
    auto pt = table.peer_table("train", 1, ids[n]);
    ASSERT_TRUE(pt.ok()) << pt.status().to_string();
    EXPECT_EQ(pt->pages(), 1u);
    EXPECT_EQ(pt->runs_size(), 1);
    EXPECT_EQ(pt->shapes_size(), 1);
    EXPECT_EQ(pt->node_count(), kNodes);
    EXPECT_EQ(pt->node_index(), n);
    std::set<uint32_t> ranks;
    for (const auto& p : pt->peers()) ranks.insert(p.rank());
    for (uint32_t r = 0; r < kPer; ++r) EXPECT_EQ(ranks.count(n * kPer + r), 1u);
    EXPECT_EQ(ranks.count((n * kPer + kWorld - 1) % kWorld), 1u) << "ring predecessor";
    EXPECT_EQ(ranks.count((n * kPer + kPer) % kWorld), 1u) << "ring successor";
    most = std::max(most, ranks.size());
    auto layout = expand_layout(*pt);
    ASSERT_TRUE(layout.ok());
    EXPECT_EQ(layout->ring.size(), kWorld);
  }
  // 8 own + 2 ring neighbours + per tree at most 8 parents' worth and 16 children.
  EXPECT_LE(most, size_t(8 + 2 + 2 * (8 + 16)));
}

// A node with more entries than a page gets them over several pages, and any rank can be
// fetched by key.
TEST_F(JobTableTest, LargeTablesArePagedAndRanksFetchedByKey) {
  constexpr uint32_t kPer = 6000, kWorld = 2 * kPer;
  std::string a = add_node("hostA"), b = add_node("hostB");
  std::vector<uint32_t> ra, rb;
  for (uint32_t r = 0; r < kPer; ++r) {
    ra.push_back(r);
    rb.push_back(kPer + r);
  }
  ASSERT_TRUE(table.join(req(a, ra, kWorld), t0).ok());
  ASSERT_TRUE(table.join(req(b, rb, kWorld), t0).ok());
  auto first = table.peer_table("train", 1, a, 0);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  ASSERT_GT(first->pages(), 1u);
  std::set<uint32_t> seen;
  for (uint32_t p = 0; p < first->pages(); ++p) {
    auto page = table.peer_table("train", 1, a, p);
    ASSERT_TRUE(page.ok()) << page.status().to_string();
    EXPECT_LE(uint32_t(page->peers_size()), kPageEntries);
    for (const auto& e : page->peers()) EXPECT_TRUE(seen.insert(e.rank()).second) << e.rank();
  }
  for (uint32_t r = 0; r < kPer; ++r) ASSERT_EQ(seen.count(r), 1u) << r;
  EXPECT_EQ(table.peer_table("train", 1, a, first->pages()).status().code(), Code::kInvalidArgument);
  auto keyed = table.peer_table("train", 1, "", 0, {11999, 7});
  ASSERT_TRUE(keyed.ok()) << keyed.status().to_string();
  ASSERT_EQ(keyed->peers_size(), 2);
  EXPECT_EQ(keyed->peers(0).endpoint(), "ep11999");
  EXPECT_EQ(keyed->peers(1).node_id(), a);
  EXPECT_EQ(table.peer_table("train", 1, "", 0, {kWorld}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(table.peer_table("train", 1, "stranger-1").status().code(), Code::kFailedPrecondition);
  auto d0 = table.describe("train", 0);
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ(d0->pages(), 3u);
  EXPECT_EQ(uint32_t(d0->peers_size()), kPageEntries);
  auto d2 = table.describe("train", 2);
  ASSERT_TRUE(d2.ok());
  EXPECT_EQ(uint32_t(d2->peers_size()), kWorld - 2 * kPageEntries);
  EXPECT_EQ(d2->peers(0).rank(), 2 * kPageEntries);
}

// The nodes' channel offers are folded once, when the generation completes; a conflict
// reaches every node with its peer table, naming both nodes.
TEST_F(JobTableTest, TheChannelAgreementComesWithThePeerTable) {
  std::string a = add_node("hostA"), b = add_node("hostB");
  JoinRequest ra = req(a, {0}, 2), rb = req(b, {1}, 2);
  ra.offer.set_rings(4);
  ra.offer.set_rings_chosen(true);
  ra.offer.set_slots(8);
  ra.offer.set_slot_bytes(1 << 20);
  rb.offer = ra.offer;
  rb.offer.set_rings(2);
  ASSERT_TRUE(table.join(ra, t0).ok());
  ASSERT_TRUE(table.join(rb, t0).ok());
  auto pt = table.peer_table("train", 1, a);
  ASSERT_TRUE(pt.ok());
  EXPECT_EQ(pt->agreement().rings(), 2u);
  EXPECT_EQ(pt->agreement().error(), "");
  ASSERT_TRUE(table.abort("", "train", 0, "next", -1).ok());
  rb.offer.set_slots(4);
  ASSERT_TRUE(table.join(ra, t0).ok());
  ASSERT_TRUE(table.join(rb, t0).ok());
  pt = table.peer_table("train", 2, b);
  ASSERT_TRUE(pt.ok());
  EXPECT_NE(pt->agreement().error().find("has channel geometry slots=4"), std::string::npos) << pt->agreement().error();
  EXPECT_NE(pt->agreement().error().find("--slots/--slot-bytes"), std::string::npos);
}

}  // namespace
}  // namespace gradsync::coordinator
