// gradsyncctl doctor's logic (runtime/topology/gpudirect.{h,cc}): PCIe distance letters, the
// design §3 path decision, and reports built from fake sysfs trees in a temp dir.
#include "topology/gpudirect.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "fake_sysfs.h"

namespace gradsync::topology {
namespace {

namespace fs = std::filesystem;

// --- pci_distance -----------------------------------------------------------------------

const std::string kRoot = "/sys/devices/pci0000:17/0000:17:00.0";  // host bridge + root port
const std::string kUp = kRoot + "/0000:18:00.0";                   // switch upstream port
const std::string kGpu = kUp + "/0000:19:00.0/0000:1a:00.0";        // behind downstream 19:00.0

TEST(PciDistance, SameImmediateBridgeIsPix) {
  EXPECT_EQ(pci_distance(kGpu, 0, kUp + "/0000:19:00.0/0000:1a:00.1", 0), PciDistance::PIX);
}

TEST(PciDistance, SameSwitchOtherPortIsPxb) {
  EXPECT_EQ(pci_distance(kGpu, 0, kUp + "/0000:19:04.0/0000:1b:00.0", 0), PciDistance::PXB);
}

TEST(PciDistance, OnlyHostBridgeInCommonIsPhb) {
  EXPECT_EQ(pci_distance("/sys/devices/pci0000:17/0000:17:01.0/0000:20:00.0", 0,
                         "/sys/devices/pci0000:17/0000:17:02.0/0000:21:00.0", 0),
            PciDistance::PHB);
  // Two devices straight on the root bus share no bridge either.
  EXPECT_EQ(pci_distance("/sys/devices/pci0000:00/0000:00:04.0", -1,
                         "/sys/devices/pci0000:00/0000:00:05.0", -1),
            PciDistance::PHB);
}

TEST(PciDistance, OtherHostBridgeSameNumaIsNode) {
  EXPECT_EQ(pci_distance(kGpu, 0, "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", 0),
            PciDistance::NODE);
  EXPECT_EQ(pci_distance(kGpu, -1, "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", -1),
            PciDistance::NODE);
}

TEST(PciDistance, OtherNumaNodeIsSys) {
  EXPECT_EQ(pci_distance(kGpu, 0, "/sys/devices/pci0000:9a/0000:9a:00.0/0000:9b:00.0", 1),
            PciDistance::SYS);
  EXPECT_EQ(pci_distance(kGpu, 0, "/sys/devices/virtual/net/lo", 0), PciDistance::SYS);
}

TEST(PciDistance, WorksUnderATempRootPrefix) {
  EXPECT_EQ(pci_distance("/tmp/x" + kGpu, 0, "/tmp/x" + kUp + "/0000:19:00.0/0000:1a:00.1", 0),
            PciDistance::PIX);
}

TEST(PciDistance, ParseLevels) {
  EXPECT_EQ(parse_distance("pxb"), PciDistance::PXB);
  EXPECT_EQ(parse_distance("SYS"), PciDistance::SYS);
  EXPECT_EQ(parse_distance("3"), PciDistance::PHB);
  EXPECT_EQ(parse_distance("Node"), PciDistance::NODE);
  EXPECT_FALSE(parse_distance("LOC").has_value());
  EXPECT_FALSE(parse_distance("").has_value());
}

// --- decide_path --------------------------------------------------------------------------

PathInputs good_inputs() {
  PathInputs in;
  in.any_rdma_device = true;
  in.nic_active = true;
  in.nic = "mlx5_0";
  in.distance = PciDistance::PIX;
  in.gpu_direct_rdma_supported = 1;
  in.dma_buf_supported = 1;
  in.kernel_rdma_dmabuf = true;
  return in;
}

TEST(DecidePath, NoRdmaDeviceIsTcp) {
  PathInputs in;
  in.cuda_unknown_reason = "built without CUDA";
  EXPECT_EQ(decide_path(in, PciDistance::PXB).path, DataPath::kTcp);
  in.any_rdma_device = true;  // present but no ACTIVE port
  auto p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kTcp);
  EXPECT_NE(p.reason.find("ACTIVE"), std::string::npos);
}

TEST(DecidePath, DmaBufWithinLevelIsGpuDirect) {
  auto p = decide_path(good_inputs(), PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(p.registration, "dma-buf");
  EXPECT_EQ(p.nic, "mlx5_0");
}

TEST(DecidePath, TooFarIsHostStaged) {
  auto in = good_inputs();
  in.distance = PciDistance::PHB;
  auto p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kHostStagedRdma);
  EXPECT_NE(p.reason.find("GRADSYNC_GDR_LEVEL=PXB"), std::string::npos);
  EXPECT_EQ(decide_path(in, PciDistance::PHB).path, DataPath::kGpuDirectRdma);
  in.distance = PciDistance::SYS;
  EXPECT_EQ(decide_path(in, PciDistance::NODE).path, DataPath::kHostStagedRdma);
  EXPECT_EQ(decide_path(in, PciDistance::SYS).path, DataPath::kGpuDirectRdma);
}

TEST(DecidePath, RegistrationChoices) {
  auto in = good_inputs();
  in.dma_buf_supported = 0;
  EXPECT_EQ(decide_path(in, PciDistance::PXB).path, DataPath::kHostStagedRdma);
  in.peermem = true;
  auto p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(p.registration, "nvidia-peermem");

  in = good_inputs();
  in.kernel_rdma_dmabuf = false;  // dma-buf needs kernel >= 5.12
  EXPECT_EQ(decide_path(in, PciDistance::PXB).path, DataPath::kHostStagedRdma);

  in = good_inputs();
  in.gpu_direct_rdma_supported = 0;
  in.peermem = true;
  EXPECT_EQ(decide_path(in, PciDistance::PXB).path, DataPath::kHostStagedRdma);
}

TEST(DecidePath, UnknownCudaNeedsPeermemOrOpenModule) {
  auto in = good_inputs();
  in.dma_buf_supported = -1;
  in.gpu_direct_rdma_supported = -1;
  in.cuda_unknown_reason = "built without CUDA";
  auto p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kHostStagedRdma);
  EXPECT_NE(p.reason.find("unknown (built without CUDA)"), std::string::npos);
  in.open_kernel_module = true;
  p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kGpuDirectRdma);
  EXPECT_NE(p.registration.find("inferred"), std::string::npos);
}

