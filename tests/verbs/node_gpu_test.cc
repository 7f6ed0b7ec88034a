// One node, several ranks as threads of this process on GPU 0 (one CUDA context: the ranks'
// kernels run side by side, as on GPUs of their own): the one-node protocols — low-latency,
// one-shot and two-shot (kernels/cuda_node_two_shot.cuh) — and the planner's ring and trees
// over CUDA IPC (the step channels, gpu/gdr_channels.h) on the collectives matrix, and the
// bytes each rank stores into its peers' memory, read from the counters.
// Label gpu; skips itself without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../unit/collective_matrix.h"
#include "gpu_world.h"
#include "kernel_stamps_report.h"
#include "step_replay_calls.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::DaemonCluster;
using testing::DaemonWorld;
using testing::GpuWorld;
using testing::gpu_count;

// Every rank on GPU 0: the shape of n GPUs of one node, on the one GPU a test machine has.
void on_gpu0(int, JoinOptions& o) { o.device = 0; }

struct NodeShape {
  int ranks;
  const char* two_shot_min;  // GRADSYNC_GPU_TWOSHOT_MIN: "1" every allreduce/broadcast
};

class OneNode : public ::testing::TestWithParam<NodeShape> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("GRADSYNC_GPU_TWOSHOT_MIN", GetParam().two_shot_min, 1);
  }
  void TearDown() override { ::unsetenv("GRADSYNC_GPU_TWOSHOT_MIN"); }
};

TEST_P(OneNode, CollectivesMatrixOnDeviceBuffers) {
  const int n = GetParam().ranks;
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 1, n, "node-matrix", 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  for (int r = 0; r < n; ++r) ASSERT_EQ(world.comm(r).gpu_path(), "cuda-ipc") << "rank " << r;
  GpuWorld gpus(world);
  testing::allreduce_matrix(gpus, Algorithm::kAuto);
  testing::reduce_scatter_all_gather_broadcast_matrix(gpus, Algorithm::kAuto);
}

INSTANTIATE_TEST_SUITE_P(Shapes, OneNode,
                         ::testing::Values(NodeShape{3, "1"}, NodeShape{4, "1"}, NodeShape{8, "1"},
                                           NodeShape{4, "0"}, NodeShape{8, "0"}),
                         [](const auto& info) {
                           return "x" + std::to_string(info.param.ranks) +
                                  (std::string(info.param.two_shot_min) == "0" ? "_OneShot" : "_TwoShot");
                         });

