// The hierarchical allreduce on the step channels (gpu/step_runner.h's RdmaChannels::hier), on
// the CPU with the host loops (gdr_link_world.h): each node's pairs reduce-scatter and
// all-gather, and a ring per local index joins the nodes, each on its own rank's link. Exact at
// several shapes, with the hops between nodes over queue pairs of the emulated fabric or over
// TCP, and inside a node direct or through the NIC; each rank's bytes on each link class are the
// schedule's, 2 (g-1)/g S inside its node and 2 (k-1)/k S/g to the next node; the cost model
// takes it where its fewer bytes between nodes win; a set-up without the pairs refuses it by
// name.
#include "gdr_link_world.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using plan::Algo;

// nodes x per ranks, the pairs asked for (the hierarchical channels across nodes).
Ring hier_ring(int nodes, int per, bool direct, bool tcp) {
  return Ring(nodes * per, 2, 256, per, 10s, 1, direct, /*nic=*/!tcp, tcp, {}, /*pairs=*/true);
}

struct HierShape {
  int nodes, per;
  bool direct, tcp;
};

class HierSteps : public ::testing::TestWithParam<HierShape> {};

TEST_P(HierSteps, AllreduceExactBesideTheOtherAlgorithms) {
  const HierShape p = GetParam();
  const int n = p.nodes * p.per;
  Ring ring = hier_ring(p.nodes, p.per, p.direct, p.tcp);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) ASSERT_GT(ring.channels(r).hier.size(), 0) << "rank " << r;
  for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
    for (Algo algo : {Algo::kHierarchical, Algo::kRing, Algo::kTree, Algo::kHierarchical}) {
      expect_allreduce(ring, n, count, algo);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  // In place: the node's fold of its segment reads the own buffer with the peers' before
  // writing it.
  auto buf = inputs(n, 515);
  const auto want = buf;
  auto st = ring.collective(CollectiveKind::kAllreduce, {515}, 0, buf, buf, Algo::kHierarchical);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    for (size_t i = 0; i < 515; ++i) ASSERT_EQ(buf[r][i], sum_at(want, i)) << "in place, rank " << r << " i " << i;
  }
  // The other collectives asked for hierarchical take the ring.
  expect_reduce_scatter(ring, n, 333, Algo::kHierarchical);
  expect_all_gather_and_broadcast(ring, n, Algo::kHierarchical, Algo::kHierarchical);
}

INSTANTIATE_TEST_SUITE_P(Shapes, HierSteps,
                         ::testing::Values(HierShape{2, 2, true, false}, HierShape{2, 2, false, false},
                                           HierShape{2, 4, true, false}, HierShape{3, 2, true, false},
                                           HierShape{4, 2, false, false}, HierShape{2, 2, true, true},
                                           HierShape{3, 2, true, true}),
                         [](const auto& info) {
                           const HierShape& s = info.param;
                           return "x" + std::to_string(s.nodes) + "_" + std::to_string(s.per) +
                                  (s.direct ? "_direct" : "_nic") + (s.tcp ? "_tcp" : "");
                         });

