// GPU collectives over host-staged RDMA (design §3's middle path): GPU communicators as
// threads, one per "node", each node a gradsyncd object on its own emulated RDMA device
// (daemon_cluster.h). The collective's device buffers are staged through pinned host memory
// by the GPU communicator and cross nodes over the daemons' verbs channels; the whole matrix of
// collective_matrix.h (every collective x type x op, in and out of place) runs on device
// copies of its buffers. Label gpu: skips
// itself without a CUDA device. The busbw table (verbs channels beside TCP channels, same
// process, same buffers) is a benchmark, run with --gtest_also_run_disabled_tests.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../unit/collective_matrix.h"
#include "daemon_cluster.h"
#include "gpu_world.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::DaemonCluster;
using testing::DaemonWorld;
using testing::GpuWorld;
using testing::gpu_count;
using testing::on_gpus;

class StagedRdma : public ::testing::TestWithParam<Algorithm> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    // The daemons run verbs here, so GPU communicators would take GPUDirect RDMA
    // (verbs_gdr_gpu_test); this test is about the host-staged path.
    ::setenv("GRADSYNC_GPU_STAGED", "1", 1);
  }
};

TEST_P(StagedRdma, CollectivesMatrixOnDeviceBuffers) {
  DaemonCluster cluster({.nodes = 2, .slot_bytes = 64 << 10});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_EQ(cluster.daemon(0).transport(), "verbs");
  DaemonWorld world(cluster, 2, 1, "gpu-matrix", 60s, on_gpus);
  ASSERT_EQ(world.join_error(), "");
  for (int r = 0; r < 2; ++r) ASSERT_EQ(world.comm(r).gpu_path(), "host-staged") << "rank " << r;
  GpuWorld gpus(world);
  testing::allreduce_matrix(gpus, GetParam());
  testing::reduce_scatter_all_gather_broadcast_matrix(gpus, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Algorithms, StagedRdma, ::testing::Values(Algorithm::kRing, Algorithm::kTree),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// Daemons that run TCP only (GRADSYNC_GPU_STAGED=steps asks for what is also the default):
// the planner's ring and trees on the step channels (gpu/gdr_channels.h) with every hop
// between nodes a TCP peer of the link (gpu/gdr_link_tcp.cc) and, from 2 ranks per node, the
// hops inside a node by CUDA IPC (every rank on GPU 0 here). Shapes (nodes x ranks per node)
// 2x1, 2x2, 2x4 and 3x2; path tcp-steps; the whole matrix exact.
class TcpSteps : public ::testing::TestWithParam<std::tuple<std::pair<int, int>, Algorithm>> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("GRADSYNC_GPU_STAGED", "steps", 1);
  }
  void TearDown() override { ::unsetenv("GRADSYNC_GPU_STAGED"); }
};

TEST_P(TcpSteps, CollectivesMatrixOnDeviceBuffers) {
  const auto [shape, algo] = GetParam();
  const auto [nodes, per_node] = shape;
  DaemonCluster cluster(
      {.nodes = nodes, .transport = std::vector<std::string>(size_t(nodes), "tcp"), .slot_bytes = 64 << 10});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, nodes, per_node, "gpu-tcp-steps", 60s, on_gpus);
  ASSERT_EQ(world.join_error(), "");
  for (int r = 0; r < nodes * per_node; ++r) {
    ASSERT_EQ(world.comm(r).gpu_path(), "tcp-steps") << "rank " << r << " (its log says why)";
  }
  GpuWorld gpus(world);
  testing::allreduce_matrix(gpus, algo);
  testing::reduce_scatter_all_gather_broadcast_matrix(gpus, algo);
}

using TcpShape = std::tuple<std::pair<int, int>, Algorithm>;
std::string tcp_shape_name(const ::testing::TestParamInfo<TcpShape>& info) {
  const std::pair<int, int> shape = std::get<0>(info.param);
  return "x" + std::to_string(shape.first) + "_" + std::to_string(shape.second) + "_" +
         to_string(std::get<1>(info.param));
}
INSTANTIATE_TEST_SUITE_P(Shapes, TcpSteps,
                         ::testing::Combine(::testing::Values(std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 4},
                                                              std::pair{3, 2}),
                                            ::testing::Values(Algorithm::kRing, Algorithm::kTree)),
                         tcp_shape_name);