// --- reports from a fake sysfs tree ---------------------------------------------------------

const std::string kSwitch = "pci0000:17/0000:17:00.0/0000:18:00.0";

CudaFacts h200_cuda(const std::string& addr) {
  CudaFacts c;
  c.available = true;
  c.driver_version = 13000;
  CudaGpu g;
  g.pci_address = addr;
  g.name = "NVIDIA H200";
  g.dma_buf_supported = 1;
  g.gpu_direct_rdma_supported = 1;
  g.rdma_writes_ordering = 100;
  c.gpus.push_back(g);
  return c;
}

TEST(DoctorReport, GpuBehindSwitchWithNics) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);                    // GPU 0000:19:00.0
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0);          // same downstream port: PIX
  t.add_mlx5("mlx5_1", kSwitch + "/0000:18:04.0/0000:1c:00.0", 0);  // other port: PXB
  t.add_mlx5("mlx5_2", "pci0000:9a/0000:9a:00.0/0000:9b:00.0", 1);  // other socket: SYS
  t.write("proc/driver/nvidia/version",
          "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build");

  const GpuReport r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB);
  ASSERT_EQ(r.gpus.size(), 1u);
  EXPECT_EQ(r.gpus[0].pci_address, "0000:19:00.0");
  EXPECT_EQ(r.gpus[0].model, "NVIDIA H200");
  EXPECT_EQ(r.gpus[0].pci_id, "10de:2335");
  ASSERT_EQ(r.nics.size(), 3u);
  EXPECT_EQ(r.nics[0].pci_address, "0000:1a:00.0");
  EXPECT_EQ(r.nics[0].numa_node, 0);
  ASSERT_EQ(r.nics[0].ports.size(), 1u);
  EXPECT_EQ(r.nics[0].ports[0].state, "ACTIVE");
  EXPECT_EQ(r.nics[0].ports[0].link_layer, "InfiniBand");
  EXPECT_EQ(r.nics[0].netdevs, std::vector<std::string>{"ib_mlx5_0"});
  EXPECT_EQ(r.distance[0][0], PciDistance::PIX);
  EXPECT_EQ(r.distance[0][1], PciDistance::PXB);
  EXPECT_EQ(r.distance[0][2], PciDistance::SYS);
  ASSERT_EQ(r.paths.size(), 1u);
  EXPECT_EQ(r.paths[0].path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(r.paths[0].nic, "mlx5_0");
  EXPECT_EQ(r.paths[0].registration, "dma-buf");
  EXPECT_TRUE(r.reg.open_kernel_module);
  EXPECT_FALSE(r.reg.peermem_module);
  EXPECT_EQ(doctor_exit_code(r, true), 0);

  const std::string text = render(r);
  EXPECT_NE(text.find("GPU0   PIX"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU0: GPUDirect RDMA via mlx5_0"), std::string::npos) << text;
  EXPECT_NE(text.find("OWNER (100)"), std::string::npos) << text;
  EXPECT_NE(text.find("nvidia-peermem: not loaded"), std::string::npos) << text;
}

// The verbs probe of each NIC (gradsyncctl doctor) is shown, and a NIC that refuses dma-buf
// leaves peermem or host staging.
TEST(DoctorReport, NicDmaBufProbe) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0);
  auto probe = [](int yes) {
    return [yes](const std::string& dev) {
      return NicDmaBufProbe{yes, dev + (yes ? ": EBADF, as expected" : ": EOPNOTSUPP")};
    };
  };
  GpuReport r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB, probe(1));
  ASSERT_EQ(r.nics.size(), 1u);
  EXPECT_EQ(r.nics[0].dmabuf, 1);
  EXPECT_EQ(r.paths[0].registration, "dma-buf");
  EXPECT_NE(render(r).find("dma-buf registration: yes (mlx5_0: EBADF, as expected)"), std::string::npos)
      << render(r);

  r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB, probe(0));
  EXPECT_EQ(r.nics[0].dmabuf, 0);
  EXPECT_EQ(r.paths[0].path, DataPath::kHostStagedRdma);
  EXPECT_NE(r.paths[0].reason.find("mlx5_0 does not register dma-buf (mlx5_0: EOPNOTSUPP)"), std::string::npos)
      << r.paths[0].reason;
  EXPECT_NE(render(r).find("dma-buf registration: no"), std::string::npos);

  r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB);  // not probed
  EXPECT_EQ(r.nics[0].dmabuf, -1);
  EXPECT_EQ(r.paths[0].registration, "dma-buf");
  EXPECT_NE(render(r).find("dma-buf registration: not probed"), std::string::npos);
}

