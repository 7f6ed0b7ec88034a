// Cross-node channels over the verbs transport, on the emulated fabric (harness:
// daemon_cluster.h; tests/integration runs the same daemons as processes over TCP).
//
// Covered: the collectives matrix (every collective x type x op x algorithm, counts 0 to 5003,
// 4 KiB slots so that messages span many slots) over RC QPs with WRITE_WITH_IMM and credits;
// per-peer fallback to TCP when one node has no RDMA; fault injection (link down, QP error)
// mid-collective, which must fail every rank within the timeout with an error naming the peer.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "../unit/collective_matrix.h"
#include "client/daemon_client.h"
#include "daemon_cluster.h"
#include "topology/rail_devices.h"
#include "transport/verbs/node.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::DaemonCluster;
using testing::DaemonWorld;
using testing::g_clusters;
using verbs::EmulatedFabric;

// nodes, ranks per node, algorithm, rings
using Shape = std::tuple<int, int, Algorithm, uint32_t>;

class VerbsCollectives : public ::testing::TestWithParam<Shape> {};

TEST_P(VerbsCollectives, MatrixOverRcQueuePairs) {
  auto [nodes, per_node, algo, rings] = GetParam();
  DaemonCluster cluster({.nodes = nodes, .rings = rings});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (int i = 0; i < nodes; ++i) ASSERT_EQ(cluster.daemon(i).transport(), "verbs");
  DaemonWorld world(cluster, nodes, per_node, "matrix");
  ASSERT_EQ(world.join_error(), "");
  testing::allreduce_matrix(world, algo);
  testing::reduce_scatter_all_gather_broadcast_matrix(world, algo);
}

INSTANTIATE_TEST_SUITE_P(Shapes, VerbsCollectives,
                         ::testing::Values(Shape{2, 1, Algorithm::kRing, 1}, Shape{2, 1, Algorithm::kTree, 1},
                                           Shape{2, 2, Algorithm::kRing, 2}, Shape{2, 2, Algorithm::kTree, 1},
                                           Shape{3, 1, Algorithm::kRing, 1}, Shape{3, 1, Algorithm::kTree, 1},
                                           Shape{3, 2, Algorithm::kRing, 1}, Shape{3, 2, Algorithm::kTree, 1}),
                         [](const auto& info) {
                           const Shape& p = info.param;
                           return std::to_string(std::get<0>(p)) + "nodes_x" + std::to_string(std::get<1>(p)) +
                                  "_" + to_string(std::get<2>(p)) + "_rings" + std::to_string(std::get<3>(p));
                         });

// The shapes of the host-staged GPU path (gpu_collectives_test's StagedShapesAsProcesses) on the CPU: the
// same daemons as objects, channels over TCP, ring and tree, every collective.
class TcpCollectives : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(TcpCollectives, MatrixRingAndTree) {
  const auto [nodes, per_node] = GetParam();
  DaemonCluster cluster({.nodes = nodes, .transport = std::vector<std::string>(size_t(nodes), "tcp")});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, nodes, per_node, "tcp-matrix");
  ASSERT_EQ(world.join_error(), "");
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kTree}) {
    testing::allreduce_matrix(world, algo);
    testing::reduce_scatter_all_gather_broadcast_matrix(world, algo);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TcpCollectives, ::testing::Values(std::pair{2, 4}, std::pair{3, 2}),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "nodes_x" + std::to_string(info.param.second);
                         });

// InfiniBand ports: QPs addressed by LID without a GRH (RoCE, above, uses GIDs).
TEST(VerbsTransport, InfiniBandChannelsAddressByLid) {
  DaemonCluster cluster({.nodes = 2, .link_layer = verbs::LinkLayer::kInfiniBand});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_EQ(cluster.daemon(0).transport(), "verbs");
  DaemonWorld world(cluster, 2, 1, "infiniband");
  ASSERT_EQ(world.join_error(), "");
  testing::allreduce_matrix(world, Algorithm::kRing);
}

