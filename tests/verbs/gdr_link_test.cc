// The transport half of the GPU communicator's RDMA path (gpu/gdr_link.h) and the step
// runner (gpu/step_runner.h) on the CPU: ranks as threads, each with its own emulated RDMA
// device (or one per "node"), a slot region in host memory registered with ibv_reg_mr, and a
// "stream" that does what the GPU stream does in the GPU communicator (gpu/gdr_channels.cc):
// the plan's steps (gpu/plan/schedule.h) for the ring and the double binary tree, through the
// same StepRunner, with the host reduction loops in place of the kernels. Everything else is
// the production engine: set-up through a host allreduce, an RC QP per peer INIT -> RTR -> RTS,
// WRITE_WITH_IMM slot to slot, credits by RDMA write, arrival checks, error completions, stall
// detection.
#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

#include "common/log.h"
#include "gdr_link_world.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;

class GdrLinkWorlds : public ::testing::TestWithParam<std::tuple<int, uint32_t>> {};

// Allreduce of many counts on the ring and on the trees, in calls back to back (message
// numbers, slots and credits carry over, and ring and tree calls share peers), then
// reduce_scatter, all_gather and broadcast, with 64-byte slots: many messages. Every rank its
// own node. The host stream signals each message before the runner plans it, so every message
// is ready before the worker knows its length (the late plan a GPU stream may cause).
TEST_P(GdrLinkWorlds, CollectivesOverTheLinks) {
  const auto [n, slots] = GetParam();
  Ring ring(n, slots, 64);
  ASSERT_EQ(ring.error(), "");
  for (size_t count : {size_t(1), size_t(13), size_t(1031), size_t(5003)}) {
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      if (algo == plan::Algo::kTree && count > 1031) continue;  // CI time: the shapes below cover more
      expect_allreduce(ring, n, count, algo);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  const size_t count = 301;
  expect_reduce_scatter(ring, n, count, plan::Algo::kRing);
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count * n, -1));
  auto st = ring.collective(CollectiveKind::kAllGather, {count}, 0, send, recv);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[r][size_t(q) * count + i], send[q][i]) << "all_gather";
  }
  recv = inputs(n, count);  // broadcast: recv is the buffer
  const auto root_data = recv[n - 1];
  st = ring.collective(CollectiveKind::kBroadcast, {count}, n - 1, send, recv);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
  }
}

// The links' byte counters (GdrLink::bytes_sent, behind Communicator::gpu_bytes_sent_by_link)
// after a ring allreduce of S bytes over 4 single-rank nodes: 2 (n-1)/n S per rank, all of it
// to the next rank on the ring; the trees' calls after it add to the same counters.
TEST(GdrLink, ByteCountersGiveTheRingsTwoNMinusOneOverN) {
  const int n = 4;
  Ring ring(n, 4, 64);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 64;  // int64: S = 512 bytes, 128-byte chunks, two messages each
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kRing);
  std::vector<uint64_t> after_ring(n, 0);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    uint64_t to_next = 0;
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      after_ring[r] += ring.link(r).bytes_sent(p);
      if (ring.link(r).peer(p).rank == (r + 1) % n) to_next = ring.link(r).bytes_sent(p);
    }
    EXPECT_EQ(after_ring[r], 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
    EXPECT_EQ(to_next, after_ring[r]) << "rank " << r;
  }
  st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kTree);
  uint64_t tree = 0;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (int p = 0; p < ring.link(r).peer_count(); ++p) tree += ring.link(r).bytes_sent(p);
    tree -= after_ring[r];
  }
  // The trees move each half of S up and down once: every rank but the roots sends each half
  // up once, and every edge carries it down once: 2 (n-1) halves up and down in all.
  EXPECT_EQ(tree, 2 * uint64_t(n - 1) * count * 8);
}