// Runs `iters` float32 sum allreduces of `count` elements (out of place, every rank's input
// element i = rank + (i % 7)), checks every rank's result exactly, and returns the bytes each
// rank's kernels stored into peers' memory and the slowest rank's microseconds per call.
struct Measured {
  std::vector<uint64_t> sent;
  double us = 0;
  double host_us = 0;  // the slowest rank's time inside the calls (queueing them), per call
};
// NODE_BENCH_GATE=1: every rank's stream is held by a host function until every rank has
// queued all its calls, so the time per call is the GPU's alone (no host queueing in it).
// Bounded too: if every rank's queueing blocks on its own held stream (a launch queue full of
// held work, say), no rank opens the gates, and the first gate opens itself after 40 s, saying
// how many ranks had queued everything.
struct Gate {
  int open = 0;
  std::atomic<int> queued{0};
  std::atomic<bool> timed_out{false};
};
void gate_wait(void* arg) {
  Gate& g = *static_cast<Gate*>(arg);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(40);
  while (!__atomic_load_n(&g.open, __ATOMIC_ACQUIRE)) {
    if (std::chrono::steady_clock::now() > deadline) {
      if (!g.timed_out.exchange(true))
        std::fprintf(stderr, "node_gpu_test: the gate opened at its 40 s deadline with %d rank(s) done queueing\n",
                     g.queued.load());
      __atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
      break;
    }
    std::this_thread::yield();
  }
}
Measured allreduce_on_gpus(DaemonWorld& world, size_t count, int iters, Algorithm algo) {
  const CallOptions opts{algo};
  const int n = world.size();
  Measured m;
  m.sent.assign(size_t(n), 0);
  std::vector<double> us(size_t(n), 0), host_us(size_t(n), 0);
  static const bool gated = std::getenv("NODE_BENCH_GATE") != nullptr;
  Gate gate;
  auto st = world.run([&](int r) -> Status {
    Communicator& comm = world.comm(r);
    GS_RETURN_IF_ERROR(testing::cuda_status(cudaSetDevice(comm.device()), "cudaSetDevice"));
    std::vector<float> host(count);
    for (size_t i = 0; i < count; ++i) host[i] = float(r + int(i % 7));
    float *in = nullptr, *out = nullptr;
    cudaStream_t stream = nullptr;
    GS_RETURN_IF_ERROR(testing::cuda_status(cudaMalloc(reinterpret_cast<void**>(&in), count * 4), "cudaMalloc"));
    GS_RETURN_IF_ERROR(testing::cuda_status(cudaMalloc(reinterpret_cast<void**>(&out), count * 4), "cudaMalloc"));
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaMemcpyAsync(in, host.data(), count * 4, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    // Allocation and release between barriers (gpu_world.h says why): a rank's cudaMalloc or
    // cudaFree may wait for every kernel of the shared context, among them a peer's waits for
    // this very rank's next call.
    Status s = comm.barrier();
    if (s.ok()) s = comm.allreduce(in, out, count, DataType::kFloat32, ReduceOp::kSum, stream, opts);  // warm-up
    cudaStreamSynchronize(stream);
    if (s.ok()) s = comm.barrier();
    auto before = comm.gpu_bytes_sent();
    if (!before.ok()) s = before.status();
    using clock = std::chrono::steady_clock;
    if (gated) cudaLaunchHostFunc(stream, gate_wait, &gate);
    auto t0 = clock::now();
    // NODE_BENCH_SYNC=1: wait for each call before the next (back to back otherwise).
    static const bool sync_each = std::getenv("NODE_BENCH_SYNC") != nullptr;
    clock::duration in_calls{};
    for (int i = 0; i < iters && s.ok(); ++i) {
      const auto c0 = clock::now();
      s = comm.allreduce(in, out, count, DataType::kFloat32, ReduceOp::kSum, stream, opts);
      in_calls += clock::now() - c0;
      if (sync_each) cudaStreamSynchronize(stream);
    }
    if (gated) {
      // The last rank to have queued everything opens every gate; the clock starts there.
      if (gate.queued.fetch_add(1) + 1 == n) __atomic_store_n(&gate.open, 1, __ATOMIC_RELEASE);
      // Bounded: a rank that failed before queueing still gets here, one that returned early
      // does not, and the gates then open after 30 s (the figures are then worthless; the
      // error says why).
      const auto deadline = clock::now() + std::chrono::seconds(30);
      while (!__atomic_load_n(&gate.open, __ATOMIC_ACQUIRE) && clock::now() < deadline) std::this_thread::yield();
      __atomic_store_n(&gate.open, 1, __ATOMIC_RELEASE);
      t0 = clock::now();
    }
    cudaStreamSynchronize(stream);
    if (s.ok() && gate.timed_out) s = {Code::kDeadlineExceeded, "the bench's gate opened at its deadline (see above)"};
    us[r] = std::chrono::duration<double, std::micro>(clock::now() - t0).count() / iters;
    host_us[r] = std::chrono::duration<double, std::micro>(in_calls).count() / iters;
    if (s.ok()) s = comm.async_error();
    auto after = comm.gpu_bytes_sent();
    if (s.ok() && !after.ok()) s = after.status();
    if (s.ok()) m.sent[r] = (*after - *before) / uint64_t(iters);
    if (s.ok()) {
      cudaMemcpyAsync(host.data(), out, count * 4, cudaMemcpyDeviceToHost, stream);
      cudaStreamSynchronize(stream);
      const float ranks_sum = float(n * (n - 1) / 2);
      for (size_t i = 0; i < count && s.ok(); ++i) {
        const float want = ranks_sum + float(n * int(i % 7));
        if (host[i] != want)
          s = {Code::kInternal, "element " + std::to_string(i) + " = " + std::to_string(host[i]) +
                                    ", want " + std::to_string(want)};
      }
    }
    if (s.ok()) s = comm.barrier();
    cudaStreamDestroy(stream);
    cudaFree(in);
    cudaFree(out);
    if (Status b = comm.barrier(); s.ok()) s = b;
    return s;
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
  m.us = *std::max_element(us.begin(), us.end());
  m.host_us = *std::max_element(host_us.begin(), host_us.end());
  return m;
}

// The planner's ring and trees on one node (GRADSYNC_ALGO or CallOptions::algorithm): every
// hop by CUDA IPC through the step channels, no NIC; every type, op and odd count exact, in
// and out of place, and the other collectives on the ring.
class OneNodeSteps : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Every rank's path, the allreduce matrix on the ring and the trees (and on the model's
// choice: `with_auto`), the other collectives on the ring, and the ring's bytes per rank.
void steps_matrix(DaemonWorld& world, const std::string& path, bool with_auto) {
  const int n = world.size();
  for (int r = 0; r < n; ++r) ASSERT_EQ(world.comm(r).gpu_path(), path) << "rank " << r;
  {
    GpuWorld gpus(world);
    testing::allreduce_matrix(gpus, Algorithm::kRing);
    testing::allreduce_matrix(gpus, Algorithm::kTree);
    if (with_auto) testing::allreduce_matrix(gpus, Algorithm::kAuto);
    testing::reduce_scatter_all_gather_broadcast_matrix(gpus, Algorithm::kRing);
  }
  // The steps ran, not the kernels: a ring allreduce sends 2 (n-1)/n S per rank (the kernels'
  // low-latency lines at this size would store 2 (n-1) S).
  const size_t count = 4096 * size_t(n);
  const std::vector<uint64_t> sent = allreduce_on_gpus(world, count, 2, Algorithm::kRing).sent;
  for (int r = 0; r < n; ++r) EXPECT_EQ(sent[r], 2 * uint64_t(n - 1) * count * 4 / n) << "rank " << r;
}

TEST_P(OneNodeSteps, RingAndTreeMatrixOverCudaIpc) {
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 1, GetParam(), "node-steps", 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  steps_matrix(world, "cuda-ipc", false);
}

INSTANTIATE_TEST_SUITE_P(Shapes, OneNodeSteps, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "x" + std::to_string(info.param); });

// A node of more ranks than the node kernels serve (12 > 8): the step channels over CUDA IPC
// take every call (path cuda-ipc-steps). With GRADSYNC_GDR_MIN_BYTES=1 no call is host-staged:
// the ring, the trees and the model's choice on the allreduce matrix, the other collectives on
// the ring, and the ring's 2 (n-1)/n S per rank; then, at the threshold measured at join, a
// small and a large call, exact either side of it.
TEST(OneNodeOfTwelve, StepChannelsTakeEveryCall) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int n = 12;
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  {
    ::setenv("GRADSYNC_GDR_MIN_BYTES", "1", 1);
    DaemonWorld world(cluster, 1, n, "node-twelve", 60s, on_gpu0);
    ::unsetenv("GRADSYNC_GDR_MIN_BYTES");
    ASSERT_EQ(world.join_error(), "");
    steps_matrix(world, "cuda-ipc-steps", true);
    if (HasFatalFailure()) return;
  }
  DaemonWorld world(cluster, 1, n, "node-twelve-measured", 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  ASSERT_EQ(world.comm(0).gpu_path(), "cuda-ipc-steps");
  // Bytes by the step channels per call (a host-staged call counts none).
  const uint64_t small = allreduce_on_gpus(world, 3, 2, Algorithm::kAuto).sent[0];
  const uint64_t large = allreduce_on_gpus(world, (size_t(1) << 20) + 5, 2, Algorithm::kAuto).sent[0];
  EXPECT_GT(large, 0u) << "a 4 MiB allreduce was host-staged";
  std::printf("12 ranks on one node, threshold measured at join: rank 0 sent %llu bytes by the steps "
              "for 3 floats, %llu for 1048581\n",
              static_cast<unsigned long long>(small), static_cast<unsigned long long>(large));
}

// A one-node call that repeats an earlier one relaunches its step tables instead of planning
// again (gpu/step_table_cache.h). In-place int32 allreduces on one buffer, each feeding the
// next, with counts, ops and protocols (low-latency at 37 and 1001 elements, bulk at 300001)
// interleaved so that most calls are replays of an earlier one: the buffer at the end is
// exact against the host's sequence only if every replay ran its own call, and each replay
// counts the bytes its planned call counted.
class OneNodeStepReplay : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("GRADSYNC_GPU_NODE_STEPS", "1", 1);
    ::setenv("GRADSYNC_ALGO", GetParam(), 1);
  }
  void TearDown() override {
    for (const char* v : {"GRADSYNC_GPU_NODE_STEPS", "GRADSYNC_ALGO"}) ::unsetenv(v);
  }
};

