// The planner's shape from discovered node topologies (runtime/gpu/plan/from_topology.h), read
// from the topology files of tests/data/topo: rails, GPUDirect reach, CUDA IPC and link figures,
// and the channels planned over them.
#include <gtest/gtest.h>

#include "gpu/plan/from_topology.h"
#include "gpu/plan/schedule.h"
#include "topology/topo_file.h"

namespace gradsync::plan {
namespace {

topology::NodeTopology load(const std::string& name) {
  auto t = topology::parse_topo_file(std::string(GRADSYNC_TEST_DATA_DIR) + "/topo/" + name);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : topology::NodeTopology{};
}

// `nodes` nodes of `topo`, local rank i on GPU i, ranks node-major.
JobShape shape_of(const topology::NodeTopology& topo, int nodes, topology::PciDistance level) {
  JobShape shape;
  const int g = int(topo.gpus.size());
  std::vector<int> gpus;
  for (int i = 0; i < g; ++i) gpus.push_back(i);
  for (int x = 0; x < nodes; ++x) {
    NodeRanks r{"node" + std::to_string(x), {}, gpus};
    for (int i = 0; i < g; ++i) r.ranks.push_back(x * g + i);
    auto node = node_shape(topo, r, level);
    EXPECT_TRUE(node.ok()) << node.status().to_string();
    if (node.ok()) shape.nodes.push_back(*node);
  }
  shape.links = node_links(topo, gpus);
  return shape;
}

TEST(GpuPlanTopology, NvSwitchNodeWithOneNicPerGpu) {
  const auto topo = load("1x8-nvswitch.topo");
  JobShape shape = shape_of(topo, 2, topology::PciDistance::PXB);
  ASSERT_EQ(shape.validate(), "");
  EXPECT_EQ(shape.links.intra_class, LinkClass::kNVLink);
  EXPECT_DOUBLE_EQ(shape.links.intra_gbps, 450);  // NV18 through the switch, not 7 x 450
  EXPECT_DOUBLE_EQ(shape.links.nic_gbps, 48);     // 400 Gb/s x 0.96
  for (int l = 0; l < 8; ++l) EXPECT_EQ(shape.nodes[0].nics[size_t(l)], l);
  EXPECT_EQ(shape.nodes[0].nic_count, 8);
  // Ring channel c leaves each node through NIC c, by GPUDirect RDMA (the NIC is PIX).
  ChannelSet rings = ring_channels(shape, default_ring_channels(shape));
  ASSERT_EQ(rings.size(), 8);
  for (int c = 0; c < 8; ++c)
    for (const Hop& h : rings[c].hops) {
      if (!h.inter_node) continue;
      EXPECT_EQ(h.nic, c);
      EXPECT_EQ(h.transport, Transport::kGpuDirectRdma);
    }
}

TEST(GpuPlanTopology, NvLinkMeshSumsItsLinks) {
  const auto topo = load("2x4-node.topo");
  JobShape shape = shape_of(topo, 2, topology::PciDistance::PXB);
  ASSERT_EQ(shape.validate(), "");
  EXPECT_EQ(shape.links.intra_class, LinkClass::kNVLink);
  EXPECT_DOUBLE_EQ(shape.links.intra_gbps, 3 * 150);  // NV6 to each of three peers
  PlanRequest req;
  req.algo = Algo::kHierarchical;
  req.count = 1000;
  EXPECT_EQ(check_request(shape, req), "");
}

TEST(GpuPlanTopology, PcieBoxSharesNicsAndHonoursTheGdrLevel) {
  const auto topo = load("pcie-box.topo");
  JobShape shape = shape_of(topo, 2, topology::PciDistance::PXB);
  ASSERT_EQ(shape.validate(), "");
  EXPECT_EQ(shape.links.intra_class, LinkClass::kPCIe);
  EXPECT_DOUBLE_EQ(shape.links.intra_gbps, kPcieGBps);
  EXPECT_DOUBLE_EQ(shape.links.nic_gbps, 12);  // 100 Gb/s x 0.96
  EXPECT_EQ(shape.nodes[0].nics, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(hop_transport(shape, 0, 4), Transport::kGpuDirectRdma);  // PXB is within PXB
  // With GRADSYNC_GDR_LEVEL=PIX the NICs are too far: RDMA into host memory.
  JobShape strict = shape_of(topo, 2, topology::PciDistance::PIX);
  EXPECT_EQ(hop_transport(strict, 0, 4), Transport::kRdmaHostMemory);
}

TEST(GpuPlanTopology, BadInputNamesTheNode) {
  const auto topo = load("2x4-node.topo");
  auto bad = node_shape(topo, {"n7", {0, 1}, {0, 9}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("node n7"), std::string::npos) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find("GPU 9"), std::string::npos) << bad.status().to_string();
  EXPECT_FALSE(node_shape(topo, {"n7", {0, 1}, {0}}).ok());
}

}  // namespace
}  // namespace gradsync::plan