// busbw of float32 sum allreduce on device buffers, 2 nodes x 1 GPU, channels over the
// emulated verbs fabric beside channels over loopback TCP, in this process. The emulated NIC
// is a memcpy under one lock: this compares the daemons' two channel paths, not a NIC.
TEST(StagedRdmaBench, DISABLED_BusbwVerbsBesideTcp) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  ::setenv("GRADSYNC_GPU_STAGED", "1", 1);
  struct Row {
    size_t bytes;
    double us[2];
  };
  std::vector<Row> rows;
  for (size_t bytes = 1 << 20; bytes <= (size_t(256) << 20); bytes *= 4) rows.push_back({bytes, {0, 0}});
  const char* names[2] = {"verbs", "tcp"};
  for (int t = 0; t < 2; ++t) {
    DaemonCluster cluster({.nodes = 2, .transport = {names[t], names[t]}, .slots = 8, .slot_bytes = 1 << 20});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 2, 1, std::string("bench-") + names[t], 120s, on_gpus);
    ASSERT_EQ(world.join_error(), "");
    Status s = testing::device_allreduce_sweep(world, rows, t);
    ASSERT_TRUE(s.ok()) << names[t] << ": " << s.to_string();
  }
  // busbw = algbw * 2 (n - 1) / n, n = 2 ranks: algbw.
  std::printf("# GPU allreduce float32 sum, 2 nodes x 1 GPU, host-staged; daemons in one process\n");
  std::printf("# %12s %12s %12s %14s %14s %8s\n", "bytes", "verbs(us)", "tcp(us)", "verbs busbw", "tcp busbw",
              "ratio");
  for (const auto& row : rows) {
    double bw[2];
    for (int t = 0; t < 2; ++t) bw[t] = double(row.bytes) / row.us[t] / 1e3;
    std::printf("  %12zu %12.1f %12.1f %11.2f GB/s %11.2f GB/s %7.2fx\n", row.bytes, row.us[0], row.us[1], bw[0],
                bw[1], bw[0] / bw[1]);
  }
}

// The two paths of GPU buffers over TCP between nodes, per call, ranks as threads of this
// process (one CUDA context: no time-slicing between processes on a shared GPU): the host-staged
// schedule (device_comm_staged.cc: the stream hands each piece to the host ring) beside the
// step channels over TCP peers (GRADSYNC_GPU_STAGED=steps: one step kernel per call, the
// link's worker moving the slots). NODE_BENCH_SHAPE=2x2 for two ranks per node.
TEST(TcpStepsBench, DISABLED_HostStagedBesideTcpSteps) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* shape = std::getenv("NODE_BENCH_SHAPE");
  const int per_node = shape != nullptr && std::string(shape) == "2x2" ? 2 : 1;
  struct Row {
    size_t bytes;
    double us[2];
  };
  std::vector<Row> rows;
  for (size_t bytes : {size_t(8), size_t(64) << 10, size_t(1) << 20, size_t(4) << 20, size_t(16) << 20,
                       size_t(64) << 20})
    rows.push_back({bytes, {0, 0}});
  const char* modes[2] = {"1", "steps"};
  for (int t = 0; t < 2; ++t) {
    ::setenv("GRADSYNC_GPU_STAGED", modes[t], 1);
    DaemonCluster cluster({.nodes = 2, .transport = {"tcp", "tcp"}});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 2, per_node, std::string("bench-tcp-") + modes[t], 120s, on_gpus);
    ASSERT_EQ(world.join_error(), "");
    Status s = testing::device_allreduce_sweep(world, rows, t);
    ASSERT_TRUE(s.ok()) << modes[t] << ": " << s.to_string();
  }
  ::unsetenv("GRADSYNC_GPU_STAGED");
  std::printf("# GPU allreduce float32 sum in place, 2 nodes x %d GPU, TCP between nodes; one process\n", per_node);
  std::printf("# %12s %14s %14s %10s\n", "bytes", "staged(us)", "tcp-steps(us)", "speedup");
  for (const auto& row : rows) {
    std::printf("  %12zu %14.1f %14.1f %9.2fx\n", row.bytes, row.us[0], row.us[1], row.us[0] / row.us[1]);
  }
}

// Small calls on the host-staged path, per call (200 calls queued back to back), over the
// daemons' TCP channels, with both ranks in one process: on a machine with one GPU, two
// processes would time-slice the GPU between their contexts and hide the path's own cost
// (docs/benchmarks.md).
TEST(StagedRdmaBench, DISABLED_SmallCallsInOneProcess) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  ::setenv("GRADSYNC_GPU_STAGED", "1", 1);
  DaemonCluster cluster({.nodes = 2, .transport = {"tcp", "tcp"}, .slots = 8, .slot_bytes = 1 << 20});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 2, 1, "bench-small", 120s, on_gpus);
  ASSERT_EQ(world.join_error(), "");
  std::printf("# GPU allreduce float32 sum, 2 nodes x 1 GPU, host-staged over TCP; one process\n");
  std::printf("# %12s %12s\n", "bytes", "us/call");
  for (size_t bytes : {size_t(8), size_t(1) << 10, size_t(64) << 10, size_t(1) << 20}) {
    auto us = testing::device_allreduce_us(world, bytes, 200);
    ASSERT_TRUE(us.ok()) << us.status().to_string();
    std::printf("  %12zu %12.1f\n", bytes, *us);
  }
}

}  // namespace
}  // namespace gradsync