TEST_P(OneNodeStepReplay, RepeatedCallsOnOneBufferAreExact) {
  const int n = 4;
  const auto& calls = step_replay::kCalls;  // step_replay_calls.h: also run on the CPU
  const size_t cap = step_replay::kCap;
  using step_replay::initial;
  // The host's sequence: after each call every rank holds the reduction of the prefix.
  std::vector<int32_t> want(cap);
  {
    auto v = std::vector<std::vector<int32_t>>(size_t(n), std::vector<int32_t>(cap));
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < cap; ++i) v[size_t(r)][i] = initial(r, i);
    for (const step_replay::Call& c : calls) step_replay::reduce_on_host(c, v);
    want = v[0];
  }
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 1, n, std::string("node-replay-") + GetParam(), 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  auto st = world.run([&](int r) -> Status {
    Communicator& comm = world.comm(r);
    GS_RETURN_IF_ERROR(testing::cuda_status(cudaSetDevice(comm.device()), "cudaSetDevice"));
    std::vector<int32_t> host(cap);
    for (size_t i = 0; i < cap; ++i) host[i] = initial(r, i);
    int32_t* buf = nullptr;
    cudaStream_t stream = nullptr;
    GS_RETURN_IF_ERROR(testing::cuda_status(cudaMalloc(reinterpret_cast<void**>(&buf), cap * 4), "cudaMalloc"));
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    cudaMemcpyAsync(buf, host.data(), cap * 4, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    Status s = comm.barrier();
    // The bytes of the first call of each (count, op), which its replays must count again.
    std::vector<std::pair<size_t, uint64_t>> first;
    for (size_t k = 0; k < sizeof(calls) / sizeof(calls[0]) && s.ok(); ++k) {
      auto before = comm.gpu_bytes_sent();
      s = before.status();
      if (s.ok()) s = comm.allreduce(buf, buf, calls[k].count, DataType::kInt32, calls[k].op, stream);
      auto after = comm.gpu_bytes_sent();
      if (s.ok()) s = after.status();
      if (!s.ok()) break;
      const uint64_t bytes = *after - *before;
      const size_t id = calls[k].count * 2 + (calls[k].op == ReduceOp::kSum ? 1 : 0);
      auto seen = std::find_if(first.begin(), first.end(), [&](const auto& f) { return f.first == id; });
      if (seen == first.end()) {
        first.emplace_back(id, bytes);
      } else if (seen->second != bytes) {
        s = {Code::kInternal, "call " + std::to_string(k) + " (a repeat) counted " + std::to_string(bytes) +
                                  " bytes, its first " + std::to_string(seen->second)};
      }
      if (s.ok() && bytes == 0) s = {Code::kInternal, "call " + std::to_string(k) + " counted no bytes"};
    }
    cudaStreamSynchronize(stream);
    if (s.ok()) s = comm.async_error();
    if (s.ok()) {
      cudaMemcpy(host.data(), buf, cap * 4, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < cap && s.ok(); ++i) {
        if (host[i] != want[i])
          s = {Code::kInternal, "element " + std::to_string(i) + " = " + std::to_string(host[i]) + ", want " +
                                    std::to_string(want[i])};
      }
    }
    if (Status b = comm.barrier(); s.ok()) s = b;
    cudaStreamDestroy(stream);
    cudaFree(buf);
    if (Status b = comm.barrier(); s.ok()) s = b;
    return s;
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
}

INSTANTIATE_TEST_SUITE_P(Algos, OneNodeStepReplay, ::testing::Values("ring", "tree", "oneshot", "twoshot"),
                         [](const auto& info) { return std::string(info.param); });

// The step channels' low-latency protocol (GRADSYNC_PROTO=ll: every message in the peers'
// low-latency slots, read as its lines land) on the ring, the trees, and one-shot and two-shot
// as steps (GRADSYNC_GPU_NODE_STEPS=1, forced by GRADSYNC_ALGO): every type, op and odd count
// exact, in and out of place; the ring's bytes are still 2 (n-1)/n S per rank.
class OneNodeLowLatency : public ::testing::TestWithParam<std::tuple<int, const char*>> {
 protected:
  void SetUp() override {
    if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("GRADSYNC_PROTO", "ll", 1);
    ::setenv("GRADSYNC_GPU_NODE_STEPS", "1", 1);
    ::setenv("GRADSYNC_ALGO", std::get<1>(GetParam()), 1);
  }
  void TearDown() override {
    for (const char* v : {"GRADSYNC_PROTO", "GRADSYNC_GPU_NODE_STEPS", "GRADSYNC_ALGO"}) ::unsetenv(v);
  }
};

TEST_P(OneNodeLowLatency, MatrixExactOverLowLatencySlots) {
  const auto [n, algo] = GetParam();
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 1, n, std::string("node-ll-") + algo, 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  for (int r = 0; r < n; ++r) ASSERT_EQ(world.comm(r).gpu_path(), "cuda-ipc") << "rank " << r;
  // What `gradsyncctl describe` shows: the step channels on the low-latency protocol.
  auto d = cluster.describe(std::string("node-ll-") + algo, n);
  ASSERT_EQ(d.paths_size(), n);
  for (const auto& p : d.paths()) {
    EXPECT_NE(p.why().find("LL at every size (GRADSYNC_PROTO)"), std::string::npos) << p.why();
  }
  {
    GpuWorld gpus(world);
    testing::allreduce_matrix(gpus, Algorithm::kAuto);
    if (std::string(algo) != "tree") testing::reduce_scatter_all_gather_broadcast_matrix(gpus, Algorithm::kAuto);
  }
  if (std::string(algo) == "ring") {
    const size_t count = 4096 * size_t(n) + 3;
    const std::vector<uint64_t> sent = allreduce_on_gpus(world, count, 2, Algorithm::kAuto).sent;
    const double ideal = 2.0 * (n - 1) / n * double(count * 4);
    for (int r = 0; r < n; ++r) EXPECT_NEAR(double(sent[r]), ideal, ideal * 0.05) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, OneNodeLowLatency,
                         ::testing::Combine(::testing::Values(2, 4, 8),
                                            ::testing::Values("ring", "tree", "oneshot", "twoshot")),
                         [](const auto& info) {
                           return "x" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// The bytes argument of the one-node paths at 8 ranks: one-shot stores (n-1) S per rank,
// two-shot 2 (n-1) ceil256(S / n): 4x fewer, to within the segments' rounding.
TEST(OneNodeBytes, TwoShotSendsAQuarterOfOneShotAtEightRanks) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int n = 8;
  const size_t count = (size_t(4) << 20) / 4 + 3;  // 4 MiB + 12 bytes, odd
  const uint64_t bytes = count * 4;
  std::vector<uint64_t> one, two;
  for (const char* min : {"0", "1"}) {
    ::setenv("GRADSYNC_GPU_TWOSHOT_MIN", min, 1);
    DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 1, n, std::string("node-bytes-") + min, 60s, on_gpu0);
    ASSERT_EQ(world.join_error(), "");
    (std::string(min) == "0" ? one : two) = allreduce_on_gpus(world, count, 3, Algorithm::kAuto).sent;
  }
  ::unsetenv("GRADSYNC_GPU_TWOSHOT_MIN");
  const uint64_t seg = ((bytes + n - 1) / n + 255) / 256 * 256;  // two_shot_segment_bytes
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(one[r], uint64_t(n - 1) * bytes) << "rank " << r << " one-shot";
    // Round 1: every segment but its own (bytes - own); round 2: its own to n - 1 peers. The
    // last segment is the short one.
    const uint64_t own = std::min(seg, bytes - std::min(bytes, uint64_t(r) * seg));
    EXPECT_EQ(two[r], bytes + uint64_t(n - 2) * own) << "rank " << r << " two-shot";
    EXPECT_GE(double(one[r]) / double(two[r]), 3.99) << "rank " << r;
  }
  std::printf("bytes sent per rank and call, 8 ranks, %llu-byte float32 allreduce: one-shot %llu, "
              "two-shot %llu (rank 0), ratio %.3f\n",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(one[0]),
              static_cast<unsigned long long>(two[0]), double(one[0]) / double(two[0]));
}

// The ring on one node sends what two-shot sends, 2 (n-1)/n S per rank, a quarter of one-shot's
// (n-1) S at 8 ranks; here counted by the step channels (each message's bytes as planned).
TEST(OneNodeBytes, RingStepsSendTwoNMinusOneOverNAtEightRanks) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int n = 8;
  const size_t count = (size_t(4) << 20) / 4 + 3;  // 4 MiB + 12 bytes, odd
  const uint64_t bytes = count * 4;
  DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 1, n, "node-ring-bytes", 60s, on_gpu0);
  ASSERT_EQ(world.join_error(), "");
  const std::vector<uint64_t> ring = allreduce_on_gpus(world, count, 3, Algorithm::kRing).sent;
  const double ideal = 2.0 * (n - 1) / n * double(bytes);
  for (int r = 0; r < n; ++r) {
    // Within 5% of 2 (n-1)/n S (the chunks of an odd count are not all equal), and 4x fewer
    // bytes than one-shot's (n-1) S.
    EXPECT_LE(double(ring[r]), ideal * 1.05) << "rank " << r;
    EXPECT_GE(double(ring[r]), ideal * 0.95) << "rank " << r;
    EXPECT_GE(double(uint64_t(n - 1) * bytes) / double(ring[r]), 3.8) << "rank " << r;
  }
  std::printf("bytes sent per rank and call, 8 ranks, %llu-byte float32 allreduce: ring steps %llu (rank 0), "
              "one-shot would send %llu, ratio %.3f\n",
              static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(ring[0]),
              static_cast<unsigned long long>(uint64_t(n - 1) * bytes), double(uint64_t(n - 1) * bytes) / double(ring[0]));
}

