// The pieces of the coordinator that keep a large rendezvous O(n): the generation's layout in
// runs (and the daemon's expansion of it), the channels of a few ring positions, the channel
// agreement folded from the nodes' offers, and heartbeat leases in a heap.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <string>
#include <vector>

#include "collectives/topology.h"
#include "coordinator/agreement.h"
#include "coordinator/job_layout.h"
#include "coordinator/leases.h"
#include "daemon/peer_layout.h"

namespace gradsync::coordinator {
namespace {

using std::chrono::milliseconds;

// Builds the layout of `owner_of` (node name per rank) and hands it back as a daemon sees it.
struct Built {
  JobLayout layout;
  v1::PeerTableResponse table;
};
Built build(const std::vector<std::string>& owner_of, const std::map<std::string, v1::GpuTopology>& topo = {}) {
  std::vector<const std::string*> owner;
  for (const auto& o : owner_of) owner.push_back(&o);
  std::unordered_map<std::string, const v1::GpuTopology*> topology_of;
  for (const auto& [id, t] : topo) topology_of[id] = &t;
  Built b{build_layout(owner, topology_of), {}};
  b.table.set_world_size(uint32_t(owner_of.size()));
  b.table.set_node_count(uint32_t(b.layout.node_ids.size()));
  for (const auto& r : b.layout.runs) *b.table.add_runs() = r;
  for (const auto& s : b.layout.shapes) *b.table.add_shapes() = s;
  return b;
}

TEST(JobLayout, UniformNodesAreOneRun) {
  std::vector<std::string> owner;
  for (int n = 0; n < 1000; ++n)
    for (int r = 0; r < 8; ++r) owner.push_back("n" + std::to_string(n));
  Built b = build(owner);
  ASSERT_EQ(b.layout.runs.size(), 1u);
  EXPECT_EQ(b.layout.runs[0].nodes(), 1000u);
  EXPECT_EQ(b.layout.runs[0].ranks_per_node(), 8u);
  auto l = expand_layout(b.table);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  for (uint32_t r = 0; r < 8000; ++r) {
    ASSERT_EQ(l->ring[r], r);
    ASSERT_EQ(l->rank_node[r], r / 8);
  }
}

// Nodes of interleaved ranks, of different sizes and shapes: the runs still give the ring
// (nodes by smallest rank, ranks ascending within) and each rank's node and topology.
TEST(JobLayout, IrregularNodesRoundTrip) {
  const std::vector<std::string> owner{"a", "b", "a", "c", "c", "b", "d", "d", "d", "e"};
  v1::GpuTopology gpu;
  gpu.set_source("nvml");
  gpu.add_gpus()->set_bus_id("0000:19:00.0");
  Built b = build(owner, {{"c", gpu}, {"e", gpu}});
  auto l = expand_layout(b.table);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->ring, (std::vector<uint32_t>{0, 2, 1, 5, 3, 4, 6, 7, 8, 9}));
  EXPECT_EQ(l->rank_node, (std::vector<uint32_t>{0, 1, 0, 2, 2, 1, 3, 3, 3, 4}));
  ASSERT_EQ(b.table.shapes_size(), 2);
  EXPECT_EQ(l->node_shape, (std::vector<uint32_t>{0, 0, 1, 0, 1}));
  for (uint32_t p = 0; p < l->ring.size(); ++p) EXPECT_EQ(l->position[l->ring[p]], p);
}

TEST(JobLayout, MalformedRunsAreRefused) {
  Built b = build({"a", "a", "b", "b"});
  v1::PeerTableResponse t = b.table;
  t.mutable_runs(0)->set_nodes(3);  // 6 ranks in a world of 4
  EXPECT_FALSE(expand_layout(t).ok());
  t = b.table;
  t.set_world_size(5);
  EXPECT_FALSE(expand_layout(t).ok());
  t = b.table;
  t.mutable_runs(0)->set_continues(true);
  EXPECT_FALSE(expand_layout(t).ok());
  t = b.table;
  t.mutable_runs(0)->set_shape(3);
  EXPECT_FALSE(expand_layout(t).ok());
  t = b.table;
  *t.add_runs() = t.runs(0);  // ranks twice
  t.set_world_size(8);
  EXPECT_FALSE(expand_layout(t).ok());
}

// The channels of some positions are exactly channel_edges()'s with an end there, so a daemon
// that plans only its own ranks' channels agrees with every other daemon.
TEST(ChannelEdgesAt, MatchesTheWholeGraphFiltered) {
  for (uint32_t n : {1u, 2u, 3u, 7u, 64u, 100u}) {
    std::vector<uint32_t> ring;
    for (uint32_t p = 0; p < n; ++p) ring.push_back((p + n / 3) % n);  // positions differ from ranks
    for (uint32_t rings : {1u, 3u}) {
      const auto all = channel_edges(ring, rings);
      for (size_t first = 0; first < n; first += 5) {
        std::vector<size_t> pos;
        std::set<uint32_t> mine;
        for (size_t p = first; p < std::min<size_t>(n, first + 4); ++p) {
          pos.push_back(p);
          mine.insert(ring[p]);
        }
        std::vector<Edge> want;
        for (const Edge& e : all) {
          if (mine.count(e.src) || mine.count(e.dst)) want.push_back(e);
        }
        EXPECT_EQ(channel_edges_at(ring, pos, rings), want) << "n=" << n << " first=" << first;
      }
    }
  }
}

TEST(OfferFold, AJobUsesTheGivenCountOrTheSmallestChoice) {
  auto fold = [](std::vector<std::tuple<uint32_t, bool, std::string>> offers) {
    OfferFold f;
    for (const auto& [rings, chosen, who] : offers) {
      v1::ChannelOffer o;
      o.set_rings(rings);
      o.set_rings_chosen(chosen);
      o.set_slots(8);
      o.set_slot_bytes(1024);
      f.add(o, who);
    }
    return f.result();
  };
  EXPECT_EQ(fold({{8, true, "a"}, {1, true, "b"}, {4, true, "c"}}).rings(), 1u);
  EXPECT_EQ(fold({{8, true, "a"}, {3, false, "b"}, {3, false, "c"}}).rings(), 3u);
  EXPECT_EQ(fold({{16, false, "a"}, {2, true, "b"}}).rings(), 16u);
  EXPECT_EQ(fold({}).rings(), 1u);
  EXPECT_EQ(fold({}).error(), "");
  auto clash = fold({{4, false, "node a-1 (host a)"}, {1, true, "node b-2 (host b)"}, {8, false, "node c-3 (host c)"}});
  EXPECT_NE(clash.error().find("node a-1 (host a) was started with rings=4 but node c-3 (host c) with rings=8"),
            std::string::npos)
      << clash.error();
  EXPECT_NE(fold({{17, false, "node b-2 (host b)"}}).error().find("node b-2 (host b) offers 17 rings"),
            std::string::npos);
}

TEST(Leases, ExpireOnlySilentNodesOldestFirst) {
  Leases leases(milliseconds(1000));
  const auto t0 = Leases::TimePoint{} + std::chrono::hours(1);
  leases.add("a", t0);
  leases.add("b", t0 + milliseconds(100));
  leases.add("c", t0 + milliseconds(200));
  EXPECT_TRUE(leases.renew("a", t0 + milliseconds(900)));
  EXPECT_TRUE(leases.expire(t0 + milliseconds(1099)).empty());
  auto gone = leases.expire(t0 + milliseconds(1250));
  ASSERT_EQ(gone.size(), 2u);
  EXPECT_EQ(gone[0].first, "b");
  EXPECT_EQ(gone[0].second, milliseconds(1150));
  EXPECT_EQ(gone[1].first, "c");
  EXPECT_FALSE(leases.renew("b", t0 + milliseconds(1300)));
  EXPECT_EQ(leases.expiry_reason(milliseconds(1150)), "no heartbeat for 1150 ms (lease 1000 ms)");
  leases.remove("a");
  leases.add("a", t0 + milliseconds(1300));  // again: its old heap entry must not expire it
  EXPECT_TRUE(leases.expire(t0 + milliseconds(2000)).empty());
  EXPECT_EQ(leases.expire(t0 + milliseconds(2300)).size(), 1u);
  EXPECT_EQ(leases.size(), 0u);
}

// Time the coordinator itself was stalled is not held against the nodes.
TEST(Leases, ACoordinatorStallExtendsEveryLease) {
  Leases leases(milliseconds(1000));
  const auto t0 = Leases::TimePoint{} + std::chrono::hours(1);
  leases.add("a", t0);
  leases.stalled(milliseconds(3000));
  EXPECT_TRUE(leases.expire(t0 + milliseconds(3999)).empty());
  auto gone = leases.expire(t0 + milliseconds(4000));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].second, milliseconds(1000));
}