// The cost model's choice on the RDMA channels (rdma_auto_algo): across 16 single-GPU nodes
// the trees' log2 depth beats the ring's 30 hops for small calls, and the ring's fewer bytes
// per NIC win for large ones; on one node of 4 the chain and the ring are the same hops.
TEST(RdmaChannels, TheCostModelTakesTheTreesForSmallCallsAcrossManyNodes) {
  std::vector<int> members;
  std::vector<std::string> hosts;
  for (int r = 0; r < 16; ++r) {
    members.push_back(r);
    hosts.push_back("n" + std::to_string(r));
  }
  auto ch = rdma_channels(members, hosts, 5);
  ASSERT_TRUE(ch.ok()) << ch.status().to_string();
  rdma_choose_algos(*ch);
  ASSERT_FALSE(ch->auto_algo.empty());
  EXPECT_EQ(rdma_auto_algo(*ch, 8), plan::Algo::kTree);
  EXPECT_EQ(rdma_auto_algo(*ch, 4096), plan::Algo::kTree);
  EXPECT_EQ(rdma_auto_algo(*ch, size_t(1) << 30), plan::Algo::kRing);
  EXPECT_EQ(rdma_auto_summary(*ch).rfind("tree up to ", 0), 0u) << rdma_auto_summary(*ch);
  EXPECT_NE(rdma_auto_summary(*ch).find("ring above"), std::string::npos) << rdma_auto_summary(*ch);
  // A single member has no choice to make.
  auto one = rdma_channels({3}, hosts, 3);
  ASSERT_TRUE(one.ok());
  rdma_choose_algos(*one);
  EXPECT_EQ(rdma_auto_algo(*one, 8), plan::Algo::kRing);
  EXPECT_EQ(rdma_auto_summary(*one), "ring at every size");
}

// With direct peers the hops inside a node are costed at the intra-node link and only the
// bytes between nodes at the NIC: at 2 nodes x 2 the trees' busiest NIC sends S against the
// ring's 1.5 S, in fewer hops, so the trees win at every size; through the NIC (not direct)
// the ring's fewer bytes per rank win for large calls. The tables of a few shapes are printed;
// each is one switch at most (trees below a size, the ring above), since these channels have
// the bulk protocol only.
TEST(RdmaChannels, DirectHopsAreCostedAtTheLinkInsideTheNode) {
  auto shape = [](int nodes, int per, bool direct) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (int r = 0; r < nodes * per; ++r) {
      members.push_back(r);
      hosts.push_back("n" + std::to_string(r / per));
    }
    auto ch = rdma_channels(members, hosts, 0, direct);
    EXPECT_TRUE(ch.ok()) << ch.status().to_string();
    rdma_choose_algos(*ch);
    return *ch;
  };
  const RdmaChannels direct = shape(2, 2, true), nic = shape(2, 2, false);
  EXPECT_EQ(rdma_auto_summary(direct), "tree at every size");
  EXPECT_EQ(rdma_auto_algo(nic, size_t(64) << 20), plan::Algo::kRing) << rdma_auto_summary(nic);
  for (const GdrPeer& p : direct.peers) EXPECT_EQ(p.direct, p.rank == 1) << "peer " << p.rank;
  for (const RdmaChannels& ch : {shape(4, 2, true), shape(2, 4, false), shape(4, 8, false)}) {
    size_t switches = 0;
    for (size_t i = 1; i < ch.auto_algo.size(); ++i) switches += ch.auto_algo[i] != ch.auto_algo[i - 1];
    EXPECT_LE(switches, 1u) << rdma_auto_summary(ch);
  }
  for (const GdrPeer& p : nic.peers) EXPECT_FALSE(p.direct) << "peer " << p.rank;
  for (auto [nodes, per] : {std::pair{2, 1}, std::pair{3, 1}, std::pair{4, 1}, std::pair{8, 1}, std::pair{16, 1},
                            std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 4}, std::pair{4, 2}, std::pair{4, 8}}) {
    std::printf("%dx%d: direct: %s; through the NIC: %s\n", nodes, per, rdma_auto_summary(shape(nodes, per, true)).c_str(),
                rdma_auto_summary(shape(nodes, per, false)).c_str());
  }
}

// Rails: 3 nodes x 2 ranks, node-major, each node's two ranks on its one device; rank r is in
// the ring of local index r % 2 ({0, 2, 4} and {1, 3, 5}), both built by one collective set-up.
// Each ring sums its own members only, and names its own neighbours.
TEST(GdrLink, OneRingPerRailSumsItsMembers) {
  const int n = 6, rails = 2;
  Ring ring(n, 2, 64, /*per_node=*/rails, 10s, rails);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(ring.channels(r).members.size(), size_t(n / rails));
    EXPECT_EQ(ring.channels(r).position, r / rails);
    EXPECT_EQ(ring.channels(r).shape.node_count(), n / rails) << "one member per node";
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_EQ(ring.link(r).peer(p).rank % rails, r % rails) << "rank " << r << " has a peer outside its rail";
    }
  }
  for (size_t count : {size_t(1), size_t(13), size_t(1031)}) {
    auto send = inputs(n, count);
    std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
    auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      for (int r = 0; r < n; ++r) {
        int64_t want = 0;
        for (int q = r % rails; q < n; q += rails) want += send[q][i];
        ASSERT_EQ(recv[r][i], want) << "count " << count << " rank " << r << " i " << i;
      }
    }
  }
}

