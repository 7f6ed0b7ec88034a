// One-shot and two-shot as schedules of the step runner (gpu/step_runner.h) on the CPU: one
// node whose ranks (threads) are all direct peers of each other (mapped memory, as CUDA IPC on
// the GPU; no RDMA device), the channels with the node's direct pairs (rdma_channels' `pairs`),
// the planner's one-shot and two-shot steps (gpu/plan/schedule.h) through the same StepRunner
// and host stream as the ring and trees (gdr_link_world.h). Every collective exact at odd
// counts, in place too, with ring calls in between on the same peers; the bytes each rank's
// link sent are the planner's: one-shot allreduce (n-1) S, two-shot 2 (n-1) segments at most.
#include "gdr_link_world.h"
#include "gpu/plan/schedule.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;
using plan::Algo;

Ring pair_ring(int n) {
  return Ring(n, 2, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false, /*tcp=*/false, {}, /*pairs=*/true);
}

// Rank r's two-shot segment of `count` int64 (segment s: [s seg, (s+1) seg) cut at count).
uint64_t seg_len(size_t count, int n, int s) {
  const size_t seg = plan::two_shot_segment(count, 8, n, 256);
  return std::min<uint64_t>(seg, count > size_t(s) * seg ? count - size_t(s) * seg : 0);
}

// What rank r sends in a two-shot allreduce (broadcast from `root` with `bcast`): the other
// ranks' segments to them (the root alone, broadcasting), then its own to every peer.
uint64_t two_shot_bytes(size_t count, int n, int r, bool bcast = false, int root = 0) {
  uint64_t elems = uint64_t(n - 1) * seg_len(count, n, r);
  if (!bcast || r == root)
    for (int s = 0; s < n; ++s)
      if (s != r) elems += seg_len(count, n, s);
  return elems * 8;
}

// The bytes every rank's link sent since `before` (updated to now).
std::vector<uint64_t> sent_since(Ring& ring, int n, std::vector<uint64_t>& before) {
  std::vector<uint64_t> d(static_cast<size_t>(n), 0);
  for (int r = 0; r < n; ++r) {
    const uint64_t now = ring.bytes_sent(r);
    d[size_t(r)] = now - before[size_t(r)];
    before[size_t(r)] = now;
  }
  return d;
}

class PairSteps : public ::testing::TestWithParam<int> {};

// Allreduce by one-shot and two-shot (and the ring between them, on the same peers) at counts
// 1, 7 and 2053, out of place and in place (a fold whose own operand is third or later writes
// its own operand in one pass); the bytes per rank exact.
TEST_P(PairSteps, AllreduceExactWithThePlannersBytes) {
  const int n = GetParam();
  Ring ring = pair_ring(n);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(ring.channels(r).pairs.size(), 1) << "rank " << r;
    ASSERT_EQ(ring.link(r).peer_count(), n - 1) << "rank " << r << ": every other rank of the node";
    for (int p = 0; p < n - 1; ++p) {
      EXPECT_TRUE(ring.link(r).peer(p).direct && ring.link(r).peer(p).send && ring.link(r).peer(p).recv)
          << "rank " << r << " peer " << ring.link(r).peer(p).rank;
    }
  }
  EXPECT_EQ(ring.link(0).region_bytes(), 0u) << "no NIC";
  std::vector<uint64_t> before(size_t(n), 0);
  for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
    for (bool in_place : {false, true}) {
      for (Algo algo : {Algo::kOneShot, Algo::kRing, Algo::kTwoShot}) {
        const std::string what = std::string(plan::to_string(algo)) + " 1x" + std::to_string(n) + " count " +
                                 std::to_string(count) + (in_place ? " in place" : "");
        auto send = inputs(n, count);
        const auto want = send;
        std::vector<std::vector<int64_t>> out(n, std::vector<int64_t>(count, -1));
        auto& recv = in_place ? send : out;
        auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
        const auto sent = sent_since(ring, n, before);
        for (int r = 0; r < n; ++r) {
          ASSERT_TRUE(st[r].ok()) << what << " rank " << r << ": " << st[r].to_string();
          for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[r][i], sum_at(want, i)) << what << " rank " << r << " i " << i;
          const uint64_t S = count * 8, seg = plan::two_shot_segment(count, 8, n, 256) * 8;
          if (algo == Algo::kOneShot) {
            EXPECT_EQ(sent[size_t(r)], uint64_t(n - 1) * S) << what << " rank " << r;
          } else if (algo == Algo::kTwoShot) {
            EXPECT_EQ(sent[size_t(r)], two_shot_bytes(count, n, r)) << what << " rank " << r;
            EXPECT_LE(sent[size_t(r)], 2 * uint64_t(n - 1) * seg) << what << " rank " << r;
            if (S >= uint64_t(n) * seg) {
              EXPECT_EQ(sent[size_t(r)], 2 * uint64_t(n - 1) * seg) << what << " rank " << r;
            }
          }
        }
        if (count == 2053 && !in_place && algo != Algo::kRing) {
          std::printf("1x%d %s allreduce of S = %zu B: rank 0 sent %llu B, rank %d %llu B (one-shot (n-1) S = %llu, "
                      "two-shot 2 (n-1) seg = %llu)\n",
                      n, plan::to_string(algo), count * 8, (unsigned long long)sent[0], n - 1,
                      (unsigned long long)sent[size_t(n - 1)], (unsigned long long)(uint64_t(n - 1) * count * 8),
                      (unsigned long long)(2 * uint64_t(n - 1) * plan::two_shot_segment(count, 8, n, 256) * 8));
        }
      }
    }
  }
}

