// Benchmarks of the GPU communicator's multi-node paths, ranks as threads of this process on
// the emulated RDMA fabric (as verbs_gdr_gpu_test): disabled, run with
// --gtest_also_run_disabled_tests. docs/benchmarks.md has their tables.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon_cluster.h"
#include "emulated_gpu_nic.h"
#include "gpu_world.h"
#include "transport/verbs/emulated_fabric.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::DaemonCluster;
using testing::DaemonWorld;
using testing::gpu_copier;
using testing::gpu_count;
using testing::kEagerLoading;
using testing::on_gpus;

// Time per allreduce at 2 nodes x 2 and 2 x 4 (ranks as threads sharing GPU 0, each node a
// daemon with its own emulated RDMA device): the flat channels with the hops inside a node by
// CUDA IPC and through the NIC (GRADSYNC_GDR_DIRECT=0), ring and trees forced, and the
// hierarchical path. Ranks sharing one GPU time-slice it, so the figures compare paths of one
// run, not GPUs.
TEST(GdrBench, DISABLED_FlatChannelsDirectBesideNic) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kEagerLoading);
  verbs::EmulatedFabric::instance().set_copier(gpu_copier);
  ::setenv("GRADSYNC_GDR_MIN_BYTES", "0", 1);
  ::setenv("GRADSYNC_GPU_BLOCKS", "8", 1);
  struct Path {
    const char* name;
    const char* algo;  // GRADSYNC_ALGO
    const char* direct;
    const char* hierarchical;
  };
  const Path paths[] = {{"ring, CUDA IPC", "ring", "1", "0"}, {"ring, NIC", "ring", "0", "0"},
                        {"tree, CUDA IPC", "tree", "1", "0"}, {"tree, NIC", "tree", "0", "0"},
                        {"hierarchical", "auto", "1", "1"}};
  const size_t sizes[] = {size_t(1) << 20, size_t(16) << 20, size_t(64) << 20};
  std::printf("# GPU allreduce float32 sum, us per call; ranks as threads sharing GPU 0, emulated RDMA fabric\n");
  std::printf("# %-6s %-16s %12s %12s %12s\n", "shape", "path", "1 MiB", "16 MiB", "64 MiB");
  for (int per : {2, 4}) {
    for (const Path& p : paths) {
      ::setenv("GRADSYNC_ALGO", p.algo, 1);
      ::setenv("GRADSYNC_GDR_DIRECT", p.direct, 1);
      ::setenv("GRADSYNC_GPU_HIERARCHICAL", p.hierarchical, 1);
      DaemonCluster cluster({.nodes = 2});
      ASSERT_TRUE(cluster.ok()) << cluster.error();
      DaemonWorld world(cluster, 2, per, "bench-flat-" + std::to_string(per) + "-" + p.algo + p.direct + p.hierarchical,
                        60s, on_gpus);
      ASSERT_EQ(world.join_error(), "");
      double us[3];
      for (int i = 0; i < 3; ++i) {
        auto t = testing::device_allreduce_us(world, sizes[i], i == 0 ? 20 : 5);
        ASSERT_TRUE(t.ok()) << p.name << ": " << t.status().to_string();
        us[i] = *t;
      }
      std::printf("  2x%-4d %-16s %12.1f %12.1f %12.1f\n", per, p.name, us[0], us[1], us[2]);
    }
  }
  for (const char* v : {"GRADSYNC_ALGO", "GRADSYNC_GDR_DIRECT", "GRADSYNC_GPU_HIERARCHICAL", "GRADSYNC_GDR_MIN_BYTES",
                        "GRADSYNC_GPU_BLOCKS"}) {
    ::unsetenv(v);
  }
  verbs::EmulatedFabric::instance().set_copier(nullptr);
}

// busbw of float32 sum allreduce on device buffers, 2 nodes x 1 GPU: GPUDirect RDMA beside
// the host-staged path over the daemons' verbs channels and over TCP channels, in this
// process. The emulated NIC is a cudaMemcpy under one lock: this compares the paths' own
// costs, not a NIC.
TEST(GdrBench, DISABLED_BusbwGpuDirectBesideHostStaged) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(kEagerLoading);
  verbs::EmulatedFabric::instance().set_copier(gpu_copier);
  ::unsetenv("GRADSYNC_GDR");
  ::setenv("GRADSYNC_GDR_MIN_BYTES", "0", 1);
  constexpr int kPaths = 4;
  struct Row {
    size_t bytes;
    double us[kPaths];
  };
  std::vector<Row> rows;
  for (size_t bytes = 64 << 10; bytes <= (size_t(256) << 20); bytes *= 4) rows.push_back({bytes, {}});
  // The GPU ring with GPU slots, the same ring with pinned host slots, and the daemons'
  // host-staged path over verbs and over TCP channels.
  const char* names[kPaths] = {"gpudirect", "host-slots", "staged-verbs", "staged-tcp"};
  for (int t = 0; t < kPaths; ++t) {
    if (t == 1) ::setenv("GRADSYNC_GDR_HOST_SLOTS", "1", 1); else ::unsetenv("GRADSYNC_GDR_HOST_SLOTS");
    if (t < 2) ::unsetenv("GRADSYNC_GPU_STAGED"); else ::setenv("GRADSYNC_GPU_STAGED", "1", 1);
    const std::string tr = t == 3 ? "tcp" : "verbs";
    DaemonCluster cluster({.nodes = 2, .transport = {tr, tr}, .slots = 8, .slot_bytes = 1 << 20});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 2, 1, std::string("bench-") + names[t], 120s, on_gpus);
    ASSERT_EQ(world.join_error(), "");
    Status s = testing::device_allreduce_sweep(world, rows, t);
    ASSERT_TRUE(s.ok()) << names[t] << ": " << s.to_string();
  }
  ::unsetenv("GRADSYNC_GPU_STAGED");
  ::unsetenv("GRADSYNC_GDR_HOST_SLOTS");
  ::unsetenv("GRADSYNC_GDR_MIN_BYTES");
  verbs::EmulatedFabric::instance().set_copier(nullptr);
  // busbw = algbw * 2 (n - 1) / n, n = 2 ranks: algbw.
  std::printf("# GPU allreduce float32 sum, 2 nodes x 1 GPU, emulated RDMA fabric; daemons in one process\n");
  std::printf("# %11s %11s %11s %13s %11s %10s %10s\n", "bytes", "gdr GB/s", "host-slots", "staged-verbs",
              "staged-tcp", "gdr/verbs", "gdr/tcp");
  for (const auto& row : rows) {
    double bw[kPaths];
    for (int t = 0; t < kPaths; ++t) bw[t] = double(row.bytes) / row.us[t] / 1e3;
    std::printf("  %11zu %11.2f %11.2f %13.2f %11.2f %9.2fx %9.2fx\n", row.bytes, bw[0], bw[1], bw[2], bw[3],
                bw[0] / bw[2], bw[0] / bw[3]);
  }
}

}  // namespace
}  // namespace gradsync