// A registered node's first lease is longer by the grace it was given, until its first renewal.
TEST(Leases, AFreshNodeHasItsGraceUntilItsFirstHeartbeat) {
  Leases leases(milliseconds(1000));
  const auto t0 = Leases::TimePoint{} + std::chrono::hours(1);
  leases.add("new", t0, milliseconds(1000));
  leases.add("renewed", t0, milliseconds(1000));
  EXPECT_TRUE(leases.renew("renewed", t0 + milliseconds(100)));
  auto gone = leases.expire(t0 + milliseconds(1100));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].first, "renewed");  // its grace ended with its first renewal
  EXPECT_TRUE(leases.expire(t0 + milliseconds(1999)).empty());
  gone = leases.expire(t0 + milliseconds(2000));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].first, "new");
  EXPECT_EQ(gone[0].second, milliseconds(2000));  // silent since it registered
}

// Heartbeats read late because the coordinator's reads are behind (a queue of unread
// messages, not a late ticker) extend every lease by the rise of the median past the slack;
// a fall takes nothing back, and a window without samples reads as caught up.
TEST(Leases, ReadsBehindExtendEveryLease) {
  Leases leases(milliseconds(1000));
  const auto t0 = Leases::TimePoint{} + std::chrono::hours(1);
  const milliseconds slack(250);
  leases.add("a", t0);
  EXPECT_EQ(leases.update_behind(t0, slack), milliseconds(0));
  // A window is judged at 32 samples: 20 read 1,200 ms late and 12 on time give a median of
  // 1,200 ms, 950 past the slack.
  for (int i = 0; i < 20; ++i) leases.read_lag(milliseconds(1200));
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(100), slack), milliseconds(0));  // 20: not yet
  for (int i = 0; i < 12; ++i) leases.read_lag(milliseconds(0));
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(200), slack), milliseconds(1200));
  EXPECT_EQ(leases.behind(), milliseconds(1200));
  EXPECT_EQ(leases.stalled_total(), milliseconds(950));
  EXPECT_TRUE(leases.expire(t0 + milliseconds(1949)).empty());
  // Still 1,200 ms behind: nothing more is added.
  for (int i = 0; i < 32; ++i) leases.read_lag(milliseconds(1200));
  leases.update_behind(t0 + milliseconds(300), slack);
  EXPECT_EQ(leases.stalled_total(), milliseconds(950));
  // A single window of a few samples (under 32) is judged after a second: one slow stream does
  // not make a median, and noise under the slack adds nothing.
  for (int i = 0; i < 3; ++i) leases.read_lag(milliseconds(i == 0 ? 5000 : 10));
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(400), slack), milliseconds(1200));
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(1300), slack), milliseconds(10));
  EXPECT_EQ(leases.stalled_total(), milliseconds(950));
  // Behind again after catching up: the new rise is added.
  for (int i = 0; i < 32; ++i) leases.read_lag(milliseconds(750));
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(1400), slack), milliseconds(750));
  EXPECT_EQ(leases.stalled_total(), milliseconds(1450));
  auto gone = leases.expire(t0 + milliseconds(2450));
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].second, milliseconds(1000));  // the extension is not counted as silence
  // No samples for a second: caught up.
  EXPECT_EQ(leases.update_behind(t0 + milliseconds(2500), slack), milliseconds(0));
  // A stall of the ticker is counted once: the reads it delayed add only what exceeds it.
  leases.stalled(milliseconds(400));
  for (int i = 0; i < 32; ++i) leases.read_lag(milliseconds(850));
  leases.update_behind(t0 + milliseconds(2600), slack);
  EXPECT_EQ(leases.stalled_total(), milliseconds(1450 + 400 + 200));
}

}  // namespace
}  // namespace gradsync::coordinator