// reduce_scatter, all_gather and broadcast by one-shot and two-shot (two-shot's reduce_scatter
// and all_gather are one-shot's): exact, and reduce_scatter and all_gather send (n-1)/n of
// the full buffer per rank; broadcast: the root (n-1) S by one-shot, the segments by two-shot.
TEST_P(PairSteps, TheOtherCollectivesExact) {
  const int n = GetParam();
  Ring ring = pair_ring(n);
  ASSERT_EQ(ring.error(), "");
  std::vector<uint64_t> before(size_t(n), 0);
  for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
    SCOPED_TRACE(std::string(plan::to_string(algo)) + " 1x" + std::to_string(n));
    expect_reduce_scatter(ring, n, 333, algo);
    auto sent = sent_since(ring, n, before);
    for (int r = 0; r < n; ++r) EXPECT_EQ(sent[size_t(r)], uint64_t(n - 1) * 333 * 8) << "reduce_scatter rank " << r;
    // all_gather of 77 per rank, then a broadcast of 1001 from rank n-1.
    expect_all_gather_and_broadcast(ring, n, algo, algo);
    sent = sent_since(ring, n, before);
    for (int r = 0; r < n; ++r) {
      const uint64_t gather = uint64_t(n - 1) * 77 * 8;
      const uint64_t bcast = algo == Algo::kOneShot ? (r == n - 1 ? uint64_t(n - 1) * 1001 * 8 : 0)
                                                    : two_shot_bytes(1001, n, r, true, n - 1);
      EXPECT_EQ(sent[size_t(r)], gather + bcast) << "all_gather and broadcast rank " << r;
    }
    // A broadcast of an odd count from rank 0 too (two-shot: rank 0 owns the first segment).
    auto buf = inputs(n, 2053);
    const auto root_data = buf[0];
    std::vector<std::vector<int64_t>> unused;
    auto st = ring.collective(CollectiveKind::kBroadcast, {2053}, 0, unused, buf, algo);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      ASSERT_EQ(buf[r], root_data) << "broadcast rank " << r;
    }
    (void)sent_since(ring, n, before);
  }
}

// What the runner asks of the stream per step, at most (a one-node step table, kernels/cuda_step.cuh,
// holds 128 waits, operations and signals: a step must fit one).
struct StepFigures {
  int waits = 0, ops = 0, signals = 0;
};
class CountingStream final : public StepStream {
 public:
  CountingStream(StepStream& inner, StepFigures* most) : in_(inner), most_(*most) {}
  Status begin_step() override {
    now_ = {};
    return in_.begin_step();
  }
  Status end_step() override {
    most_.waits = std::max(most_.waits, now_.waits);
    most_.ops = std::max(most_.ops, now_.ops);
    most_.signals = std::max(most_.signals, now_.signals);
    return in_.end_step();
  }
  Status begin_call(bool relative) override { return in_.begin_call(relative); }
  Status end_call() override { return in_.end_call(); }
  Status wait_arrived(int p, int64_t v) override { return ++now_.waits, in_.wait_arrived(p, v); }
  Status wait_send_free(int p, int64_t v) override { return ++now_.waits, in_.wait_send_free(p, v); }
  Status signal_ready(int p, uint64_t v) override { return ++now_.signals, in_.signal_ready(p, v); }
  Status signal_consumed(int p, uint64_t v) override { return ++now_.signals, in_.signal_consumed(p, v); }
  Status copy(StepBuf d, StepBuf s, size_t b) override { return ++now_.ops, in_.copy(d, s, b); }
  // A fold of k operands is k - 1 operations of the step kernel's table (a run of chained ones).
  Status fold(StepBuf d, StepBuf d2, const StepBuf* x, int k, size_t n, bool final) override {
    return now_.ops += k - 1, in_.fold(d, d2, x, k, n, final);
  }

