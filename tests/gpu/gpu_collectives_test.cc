// GPU collectives (allreduce, reduce_scatter, all_gather, broadcast on device memory) through
// the real coordinator, daemons and trainer processes (gpu_worker): one node (CUDA IPC between
// the ranks' GPUs) and two daemons as two nodes (host-staged). Skips itself where no CUDA
// device is visible. Ranks get GPU rank % devices.
//
// On the GPU machine: gpu_collectives_test --gtest_filter='GpuAllreduce.*:GpuCollectives.*'
// (GPU_TEST_COUNTS=1,1000,65537 for a shorter run; each rank's output is in the report of a
// failing test, its stderr naming the collective, type, op, count, rank and first bad element).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cluster.h"

namespace gradsync::testing {
namespace {

int devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (devices() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

// The host-staged schedule between nodes (TCP steps are the default where daemons run TCP).
JobSpec staged(JobSpec spec) {
  spec.env["GRADSYNC_GPU_STAGED"] = "1";
  return spec;
}

JobSpec gpu_job(const std::string& name, int world, std::vector<int> per_daemon,
                std::vector<std::string> args) {
  JobSpec spec;
  spec.job = name;
  spec.world = world;
  spec.ranks_per_daemon = std::move(per_daemon);
  spec.args = std::move(args);
  spec.program = "gpu_worker";
  const int n = devices();
  spec.per_rank = [n](int rank, Env& env) { env["GRADSYNC_DEVICE"] = std::to_string(rank % n); };
  return spec;
}

// Both protocols of the one-node path (low latency up to 1 MiB, chunked above) and several
// staging pieces between nodes. GPU_TEST_COUNTS overrides (e.g. smaller under a sanitizer).
std::string counts(const char* fallback) {
  const char* env = std::getenv("GPU_TEST_COUNTS");
  return env && *env ? env : fallback;
}
const char* kCounts = "1,3,1000,4097,65536,1048579,3000001";

TEST(GpuAllreduce, OneNodeTwoRanksEveryTypeAndOp) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("gpu1", 2, {2}, {"matrix", counts(kCounts)}));
  std::string bad = all_succeeded(ranks, Millis(240'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path cuda-ipc"), std::string::npos) << ranks[0].output();
}

TEST(GpuAllreduce, TwoNodesHostStagedEveryTypeAndOp) {
  REQUIRE_GPU();
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(staged(gpu_job("gpu2", 2, {1, 1}, {"matrix", counts(kCounts)})));
  std::string bad = all_succeeded(ranks, Millis(240'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path host-staged"), std::string::npos) << ranks[0].output();
}

// The default between nodes whose daemons run TCP: the step channels over TCP peers, each
// rank a process (calls below the threshold measured at set-up stay host-staged).
TEST(GpuAllreduce, TwoNodesTcpStepsEveryTypeAndOp) {
  REQUIRE_GPU();
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("gpu2-steps", 2, {1, 1}, {"matrix", counts(kCounts)}));
  std::string bad = all_succeeded(ranks, Millis(240'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path tcp-steps"), std::string::npos) << ranks[0].output();
}

TEST(GpuAllreduce, FourRanksTwoNodesHostStaged) {
  REQUIRE_GPU();
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(staged(gpu_job("gpu4", 4, {2, 2}, {"matrix", counts("1,1000,65537")})));
  std::string bad = all_succeeded(ranks, Millis(240'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

TEST(GpuAllreduce, CapturedInACudaGraphReplays) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("graph", 2, {2}, {"graph", "300000"}));
  std::string bad = all_succeeded(ranks, Millis(120'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

TEST(GpuAllreduce, LowLatencyProtocolCapturedInACudaGraphReplays) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("graph-ll", 2, {2}, {"graph", "1000"}));
  std::string bad = all_succeeded(ranks, Millis(120'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

// reduce_scatter (every type and op), all_gather and broadcast (every type, every root), with
// an allreduce between each type's calls, both protocols of the one-node path and several
// staging pieces between nodes (1048579 elements: over 1 MiB a segment in every type).
const char* kCollectiveCounts = "1,3,1000,4097,65537,1048579";

TEST(GpuCollectives, OneNodeTwoRanksReduceScatterAllGatherBroadcast) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("coll1", 2, {2}, {"collectives", counts(kCollectiveCounts)}));
  std::string bad = all_succeeded(ranks, Millis(300'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path cuda-ipc"), std::string::npos) << ranks[0].output();
}

// Three ranks, each on its own GPU (skips with fewer): an odd world (avg divides by 3, every
// segment boundary off the 16-byte grid for odd counts) and a broadcast with two non-roots,
// whose acknowledgement lines the low-latency protocol needs.
TEST(GpuCollectives, OneNodeThreeRanksOwnGpus) {
  REQUIRE_GPU();
  if (devices() < 3) GTEST_SKIP() << "needs 3 CUDA devices, " << devices() << " visible";
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks =
      c.spawn_ranks(gpu_job("coll3", 3, {3}, {"collectives", counts("1,3,1000,65537,1048579")}));
  std::string bad = all_succeeded(ranks, Millis(300'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path cuda-ipc"), std::string::npos) << ranks[0].output();
}

// Small chunks, two slots, four blocks and a 4 KiB low-latency limit: many chunks a block in
// one call, so slot credits are reused inside calls and across calls of different collectives
// (the default geometry gives each block one chunk a call at these sizes).
TEST(GpuCollectives, OneNodeTwoRanksManyChunksPerBlock) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  JobSpec spec =
      gpu_job("coll-chunks", 2, {2}, {"collectives", counts("1,1000,4097,65537,300007")});
  spec.env["GRADSYNC_GPU_BLOCKS"] = "4";
  spec.env["GRADSYNC_GPU_CHUNK"] = "4096";
  spec.env["GRADSYNC_GPU_SLOTS"] = "2";
  spec.env["GRADSYNC_GPU_LL_MAX"] = "4096";
  auto ranks = c.spawn_ranks(spec);
  std::string bad = all_succeeded(ranks, Millis(300'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path cuda-ipc"), std::string::npos) << ranks[0].output();
}

TEST(GpuCollectives, TwoNodesHostStagedReduceScatterAllGatherBroadcast) {
  REQUIRE_GPU();
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks =
      c.spawn_ranks(staged(gpu_job("coll2", 2, {1, 1}, {"collectives", counts(kCollectiveCounts)})));
  std::string bad = all_succeeded(ranks, Millis(300'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  EXPECT_NE(ranks[0].output().find("path host-staged"), std::string::npos) << ranks[0].output();
}

TEST(GpuCollectives, FourRanksTwoNodesHostStaged) {
  REQUIRE_GPU();
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error();
  // 64 KiB pieces: up to 33 pieces a call through the 4 staging slots.
  JobSpec spec = staged(gpu_job("coll4", 4, {2, 2}, {"collectives", counts("1,1000,65537")}));
  spec.env["GRADSYNC_STAGE_PIECE"] = "65536";
  auto ranks = c.spawn_ranks(spec);
  std::string bad = all_succeeded(ranks, Millis(300'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

// The host-staged shapes 2 nodes x 1, 2 x 2, 2 x 4 and 3 x 2, each rank a process of its own (the real
// layout: a CUDA context per rank): allreduce with GPU calls forced to the host ring and to
// the host tree (GRADSYNC_ALGO), and reduce_scatter, all_gather and broadcast. With the ranks
// as threads of one process (as verbs_gdr_gpu_test ran them until 2026-12-04) 6 to 8 streams of one context
// each hold a wait kernel, and one rank's copy to host memory waited behind them past the op
// timeout: an artefact of sharing a context, so these shapes run as processes. 2x2 joined them
// after it failed that way once as threads (2026-12-02, 1 of 9 whole runs on the H200), 2x1
// after it did (2026-12-04).
TEST(GpuCollectives, StagedShapesAsProcesses) {
  REQUIRE_GPU();
  for (const std::vector<int>& layout :
       {std::vector<int>{1, 1}, std::vector<int>{2, 2}, std::vector<int>{4, 4}, std::vector<int>{2, 2, 2}}) {
    Cluster c({.daemons = int(layout.size())});
    ASSERT_TRUE(c.ok()) << c.error();
    const int world = layout[0] * int(layout.size());
    const std::string shape = std::to_string(layout.size()) + "x" + std::to_string(layout[0]);
    for (const char* algo : {"ring", "tree"}) {
      JobSpec spec = staged(gpu_job("staged-" + shape + "-" + algo, world, layout, {"matrix", counts("1,1000,65537")}));
      spec.env["GRADSYNC_ALGO"] = algo;
      auto ranks = c.spawn_ranks(spec);
      std::string bad = all_succeeded(ranks, Millis(300'000));
      EXPECT_EQ(bad, "") << shape << " " << algo << ": " << c.report(ranks);
      EXPECT_NE(ranks[0].output().find("path host-staged"), std::string::npos) << ranks[0].output();
    }
    auto ranks =
        c.spawn_ranks(staged(gpu_job("staged-" + shape + "-coll", world, layout, {"collectives", counts("1,1000,65537")})));
    std::string bad = all_succeeded(ranks, Millis(300'000));
    EXPECT_EQ(bad, "") << shape << ": " << c.report(ranks);
  }
}

TEST(GpuCollectives, AllFourCapturedInOneCudaGraphReplay) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("graph-all", 2, {2}, {"graph", "300001", "all"}));
  std::string bad = all_succeeded(ranks, Millis(120'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

TEST(GpuCollectives, AllFourLowLatencyCapturedInOneCudaGraphReplay) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  auto ranks = c.spawn_ranks(gpu_job("graph-all-ll", 2, {2}, {"graph", "1001", "all"}));
  std::string bad = all_succeeded(ranks, Millis(120'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
}

// The one-node step channels (the planner's ring and trees over CUDA IPC, and one-shot and
// two-shot as steps) captured in a CUDA graph: their message counts are relative to bases in
// device memory, so the four collectives replay, with uncaptured calls between the replays.
// 4 ranks on one node, bulk (300001 floats) and low-latency (1001) calls.
TEST(GpuCollectives, StepChannelsCapturedInOneCudaGraphReplay) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  for (const char* algo : {"ring", "tree", "oneshot", "twoshot"}) {
    for (const char* count : {"300001", "1001"}) {
      JobSpec spec = gpu_job(std::string("graph-steps-") + algo + "-" + count, 4, {4}, {"graph", count, "all"});
      spec.env["GRADSYNC_ALGO"] = algo;
      if (std::string(algo) == "oneshot" || std::string(algo) == "twoshot") spec.env["GRADSYNC_GPU_NODE_STEPS"] = "1";
      auto ranks = c.spawn_ranks(spec);
      std::string bad = all_succeeded(ranks, Millis(120'000));
      EXPECT_EQ(bad, "") << algo << " " << count << ": " << c.report(ranks);
    }
  }
}

// GRADSYNC_GPU_TIMELINE=1: a 64 MiB float32 allreduce on 2 ranks (chunked protocol, 2 chunks a
// block with the default 128 blocks of 256 KiB) records a well-formed in-kernel timeline on
// every rank (gpu_worker timeline: intervals ordered, the expected chunks, nothing dropped,
// calls in order, the low-latency protocol recording nothing). No timing figure is judged.
TEST(GpuAllreduce, TimelineOfA64MiBAllreduceIsWellFormed) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  JobSpec spec = gpu_job("timeline", 2, {2}, {"timeline", std::to_string(16u << 20)});
  spec.env["GRADSYNC_GPU_TIMELINE"] = "1";
  auto ranks = c.spawn_ranks(spec);
  std::string bad = all_succeeded(ranks, Millis(120'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  for (auto& r : ranks) {
    EXPECT_NE(r.output().find("timeline call 1: allreduce 67108864 B"), std::string::npos)
        << r.output();
  }
}

TEST(GpuAllreduce, AbsentPeerFailsByTheDeadline) {
  REQUIRE_GPU();
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  JobSpec spec = gpu_job("absent", 2, {2}, {"absent"});
  spec.env["GRADSYNC_OP_TIMEOUT_MS"] = "2000";
  auto ranks = c.spawn_ranks(spec);
  std::string bad = all_succeeded(ranks, Millis(60'000));
  EXPECT_EQ(bad, "") << c.report(ranks);
  const std::string line = line_with(ranks[0].output(), "async_error");
  EXPECT_NE(line.find("DEADLINE_EXCEEDED"), std::string::npos) << ranks[0].output();
  EXPECT_NE(line.find("rank 1"), std::string::npos) << line;
}

}  // namespace
}  // namespace gradsync::testing