// The GPU communicator's check of GRADSYNC_GDR_LEVEL: the distance of one GPU (as CUDA prints
// its PCI address) to one RDMA device by name.
TEST(DoctorReport, GpuNicDistanceByAddressAndName) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0);
  t.add_mlx5("mlx5_2", "pci0000:9a/0000:9a:00.0/0000:9b:00.0", 1);
  EXPECT_EQ(gpu_nic_distance(t.root(), "00000000:19:00.0", "mlx5_0"), PciDistance::PIX);
  EXPECT_EQ(gpu_nic_distance(t.root(), "0000:19:00.0", "mlx5_2"), PciDistance::SYS);
  EXPECT_EQ(gpu_nic_distance(t.root(), "0000:19:00.0", "emu1n0"), std::nullopt);  // not in sysfs
  EXPECT_EQ(gpu_nic_distance(t.root(), "0000:55:00.0", "mlx5_0"), std::nullopt);  // no such GPU
}

TEST(DoctorReport, NicOnlyOnTheOtherSocketIsHostStaged) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", "pci0000:9a/0000:9a:00.0/0000:9b:00.0", 1);
  GpuReport r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB);
  ASSERT_EQ(r.paths.size(), 1u);
  EXPECT_EQ(r.distance[0][0], PciDistance::SYS);
  EXPECT_EQ(r.paths[0].path, DataPath::kHostStagedRdma);
  EXPECT_EQ(doctor_exit_code(r, false), 0);
  EXPECT_EQ(doctor_exit_code(r, true), 1);
  EXPECT_NE(render(r).find("GPU0: host-staged RDMA via mlx5_0 -- GPU 0 - mlx5_0 is SYS, above "
                           "GRADSYNC_GDR_LEVEL=PXB"),
            std::string::npos);

  // GRADSYNC_GDR_LEVEL=SYS allows it.
  r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::SYS);
  EXPECT_EQ(r.paths[0].path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(doctor_exit_code(r, true), 0);
}