// A node without RDMA: channels to and from it run over TCP, the others over verbs.
TEST(VerbsTransport, PeerWithoutRdmaGetsTcpChannels) {
  DaemonCluster cluster({.nodes = 3, .transport = {"verbs", "verbs", "tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  EXPECT_EQ(cluster.daemon(0).transport(), "verbs");
  EXPECT_EQ(cluster.daemon(2).transport(), "tcp");
  DaemonWorld world(cluster, 3, 1, "mixed");
  ASSERT_EQ(world.join_error(), "");
  // What `gradsyncctl describe mixed` shows per rank: the daemon of ranks 0 and 1 has RDMA.
  auto d = cluster.describe("mixed", 3);
  ASSERT_EQ(d.paths_size(), 3);
  EXPECT_EQ(d.paths(0).path(), "host-channels");
  EXPECT_NE(d.paths(0).why().find("2 rank(s) on other nodes through gradsyncd over RDMA where their node has it"),
            std::string::npos) << d.paths(0).why();
  EXPECT_NE(d.paths(2).why().find("over TCP"), std::string::npos) << d.paths(2).why();
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kTree}) {
    const size_t count = 70001;  // many slots of 4 KiB
    std::vector<std::vector<float>> buf(3, std::vector<float>(count));
    auto st = world.run([&](int r) {
      for (size_t i = 0; i < count; ++i) buf[r][i] = float(r + 1) * float(i % 97);
      return world.comm(r).allreduce(buf[r].data(), count, DataType::kFloat32, ReduceOp::kSum, {algo});
    });
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(buf[r][i], 6.0f * float(i % 97)) << "rank " << r << " i " << i;
    }
  }
}