// Time per call of the node kernels' one-shot and two-shot, the ring steps, and one-shot and
// two-shot as steps (GRADSYNC_GPU_NODE_STEPS=1), 8 ranks as threads sharing GPU 0 (one context:
// their kernels run side by side; every "peer" store lands in the same HBM, so the time follows
// the bytes moved). A measurement, not a test: --gtest_also_run_disabled_tests.
TEST(OneNodeBench, DISABLED_OneShotBesideTwoShot) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* env = std::getenv("NODE_BENCH_RANKS");
  const int n = env ? std::atoi(env) : 8;
  const std::vector<size_t> sizes = {size_t(64) << 10, size_t(256) << 10, size_t(1) << 20,
                                     size_t(4) << 20, size_t(16) << 20, size_t(64) << 20,
                                     size_t(256) << 20};
  struct Proto {
    const char* name;
    const char* two_shot_min;
    Algorithm algo;
    // GRADSYNC_ALGO with GRADSYNC_GPU_NODE_STEPS=1 (null: neither; empty: the steps' cost model)
    const char* steps_algo;
  };
  const Proto protos[] = {{"1-shot", "0", Algorithm::kAuto, nullptr},
                          {"2-shot", "1", Algorithm::kAuto, nullptr},
                          {"ring", "0", Algorithm::kRing, nullptr},
                          {"1s-steps", "0", Algorithm::kAuto, "oneshot"},
                          {"2s-steps", "0", Algorithm::kAuto, "twoshot"},
                          {"steps-auto", "0", Algorithm::kAuto, ""}};
  constexpr int kProtos = int(sizeof(protos) / sizeof(protos[0]));
  // NODE_BENCH_PROTOS: the columns to run, e.g. "ring" or "1-shot,ring" (default all).
  const char* only = std::getenv("NODE_BENCH_PROTOS");
  auto wanted = [&](const char* name) { return only == nullptr || std::string(only).find(name) != std::string::npos; };
  std::vector<std::vector<Measured>> res(kProtos);
  for (int p = 0; p < kProtos; ++p) {
    if (!wanted(protos[p].name)) {
      res[p].assign(sizes.size(), Measured{std::vector<uint64_t>(size_t(n), 0), 0});
      continue;
    }
    ::setenv("GRADSYNC_GPU_TWOSHOT_MIN", protos[p].two_shot_min, 1);
    if (protos[p].steps_algo) {
      ::setenv("GRADSYNC_GPU_NODE_STEPS", "1", 1);
      if (*protos[p].steps_algo) ::setenv("GRADSYNC_ALGO", protos[p].steps_algo, 1);
    }
    DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 1, n, "node-bench-" + std::to_string(p), 120s, on_gpu0);
    for (const char* v : {"GRADSYNC_GPU_NODE_STEPS", "GRADSYNC_ALGO"}) ::unsetenv(v);
    ASSERT_EQ(world.join_error(), "");
    for (size_t b : sizes) res[p].push_back(allreduce_on_gpus(world, b / 4, b >= (64u << 20) ? 5 : 20, protos[p].algo));
  }
  ::unsetenv("GRADSYNC_GPU_TWOSHOT_MIN");
  std::printf("# float32 sum allreduce, 1 node x %d ranks as threads on GPU 0, out of place\n", n);
  std::printf("# %10s", "bytes");
  for (const Proto& p : protos) std::printf(" %14s", (std::string("sent ") + p.name).c_str());
  for (const Proto& p : protos) std::printf(" %11s", (std::string("us ") + p.name).c_str());
  std::printf("\n");
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::printf("  %10zu", sizes[i]);
    for (int p = 0; p < kProtos; ++p) std::printf(" %14llu", static_cast<unsigned long long>(res[p][i].sent[0]));
    for (int p = 0; p < kProtos; ++p) std::printf(" %11.1f", res[p][i].us);
    std::printf("\n");
  }
}

