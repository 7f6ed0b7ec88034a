// Path selection per peer (design §3, runtime/topology/gpudirect.h): GPUDirect RDMA, host-staged
// RDMA or TCP from the NIC, the registration method and GRADSYNC_GDR_LEVEL; the per-message
// GRADSYNC_GDR_MIN_BYTES rule and its parsing. The sysfs side is in doctor_test.cc.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <optional>
#include <string>

#include "topology/gpudirect.h"

namespace gradsync::topology {
namespace {

bool contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

// GPU 0 next to an ACTIVE mlx5_0 (PIX), dma-buf possible.
PathInputs near_nic() {
  PathInputs in;
  in.gpu = 0;
  in.any_rdma_device = true;
  in.nic_active = true;
  in.nic = "mlx5_0";
  in.distance = PciDistance::PIX;
  in.gpu_direct_rdma_supported = 1;
  in.dma_buf_supported = 1;
  in.kernel_rdma_dmabuf = true;
  return in;
}

TEST(GdrPath, NicRegistrationAndDistanceGiveGpuDirect) {
  for (PciDistance d : {PciDistance::PIX, PciDistance::PXB}) {
    PathInputs in = near_nic();
    in.distance = d;
    GpuPath p = decide_path(in, PciDistance::PXB);
    EXPECT_EQ(p.path, DataPath::kGpuDirectRdma) << p.reason;
    EXPECT_EQ(p.registration, "dma-buf");
    EXPECT_TRUE(contains(p.reason, std::string("GPU 0 - mlx5_0 is ") + distance_name(d) +
                                       ", within GRADSYNC_GDR_LEVEL=PXB"))
        << p.reason;
  }
  PathInputs in = near_nic();
  in.dma_buf_supported = 0;
  in.peermem = true;
  GpuPath p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kGpuDirectRdma);
  EXPECT_EQ(p.registration, "nvidia-peermem");
}

TEST(GdrPath, TooFarIsHostStagedWithAnExplicitReason) {
  PathInputs in = near_nic();
  in.distance = PciDistance::SYS;
  GpuPath p = decide_path(in, PciDistance::PXB);
  EXPECT_EQ(p.path, DataPath::kHostStagedRdma);
  EXPECT_EQ(p.nic, "mlx5_0");
  EXPECT_EQ(p.reason, "GPU 0 - mlx5_0 is SYS, above GRADSYNC_GDR_LEVEL=PXB");
  in.gpu = 3;
  in.distance = PciDistance::PHB;
  EXPECT_EQ(decide_path(in, PciDistance::PIX).reason, "GPU 3 - mlx5_0 is PHB, above GRADSYNC_GDR_LEVEL=PIX");
  EXPECT_EQ(decide_path(in, PciDistance::PHB).path, DataPath::kGpuDirectRdma);
}

TEST(GdrPath, NoRegistrationIsHostStaged) {
  PathInputs in = near_nic();
  in.dma_buf_supported = 0;  // and no peermem
  GpuPath p = decide_path(in, PciDistance::SYS);
  EXPECT_EQ(p.path, DataPath::kHostStagedRdma);
  EXPECT_TRUE(contains(p.reason, "GPU 0 memory cannot be registered with mlx5_0")) << p.reason;
  EXPECT_TRUE(contains(p.reason, "DMA_BUF_SUPPORTED=0")) << p.reason;
  EXPECT_TRUE(contains(p.reason, "nvidia-peermem is not loaded")) << p.reason;

  in = near_nic();
  in.gpu_direct_rdma_supported = 0;
  p = decide_path(in, PciDistance::SYS);
  EXPECT_EQ(p.path, DataPath::kHostStagedRdma);
  EXPECT_TRUE(contains(p.reason, "GPU 0 reports GPU_DIRECT_RDMA_SUPPORTED=0")) << p.reason;
}

TEST(GdrPath, NoNicIsTcp) {
  PathInputs in;
  in.gpu = 1;
  EXPECT_EQ(decide_path(in, PciDistance::SYS).path, DataPath::kTcp);
  in = near_nic();
  in.nic_active = false;  // a device, but no ACTIVE port
  GpuPath p = decide_path(in, PciDistance::SYS);
  EXPECT_EQ(p.path, DataPath::kTcp);
  EXPECT_TRUE(p.nic.empty());
}

TEST(GdrPath, SmallMessagesAreHostStaged) {
  const GpuPath gdr = decide_path(near_nic(), PciDistance::PXB);
  ASSERT_EQ(gdr.path, DataPath::kGpuDirectRdma);
  GpuPath small = path_for_message(gdr, 1024, 65536);
  EXPECT_EQ(small.path, DataPath::kHostStagedRdma);
  EXPECT_EQ(small.nic, "mlx5_0");
  EXPECT_TRUE(small.registration.empty());
  EXPECT_TRUE(contains(small.reason, "1024 bytes < GRADSYNC_GDR_MIN_BYTES=65536")) << small.reason;
  EXPECT_EQ(path_for_message(gdr, 65536, 65536).path, DataPath::kGpuDirectRdma);  // the bound is included
  EXPECT_EQ(path_for_message(gdr, 0, 0).path, DataPath::kGpuDirectRdma);          // 0 = always
  // Other paths are not changed by size.
  PathInputs far = near_nic();
  far.distance = PciDistance::SYS;
  const GpuPath staged = decide_path(far, PciDistance::PXB);
  EXPECT_EQ(path_for_message(staged, 1u << 30, 65536).reason, staged.reason);
  EXPECT_EQ(path_for_message(decide_path(PathInputs{}, PciDistance::PXB), 1, 65536).path, DataPath::kTcp);
}

TEST(GdrPath, ParseMinBytes) {
  struct Good {
    const char* text;
    size_t want;
  };
  for (const Good& g : {Good{"0", 0}, Good{"65536", 65536}, Good{"64K", 64u << 10}, Good{"64k", 64u << 10},
                        Good{"1M", 1u << 20}, Good{"2g", size_t{2} << 30}}) {
    auto r = parse_gdr_min_bytes(g.text);
    ASSERT_TRUE(r.ok()) << g.text << ": " << r.status().to_string();
    EXPECT_EQ(*r, g.want) << g.text;
  }
  for (const char* bad : {"", "abc", "-1", "12KB", "1.5M", "64 K", "1T", "99999999999999999999",
                          "17179869184G"}) {
    auto r = parse_gdr_min_bytes(bad);
    ASSERT_FALSE(r.ok()) << "'" << bad << "' was accepted";
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_TRUE(contains(r.status().message(), std::string("GRADSYNC_GDR_MIN_BYTES='") + bad + "'"))
        << r.status().message();
  }
}

// Restores GRADSYNC_GDR_MIN_BYTES after a test that sets it.
class EnvGuard {
 public:
  EnvGuard() {
    if (const char* v = std::getenv("GRADSYNC_GDR_MIN_BYTES")) old_ = v;
  }
  ~EnvGuard() {
    if (old_) ::setenv("GRADSYNC_GDR_MIN_BYTES", old_->c_str(), 1);
    else ::unsetenv("GRADSYNC_GDR_MIN_BYTES");
  }