// Bytes per rank and link class at 2 nodes x 4 (direct inside the node) and 4 x 2 (through the
// NIC): S = 8 count bytes, whole chunks of 32 elements (a slot of 256 bytes) that split evenly
// into the node's segments (8 and 16 elements) and the ring's pieces (4 each). Inside the node (g-1)/g S out for the
// reduce-scatter and as much for the all-gather; to the next node 2 (k-1)/k of the S/g segment.
TEST(HierSteps, EachRankSendsTheSchedulesBytesOnEachLinkClass) {
  for (HierShape p : {HierShape{2, 4, true, false}, HierShape{4, 2, false, false}}) {
    const int n = p.nodes * p.per, g = p.per, k = p.nodes;
    Ring ring = hier_ring(p.nodes, p.per, p.direct, p.tcp);
    ASSERT_EQ(ring.error(), "");
    const size_t count = 32 * 40;  // 40 chunks
    const uint64_t S = count * 8;
    std::vector<uint64_t> before_intra(size_t(n), 0), before_inter(size_t(n), 0);
    auto tally = [&](int r, uint64_t* intra, uint64_t* inter) {
      *intra = *inter = 0;
      for (int q = 0; q < ring.link(r).peer_count(); ++q) {
        const bool same = ring.link(r).peer(q).rank / g == r / g;
        (same ? *intra : *inter) += ring.link(r).bytes_sent(q);
      }
    };
    for (int r = 0; r < n; ++r) tally(r, &before_intra[size_t(r)], &before_inter[size_t(r)]);
    expect_allreduce(ring, n, count, Algo::kHierarchical);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    const uint64_t want_intra = 2 * uint64_t(g - 1) * S / uint64_t(g);
    const uint64_t want_inter = 2 * uint64_t(k - 1) * (S / uint64_t(g)) / uint64_t(k);
    for (int r = 0; r < n; ++r) {
      // The worker counts a write once it returned: the counts settle within a deadline.
      uint64_t intra = 0, inter = 0;
      for (const auto deadline = std::chrono::steady_clock::now() + 5s;;) {
        tally(r, &intra, &inter);
        intra -= before_intra[size_t(r)];
        inter -= before_inter[size_t(r)];
        if ((intra >= want_intra && inter >= want_inter) || std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(1ms);
      }
      EXPECT_EQ(intra, want_intra) << k << "x" << g << " rank " << r << ": inside its node";
      EXPECT_EQ(inter, want_inter) << k << "x" << g << " rank " << r << ": to the next node";
    }
  }
}

// Channels set up without the pairs have no hierarchical set: a call that forces it is refused,
// naming the rank and what is missing; one node, or nodes of different rank counts, never plan it.
TEST(HierSteps, RefusedWithoutThePairsOfEveryNode) {
  auto shape = [](std::vector<int> per_node, bool pairs, int me) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (size_t x = 0; x < per_node.size(); ++x)
      for (int l = 0; l < per_node[x]; ++l) {
        members.push_back(int(hosts.size()));
        hosts.push_back("n" + std::to_string(x));
      }
    auto ch = rdma_channels(members, hosts, me, true, pairs);
    EXPECT_TRUE(ch.ok()) << ch.status().to_string();
    return *ch;
  };
  const RdmaChannels without = shape({2, 2}, false, 1);
  EXPECT_EQ(without.hier.size(), 0);
  auto steps = rdma_steps(without, CollectiveKind::kAllreduce, Algo::kHierarchical, 100, 8, 0, 256);
  ASSERT_FALSE(steps.ok());
  EXPECT_EQ(steps.status().code(), Code::kInvalidArgument);
  EXPECT_NE(steps.status().message().find("rank 1: hierarchical needs the pairs of every node"), std::string::npos)
      << steps.status().message();
  EXPECT_EQ(shape({4}, true, 0).hier.size(), 0) << "one node: two-shot is its form";
  EXPECT_EQ(shape({2, 3}, true, 0).hier.size(), 0) << "nodes of different rank counts";
  const RdmaChannels with = shape({2, 2}, true, 1);
  EXPECT_GT(with.hier.size(), 0);
  EXPECT_TRUE(rdma_steps(with, CollectiveKind::kAllreduce, Algo::kHierarchical, 100, 8, 0, 256).ok());
  // Rank 1 of 2 x 2 reaches its node's rank 0 and its rail neighbour, rank 3, and no more than
  // the ring and trees already needed.
  for (const GdrPeer& peer : with.peers) EXPECT_TRUE(peer.rank == 0 || peer.rank == 2 || peer.rank == 3) << peer.rank;
}

// The cost model with the hierarchical channels (rdma_choose_algos), direct hops inside the
// node: the ring's busiest NIC sends 2 (n-1)/n S and the hierarchical rails 2 (k-1)/k S/g each,
// so hierarchical takes large calls everywhere. Small calls go by hops: at 2 nodes hierarchical
// has the fewest (2 inside the node, 2 between nodes, against the trees' chain of g - 1 each
// way), at 8 nodes the trees' log2 depth beats the rails' 2 (k-1) hops. The tables are printed.
TEST(HierSteps, TheCostModelTakesHierarchicalForLargeCalls) {
  for (auto [nodes, per] : {std::pair{2, 8}, std::pair{2, 4}, std::pair{8, 4}}) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (int r = 0; r < nodes * per; ++r) {
      members.push_back(r);
      hosts.push_back("n" + std::to_string(r / per));
    }
    auto ch = rdma_channels(members, hosts, 0, true, true);
    ASSERT_TRUE(ch.ok()) << ch.status().to_string();
    rdma_choose_algos(*ch);
    std::printf("%dx%d direct, with the pairs: %s\n", nodes, per, rdma_auto_summary(*ch).c_str());
    EXPECT_EQ(rdma_auto_algo(*ch, size_t(256) << 20), Algo::kHierarchical) << rdma_auto_summary(*ch);
    EXPECT_EQ(rdma_auto_algo(*ch, 8), nodes == 2 ? Algo::kHierarchical : Algo::kTree) << rdma_auto_summary(*ch);
  }
}

}  // namespace
}  // namespace gradsync
