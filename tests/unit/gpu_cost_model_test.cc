// The GPU cost model (runtime/gpu/plan/cost_model.h): NCCL's latency figures reproduced, the
// bytes taken from the schedule, and the choice flipping where it should (one-shot or tree
// for small calls, two-shot or ring for large ones), with the overrides.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu/plan/cost_model.h"

namespace gradsync::plan {
namespace {

using Kind = CollectiveKind;

const Estimate& find(const Choice& c, Algo a, Protocol p) {
  for (const auto& e : c.all)
    if (e.algo == a && e.proto == p) return e;
  static Estimate none;
  ADD_FAILURE() << "no estimate for " << to_string(a) << " " << to_string(p);
  return none;
}

// NCCL's own model values (nccl.md §1): an 8-GPU NVLink ring allreduce with LL costs
// 6.6 + 14 x 0.6 = 15.0 us before bandwidth.
TEST(GpuCostModel, RingLatencyIsNcclsFigure) {
  const JobShape shape = uniform_shape(1, 8, 8);
  Choice c = choose(shape, Kind::kAllreduce, 2, 4, 0);
  const Estimate& ring = find(c, Algo::kRing, Protocol::kLowLatency);
  EXPECT_EQ(ring.fig.intra_hops, 14);
  EXPECT_EQ(ring.fig.inter_hops, 0);
  EXPECT_NEAR(ring.us, 15.0, 0.01);
  // Bulk: 8.4 + 14 x 3.4.
  EXPECT_NEAR(find(c, Algo::kRing, Protocol::kBulk).us, 8.4 + 14 * 3.4, 0.01);
}

// 2 nodes x 8: the tree's hops are the chain (7) and one tree level, up and down: NCCL's
// 2·((ppn-1)·intraLat + log2(nodes)·interLat). With the ring's NET LL hop (2.7 us) that is
// 6.8 + 2·(7·0.6 + 2.7) = 20.6 us; NCCL's table has 5.0 us for a tree's NET LL hop (25.2 us).
TEST(GpuCostModel, TreeLatencyFollowsTheChannelDepth) {
  const JobShape shape = uniform_shape(2, 8, 8);
  Choice c = choose(shape, Kind::kAllreduce, 1, 4, 0);
  const Estimate& tree = find(c, Algo::kTree, Protocol::kLowLatency);
  EXPECT_EQ(tree.fig.intra_hops, 14);
  EXPECT_EQ(tree.fig.inter_hops, 2);
  EXPECT_NEAR(tree.us, 6.8 + 2 * (7 * 0.6 + 2.7), 0.01);
  // The ring: 30 hops, 2 between nodes.
  const Estimate& ring = find(c, Algo::kRing, Protocol::kLowLatency);
  EXPECT_EQ(ring.fig.inter_hops, 2);
  EXPECT_EQ(ring.fig.intra_hops, 28);
}

// The bandwidth term uses the schedule's bytes: a 1 GiB allreduce on 1x8 one-shot moves 7 S
// per GPU, two-shot and ring 1.75 S.
TEST(GpuCostModel, BytesComeFromTheSchedule) {
  const JobShape shape = uniform_shape(1, 8, 8);
  const size_t count = size_t{1} << 28, S = count * 4;
  Choice c = choose(shape, Kind::kAllreduce, count, 4, 0);
  EXPECT_EQ(find(c, Algo::kOneShot, Protocol::kBulk).fig.max_intra_bytes, 7 * S);
  EXPECT_EQ(find(c, Algo::kTwoShot, Protocol::kBulk).fig.max_intra_bytes, 7 * S / 4);
  EXPECT_EQ(find(c, Algo::kRing, Protocol::kBulk).fig.max_intra_bytes, 7 * S / 4);
  const double t = find(c, Algo::kTwoShot, Protocol::kBulk).us;
  EXPECT_NEAR(t, 8.4 + 2 * 3.4 + double(7 * S / 4) / 450e3, 0.01);
}

// The choice on one node: one-shot for small calls, two-shot for large ones, and the flip in
// between. Across nodes: tree for small calls; ring for large ones once the ring's 2(n-1)
// hops of latency are paid back by its bytes (2(n-1)/n·S per node against the tree's 2·S at
// NCCL's 0.92): from a few hundred MiB at 4 x 8, between 1 and 4 GiB at 16 x 8.
// The first size (bytes, float32, growing by `factor`) at which the model picks another
// algorithm than `small`; 0 if none up to 1 GiB.
size_t flip_from(const JobShape& shape, Algo small, size_t factor) {
  for (size_t count = 1; count <= size_t{1} << 28; count *= factor)
    if (choose(shape, Kind::kAllreduce, count, 4, 0).best.algo != small) return count * 4;
  return 0;
}

TEST(GpuCostModel, ChoiceFlipsWithSize) {
  const JobShape one = uniform_shape(1, 8, 8);
  EXPECT_EQ(choose(one, Kind::kAllreduce, 2, 4, 0).best.algo, Algo::kOneShot);
  EXPECT_EQ(choose(one, Kind::kAllreduce, 2, 4, 0).best.proto, Protocol::kLowLatency);
  EXPECT_EQ(choose(one, Kind::kAllreduce, size_t{1} << 28, 4, 0).best.algo, Algo::kTwoShot);
  EXPECT_EQ(choose(one, Kind::kAllreduce, size_t{1} << 28, 4, 0).best.proto, Protocol::kBulk);
  size_t flip = flip_from(one, Algo::kOneShot, 2);
  EXPECT_GT(flip, size_t{4} << 10);
  EXPECT_LT(flip, size_t{64} << 20);

  // Without the hierarchical form (16 ranks per node is more than its direct pushes take):
  // tree for small calls, the ring for large ones.
  const JobShape four = uniform_shape(4, 16, 8);
  EXPECT_EQ(choose(four, Kind::kAllreduce, 2, 4, 0).best.algo, Algo::kTree);
  flip = flip_from(four, Algo::kTree, 4);
  EXPECT_EQ(choose(four, Kind::kAllreduce, size_t{1} << 28, 4, 0).best.algo, Algo::kRing);
  EXPECT_GT(flip, size_t{16} << 20);
  EXPECT_LE(flip, size_t{1} << 30);
  // 16 x 8: tree for small calls, hierarchical (2(k-1)/k·S per node against the tree's 2·S
  // at 0.92, but 2(k-1) network hops against the tree's 2·log2(k)) from a few hundred MiB.
  const JobShape many = uniform_shape(16, 8, 8);
  EXPECT_EQ(choose(many, Kind::kAllreduce, 2, 4, 0).best.algo, Algo::kTree);
  flip = flip_from(many, Algo::kTree, 4);
  EXPECT_GT(flip, size_t{16} << 20);
  EXPECT_LE(flip, size_t{1} << 30);
  EXPECT_EQ(choose(many, Kind::kAllreduce, size_t{1} << 28, 4, 0).best.algo, Algo::kHierarchical);
  // reduce_scatter has no tree: the ring.
  EXPECT_EQ(choose(many, Kind::kReduceScatter, 2, 4, 0).best.algo, Algo::kRing);
}

// Above the one-shot threshold the choice on one node moves at most 2(n-1)/n·S·1.05 per GPU
// (issue 15's bound): the two-shot or ring bytes, never one-shot's (n-1)·S.
TEST(GpuCostModel, AboveTheOneShotThresholdTheBytesAreTheRings) {
  for (int n : {3, 4, 8}) {
    const JobShape one = uniform_shape(1, n, n);
    const size_t flip = flip_from(one, Algo::kOneShot, 2);
    ASSERT_GT(flip, 0u) << n;
    for (size_t bytes = flip; bytes <= size_t{256} << 20; bytes *= 4) {
      const Choice c = choose(one, Kind::kAllreduce, bytes / 4, 4, 0);
      EXPECT_NE(c.best.algo, Algo::kOneShot) << "1x" << n << " " << bytes << " B";
      EXPECT_LE(double(c.best.fig.max_intra_bytes), 2.0 * (n - 1) / n * double(bytes) * 1.05)
          << "1x" << n << " " << bytes << " B " << to_string(c.best.algo);
    }
  }
}

TEST(GpuCostModel, Overrides) {
  const JobShape one = uniform_shape(1, 8, 8);
  Choice c = choose(one, Kind::kAllreduce, 2, 4, 0, Algo::kRing);
  EXPECT_EQ(c.best.algo, Algo::kRing);
  EXPECT_EQ(c.forced, "forced to ring");
  const JobShape two = uniform_shape(2, 8, 8);
  c = choose(two, Kind::kAllreduce, 2, 4, 0, Algo::kOneShot);
  EXPECT_NE(c.best.algo, Algo::kOneShot);
  EXPECT_NE(c.forced.find("cannot run it"), std::string::npos) << c.forced;

  std::string err;
  EXPECT_EQ(algo_from_env("ring", &err), Algo::kRing);
  EXPECT_EQ(algo_from_env("twoshot", &err), Algo::kTwoShot);
  EXPECT_EQ(algo_from_env("hierarchical", &err), Algo::kHierarchical);
  EXPECT_EQ(algo_from_env("auto", &err), std::nullopt);
  EXPECT_TRUE(err.empty());
  EXPECT_EQ(algo_from_env("rung", &err), std::nullopt);
  EXPECT_NE(err.find("rung"), std::string::npos);
  // A call's own algorithm wins over GRADSYNC_ALGO; kAuto leaves it.
  EXPECT_EQ(forced_algo(Algorithm::kTree, Algo::kRing), Algo::kTree);
  EXPECT_EQ(forced_algo(Algorithm::kAuto, Algo::kOneShot), Algo::kOneShot);
  EXPECT_EQ(forced_algo(Algorithm::kAuto, std::nullopt), std::nullopt);
}

}  // namespace
}  // namespace gradsync::plan
