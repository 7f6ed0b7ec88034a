// A node's GPU topology (runtime/topology/gpu_topology.h, topo_file.h, topology_summary.h):
// the topology file and its errors, rails, discovery through a fake NVML table over a fake
// sysfs tree, the fallbacks without NVML, and the bounded summary the coordinator keeps.
#include "topology/gpu_topology.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fake_sysfs.h"
#include "topology/topo_file.h"
#include "topology/topology_summary.h"

namespace gradsync::topology {
namespace {

std::string data(const std::string& name) { return std::string(GRADSYNC_TEST_DATA_DIR) + "/topo/" + name; }

std::vector<std::string> labels(const NodeTopology& t, size_t row) {
  std::vector<std::string> out;
  for (const auto& l : t.links[row]) out.push_back(link_label(l));
  return out;
}

// --- the example files -------------------------------------------------------------------

TEST(TopoFile, OneNodeOfEightGpusOnNvSwitch) {
  auto t = parse_topo_file(data("1x8-nvswitch.topo"));
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->gpus.size(), 8u);
  ASSERT_EQ(t->nics.size(), 8u);
  EXPECT_EQ(t->source, "file " + data("1x8-nvswitch.topo"));
  EXPECT_EQ(t->gpus[3].pci_bus_id, "0000:5d:00.0");
  EXPECT_EQ(t->gpus[3].device, 0);
  EXPECT_EQ(t->gpus[3].name, "NVIDIA-H200");
  EXPECT_TRUE(t->nvswitch());
  EXPECT_EQ(labels(*t, 0), (std::vector<std::string>{"X", "NV18", "NV18", "NV18", "NV18", "NV18", "NV18", "NV18"}));
  EXPECT_EQ(t->links[2][5].gbps, 450.0);
  EXPECT_EQ(t->links[2][5].kind, GpuLinkKind::kNvSwitch);
  EXPECT_EQ(t->nics[7].gbits, 400.0);
  EXPECT_EQ(t->nic_distance[6][6], PciDistance::PIX);
  EXPECT_EQ(t->nic_distance[6][0], PciDistance::SYS);
  EXPECT_EQ(t->rails, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(TopoFile, TheOtherExampleShapes) {
  auto four = parse_topo_file(data("2x4-node.topo"));
  ASSERT_TRUE(four.ok()) << four.status().to_string();
  EXPECT_EQ(labels(*four, 1), (std::vector<std::string>{"NV6", "X", "NV6", "NV6"}));
  EXPECT_EQ(four->links[1][3].gbps, 150.0);
  EXPECT_EQ(four->links[0][1].pcie, PciDistance::NODE);  // declared beside the NVLinks
  EXPECT_FALSE(four->nvswitch());
  EXPECT_EQ(four->rails, (std::vector<int>{0, 1, 2, 3}));

  auto two = parse_topo_file(data("3x2-node.topo"));
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_EQ(labels(*two, 0), (std::vector<std::string>{"X", "NV18"}));
  EXPECT_EQ(two->rails, (std::vector<int>{0, 1}));

  auto pcie = parse_topo_file(data("pcie-box.topo"));
  ASSERT_TRUE(pcie.ok()) << pcie.status().to_string();
  EXPECT_EQ(labels(*pcie, 0), (std::vector<std::string>{"X", "PIX", "SYS", "SYS"}));
  EXPECT_EQ(pcie->links[0][1].kind, GpuLinkKind::kPcie);
  EXPECT_EQ(pcie->links[0][1].gbps, 0.0);
  EXPECT_EQ(pcie->rails, (std::vector<int>{0, 0, 1, 1}));
}

TEST(TopoFile, CommentsBlankLinesAndRailOverrides) {
  auto t = parse_topo_text(
      "# two GPUs\n\n  gpu 00000000:19:00.0   # NVML's long domain\ngpu 0000:1A:00.0 device=3\n"
      "nic a\nnic b\ndistance 0 a PIX\ndistance 1 a PIX\nrail 1 b\n",
      "t.topo");
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(t->gpus[0].pci_bus_id, "0000:19:00.0");
  EXPECT_EQ(t->gpus[1].pci_bus_id, "0000:1a:00.0");
  EXPECT_EQ(t->gpus[0].device, -1);
  EXPECT_EQ(t->gpus[1].device, 3);
  EXPECT_EQ(labels(*t, 0), (std::vector<std::string>{"X", "SYS"}));  // undeclared pair
  EXPECT_EQ(t->rails, (std::vector<int>{0, 1}));
}

// Each kind of bad line is refused with the file, the line number, the line and the reason.
TEST(TopoFile, EveryKindOfBadLineNamesItsLine) {
  const std::string two = "gpu 0000:19:00.0\ngpu 0000:1a:00.0\nnic mlx5_0\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"gpux 0000:19:00.0", "line 1: 'gpux 0000:19:00.0': unknown item 'gpux'"},
      {"gpu", "line 1: 'gpu': too few fields"},
      {"gpu 19:00.0", "is not a PCI bus id"},
      {"gpu 0000:19:00.0 device=-1", "device '-1' is not a whole number from 0 to 1023"},
      {"gpu 0000:19:00.0 colour=red", "unknown option 'colour' (this item takes device, name)"},
      {"gpu 0000:19:00.0 device=1 device=2", "option 'device' given twice"},
      {"gpu 0000:19:00.0 device", "'device' is not KEY=VALUE"},
      {two + "nic mlx5_0", "line 4: 'nic mlx5_0': NIC 'mlx5_0' is declared twice"},
      {two + "nic mlx5_1 gbits=fast", "gbits 'fast' is not a whole number"},
      {two + "nvlink 0 2 4", "line 4: 'nvlink 0 2 4': GPU 2 is not declared (2 'gpu' line(s) above this one)"},
      {two + "nvlink 0 0 4", "a GPU paired with itself"},
      {two + "nvlink 0 1 0", "LINKS '0' is not a whole number from 1 to 64"},
      {two + "nvlink 0 1 4\nnvlink 1 0 4", "line 5: 'nvlink 1 0 4': this GPU pair already has an 'nvlink' line"},
      {two + "nvlink 0 1 4 gbps=0", "gbps '0' is not a whole number from 1 to 1000"},
      {two + "nvswitch 18\nnvlink 0 1 4", "GPUs joined by NVSwitch have no 'nvlink' pairs besides"},
      {two + "nvswitch 18\nnvswitch 12", "a second 'nvswitch' line"},
      {two + "pcie 0 1 NEAR", "distance 'NEAR' is not one of PIX, PXB, PHB, NODE, SYS"},
      {two + "pcie 0 1 3", "distance '3' is not one of"},
      {two + "pcie 0 1 PIX SYS", "one distance after the two GPUs, nothing more"},
      {two + "distance 0 mlx5_9 PIX", "NIC 'mlx5_9' is not declared on a 'nic' line above this one"},
      {two + "distance 0 mlx5_0 PIX\ndistance 0 mlx5_0 SYS", "this GPU and NIC already have a distance"},
      {two + "rail 1 mlx5_0\nrail 1 mlx5_0", "GPU 1 already has a rail"},
      {"# nothing\n", "t.topo: declares no GPU"},
  };
  for (const auto& [text, want] : cases) {
    auto t = parse_topo_text(text, "t.topo");
    ASSERT_FALSE(t.ok()) << "accepted: " << text;
    EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
    EXPECT_NE(t.status().message().find(want), std::string::npos) << t.status().message() << "\nwanted: " << want;
    EXPECT_EQ(t.status().message().rfind("t.topo", 0), 0u) << t.status().message();
  }
  std::string many;
  for (int i = 0; i <= 64; ++i) many += "gpu 0000:19:00.0\n";
  EXPECT_NE(parse_topo_text(many, "t.topo").status().message().find("line 65: 'gpu 0000:19:00.0': more than 64 GPUs"),
            std::string::npos);
  auto missing = parse_topo_file("/nonexistent/x.topo");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/x.topo (GRADSYNC_TOPO_FILE) cannot be read"), std::string::npos);
}

// --- rails ---------------------------------------------------------------------------------

TEST(Rails, NearestNicFirstThenSpreadOverEquallyNearOnes) {
  using D = std::optional<PciDistance>;
  const D pix = PciDistance::PIX, pxb = PciDistance::PXB, sys = PciDistance::SYS, unknown;
  // 8 GPUs that see 4 NICs alike: two each, in order.
  std::vector<std::vector<D>> alike(8, std::vector<D>(4, sys));
  EXPECT_EQ(assign_rails(alike, 4), (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  // The nearest wins even when it is taken already.
  EXPECT_EQ(assign_rails({{pix, pxb}, {pix, pxb}}, 2), (std::vector<int>{0, 0}));
  // Unknown counts as farthest.
  EXPECT_EQ(assign_rails({{unknown, sys}, {unknown, unknown}}, 2), (std::vector<int>{1, 0}));
  // Ties among the nearest spread; farther NICs do not take part.
  EXPECT_EQ(assign_rails({{pxb, pxb, sys}, {pxb, pxb, sys}, {pxb, pxb, sys}}, 3), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(assign_rails({{}, {}}, 0), (std::vector<int>{-1, -1}));
}

// --- discovery with a fake NVML ------------------------------------------------------------

// A node as NVML would describe it: GPUs by bus id and, per GPU, its links' far ends.
struct FakeNode {
  std::vector<std::string> bus;                        // "0000:19:00.0"
  std::vector<std::vector<std::string>> link_remote;   // per GPU, per link: a GPU's or a switch's bus id
  std::map<std::string, unsigned> remote_type;         // bus id -> nvmlIntNvLinkDeviceType
  bool typed = true;                                   // the library has nvmlDeviceGetNvLinkRemoteDeviceType
  nvml::Return init = nvml::kSuccess;
  int shutdowns = 0;
};
FakeNode* g_node = nullptr;

nvml::Device handle(size_t i) { return reinterpret_cast<nvml::Device>(i + 1); }
size_t index_of(nvml::Device d) { return reinterpret_cast<size_t>(d) - 1; }
nvml::PciInfo pci_of(const std::string& bus) {
  nvml::PciInfo p{};
  std::sscanf(bus.c_str(), "%x:%x:%x", &p.domain, &p.bus, &p.device);
  return p;
}

NvmlApi fake_nvml() {
  NvmlApi api{};
  api.name = "fake NVML";
  api.init = [] { return g_node->init; };
  api.shutdown = [] { ++g_node->shutdowns; return nvml::kSuccess; };
  api.error_string = [](nvml::Return) -> const char* { return "Driver Not Loaded"; };
  api.device_count = [](unsigned* n) { *n = unsigned(g_node->bus.size()); return nvml::kSuccess; };
  api.device_by_index = [](unsigned i, nvml::Device* d) { *d = handle(i); return nvml::kSuccess; };
  api.device_name = [](nvml::Device, char* name, unsigned len) {
    std::snprintf(name, len, "NVIDIA H200");
    return nvml::kSuccess;
  };
  api.pci_info = [](nvml::Device d, nvml::PciInfo* p) { *p = pci_of(g_node->bus[index_of(d)]); return nvml::kSuccess; };
  api.nvlink_state = [](nvml::Device d, unsigned link, unsigned* active) {
    if (link >= g_node->link_remote[index_of(d)].size()) return nvml::kErrorInvalidArgument;
    *active = nvml::kFeatureEnabled;
    return nvml::kSuccess;
  };
  api.nvlink_remote_pci = [](nvml::Device d, unsigned link, nvml::PciInfo* p) {
    *p = pci_of(g_node->link_remote[index_of(d)][link]);
    return nvml::kSuccess;
  };
  api.p2p_status = [](nvml::Device, nvml::Device, int, int* status) { *status = 5; return nvml::kSuccess; };
  api.nvlink_remote_type = [](nvml::Device d, unsigned link, unsigned* type) {
    if (!g_node->typed) return nvml::kErrorNotSupported;
    *type = g_node->remote_type.at(g_node->link_remote[index_of(d)][link]);
    return nvml::kSuccess;
  };
  return api;
}

// Two GPUs under one PCIe switch, a third on the other socket, and two NICs beside the first two.
class DiscoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sys.add_gpu("pci0000:17/0000:17:00.0/0000:18:00.0/0000:18:01.0/0000:19:00.0", 0);
    sys.add_gpu("pci0000:17/0000:17:00.0/0000:18:00.0/0000:18:02.0/0000:1a:00.0", 0);
    sys.add_gpu("pci0000:9a/0000:9a:00.0/0000:9b:00.0", 1);
    sys.add_mlx5("mlx5_0", "pci0000:17/0000:17:00.0/0000:18:00.0/0000:18:01.0/0000:1b:00.0", 0);
    sys.add_mlx5("mlx5_1", "pci0000:9a/0000:9a:01.0/0000:9c:00.0", 1);
    node.bus = {"0000:19:00.0", "0000:1a:00.0", "0000:9b:00.0"};
    g_node = &node;
  }
  void TearDown() override { g_node = nullptr; }

  NodeTopology discover(bool with_nvml, std::function<CudaPeers()> cuda = nullptr) {
    TopologySources src;
    src.root = sys.root();
    if (with_nvml) src.nvml = &api;
    else src.nvml_missing = "libnvidia-ml.so.1 not found (test)";
    src.cuda_peers = std::move(cuda);
    return discover_gpu_topology(src);
  }

  FakeSysfs sys;
  FakeNode node;
  NvmlApi api = fake_nvml();
};

TEST_F(DiscoverTest, NvSwitchLinksFromNvml) {
  const std::string sw = "0000:c0:00.0";
  node.link_remote = {std::vector<std::string>(18, sw), std::vector<std::string>(18, sw), std::vector<std::string>(12, sw)};
  node.remote_type = {{sw, nvml::kNvLinkDeviceSwitch}};
  const NodeTopology t = discover(true);
  EXPECT_EQ(t.source, "nvml");
  EXPECT_EQ(t.note, "");
  ASSERT_EQ(t.gpus.size(), 3u);
  EXPECT_EQ(t.gpus[0].name, "NVIDIA H200");
  EXPECT_EQ(labels(t, 0), (std::vector<std::string>{"X", "NV18", "NV12"}));
  EXPECT_EQ(t.links[0][1].gbps, 450.0);
  EXPECT_EQ(t.links[2][0].gbps, 300.0);
  EXPECT_EQ(t.links[0][1].pcie, PciDistance::PXB);  // the PCIe path is kept beside
  EXPECT_TRUE(t.nvswitch());
  EXPECT_EQ(node.shutdowns, 1);
  // NICs and rails from sysfs: GPU 0 shares mlx5_0's switch port, GPU 2 mlx5_1's host bridge.
  ASSERT_EQ(t.nics.size(), 2u);
  EXPECT_EQ(t.nics[0].gbits, 400.0);
  EXPECT_EQ(t.nic_distance[0][0], PciDistance::PIX);
  EXPECT_EQ(t.nic_distance[1][0], PciDistance::PXB);
  EXPECT_EQ(t.nic_distance[2][1], PciDistance::PHB);
  EXPECT_EQ(t.rails, (std::vector<int>{0, 0, 1}));
  EXPECT_NE(describe(t).find("nvml: 3 GPU(s), NVSwitch NV18, 2 NIC(s), rails 0>mlx5_0 1>mlx5_0 2>mlx5_1"),
            std::string::npos)
      << describe(t);
}

TEST_F(DiscoverTest, DirectNvLinksAndPcieFromNvmlWithoutTheRemoteTypeCall) {
  // GPUs 0 and 1 joined by 4 links; GPU 2 has none.
  node.link_remote = {std::vector<std::string>(4, node.bus[1]), std::vector<std::string>(4, node.bus[0]), {}};
  node.typed = false;
  api.nvlink_remote_type = nullptr;
  const NodeTopology t = discover(true);
  EXPECT_EQ(t.source, "nvml");
  EXPECT_EQ(labels(t, 0), (std::vector<std::string>{"X", "NV4", "SYS"}));
  EXPECT_EQ(labels(t, 2), (std::vector<std::string>{"SYS", "SYS", "X"}));
  EXPECT_EQ(t.links[1][0].gbps, 100.0);
  EXPECT_FALSE(t.nvswitch());
}

TEST_F(DiscoverTest, NvmlThatFailsFallsBackWithItsReason) {
  node.init = 9;
  const NodeTopology t = discover(true);
  EXPECT_EQ(t.source, "pcie");
  EXPECT_NE(t.note.find("fake NVML: nvmlInit_v2: NVML error 9 (Driver Not Loaded)"), std::string::npos) << t.note;
  EXPECT_EQ(labels(t, 0), (std::vector<std::string>{"X", "PXB", "SYS"}));
}

TEST_F(DiscoverTest, WithoutNvmlCudaPeerAccessThenPcieAlone) {
  const NodeTopology pcie = discover(false, [] { return CudaPeers{false, "built without CUDA", {}, {}}; });
  EXPECT_EQ(pcie.source, "pcie");
  EXPECT_NE(pcie.note.find("libnvidia-ml.so.1 not found (test); CUDA peer access: built without CUDA; links are the "
                           "PCIe paths alone"),
            std::string::npos)
      << pcie.note;
  EXPECT_EQ(labels(pcie, 1), (std::vector<std::string>{"PXB", "X", "SYS"}));
  EXPECT_EQ(pcie.rails, (std::vector<int>{0, 0, 1}));

  const NodeTopology cuda = discover(false, [] {
    return CudaPeers{true, "", {"00000000:1A:00.0", "00000000:19:00.0", "00000000:9B:00.0"}, {{0, 1, 0}, {1, 0, 0}, {0, 0, 0}}};
  });
  EXPECT_EQ(cuda.source, "cuda");
  EXPECT_EQ(cuda.gpus[0].device, 1);  // sysfs order, CUDA's own numbering
  EXPECT_EQ(cuda.gpus[1].device, 0);
  EXPECT_EQ(cuda.links[0][1].p2p, 1);
  EXPECT_EQ(cuda.links[0][2].p2p, 0);
  EXPECT_EQ(labels(cuda, 0), (std::vector<std::string>{"X", "PXB", "SYS"}));
}

// On this machine (CI: no NVIDIA driver) NVML is absent and says so; where it loads, the table
// is complete.
TEST(Nvml, LoadsOrSaysWhy) {
  auto api = load_nvml();
  if (api.ok()) {
    EXPECT_NE((*api)->p2p_status, nullptr);
  } else {
    EXPECT_EQ(api.status().code(), Code::kUnavailable);
    EXPECT_NE(api.status().message().find("libnvidia-ml.so.1"), std::string::npos) << api.status().message();
  }
  auto node = node_gpu_topology("");
  ASSERT_TRUE(node.ok());
  EXPECT_FALSE(node->source.empty());
  EXPECT_EQ(node->source == "nvml", api.ok() && node->note.empty());
}

// --- the summary the coordinator keeps --------------------------------------------------------

TEST(Summary, RoundTripsAndPrintsTheMatrix) {
  auto t = parse_topo_file(data("1x8-nvswitch.topo"));
  ASSERT_TRUE(t.ok());
  const v1::GpuTopology s = summarize(*t);
  EXPECT_TRUE(check_summary(s).ok()) << check_summary(s).to_string();
  EXPECT_EQ(s.links_size(), 64);
  EXPECT_EQ(s.nic_distance_size(), 64);
  EXPECT_TRUE(s.nvswitch());
  const std::string text = render_summary(s, "  ");
  EXPECT_NE(text.find("  GPUs (file " + data("1x8-nvswitch.topo") + "): 8, joined through NVSwitch\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("    GPU0   X      NV18   NV18"), std::string::npos) << text;
  EXPECT_NE(text.find("PIX    SYS    SYS    SYS    SYS    SYS    SYS    SYS    mlx5_0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("NIC7 mlx5_7 400 Gb/s"), std::string::npos) << text;
  EXPECT_NE(text.find("NV18 = 450 GB/s per direction"), std::string::npos) << text;
  EXPECT_TRUE(check_summary(v1::GpuTopology{}).ok());  // an older daemon sends none
}

// Another node's topology comes back from its summary as the planner needs it.
TEST(Summary, GivesTheTopologyBackForEveryExample) {
  for (const char* file : {"1x8-nvswitch.topo", "2x4-node.topo", "3x2-node.topo", "pcie-box.topo"}) {
    SCOPED_TRACE(file);
    auto t = parse_topo_file(data(file));
    ASSERT_TRUE(t.ok());
    auto back = from_summary(summarize(*t));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->source, t->source);
    ASSERT_EQ(back->gpus.size(), t->gpus.size());
    for (size_t a = 0; a < t->gpus.size(); ++a) {
      EXPECT_EQ(back->gpus[a].pci_bus_id, t->gpus[a].pci_bus_id);
      EXPECT_EQ(back->gpus[a].device, -1);  // not carried
      for (size_t b = 0; b < t->gpus.size(); ++b) {
        const GpuLink& want = t->links[a][b];
        const GpuLink& got = back->links[a][b];
        EXPECT_EQ(got.kind, want.kind) << a << "-" << b;
        EXPECT_EQ(got.nvlinks, want.nvlinks) << a << "-" << b;
        EXPECT_EQ(got.gbps, want.gbps) << a << "-" << b;
        if (want.kind == GpuLinkKind::kPcie) EXPECT_EQ(got.pcie, want.pcie) << a << "-" << b;
      }
    }
    ASSERT_EQ(back->nics.size(), t->nics.size());
    for (size_t j = 0; j < t->nics.size(); ++j) EXPECT_EQ(back->nics[j].gbits, t->nics[j].gbits);
    EXPECT_EQ(back->nic_distance, t->nic_distance);
    EXPECT_EQ(back->rails, t->rails);
  }
  v1::GpuTopology bad;
  bad.add_gpus();
  EXPECT_EQ(from_summary(bad).status().code(), Code::kInvalidArgument);
}

TEST(Summary, OutOfBoundsIsRefusedNamingTheField) {
  auto t = parse_topo_file(data("pcie-box.topo"));
  ASSERT_TRUE(t.ok());
  const v1::GpuTopology good = summarize(*t);
  auto expect_bad = [](const v1::GpuTopology& s, const std::string& want) {
    Status st = check_summary(s);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << want;
    EXPECT_NE(st.message().find(want), std::string::npos) << st.message();
  };
  v1::GpuTopology s = good;
  s.mutable_links()->RemoveLast();
  expect_bad(s, "15 link labels and 16 bandwidths for 4 GPUs");
  s = good;
  s.set_links(1, "NVLINK");
  expect_bad(s, "unknown link label 'NVLINK'");
  s = good;
  s.set_nic_distance(0, "NV18");
  expect_bad(s, "unknown GPU-NIC distance 'NV18'");
  s = good;
  s.set_rails(2, 2);
  expect_bad(s, "rail 2 names no NIC of 2");
  s = good;
  s.mutable_gpus(0)->set_name(std::string(200, 'x'));
  expect_bad(s, "too long");
  s = v1::GpuTopology{};
  for (int i = 0; i < 65; ++i) s.add_gpus();
  expect_bad(s, "65 GPUs, above the limit of 64");
}

}  // namespace
}  // namespace gradsync::topology