TEST(VerbsTransport, ForcedVerbsOnAMissingDeviceFailsAtStart) {
  // Another device exists, so the error is about the name, not about an empty fabric.
  EmulatedFabric::instance().add_device("present-hca" + std::to_string(++g_clusters), 1, verbs::LinkLayer::kEthernet);
  coordinator::CoordinatorServer coord;
  ASSERT_TRUE(coord.start("127.0.0.1:0").ok());
  DaemonConfig cfg;
  cfg.coordinator = "127.0.0.1:" + std::to_string(coord.port());
  cfg.socket_path = "/tmp/gsverbs-missing-" + std::to_string(::getpid()) + ".sock";
  cfg.transport = "verbs";
  cfg.ibv = verbs::emulated_ibv();
  cfg.verbs_device = "no-such-hca";
  Daemon d(cfg);
  Status s = d.start();
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_NE(s.message().find("no-such-hca"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("GRADSYNC_TRANSPORT=verbs"), std::string::npos) << s.to_string();
}

// Each GPU's rail device in the join reply (topology/rail_devices.h): node 0's topology file
// gives its 6 GPUs, in order, the daemon's own device, a second RoCE device, an InfiniBand one
// (another link layer), a RoCE device whose port is down, a NIC the fabric does not have, and
// no NIC at all. Only the first two can stand in for the daemon's device.
TEST(VerbsTransport, JoinReplyListsEachGpusRailDevice) {
  const std::string tag = "rail" + std::to_string(++g_clusters);
  auto& fabric = EmulatedFabric::instance();
  fabric.add_device(tag + "roce", 1, verbs::LinkLayer::kEthernet);
  fabric.add_device(tag + "ib", 1, verbs::LinkLayer::kInfiniBand);
  fabric.add_device(tag + "down", 1, verbs::LinkLayer::kEthernet);
  fabric.set_link_down(tag + "down", 1);
  const std::vector<std::string> nics = {"", tag + "roce", tag + "ib", tag + "down", tag + "absent"};
  DaemonCluster cluster({.nodes = 1, .topo = [&](int, const std::string& own) {
                           std::string t;
                           for (int g = 0; g < 6; ++g) t += "gpu 0000:1" + std::to_string(g) + ":00.0 device=0\n";
                           for (size_t n = 0; n < nics.size(); ++n) {
                             const std::string name = n == 0 ? own : nics[n];
                             t += "nic " + name + "\ndistance " + std::to_string(n) + " " + name + " PIX\n";
                           }
                           return t + "rail 5 none\n";
                         }});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_EQ(cluster.daemon(0).transport(), "verbs");

  // Why the others cannot stand in, as gradsyncd's start-up log says it.
  auto own = VerbsNode::open(verbs::emulated_ibv(), cluster.device(0), 1, -1);
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  EXPECT_EQ((*own)->stand_in_refusal(cluster.device(0)), "");
  EXPECT_EQ((*own)->stand_in_refusal(tag + "roce"), "");
  EXPECT_NE((*own)->stand_in_refusal(tag + "ib").find("is InfiniBand, " + cluster.device(0) + " is RoCE"),
            std::string::npos) << (*own)->stand_in_refusal(tag + "ib");
  EXPECT_NE((*own)->stand_in_refusal(tag + "down").find("not ACTIVE"), std::string::npos);
  EXPECT_NE((*own)->stand_in_refusal(tag + "absent").find("not found"), std::string::npos);

  auto client = DaemonClient::connect(cluster.socket(0), deadline_after(10s));
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  auto reply = client->call(wire::JoinRequest{"rails", "rails-token", 0, 1, 0, 1, 10000}, deadline_after(15s));
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  const auto* join = std::get_if<wire::JoinResponse>(&reply.value());
  ASSERT_NE(join, nullptr);
  ASSERT_TRUE(join->verbs.has_value());
  EXPECT_EQ(join->verbs->device, cluster.device(0));
  EXPECT_EQ(join->verbs->rail_devices,
            (std::vector<std::string>{cluster.device(0), tag + "roce", "", "", "", ""}));
  // What ranks on GPUs 1, 3 and 7 (beyond the list) pick.
  EXPECT_EQ(topology::rank_rdma_device(join->verbs->rail_devices, 1, join->verbs->device).device, tag + "roce");
  EXPECT_EQ(topology::rank_rdma_device(join->verbs->rail_devices, 3, join->verbs->device).device, cluster.device(0));
  EXPECT_EQ(topology::rank_rdma_device(join->verbs->rail_devices, 7, join->verbs->device).device, cluster.device(0));
  EXPECT_TRUE(client->call(wire::LeaveRequest{}, deadline_after(10s)).ok());
}

// Runs large allreduces on every rank until one fails, injects `fault` after the first few,
// and checks that every rank fails within the deadline with an error that names a peer.
void expect_fault_fails_every_rank(const std::function<void(DaemonCluster&)>& fault,
                                   const std::vector<std::string>& must_mention) {
  DaemonCluster cluster({.nodes = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 2, 2, "fault", 20s);
  ASSERT_EQ(world.join_error(), "");
  std::atomic<int> calls{0};
  std::atomic<bool> injected{false};
  const auto start = std::chrono::steady_clock::now();
  std::thread injector([&] {
    while (calls.load() < 8 && std::chrono::steady_clock::now() - start < 20s) std::this_thread::sleep_for(1ms);
    fault(cluster);
    injected = true;
  });
  std::vector<Clock::time_point> failed_at(4);
  auto st = world.run([&](int r) {
    std::vector<float> buf(1 << 18, 1.0f);  // 1 MiB: 256 slots of 4 KiB per call
    for (int i = 0; i < 100000; ++i) {
      Status s = world.comm(r).allreduce(buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      calls.fetch_add(1);
      if (!s.ok()) {
        failed_at[r] = Clock::now();
        return s;
      }
      if (injected && std::chrono::steady_clock::now() - start > 60s) break;
    }
    return Status::Ok();
  });
  injector.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(st[r].ok()) << "rank " << r << " never saw the fault";
    const std::string& m = st[r].message();
    // Each entry is a set of alternatives separated by '|': which daemon sees its error
    // completion first (and so whose reason wins) is a race.
    for (const auto& alternatives : must_mention) {
      bool found = false;
      for (size_t at = 0; at <= alternatives.size();) {
        size_t bar = std::min(alternatives.find('|', at), alternatives.size());
        found = found || m.find(alternatives.substr(at, bar - at)) != std::string::npos;
        at = bar + 1;
      }
      EXPECT_TRUE(found) << "rank " << r << " does not mention " << alternatives << ": " << m;
    }
    EXPECT_NE(m.find("rank "), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_LT(failed_at[r] - start, 40s) << "rank " << r;
  }
}

TEST(VerbsFaults, LinkDownMidCollectiveFailsEveryRankNamingThePeer) {
  expect_fault_fails_every_rank(
      [](DaemonCluster& c) { EmulatedFabric::instance().set_link_down(c.device(1), 1); },
      {"RDMA", "transport retry counter exceeded|Work Request Flushed Error", "gradsyncd 127.0.0.1:"});
}

TEST(VerbsFaults, QpErrorMidCollectiveFailsEveryRankNamingThePeer) {
  expect_fault_fails_every_rank(
      [](DaemonCluster& c) { EXPECT_GT(EmulatedFabric::instance().force_device_qp_errors(c.device(0)), 0); },
      {"RDMA", "Work Request Flushed Error|transport retry counter exceeded", "gradsyncd 127.0.0.1:"});
}

}  // namespace
}  // namespace gradsync
