// Each GPU's RDMA device (runtime/topology/rail_devices.h): the list gradsyncd sends per GPU of
// its node, over the example topology files, and the device a rank takes from it. Which NICs
// the daemon can really open is tests/verbs/verbs_transport_test.cc's
// JoinReplyListsEachGpusRailDevice, on the emulated fabric.
#include "topology/rail_devices.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "topology/topo_file.h"

namespace gradsync::topology {
namespace {

std::string data(const std::string& name) { return std::string(GRADSYNC_TEST_DATA_DIR) + "/topo/" + name; }

NodeTopology file(const std::string& name) {
  auto t = parse_topo_file(data(name));
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return t.ok() ? *t : NodeTopology{};
}

// A daemon that can use every NIC but those in `refused` (NIC -> why); counts the questions.
struct Daemon {
  std::map<std::string, std::string> refused;
  std::map<std::string, int> asked;
  std::function<std::string(const std::string&)> probe() {
    return [this](const std::string& nic) {
      ++asked[nic];
      auto it = refused.find(nic);
      return it == refused.end() ? std::string() : it->second;
    };
  }
};

TEST(RailDevices, OneNicPerGpuOnEightAndFourGpuNodes) {
  Daemon d;
  auto eight = rail_devices(file("1x8-nvswitch.topo"), d.probe());
  EXPECT_EQ(eight.devices, (std::vector<std::string>{"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5",
                                                     "mlx5_6", "mlx5_7"}));
  EXPECT_EQ(eight.why, std::vector<std::string>(8));
  EXPECT_EQ(describe(eight), "GPU0 mlx5_0, GPU1 mlx5_1, GPU2 mlx5_2, GPU3 mlx5_3, GPU4 mlx5_4, GPU5 mlx5_5, "
                             "GPU6 mlx5_6, GPU7 mlx5_7");

  // A NIC the daemon cannot open (say its port is down): its GPU gets the daemon's device.
  d.refused["mlx5_2"] = "verbs device mlx5_2 port 1 is not ACTIVE (link down or cable?)";
  auto four = rail_devices(file("2x4-node.topo"), d.probe());
  EXPECT_EQ(four.devices, (std::vector<std::string>{"mlx5_0", "mlx5_1", "", "mlx5_3"}));
  EXPECT_EQ(four.why[2], "mlx5_2: verbs device mlx5_2 port 1 is not ACTIVE (link down or cable?)");
  EXPECT_NE(describe(four).find("GPU2 the daemon's (mlx5_2: verbs device mlx5_2 port 1 is not ACTIVE"),
            std::string::npos) << describe(four);
}

TEST(RailDevices, SharedNicsAreAskedOnce) {
  Daemon d;
  auto box = rail_devices(file("pcie-box.topo"), d.probe());  // GPUs 0, 1 on mlx5_0; 2, 3 on mlx5_1
  EXPECT_EQ(box.devices, (std::vector<std::string>{"mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"}));
  EXPECT_EQ(d.asked, (std::map<std::string, int>{{"mlx5_0", 1}, {"mlx5_1", 1}}));
}

TEST(RailDevices, GpuWithoutARailAndANicThatIsNotAVerbsDevice) {
  Daemon d;
  d.refused["mlx5_2"] = "verbs device 'mlx5_2' not found; devices: [mlx5_0,mlx5_1]";
  const NodeTopology t = file("mixed-rails.topo");
  EXPECT_EQ(t.rails, (std::vector<int>{0, 1, 2, -1}));
  auto rails = rail_devices(t, d.probe());
  EXPECT_EQ(rails.devices, (std::vector<std::string>{"mlx5_0", "mlx5_1", "", ""}));
  EXPECT_EQ(rails.why[2], "mlx5_2: verbs device 'mlx5_2' not found; devices: [mlx5_0,mlx5_1]");
  EXPECT_EQ(rails.why[3], "no NIC is its rail");
  EXPECT_EQ(d.asked.count("mlx5_2"), 1u);

  // No NIC at all: every GPU without a rail, and nobody asked.
  auto bare = parse_topo_text("gpu 0000:18:00.0\ngpu 0000:2a:00.0\n", "bare.topo");
  ASSERT_TRUE(bare.ok()) << bare.status().to_string();
  Daemon none;
  auto empty = rail_devices(*bare, none.probe());
  EXPECT_EQ(empty.devices, (std::vector<std::string>{"", ""}));
  EXPECT_TRUE(none.asked.empty());
}

TEST(RailDevices, BoundedToTheWireLimits) {
  // 64 GPUs at most (the topology file's own bound), names of at most 64 bytes.
  std::string text;
  for (int g = 0; g < 64; ++g) {
    char bus[32];
    std::snprintf(bus, sizeof(bus), "gpu 0000:%02x:00.0\n", g + 1);
    text += bus;
  }
  const std::string long_name(kMaxRailDeviceName + 1, 'n');
  const std::string just_fits(kMaxRailDeviceName, 'f');
  text += "nic " + long_name + "\nnic " + just_fits + "\ndistance 0 " + long_name + " PIX\n";
  auto t = parse_topo_text(text, "many.topo");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Daemon d;
  auto rails = rail_devices(*t, d.probe());
  ASSERT_EQ(rails.devices.size(), kMaxRailDevices);
  EXPECT_EQ(rails.devices[0], "");
  EXPECT_NE(rails.why[0].find("65 bytes, above the limit of 64"), std::string::npos) << rails.why[0];
  EXPECT_EQ(rails.devices[1], just_fits);  // the nearest (SYS like the other) with fewer GPUs
  EXPECT_EQ(d.asked.count(long_name), 0u);
  // A topology of more GPUs than the wire carries (discovery is not bounded): the first 64.
  NodeTopology big = *t;
  big.gpus.resize(70);
  big.rails.resize(70, 1);
  EXPECT_EQ(rail_devices(big, d.probe()).devices.size(), kMaxRailDevices);
}

TEST(RailDevices, ARankTakesItsGpusEntryElseTheDaemonsDevice) {
  const std::vector<std::string> list = {"mlx5_0", "mlx5_1", "", "mlx5_3"};
  auto own = rank_rdma_device(list, 1, "mlx5_0");
  EXPECT_EQ(own.device, "mlx5_1");
  EXPECT_EQ(own.why, "GPU 1's rail NIC");
  EXPECT_EQ(rank_rdma_device(list, 0, "mlx5_0").why, "GPU 0's rail NIC, also the daemon's device");
  auto refused = rank_rdma_device(list, 2, "mlx5_0");
  EXPECT_EQ(refused.device, "mlx5_0");
  EXPECT_NE(refused.why.find("GPU 2 has no rail NIC gradsyncd can use"), std::string::npos) << refused.why;
  auto beyond = rank_rdma_device(list, 4, "mlx5_0");
  EXPECT_EQ(beyond.device, "mlx5_0");
  EXPECT_NE(beyond.why.find("rails for 4 GPU(s), none for GPU 4"), std::string::npos) << beyond.why;
  // A daemon that sends no list (an older one): its device.
  EXPECT_EQ(rank_rdma_device({}, 0, "mlx5_0").device, "mlx5_0");
}

}  // namespace
}  // namespace gradsync::topology
