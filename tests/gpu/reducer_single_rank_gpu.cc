// The GradientReducer's GPU branch on one rank (target gradient_reducer_gpu_test, label gpu;
// skips itself without a CUDA device): buckets in device memory, gradients with their own
// device buffers (copied in and back on the stream) and as views, the allreduce queued on the
// caller's stream ("single-rank" GPU path), the rebuild moving device views with their
// values, and compression of GPU buckets refused. One rank only: several ranks as threads of
// one process on one GPU could deadlock on the legacy stream's implicit synchronisation in
// cudaMalloc/cudaFree (tests/verbs/gpu_world.h), which separate processes do not share.
// Run on the GPU machine: scripts/gpu-run.sh gradient_reducer_gpu_test.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "../unit/daemon_world.h"
#include "gradsync/gradient_reducer.h"

namespace gradsync {
namespace {

using testing::DaemonWorld;
using testing::InProcessNode;

int gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(GradientReducerGpu, OneRankDeviceBucketsViewsCopiesAndRebuild) {
  if (gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ::setenv("GRADSYNC_TUNE", "0", 1);
  InProcessNode node;
  ASSERT_TRUE(node.ok()) << node.error();
  DaemonWorld world(node, 1, 1, "gpu-reducer", std::chrono::seconds(30), [](int, JoinOptions& o) { o.device = 0; });
  ASSERT_EQ(world.join_error(), "");
  Communicator& comm = world.comm(0);
  ASSERT_EQ(comm.device(), 0);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  const std::vector<size_t> counts = {1000, 300000, 50};  // 4 KB, 1.2 MB, 200 B
  float* own = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&own), counts[0] * sizeof(float)), cudaSuccess);
  std::vector<GradientSpec> specs(3);
  for (size_t i = 0; i < 3; ++i) {
    specs[i].count = counts[i];
    specs[i].device = 0;
  }
  specs[0].data = own;
  int moved = 0;
  ReducerOptions opts;
  opts.stream = stream;
  opts.first_bucket_bytes = 8 << 10;
  opts.bucket_cap_bytes = 1 << 20;
  opts.on_view_moved = [&](int, void*) { ++moved; };

  ReducerOptions compressed = opts;
  compressed.compression = Compression::kBFloat16;
  EXPECT_EQ(GradientReducer::create(comm, specs, compressed).status().code(), Code::kUnimplemented);

  auto red = GradientReducer::create(comm, specs, opts);
  ASSERT_TRUE(red.ok()) << red.status().to_string();
  auto where = [&](int i) { return i == 0 ? static_cast<void*>(own) : (*red)->view(i); };
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> host(3);
    for (int i : {0, 2, 1}) {  // not the registration order: the rebuild follows it
      host[size_t(i)].resize(counts[size_t(i)]);
      for (size_t j = 0; j < counts[size_t(i)]; ++j) host[size_t(i)][j] = float(step * 1000 + i * 10 + int(j % 9));
      ASSERT_EQ(cudaMemcpyAsync(where(i), host[size_t(i)].data(), counts[size_t(i)] * sizeof(float),
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
      ASSERT_TRUE((*red)->mark_ready(i).ok());
    }
    Status s = (*red)->finish();
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int i = 0; i < 3; ++i) {  // one rank: the average is the input
      std::vector<float> back(counts[size_t(i)]);
      ASSERT_EQ(cudaMemcpy(back.data(), where(i), back.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(back, host[size_t(i)]) << "step " << step << " gradient " << i;
    }
    if (step == 0) {
      EXPECT_TRUE((*red)->rebuilt());
      EXPECT_GT(moved, 0);
    }
  }
  red->reset();  // frees the device buckets before the stream goes
  (void)cudaFree(own);
  (void)cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace gradsync