 private:
  StepStream& in_;
  StepFigures& most_;
  StepFigures now_;
};

// At 1x8 a one-shot allreduce step receives from 7 peers and folds 8 operands: 7 waits, a fold
// of 7 table operations (one chained run), 7 signals; two-shot's reduce step also sends to the 7
// (its slots wrap after 2 messages: 14 waits, the fold's 7 operations and 6 copies, 14
// signals). Both far within a step table.
TEST(PairSteps, AStepOfSevenPeersAtEightRanks) {
  const int n = 8;
  Ring ring = pair_ring(n);
  ASSERT_EQ(ring.error(), "");
  std::vector<StepFigures> most(static_cast<size_t>(n));
  ring.wrap_stream = [&](int r, StepStream& hs) { return std::make_unique<CountingStream>(hs, &most[size_t(r)]); };
  for (Algo algo : {Algo::kOneShot, Algo::kTwoShot}) {
    for (int call = 0; call < 2; ++call) {  // the second call's sends wait for free slots
      auto send = inputs(n, 2053);
      std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(2053, -1));
      auto st = ring.collective(CollectiveKind::kAllreduce, {2053}, 0, send, recv, algo);
      for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      for (int r = 0; r < n; ++r) ASSERT_EQ(recv[r][2052], sum_at(send, 2052)) << plan::to_string(algo);
    }
    for (int r = 0; r < n; ++r) {
      const StepFigures& f = most[size_t(r)];
      if (algo == Algo::kOneShot) {
        EXPECT_EQ(f.waits, 7) << "rank " << r;
        EXPECT_EQ(f.ops, 7) << "rank " << r << ": a fold of 8 operands, or 7 copies to the send slots";
        EXPECT_EQ(f.signals, 7) << "rank " << r;
      } else {
        EXPECT_EQ(f.waits, 14) << "rank " << r;
        EXPECT_EQ(f.ops, 13) << "rank " << r;
        EXPECT_EQ(f.signals, 14) << "rank " << r;
      }
      EXPECT_LE(std::max({f.waits, f.ops, f.signals}), 128) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(OneNode, PairSteps, ::testing::Values(2, 3, 4, 8),
                         [](const auto& info) { return "x1_" + std::to_string(info.param); });

// The pairs' peers: every other rank of one node, symmetric (a sends to b exactly where b
// receives from a), only when asked; no one-shot or two-shot across nodes (the hierarchical
// channels instead) or beyond 8 ranks, where they fail clearly, naming the rank and why.
TEST(PairSteps, OnlyWhenAskedOnOneNodeOfAtMostEight) {
  auto channels = [](int nodes, int per, int me, bool pairs) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (int r = 0; r < nodes * per; ++r) {
      members.push_back(r);
      hosts.push_back("n" + std::to_string(r / per));
    }
    auto ch = rdma_channels(members, hosts, me, /*direct=*/true, pairs);
    EXPECT_TRUE(ch.ok()) << ch.status().to_string();
    return ch.ok() ? std::move(ch).value() : RdmaChannels{};
  };
  std::vector<RdmaChannels> all;
  for (int r = 0; r < 8; ++r) all.push_back(channels(1, 8, r, true));
  for (int r = 0; r < 8; ++r) {
    ASSERT_EQ(all[size_t(r)].peers.size(), 7u) << "rank " << r;
    for (const GdrPeer& p : all[size_t(r)].peers) {
      auto back = std::find_if(all[size_t(p.rank)].peers.begin(), all[size_t(p.rank)].peers.end(),
                               [&](const GdrPeer& q) { return q.rank == r; });
      ASSERT_NE(back, all[size_t(p.rank)].peers.end()) << r << " -> " << p.rank;
      EXPECT_EQ(p.send, back->recv) << r << " -> " << p.rank;
      EXPECT_EQ(p.recv, back->send) << r << " -> " << p.rank;
    }
  }
  const RdmaChannels without = channels(1, 8, 3, false);
  EXPECT_EQ(without.pairs.size(), 0);
  EXPECT_EQ(without.peers.size(), 2u) << "the ring's and the chain's neighbours";
  auto steps = rdma_steps(without, CollectiveKind::kAllreduce, Algo::kOneShot, 100, 8, 0, 256);
  ASSERT_FALSE(steps.ok());
  EXPECT_EQ(steps.status().code(), Code::kInvalidArgument);
  EXPECT_NE(steps.status().message().find("rank 3: one-shot needs the direct pairs"), std::string::npos)
      << steps.status().message();
  EXPECT_NE(steps.status().message().find("set up without them"), std::string::npos) << steps.status().message();

  const RdmaChannels two_nodes = channels(2, 2, 1, true);
  EXPECT_EQ(two_nodes.pairs.size(), 0);
  // Across nodes the pairs are the hierarchical channels' (gdr_link_hier_test.cc): rank 1 gains
  // its rail neighbour on the other node, rank 3, and no one-shot or two-shot.
  EXPECT_GT(two_nodes.hier.size(), 0);
  EXPECT_EQ(two_nodes.peers.size(), channels(2, 2, 1, false).peers.size() + 1);
  EXPECT_TRUE(std::any_of(two_nodes.peers.begin(), two_nodes.peers.end(), [](const GdrPeer& p) { return p.rank == 3; }));
  steps = rdma_steps(two_nodes, CollectiveKind::kAllreduce, Algo::kTwoShot, 100, 8, 0, 256);
  ASSERT_FALSE(steps.ok());
  EXPECT_EQ(steps.status().code(), Code::kInvalidArgument);
  EXPECT_NE(steps.status().message().find("rank 1: two-shot needs the direct pairs"), std::string::npos)
      << steps.status().message();
  EXPECT_NE(steps.status().message().find("one node only, the shape has 2"), std::string::npos)
      << steps.status().message();

  const RdmaChannels nine = channels(1, 9, 0, true);
  EXPECT_EQ(nine.pairs.size(), 0);
  steps = rdma_steps(nine, CollectiveKind::kBroadcast, Algo::kOneShot, 100, 8, 0, 256);
  ASSERT_FALSE(steps.ok());
  EXPECT_NE(steps.status().message().find("at most 8 ranks"), std::string::npos) << steps.status().message();
  // The ring and trees of those channels are as they were.
  EXPECT_TRUE(rdma_steps(two_nodes, CollectiveKind::kAllreduce, Algo::kTree, 100, 8, 0, 256).ok());
}

// The cost model on one node's pairs (GRADSYNC_GPU_NODE_STEPS=1, every call on the steps):
// one-shot and two-shot are among its choices, beside the ring and trees. One-shot (one hop)
// takes the smallest calls; large calls go to an algorithm that sends 2 (n-1)/n S per rank
// (ring or two-shot), never to one-shot's (n-1) S. Without the pairs neither is chosen.
TEST(PairSteps, TheCostModelChoosesAmongOneShotAndTwoShotOnThePairs) {
  for (int n : {3, 4, 8}) {
    std::vector<int> members;
    std::vector<std::string> hosts;
    for (int r = 0; r < n; ++r) {
      members.push_back(r);
      hosts.push_back("n0");
    }
    for (bool pairs : {true, false}) {
      auto ch = rdma_channels(members, hosts, 0, /*direct=*/true, pairs);
      ASSERT_TRUE(ch.ok()) << ch.status().to_string();
      rdma_choose_algos(*ch);
      std::printf("1x%d %s the pairs: %s\n", n, pairs ? "with" : "without", rdma_auto_summary(*ch).c_str());
      const Algo small = rdma_auto_algo(*ch, 8), large = rdma_auto_algo(*ch, size_t(256) << 20);
      if (pairs) {
        EXPECT_EQ(small, Algo::kOneShot) << n << ": " << rdma_auto_summary(*ch);
      } else {
        EXPECT_NE(small, Algo::kOneShot);
        EXPECT_NE(small, Algo::kTwoShot);
      }
      EXPECT_TRUE(large == Algo::kRing || large == Algo::kTwoShot) << n << ": " << rdma_auto_summary(*ch);
    }
  }
}

}  // namespace
}  // namespace gradsync
