// The RDMA link and the step runner on the CPU (gdr_link_world.h) over nodes of several ranks:
// the ring chained inside each node, the trees' chains and double binary tree, the hops inside
// a node through the NIC or direct (mapped memory, as CUDA IPC on the GPU), and one node of
// direct peers alone, with no RDMA device.
#include "gdr_link_world.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;

// Nodes of several ranks (each node's ranks share its device): the ring chains each node's
// ranks and crosses between nodes once per node; the trees chain each node and join the nodes'
// heads in a double binary tree. Allreduce on both, int64 sum and int32 max, odd counts, one
// call after another; then the other collectives on the ring. Every result exact.
// With `direct`, the hops inside a node go through the peers' memory, as CUDA IPC does on the
// GPU, and only the hops between nodes are queue pairs.
class GdrLinkShapes : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(GdrLinkShapes, RingAndTreeOverNodes) {
  const auto [nodes, per, direct] = GetParam();
  const int n = nodes * per;
  Ring ring(n, 2, 256, per, 10s, 1, direct);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      EXPECT_EQ(ring.link(r).peer(p).direct, direct && ring.link(r).peer(p).rank / per == r / per)
          << "rank " << r << " peer " << ring.link(r).peer(p).rank;
    }
  }
  EXPECT_EQ(ring.channels(0).shape.node_count(), nodes);
  EXPECT_EQ(ring.channels(0).tree.size(), 2) << "two trees";
  for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        const DataType type = op == ReduceOp::kSum ? DataType::kInt64 : DataType::kInt32;
        auto send = inputs(n, count);
        if (op == ReduceOp::kMax) {
          for (int r = 0; r < n; ++r)
            for (size_t i = 0; i < count; ++i) send[r][i] = int64_t((i * 2654435761u + r * 40503u) % 1000003) << 20 | r;
        }
        std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
        auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo, op, type);
        for (int r = 0; r < n; ++r) {
          ASSERT_TRUE(st[r].ok()) << plan::to_string(algo) << " count " << count << " rank " << r << ": "
                                  << st[r].to_string();
        }
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < count; ++i) {
            if (op == ReduceOp::kSum) {
              int64_t want = 0;
              for (int q = 0; q < n; ++q) want += send[q][i];
              ASSERT_EQ(recv[r][i], want) << plan::to_string(algo) << " sum count " << count << " rank " << r;
            } else {
              int32_t want[2] = {INT32_MIN, INT32_MIN}, got[2];
              for (int q = 0; q < n; ++q) {
                int32_t v[2];
                std::memcpy(v, &send[q][i], 8);
                want[0] = std::max(want[0], v[0]);
                want[1] = std::max(want[1], v[1]);
              }
              std::memcpy(got, &recv[r][i], 8);
              ASSERT_EQ(got[0], want[0]) << plan::to_string(algo) << " max count " << count << " rank " << r;
              ASSERT_EQ(got[1], want[1]) << plan::to_string(algo) << " max count " << count << " rank " << r;
            }
          }
        }
      }
    }
  }
  const size_t count = 77;
  expect_reduce_scatter(ring, n, count, plan::Algo::kTree);  // a tree reduce_scatter takes the ring
  auto send = inputs(n, count * n);
  auto recv = inputs(n, count);
  const auto root_data = recv[1];
  auto st = ring.collective(CollectiveKind::kBroadcast, {count}, 1, send, recv, plan::Algo::kTree);
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    ASSERT_EQ(recv[r], root_data) << "broadcast rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdrLinkShapes,
                         ::testing::Values(std::make_tuple(2, 2, false), std::make_tuple(3, 2, false),
                                           std::make_tuple(2, 4, false), std::make_tuple(2, 2, true),
                                           std::make_tuple(3, 2, true), std::make_tuple(2, 4, true)),
                         [](const auto& info) {
                           return "x" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_direct" : "");
                         });

