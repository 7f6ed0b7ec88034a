#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "topology/node_info.h"

namespace gradsync::topology {
namespace {

namespace fs = std::filesystem;

TEST(TopologyTest, DiscoversThisNode) {
  const NodeInfo info = discover();
  EXPECT_FALSE(info.hostname.empty());
  EXPECT_GE(info.cpus, 1u);
  for (const auto& addr : info.addresses) {
    EXPECT_NE(addr.find('='), std::string::npos) << addr;
    EXPECT_NE(addr.rfind("lo=", 0), 0u) << "loopback must be skipped: " << addr;
  }
  for (const auto& nic : info.nics) EXPECT_NE(nic, "lo");
}

TEST(TopologyTest, DescribeNamesTheHost) {
  const NodeInfo info = discover();
  const std::string line = describe(info);
  EXPECT_NE(line.find(info.hostname), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos) << "one line for logs: " << line;
}

// CI has no GPU: check the sysfs parsing against a fake /sys/bus/pci/devices.
TEST(TopologyTest, FindsNvidiaDisplayFunctionsOnly) {
  char tmpl[] = "/tmp/topology_test.XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path root = tmpl;
  auto add = [&](const std::string& bdf, const std::string& vendor, const std::string& cls) {
    fs::create_directories(root / bdf);
    std::ofstream(root / bdf / "vendor") << vendor << "\n";
    std::ofstream(root / bdf / "class") << cls << "\n";
  };
  add("0000:19:00.0", "0x10de", "0x030200");  // H100/H200: 3D controller
  add("0000:1a:00.0", "0x10de", "0x068000");  // NVSwitch bridge: not a GPU
  add("0000:3b:00.0", "0x15b3", "0x020700");  // Mellanox NIC
  add("0000:05:00.0", "0x10de", "0x030000");  // VGA controller
  EXPECT_EQ(find_nvidia_gpus(root.string()),
            (std::vector<std::string>{"0000:05:00.0 NVIDIA", "0000:19:00.0 NVIDIA"}));
  EXPECT_TRUE(find_nvidia_gpus((root / "missing").string()).empty());
  fs::remove_all(root);
}

}  // namespace
}  // namespace gradsync::topology
