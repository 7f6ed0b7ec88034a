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

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::DaemonCluster;
using testing::DaemonWorld;

int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return {Code::kInternal, std::string(what) + ": " + cudaGetErrorString(e)};
}

// The World of collective_matrix.h over device memory: each host call runs on device copies of
// its buffers (aliasing kept: an in-place call stays in place), on a stream of the rank.
class GpuWorld {
 public:
  explicit GpuWorld(DaemonWorld& w) : w_(w) {}
  int size() const { return w_.size(); }
  std::vector<Status> collective(std::vector<CollectiveCall> calls) {
    return w_.run([&](int r) { return run_on_device(r, calls[r]); });
  }

 private:
  // Device copies of the call's buffers: one allocation over both when they overlap (in
  // place), so that the device call sees the same aliasing as the host call.
  Status run_on_device(int r, const CollectiveCall& k) {
    Communicator& comm = w_.comm(r);
    if (k.kind == CollectiveKind::kBarrier) return comm.barrier();
    const size_t es = element_size(k.type), n = size_t(size());
    size_t send_bytes = k.count * es, recv_bytes = k.count * es;
    if (k.kind == CollectiveKind::kReduceScatter) send_bytes *= n;
    if (k.kind == CollectiveKind::kAllGather) recv_bytes *= n;
    const auto* s0 = static_cast<const uint8_t*>(k.send);
    auto* r0 = static_cast<uint8_t*>(k.recv);
    const bool overlap = s0 && r0 && s0 < r0 + recv_bytes && r0 < s0 + send_bytes;
    GS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(comm.device()), "cudaSetDevice"));
    uint8_t* dsend = nullptr;
    uint8_t* drecv = nullptr;
    uint8_t* block = nullptr;
    const uint8_t* lo = nullptr;
    size_t span = 0;
    if (overlap) {
      lo = std::min<const uint8_t*>(s0, r0);
      span = size_t(std::max<const uint8_t*>(s0 + send_bytes, r0 + recv_bytes) - lo);
      GS_RETURN_IF_ERROR(cuda_status(cudaMalloc(reinterpret_cast<void**>(&block), std::max<size_t>(span, 16)), "cudaMalloc"));
      if (span) GS_RETURN_IF_ERROR(cuda_status(cudaMemcpy(block, lo, span, cudaMemcpyHostToDevice), "H2D"));
      dsend = block + (s0 - lo);
      drecv = block + (r0 - lo);
    } else {
      GS_RETURN_IF_ERROR(cuda_status(cudaMalloc(reinterpret_cast<void**>(&dsend), std::max<size_t>(send_bytes, 16)), "cudaMalloc"));
      GS_RETURN_IF_ERROR(cuda_status(cudaMalloc(reinterpret_cast<void**>(&drecv), std::max<size_t>(recv_bytes, 16)), "cudaMalloc"));
      if (send_bytes) GS_RETURN_IF_ERROR(cuda_status(cudaMemcpy(dsend, s0, send_bytes, cudaMemcpyHostToDevice), "H2D"));
      if (recv_bytes) GS_RETURN_IF_ERROR(cuda_status(cudaMemcpy(drecv, r0, recv_bytes, cudaMemcpyHostToDevice), "H2D"));
    }
    cudaStream_t stream = nullptr;
    GS_RETURN_IF_ERROR(cuda_status(cudaStreamCreate(&stream), "cudaStreamCreate"));
    const CallOptions opts{k.algorithm};
    Status s;
    switch (k.kind) {
      case CollectiveKind::kAllreduce: s = comm.allreduce(dsend, drecv, k.count, k.type, k.op, stream, opts); break;
      case CollectiveKind::kReduceScatter:
        s = comm.reduce_scatter(dsend, drecv, k.count, k.type, k.op, stream, opts);
        break;
      case CollectiveKind::kAllGather: s = comm.all_gather(dsend, drecv, k.count, k.type, stream, opts); break;
      case CollectiveKind::kBroadcast: s = comm.broadcast(drecv, k.count, k.type, k.root, stream, opts); break;
      case CollectiveKind::kBarrier: break;
    }
    Status synced = cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (s.ok()) s = synced;
    if (s.ok()) s = comm.async_error();
    if (s.ok() && overlap && span) {
      s = cuda_status(cudaMemcpy(const_cast<uint8_t*>(lo), block, span, cudaMemcpyDeviceToHost), "D2H");
    } else if (s.ok() && !overlap && recv_bytes) {
      s = cuda_status(cudaMemcpy(r0, drecv, recv_bytes, cudaMemcpyDeviceToHost), "D2H");
    }
    cudaStreamDestroy(stream);
    if (overlap) {
      cudaFree(block);
    } else {
      cudaFree(dsend);
      cudaFree(drecv);
    }
    return s;
  }

  DaemonWorld& w_;
};

// Rank r uses GPU r modulo the visible GPUs.
void on_gpus(int rank, JoinOptions& o) { o.device = rank % std::max(gpu_count(), 1); }

class StagedRdma : public ::testing::TestWithParam<Algorithm> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
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

// busbw of float32 sum allreduce on device buffers, 2 nodes x 1 GPU, channels over the
// emulated verbs fabric beside channels over loopback TCP, in this process. The emulated NIC
// is a memcpy under one lock: this compares the daemons' two channel paths, not a NIC.
TEST(StagedRdmaBench, DISABLED_BusbwVerbsBesideTcp) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
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
    for (auto& row : rows) {
      const size_t count = row.bytes / 4;
      const int iters = row.bytes >= (size_t(64) << 20) ? 5 : 20;
      std::vector<double> us(2);
      auto st = world.run([&](int r) -> Status {
        Communicator& comm = world.comm(r);
        GS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(comm.device()), "cudaSetDevice"));
        void* buf = nullptr;
        GS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&buf, row.bytes), "cudaMalloc"));
        cudaMemset(buf, 0, row.bytes);
        cudaStream_t stream = nullptr;
        cudaStreamCreate(&stream);
        Status s;
        for (int i = 0; i < 2 && s.ok(); ++i)  // warm-up
          s = comm.allreduce(buf, buf, count, DataType::kFloat32, ReduceOp::kSum, stream);
        cudaStreamSynchronize(stream);
        if (s.ok()) s = comm.barrier();
        auto t0 = Clock::now();
        for (int i = 0; i < iters && s.ok(); ++i)
          s = comm.allreduce(buf, buf, count, DataType::kFloat32, ReduceOp::kSum, stream);
        cudaStreamSynchronize(stream);
        us[r] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
        if (s.ok()) s = comm.async_error();
        cudaStreamDestroy(stream);
        cudaFree(buf);
        return s;
      });
      for (int r = 0; r < 2; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      row.us[t] = std::max(us[0], us[1]);
    }
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

}  // namespace
}  // namespace gradsync