// Direct peers at 2 nodes x 4: the ring's hops inside a node move 2 (n-1)/n S through mapped
// memory, no queue pair is made for them, and only the node's exit ranks send over the NIC
// (S/n... per hop of the ring between nodes: the same 2 (n-1)/n S at the exit rank). The
// fabric's counters see the NIC bytes only.
TEST(GdrLink, DirectPeersKeepTheHopsInsideANodeOffTheNic) {
  const int nodes = 2, per = 4, n = nodes * per;
  Ring ring(n, 2, 256, per, 10s, 1, /*direct=*/true);
  ASSERT_EQ(ring.error(), "");
  const size_t count = 1024;  // int64: S = 8 KiB
  auto send = inputs(n, count);
  std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kRing);
  uint64_t nic_total = 0, direct_total = 0;
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; ++i) {
      int64_t want = 0;
      for (int q = 0; q < n; ++q) want += send[q][i];
      ASSERT_EQ(recv[r][i], want) << "rank " << r << " i " << i;
    }
    uint64_t sent = 0;
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      sent += ring.link(r).bytes_sent(p);
      (ring.link(r).peer(p).direct ? direct_total : nic_total) += ring.link(r).bytes_sent(p);
    }
    EXPECT_EQ(sent, 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
    EXPECT_GT(ring.link(r).direct_region_bytes(), 0u);
  }
  // One ring: each node has one exit rank, which sends its 2 (n-1)/n S over the NIC.
  EXPECT_EQ(nic_total, uint64_t(nodes) * 2 * (n - 1) * count * 8 / n);
  EXPECT_EQ(direct_total, uint64_t(n - nodes) * 2 * (n - 1) * count * 8 / n);
  EXPECT_NE(ring.link(0).describe().find("on this node, by CUDA IPC"), std::string::npos) << ring.link(0).describe();
}

// One node whose ranks are all direct peers needs no RDMA device: the planner's ring and trees
// run over mapped memory alone (the GPU communicator's ring and tree on one node, by CUDA
// IPC). Every collective exact at odd counts; the ring's allreduce sends 2 (n-1)/n S per rank,
// the trees' 2 S at most (a chain: up and down, half the data per tree).
TEST(GdrLink, OneNodeOfDirectPeersNeedsNoNic) {
  for (int n : {2, 3, 8}) {
    Ring ring(n, 2, 256, /*per_node=*/n, 10s, 1, /*direct=*/true, /*nic=*/false);
    ASSERT_EQ(ring.error(), "") << n << " ranks";
    EXPECT_NE(ring.link(0).describe().find("no NIC"), std::string::npos) << ring.link(0).describe();
    EXPECT_EQ(ring.link(0).region_bytes(), 0u);
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      std::vector<uint64_t> before(size_t(n), 0);
      for (int r = 0; r < n; ++r)
        for (int p = 0; p < ring.link(r).peer_count(); ++p) before[size_t(r)] += ring.link(r).bytes_sent(p);
      const size_t count = 1000 * size_t(n);  // int64: S = 8000 n bytes, a multiple of n
      auto send = inputs(n, count);
      std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
      auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo);
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(st[r].ok()) << n << " ranks, " << plan::to_string(algo) << ": " << st[r].to_string();
        for (size_t i = 0; i < count; ++i) {
          int64_t want = 0;
          for (int q = 0; q < n; ++q) want += send[q][i];
          ASSERT_EQ(recv[r][i], want) << n << " ranks, " << plan::to_string(algo) << " rank " << r;
        }
        uint64_t sent = 0;
        for (int p = 0; p < ring.link(r).peer_count(); ++p) sent += ring.link(r).bytes_sent(p);
        sent -= before[size_t(r)];
        if (algo == plan::Algo::kRing) EXPECT_EQ(sent, 2 * uint64_t(n - 1) * count * 8 / n) << "rank " << r;
        else EXPECT_LE(sent, 2 * uint64_t(count) * 8) << "rank " << r;
      }
    }
    expect_reduce_scatter(ring, n, 333, plan::Algo::kRing);
    expect_all_gather_and_broadcast(ring, n, plan::Algo::kRing);
  }
}

// Without an RDMA device, a rank with a peer on another node cannot set up, and every rank
// learns it (those whose peers are all on their node too).
TEST(GdrLink, APeerOnAnotherNodeNeedsTheNic) {
  // 2 x 4: ranks 2 and 3 (6 and 7) have only peers on their node; 0 and 1 (4 and 5) leave it
  // (the ring's exit, and the two trees' heads).
  Ring ring(8, 2, 256, /*per_node=*/4, 10s, 1, /*direct=*/true, /*nic=*/false);
  EXPECT_NE(ring.error().find("rank 0: UNAVAILABLE: GPUDirect RDMA: this node's gradsyncd runs no verbs channels"),
            std::string::npos)
      << ring.error();
  EXPECT_NE(ring.error().find("rank 2: UNAVAILABLE: GPUDirect RDMA is not possible on rank 0 (host n0)"),
            std::string::npos)
      << ring.error();
  for (int r = 0; r < 8; ++r) {
    EXPECT_NE(ring.error().find("rank " + std::to_string(r) + ":"), std::string::npos) << ring.error();
  }
}

}  // namespace
}  // namespace gradsync