 private:
  std::optional<std::string> old_;
};

TEST(GdrPath, MinBytesFromTheMeasuredTimes) {
  const std::vector<size_t> sizes = {16 << 10, 64 << 10, 256 << 10, 1 << 20};
  // GPUDirect slower for small calls, faster from 256 KiB.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {40, 60, 80, 150}, {30, 50, 120, 400}), size_t(256) << 10);
  // Faster everywhere: at every size, below the smallest measured too.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {10, 20, 30, 40}, {30, 50, 120, 400}), 0u);
  // Slower only at the smallest size: from the next.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {31, 20, 30, 40}, {30, 50, 120, 400}), size_t(64) << 10);
  // A win below a loss does not count: only from where it wins at every larger size.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {10, 90, 80, 150}, {30, 50, 120, 400}), size_t(256) << 10);
  // Slower at every size: twice the largest.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {50, 90, 200, 500}, {30, 50, 120, 400}), size_t(2) << 20);
  // A tie counts for GPUDirect.
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {30, 50, 121, 400}, {30, 50, 120, 400}), size_t(1) << 20);
  EXPECT_EQ(gdr_min_bytes_from_times(sizes, {30, 50, 120, 400}, {30, 50, 120, 400}), 0u);
  EXPECT_EQ(gdr_min_bytes_from_times({}, {}, {}), 0u);
}

TEST(GdrPath, MinBytesFromEnvOverridesTheMeasuredValue) {
  EnvGuard guard;
  ::unsetenv("GRADSYNC_GDR_MIN_BYTES");
  auto r = gdr_min_bytes_from_env(12345);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 12345u) << "unset: the measured threshold";
  ::setenv("GRADSYNC_GDR_MIN_BYTES", "", 1);
  EXPECT_EQ(*gdr_min_bytes_from_env(777), 777u) << "empty counts as unset";
  ::setenv("GRADSYNC_GDR_MIN_BYTES", "256K", 1);
  EXPECT_EQ(*gdr_min_bytes_from_env(12345), 256u << 10);
  ::setenv("GRADSYNC_GDR_MIN_BYTES", "lots", 1);
  auto bad = gdr_min_bytes_from_env(12345);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(contains(bad.status().message(), "GRADSYNC_GDR_MIN_BYTES='lots' is not a byte count"))
      << bad.status().message();
}

}  // namespace
}  // namespace gradsync::topology