TEST(DoctorReport, PeermemPresentOrAbsentWithoutCuda) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0);
  t.write("proc/driver/nvidia/version",
          "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Release Build");
  const CudaFacts no_cuda;  // "built without CUDA"

  GpuReport r = build_report(t.root(), no_cuda, PciDistance::PXB);
  EXPECT_FALSE(r.reg.peermem_module);
  EXPECT_EQ(r.paths[0].path, DataPath::kHostStagedRdma);
  EXPECT_EQ(doctor_exit_code(r, true), 1);
  std::string text = render(r);
  EXPECT_NE(text.find("DMA_BUF_SUPPORTED unknown (built without CUDA)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("proprietary kernel module"), std::string::npos) << text;

  t.add_peermem();
  r = build_report(t.root(), no_cuda, PciDistance::PXB);
  EXPECT_TRUE(r.reg.peermem_module);
  EXPECT_FALSE(r.reg.peermem_registered);
  EXPECT_EQ(r.paths[0].path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(r.paths[0].registration, "nvidia-peermem");
  EXPECT_EQ(doctor_exit_code(r, true), 0);
  text = render(r);
  EXPECT_NE(text.find("not registered with ib_core"), std::string::npos) << text;
}

TEST(DoctorReport, PeermemFromProcModules) {
  FakeSysfs t;
  t.write("proc/modules", "nvidia_peermem 16384 0 - Live 0x0000000000000000 (OE)");
  t.write("sys/kernel/mm/memory_peers/nv_mem/version", "1.3");
  const GpuReport r = build_report(t.root(), CudaFacts{}, PciDistance::PXB);
  EXPECT_TRUE(r.reg.peermem_module);
  EXPECT_TRUE(r.reg.peermem_registered);
}

TEST(DoctorReport, InactivePortMeansTcp) {
  FakeSysfs t;
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0, "1: DOWN");
  const GpuReport r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB);
  EXPECT_EQ(r.nics[0].ports[0].state, "DOWN");
  EXPECT_EQ(r.paths[0].path, DataPath::kTcp);
  EXPECT_EQ(doctor_exit_code(r, true), 1);
}

TEST(DoctorReport, NothingFoundSaysTcpPlainly) {
  FakeSysfs t;
  const GpuReport r = build_report(t.root(), CudaFacts{}, PciDistance::PXB);
  EXPECT_TRUE(r.gpus.empty());
  EXPECT_TRUE(r.nics.empty());
  EXPECT_NE(render(r).find(
                "no NVIDIA GPU found; no RDMA device found: gradsync will use TCP with host memory"),
            std::string::npos);
  EXPECT_EQ(doctor_exit_code(r, false), 0);
  EXPECT_EQ(doctor_exit_code(r, true), 1);
}

TEST(DoctorReport, OldKernelBlocksDmaBuf) {
  FakeSysfs t;
  t.write("proc/sys/kernel/osrelease", "5.10.0-28-amd64");
  t.add_gpu(kSwitch + "/0000:19:00.0", 0);
  t.add_mlx5("mlx5_0", kSwitch + "/0000:1a:00.0", 0);
  const GpuReport r = build_report(t.root(), h200_cuda("0000:19:00.0"), PciDistance::PXB);
  EXPECT_FALSE(r.reg.kernel_has_rdma_dmabuf);
  EXPECT_EQ(r.paths[0].path, DataPath::kHostStagedRdma);
}

TEST(DoctorReport, SysfsRootPath) {
  EXPECT_EQ(SysfsRoot{}.path("/sys/x"), "/sys/x");
  EXPECT_EQ(SysfsRoot{"/tmp/r/"}.path("/sys/x"), "/tmp/r/sys/x");
}

}  // namespace
}  // namespace gradsync::topology