// Two ranks on each of two devices: the ring's link inside a node loops through its NIC.
TEST(GdrLink, RanksSharingADevice) {
  Ring ring(4, 2, 64, /*per_node=*/2);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 2000;
  auto send = inputs(4, count);
  std::vector<std::vector<int64_t>> recv(4, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      ASSERT_EQ(recv[r][i], send[0][i] + send[1][i] + send[2][i] + send[3][i]) << "rank " << r << " i " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rings, GdrLinkWorlds,
                         ::testing::Values(std::make_tuple(2, 2u), std::make_tuple(2, 4u), std::make_tuple(3, 2u),
                                           std::make_tuple(4, 3u), std::make_tuple(5, 2u)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_slots" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The ranks disagree on the call (rank 1 thinks the count is 99): the receiving side's
// length check fails the link as a mismatch, the job is aborted, and both streams stop.
TEST(GdrLink, DifferentCallsAreCaughtNotCombined) {
  Ring ring(2, 2, 64);
  ASSERT_EQ(ring.error(), "");
  auto send = inputs(2, 100);
  std::vector<std::vector<int64_t>> recv(2, std::vector<int64_t>(100, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {100, 99}, 0, send, recv);
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
  const std::string why = ring.abort_reason();
  EXPECT_NE(why.find("called different collectives or counts"), std::string::npos) << why;
  EXPECT_NE(why.find("from rank"), std::string::npos) << why;
}

// A link goes down mid-collective: the writes fail with the peer named and the verbs status,
// the job is aborted, and every rank's stream stops within the deadline.
TEST(GdrLink, LinkDownMidCollectiveStopsEveryRank) {
  Ring ring(3, 2, 64);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 300000;
  auto send = inputs(3, count);
  std::vector<std::vector<int64_t>> recv(3, std::vector<int64_t>(count, -1));
  std::thread breaker([&] {  // once messages are flowing: mid-collective
    const auto until = Clock::now() + 5s;
    while (ring.consumed(0) < 100 && Clock::now() < until) std::this_thread::yield();
    verbs::EmulatedFabric::instance().set_link_down(ring.device(1), 1);
  });
  const auto t0 = Clock::now();
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
  breaker.join();
  EXPECT_LT(Clock::now() - t0, 10s);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r << " finished although a link was down";
    EXPECT_NE(st[r].message().find("rank "), std::string::npos) << st[r].to_string();
  }
  const std::string why = ring.abort_reason();
  EXPECT_NE(why.find("failed"), std::string::npos) << why;
  EXPECT_NE(why.find("rank "), std::string::npos) << why;
  std::printf("abort reason: %s\n", why.c_str());
}

// A stall: a rank stopped by the abort logs, beside its state at the end, what it waited for
// a second into the stall (the state a failed stream's late signals cannot have moved on).
// Rank 2 never makes the call; rank 0 times out first (2 s) and aborts the job, and rank 1
// (10 s) stops by the abort, waiting to send to rank 2 since its receive slots filled.
TEST(GdrLink, AStoppedRankLogsWhatItWaitedForASecondIntoTheStall) {
  std::ostringstream captured;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(captured);
  gradsync::log::get("test")->sinks().push_back(sink);
  {
    auto tweak = [](int r, GdrLinkConfig& c, GdrLinkOps&) { c.op_timeout = r == 0 ? 2s : 10s; };
    Ring ring(3, 2, 64, 1, 10s, 1, false, true, false, tweak);
    ASSERT_EQ(ring.error(), "");
    ring.sit_out[2] = true;
    const size_t count = 4001;
    auto send = inputs(3, count);
    std::vector<std::vector<int64_t>> recv(3, std::vector<int64_t>(count, -1));
    const auto t0 = Clock::now();
    auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv);
    EXPECT_LT(Clock::now() - t0, 8s);
    for (int r = 0; r < 2; ++r) EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_NE(ring.abort_reason().find("made no progress"), std::string::npos) << ring.abort_reason();
  }
  gradsync::log::get("test")->sinks().pop_back();
  const std::string text = captured.str();
  const size_t at = text.find("rank 1: stopped by the abort with messages outstanding");
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_NE(text.find("ms before, a second into the stall: waiting to send message 2 to rank 2 (host n2)"),
            std::string::npos)
      << text;
}

// No RDMA device on one rank's node: nobody takes the link, and each rank says who lacks it.
// Rank r of a two-rank world on `hosts`, with 2 slots of 64 bytes on `device` (emulated).
GdrLinkConfig two_rank_config(int r, std::vector<std::string> hosts, const std::string& device) {
  GdrLinkConfig c;
  c.who = "rank " + std::to_string(r);
  c.rank = r;
  c.world_size = 2;
  c.hosts = std::move(hosts);
  c.verbs_device = device;
  c.verbs_api = verbs::emulated_ibv()->name;
  c.slot_bytes = 64;
  c.slots = 2;
  c.log_name = "test";
  return c;
}

TEST(GdrLink, ARankWithoutDeviceLeavesEveryRankWithout) {
  ThreadAllreduce ar(2);
  std::vector<std::string> why(2);
  std::vector<Status> st(2);
  std::vector<GdrWords> words(2);
  const std::string dev = "gdrlink-nodev" + std::to_string(++g_job);
  verbs::EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      GdrLinkConfig c = two_rank_config(r, {"a", "b"}, r == 0 ? dev : "");  // rank 1's node runs TCP
      GdrLinkOps ops;
      ops.allreduce_now = [&](const void* s, void* d, size_t k, DataType t, ReduceOp o) { return ar.run(s, d, k, t, o); };
      ops.abort_reason = [] { return std::string(); };
      c.peers = {{1 - r, true, true}};
      auto link = GdrLink::create(c, ops, host_region, &words[r], nullptr, &why[r]);
      st[r] = link.ok() && *link ? Status(Code::kInternal, "a link was made") : link.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(st[r].ok()) << st[r].to_string();
  EXPECT_NE(why[0].find("not possible on rank 1 (host b)"), std::string::npos) << why[0];
  EXPECT_NE(why[1].find("runs no verbs channels"), std::string::npos) << why[1];
}

// Two ranks of one node as direct peers; rank 1 cannot map rank 0's region: neither gets a
// link, both learn that direct peers were the cause (the GPU half then sets up again with
// queue pairs), and the same set-up without direct peers works.
TEST(GdrLink, ARankThatCannotMapItsPeerRefusesDirectOnEveryRank) {
  ThreadAllreduce ar(2);
  const std::string dev = "gdrlink-direct" + std::to_string(++g_job);
  verbs::EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
  for (bool direct : {true, false}) {
    std::vector<std::string> why(2);
    std::vector<bool> refused(2, false);
    std::vector<Result<std::unique_ptr<GdrLink>>> made;
    for (int r = 0; r < 2; ++r) made.emplace_back(Status(Code::kInternal, "not run"));
    std::vector<GdrWords> words(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        GdrLinkConfig c = two_rank_config(r, {"a", "a"}, dev);
        c.peers = {{1 - r, true, true, direct}};
        GdrLinkOps ops;
        ops.allreduce_now = [&](const void* s, void* d, size_t k, DataType t, ReduceOp o) { return ar.run(s, d, k, t, o); };
        ops.abort_reason = [] { return std::string(); };
        ops.direct_make = thread_direct_region;
        ops.direct_open = [r](const uint8_t* h, int rank) -> Result<GdrDirectRegion> {
          if (r == 1) return Status(Code::kUnavailable, "no peer access (test)");
          return open_thread_region(h, rank);
        };
        bool ref = false;
        made[size_t(r)] = GdrLink::create(c, ops, host_region, &words[size_t(r)], nullptr, &why[size_t(r)], &ref);
        refused[size_t(r)] = ref;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(made[size_t(r)].ok()) << made[size_t(r)].status().to_string();
      EXPECT_EQ(*made[size_t(r)] == nullptr, direct) << "rank " << r << " direct " << direct << ": " << why[size_t(r)];
      EXPECT_EQ(refused[size_t(r)], direct) << "rank " << r;
    }
    if (direct) {
      EXPECT_NE(why[1].find("mapping the memory of rank 0"), std::string::npos) << why[1];
    }
  }
}

}  // namespace
}  // namespace gradsync