// Time per call of the step channels' protocols beside the node kernels, small calls, 8 ranks
// as threads sharing GPU 0: the kernels' default (low-latency lines, one-shot), the ring, the
// trees, one-shot and two-shot as steps each with GRADSYNC_PROTO=bulk and =ll, and the ring with the
// model's choice; the "-p" columns plan every call (GRADSYNC_GPU_STEP_CACHE=0), the others
// replay the first call's step tables. A measurement, not a test: --gtest_also_run_disabled_tests.
TEST(OneNodeBench, DISABLED_LowLatencyBesideBulk) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* env = std::getenv("NODE_BENCH_RANKS");
  const int n = env ? std::atoi(env) : 8;
  std::vector<size_t> sizes = {size_t(8) * n, size_t(1) << 10, size_t(8) << 10, size_t(64) << 10,
                               size_t(256) << 10, size_t(1) << 20};
  // NODE_BENCH_SIZES=262144,1048576,...: those sizes in bytes instead (multiples of 4 * n).
  if (const char* sz = std::getenv("NODE_BENCH_SIZES"); sz != nullptr && *sz != '\0') {
    sizes.clear();
    for (const char* q = sz; *q != '\0';) {
      char* end = nullptr;
      const unsigned long long b = std::strtoull(q, &end, 10);
      if (end == q) break;
      if (b >= size_t(4) * n) sizes.push_back(size_t(b) / (size_t(4) * n) * (size_t(4) * n));
      q = *end == ',' ? end + 1 : end;
    }
    ASSERT_FALSE(sizes.empty()) << "NODE_BENCH_SIZES=" << sz << " names no size of at least " << 4 * n << " bytes";
  }
  struct Column {
    const char* name;
    const char* algo;   // GRADSYNC_ALGO (null: unset; empty: unset, every call on the steps)
    const char* proto;  // GRADSYNC_PROTO (null: unset)
    bool planned = false;  // GRADSYNC_GPU_STEP_CACHE=0: every call planned, no table replayed
  };
  const Column cols[] = {{"kernels", nullptr, nullptr},   {"ring-bulk", "ring", "bulk"},
                         {"ring-ll", "ring", "ll"},       {"ring-auto", "ring", nullptr},
                         {"tree-bulk", "tree", "bulk"},   {"tree-ll", "tree", "ll"},
                         {"1shot-bulk", "oneshot", "bulk"}, {"1shot-ll", "oneshot", "ll"},
                         {"2shot-bulk", "twoshot", "bulk"}, {"2shot-ll", "twoshot", "ll"},
                         {"ring-auto-p", "ring", nullptr, true}, {"1shot-ll-p", "oneshot", "ll", true},
                         {"2shot-ll-p", "twoshot", "ll", true},
                         {"steps-auto", "", nullptr}};
  constexpr int kCols = int(sizeof(cols) / sizeof(cols[0]));
  // NODE_BENCH_COLS=kernels,1shot-ll,...: those columns alone. NODE_BENCH_STAMPS=1: each
  // size's launch stamps too (kernel_stamps_report.h), a line per column and size.
  const char* only = std::getenv("NODE_BENCH_COLS");
  auto chosen = [&](int c) {
    return only == nullptr || ("," + std::string(only) + ",").find("," + std::string(cols[c].name) + ",") != std::string::npos;
  };
  const bool stamps = std::getenv("NODE_BENCH_STAMPS") != nullptr;
  std::vector<std::vector<Measured>> us(kCols);
  for (int c = 0; c < kCols; ++c) {
    if (!chosen(c)) continue;
    for (const char* v : {"GRADSYNC_ALGO", "GRADSYNC_PROTO", "GRADSYNC_GPU_NODE_STEPS", "GRADSYNC_GPU_STEP_CACHE"})
      ::unsetenv(v);
    if (cols[c].planned) ::setenv("GRADSYNC_GPU_STEP_CACHE", "0", 1);
    if (cols[c].algo && *cols[c].algo) ::setenv("GRADSYNC_ALGO", cols[c].algo, 1);
    if (cols[c].proto) ::setenv("GRADSYNC_PROTO", cols[c].proto, 1);
    // "shot" columns, and "" (every call on the steps, their cost model's choice): the pairs.
    if (cols[c].algo && (!*cols[c].algo || std::string(cols[c].algo).find("shot") != std::string::npos)) {
      ::setenv("GRADSYNC_GPU_NODE_STEPS", "1", 1);
    }
    DaemonCluster cluster({.nodes = 1, .transport = {"tcp"}});
    ASSERT_TRUE(cluster.ok()) << cluster.error();
    DaemonWorld world(cluster, 1, n, std::string("node-llbench-") + cols[c].name, 120s, on_gpu0);
    ASSERT_EQ(world.join_error(), "");
    if (c == 3 || (cols[c].algo && !*cols[c].algo)) {
      auto d = cluster.describe(std::string("node-llbench-") + cols[c].name, n);
      if (d.paths_size() > 0) std::printf("# %s: %s\n", cols[c].name, d.paths(0).why().c_str());
    }
    for (size_t b : sizes) {
      std::optional<testing::KernelStampRecorder> rec;
      if (stamps) rec.emplace(4096);
      us[size_t(c)].push_back(allreduce_on_gpus(world, b / 4, 50, Algorithm::kAuto));
      if (rec) std::printf("# stamps %s %zu: %s\n", cols[c].name, b, rec->summary(2).c_str());
    }
  }
  for (const char* v : {"GRADSYNC_ALGO", "GRADSYNC_PROTO", "GRADSYNC_GPU_NODE_STEPS", "GRADSYNC_GPU_STEP_CACHE"})
    ::unsetenv(v);
  // The time per call, then the slowest rank's time inside the calls (the host's queueing).
  for (const bool host : {false, true}) {
    std::printf("# float32 sum allreduce, 1 node x %d ranks as threads on GPU 0, %s\n# %8s", n,
                host ? "us per call in the calls (host)" : "us per call", "bytes");
    for (int c = 0; c < kCols; ++c)
      if (chosen(c)) std::printf(" %10s", cols[c].name);
    std::printf("\n");
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::printf("  %8zu", sizes[i]);
      for (int c = 0; c < kCols; ++c)
        if (chosen(c)) std::printf(" %10.1f", host ? us[size_t(c)][i].host_us : us[size_t(c)][i].us);
      std::printf("\n");
    }
  }
}

}  // namespace
}  // namespace gradsync
