// GradientReducer: the bucket planner, and the reducer on ranks as threads joined through a
// real coordinator and gradsyncd in this process (daemon_world.h): start order under hooks
// firing in a different order on every rank, the rebuild after step 1, unused gradients,
// mismatched registrations, hooks, and the compression's numerics against float32.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>

#include "client/bucket_plan.h"
#include "daemon_world.h"
#include "gradsync/gradient_reducer.h"

namespace gradsync {
namespace {

using testing::DaemonWorld;
using testing::InProcessNode;

// No start-up measurement of the cost model, and no info logs of every join: these tests are
// about the reducer.
const bool kQuiet = [] { return ::setenv("GRADSYNC_TUNE", "0", 1) == 0 && ::setenv("GRADSYNC_LOG_LEVEL", "warn", 0) == 0; }();

GradientSpec f32(size_t count, bool maybe_unused = false) {
  GradientSpec g;
  g.count = count;
  g.maybe_unused = maybe_unused;
  return g;
}

std::string all(const std::vector<Status>& st) {
  std::string s;
  for (size_t r = 0; r < st.size(); ++r) s += "rank " + std::to_string(r) + ": " + st[r].to_string() + "\n";
  return s;
}

// ---- the planner ------------------------------------------------------------------------

TEST(BucketPlan, ReverseOrderSmallFirstBucketThenCap) {
  // 10 gradients of 100 floats (400 B); first cap 800 B, cap 1200 B.
  std::vector<GradientSpec> g(10, f32(100));
  auto plan = plan_buckets(g, reverse_registration_order(10), 800, 1200);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].gradients, (std::vector<int>{9, 8}));
  EXPECT_EQ(plan[1].gradients, (std::vector<int>{7, 6, 5}));
  EXPECT_EQ(plan[2].gradients, (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(plan[3].gradients, (std::vector<int>{1, 0}));
  EXPECT_EQ(plan[1].offsets, (std::vector<size_t>{0, 100, 200}));
  EXPECT_EQ(plan[1].count, 300u);
}

TEST(BucketPlan, NeverMixesTypesOrDevicesAndKeepsOrder) {
  std::vector<GradientSpec> g(6, f32(10));
  g[1].type = DataType::kFloat64;
  g[3].type = DataType::kFloat64;
  g[4].device = 0;
  auto plan = plan_buckets(g, {5, 4, 3, 2, 1, 0}, 1 << 20, 1 << 20);
  ASSERT_EQ(plan.size(), 3u);
  // Ordered by the position of each bucket's first gradient in the order.
  EXPECT_EQ(plan[0].gradients, (std::vector<int>{5, 2, 0}));
  EXPECT_EQ(plan[0].type, DataType::kFloat32);
  EXPECT_EQ(plan[1].gradients, (std::vector<int>{4}));
  EXPECT_EQ(plan[1].device, 0);
  EXPECT_EQ(plan[2].gradients, (std::vector<int>{3, 1}));
  EXPECT_EQ(plan[2].type, DataType::kFloat64);
}

TEST(BucketPlan, DefaultCapsAndAnOversizedGradient) {
  // 2 MiB, 1 KiB, 40 MiB, 10 x 4 MiB (float32), with DDP's caps.
  std::vector<GradientSpec> g = {f32(512 << 10), f32(256), f32(10 << 20)};
  for (int i = 0; i < 10; ++i) g.push_back(f32(1 << 20));
  ReducerOptions o;
  auto plan = plan_buckets(g, reverse_registration_order(int(g.size())), o.first_bucket_bytes, o.bucket_cap_bytes);
  ASSERT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].gradients, (std::vector<int>{12}));                     // 4 MiB >= 1 MiB: closes
  EXPECT_EQ(plan[1].gradients, (std::vector<int>{11, 10, 9, 8, 7, 6, 5}));  // 28 MiB >= 25 MiB
  EXPECT_EQ(plan[2].gradients, (std::vector<int>{4, 3, 2}));                // 8 + 40 MiB
  EXPECT_EQ(plan[3].gradients, (std::vector<int>{1, 0}));                   // what is left
  // A gradient over the cap gets a bucket of its own.
  auto big_first = plan_buckets(g, {2, 0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, o.first_bucket_bytes, o.bucket_cap_bytes);
  EXPECT_EQ(big_first[0].gradients, (std::vector<int>{2}));
  EXPECT_EQ(big_first[0].count, size_t(10) << 20);
  EXPECT_TRUE(is_permutation_of({2, 0, 1}, 3));
  EXPECT_FALSE(is_permutation_of({2, 2, 1}, 3));
}

// ---- the reducer on ranks as threads ----------------------------------------------------

class ReducerWorld {
 public:
  ReducerWorld(int n, const std::string& job) : world_(node_, 1, n, job, std::chrono::seconds(20)) {}
  bool ok() const { return node_.ok() && world_.join_error().empty(); }
  std::string error() const { return node_.error() + world_.join_error(); }
  DaemonWorld& world() { return world_; }
  int size() const { return world_.size(); }

 private:
  InProcessNode node_;
  DaemonWorld world_;
};

// Gradient i of rank r, element j: small integers, so that sums are exact in float32.
float value(int r, int i, size_t j) { return float((r + 1) * (i + 1) + int(j % 7)); }
float expected_avg(int n, int i, size_t j) {
  float sum = 0;
  for (int r = 0; r < n; ++r) sum += value(r, i, j);
  return sum / float(n);
}

// One rank's registration: gradients with their own buffers (odd i) and views (even i).
struct RankGrads {
  std::vector<std::vector<float>> own;
  std::vector<GradientSpec> specs;
  explicit RankGrads(const std::vector<size_t>& counts) : own(counts.size()) {
    for (size_t i = 0; i < counts.size(); ++i) {
      GradientSpec s = f32(counts[i]);
      if (i % 2 == 1) {
        own[i].resize(counts[i]);
        s.data = own[i].data();
      }
      specs.push_back(s);
    }
  }
  float* grad(GradientReducer& red, int i) {
    return specs[size_t(i)].data ? own[size_t(i)].data() : static_cast<float*>(red.view(i));
  }
};

// Writes rank r's gradients, marks them ready in `order`, finishes; checks the averages.
Status run_step(GradientReducer& red, RankGrads& g, int r, int n, const std::vector<int>& order) {
  for (int i : order) {
    float* p = g.grad(red, i);
    for (size_t j = 0; j < g.specs[size_t(i)].count; ++j) p[j] = value(r, i, j);
    GS_RETURN_IF_ERROR(red.mark_ready(i));
  }
  GS_RETURN_IF_ERROR(red.finish());
  for (size_t i = 0; i < g.specs.size(); ++i) {
    const float* p = g.grad(red, int(i));
    for (size_t j = 0; j < g.specs[i].count; ++j) {
      if (p[j] != expected_avg(n, int(i), j)) {
        return {Code::kInternal, "rank " + std::to_string(r) + " gradient " + std::to_string(i) + "[" +
                                     std::to_string(j) + "] = " + std::to_string(p[j]) + ", expected " +
                                     std::to_string(expected_avg(n, int(i), j))};
      }
    }
  }
  return Status::Ok();
}

const std::vector<size_t> kCounts = {40, 13, 64, 7, 100, 33, 50, 9};

ReducerOptions small_buckets() {
  ReducerOptions o;
  o.first_bucket_bytes = 128;
  o.bucket_cap_bytes = 320;
  return o;
}

TEST(GradientReducer, HooksInADifferentOrderOnEveryRankStillReduceCorrectly) {
  ReducerWorld w(3, "order");
  ASSERT_TRUE(w.ok()) << w.error();
  auto st = w.world().run([&](int r) -> Status {
    RankGrads g(kCounts);
    ReducerOptions o = small_buckets();
    o.rebuild_after_first_step = false;
    auto red = GradientReducer::create(w.world().comm(r), g.specs, o);
    if (!red.ok()) return red.status();
    if ((*red)->buckets().size() < 4) return {Code::kInternal, "expected several buckets"};
    std::mt19937 rng(uint32_t(17 + r));
    for (int step = 0; step < 4; ++step) {
      std::vector<int> order(kCounts.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
      std::shuffle(order.begin(), order.end(), rng);
      GS_RETURN_IF_ERROR(run_step(**red, g, r, w.size(), order));
    }
    return Status::Ok();
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << all(st);
}

TEST(GradientReducer, ConcurrentHooksFromSeveralThreads) {
  ReducerWorld w(2, "threads");
  ASSERT_TRUE(w.ok()) << w.error();
  auto st = w.world().run([&](int r) -> Status {
    RankGrads g(kCounts);
    auto red = GradientReducer::create(w.world().comm(r), g.specs, small_buckets());
    if (!red.ok()) return red.status();
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < kCounts.size(); ++i) {
        float* p = g.grad(**red, int(i));
        for (size_t j = 0; j < kCounts[i]; ++j) p[j] = value(r, int(i), j);
      }
      std::atomic<int> next{0};
      std::vector<Status> marks(4);
      std::vector<std::thread> hooks;
      for (int t = 0; t < 4; ++t) {
        hooks.emplace_back([&, t] {
          for (int i; (i = next.fetch_add(1)) < int(kCounts.size());) {
            Status s = (*red)->mark_ready(int(kCounts.size()) - 1 - i);
            if (!s.ok()) marks[size_t(t)] = s;
          }
        });
      }
      for (auto& h : hooks) h.join();
      for (auto& m : marks) GS_RETURN_IF_ERROR(m);
      GS_RETURN_IF_ERROR((*red)->finish());
      for (size_t i = 0; i < kCounts.size(); ++i) {
        if (g.grad(**red, int(i))[0] != expected_avg(2, int(i), 0)) return {Code::kInternal, "wrong average"};
      }
    }
    return Status::Ok();
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << all(st);
}

TEST(GradientReducer, ABucketStartsOnceItAndEveryEarlierBucketAreReady) {
  ReducerWorld w(2, "start");
  ASSERT_TRUE(w.ok()) << w.error();
  auto st = w.world().run([&](int r) -> Status {
    RankGrads g(kCounts);
    ReducerOptions o = small_buckets();
    o.rebuild_after_first_step = false;
    auto red = GradientReducer::create(w.world().comm(r), g.specs, o);
    if (!red.ok()) return red.status();
    auto plan = (*red)->buckets();
    // Bucket 1's gradients first: nothing may start (bucket 0 is not ready).
    for (int i : plan[1].gradients) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    if ((*red)->buckets_started() != 0) return {Code::kInternal, "bucket 1 started before bucket 0"};
    // Bucket 0 ready: both start at once, before finish().
    for (int i : plan[0].gradients) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    if ((*red)->buckets_started() != 2) {
      return {Code::kInternal, "started " + std::to_string((*red)->buckets_started()) + " buckets, expected 2"};
    }
    for (size_t b = 2; b < plan.size(); ++b) {
      for (int i : plan[b].gradients) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    }
    if ((*red)->buckets_started() != int(plan.size())) return {Code::kInternal, "not every bucket started"};
    return (*red)->finish();
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << all(st);
}

TEST(GradientReducer, RebuildsOnceFromRankZerosReadyOrder) {
  ReducerWorld w(3, "rebuild");
  ASSERT_TRUE(w.ok()) << w.error();
  const std::vector<int> order0 = {0, 2, 4, 6, 1, 3, 5, 7};  // rank 0's hooks in step 1
  std::vector<std::vector<BucketInfo>> after(3);
  std::vector<int> moved(3, 0);
  auto st = w.world().run([&](int r) -> Status {
    RankGrads g(kCounts);
    ReducerOptions o = small_buckets();
    o.on_view_moved = [&, r](int i, void* p) {
      if (g.specs[size_t(i)].data == nullptr) ++moved[size_t(r)];
    };
    auto red = GradientReducer::create(w.world().comm(r), g.specs, o);
    if (!red.ok()) return red.status();
    std::vector<int> order = order0;
    if (r != 0) std::reverse(order.begin(), order.end());  // the others differ: rank 0 decides
    GS_RETURN_IF_ERROR(run_step(**red, g, r, 3, order));  // checks the moved views' values too
    if (!(*red)->rebuilt()) return {Code::kInternal, "no rebuild after step 1"};
    after[size_t(r)] = (*red)->buckets();
    GS_RETURN_IF_ERROR(run_step(**red, g, r, 3, order));
    GS_RETURN_IF_ERROR(run_step(**red, g, r, 3, {7, 6, 5, 4, 3, 2, 1, 0}));
    auto again = (*red)->buckets();
    for (size_t b = 0; b < again.size(); ++b) {
      if (again[b].gradients != after[size_t(r)][b].gradients) return {Code::kInternal, "rebuilt twice"};
    }
    return Status::Ok();
  });
  for (auto& s : st) ASSERT_TRUE(s.ok()) << all(st);
  auto want = plan_buckets(RankGrads(kCounts).specs, order0, 128, 320);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(after[size_t(r)].size(), want.size());
    for (size_t b = 0; b < want.size(); ++b) EXPECT_EQ(after[size_t(r)][b].gradients, want[b].gradients) << r;
    EXPECT_GT(moved[size_t(r)], 0);
  }
}

TEST(GradientReducer, UnusedGradientsAreZerosWhenDeclaredAndAnErrorOnEveryRankOtherwise) {
  ReducerWorld w(2, "unused");
  ASSERT_TRUE(w.ok()) << w.error();
  std::vector<Status> second(2);
  auto st = w.world().run([&](int r) -> Status {
    std::vector<GradientSpec> specs = {f32(16), f32(16, /*maybe_unused=*/true), f32(16)};
    auto red = GradientReducer::create(w.world().comm(r), specs, small_buckets());
    if (!red.ok()) return red.status();
    // Step 1: rank 1 never marks the maybe-unused gradient 1: it counts as zeros.
    for (int i = 0; i < 3; ++i) {
      std::fill_n(static_cast<float*>((*red)->view(i)), 16, float(r + 1));
      if (!(r == 1 && i == 1)) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    }
    GS_RETURN_IF_ERROR((*red)->finish());
    if (static_cast<float*>((*red)->view(1))[5] != 0.5f || static_cast<float*>((*red)->view(0))[5] != 1.5f) {
      return {Code::kInternal, "unused gradient not reduced as zeros"};
    }
    // Step 2: rank 0 forgets gradient 2, which is not declared maybe-unused.
    for (int i = 0; i < 3; ++i) {
      if (!(r == 0 && i == 2)) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    }
    second[size_t(r)] = (*red)->finish();
    // The reducer goes on after a failed step.
    for (int i = 0; i < 3; ++i) GS_RETURN_IF_ERROR((*red)->mark_ready(i));
    return (*red)->finish();
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << all(st);
  for (auto& s : second) {
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << all(second);
    EXPECT_NE(s.message().find("rank 0: gradient 2 never became ready"), std::string::npos) << s.to_string();
  }
}

TEST(GradientReducer, MismatchedRegistrationsFailEveryRankNamingTheGradient) {
  ReducerWorld w(3, "mismatch");
  ASSERT_TRUE(w.ok()) << w.error();
  std::vector<Status> count_st(3), type_st(3), number_st(3);
  auto st = w.world().run([&](int r) -> Status {
    std::vector<GradientSpec> specs = {f32(16), f32(16), f32(16)};
    if (r == 2) specs[1].count = 17;
    count_st[size_t(r)] = GradientReducer::create(w.world().comm(r), specs).status();
    specs[1].count = 16;
    if (r == 1) specs[2].type = DataType::kFloat64;
    type_st[size_t(r)] = GradientReducer::create(w.world().comm(r), specs).status();
    specs[2].type = DataType::kFloat32;
    if (r == 1) specs.push_back(f32(4));
    number_st[size_t(r)] = GradientReducer::create(w.world().comm(r), specs).status();
    return Status::Ok();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(count_st[size_t(r)].code(), Code::kMismatch);
    EXPECT_NE(count_st[size_t(r)].message().find("gradient 1 is 16 x float32 on the host on rank 0 but 17 x "
                                                 "float32 on the host on rank 2"),
              std::string::npos)
        << count_st[size_t(r)].to_string();
    EXPECT_NE(type_st[size_t(r)].message().find("gradient 2 is 16 x float32 on the host on rank 0 but 16 x "
                                                "float64 on the host on rank 1"),
              std::string::npos)
        << type_st[size_t(r)].to_string();
    EXPECT_NE(number_st[size_t(r)].message().find("gradients is 3 on rank 0 but 4 on rank 1"), std::string::npos)
        << number_st[size_t(r)].to_string();
  }
}

TEST(GradientReducer, BadArgumentsOnOneRankFailEveryRank) {
  ReducerWorld w(2, "bad");
  ASSERT_TRUE(w.ok()) << w.error();
  std::vector<Status> out(2);
  (void)w.world().run([&](int r) -> Status {
    std::vector<GradientSpec> specs = {f32(16)};
    if (r == 1) specs[0].device = 0;  // a GPU gradient on a host-only communicator
    out[size_t(r)] = GradientReducer::create(w.world().comm(r), specs).status();
    return Status::Ok();
  });
  EXPECT_EQ(out[1].code(), Code::kInvalidArgument) << out[1].to_string();
  EXPECT_NE(out[1].message().find("on GPU 0, but the communicator's device is none"), std::string::npos);
  EXPECT_NE(out[0].message().find("rank 1 refused its own registration"), std::string::npos) << out[0].to_string();
}

TEST(GradientReducer, MarkedTwiceFailsTheStepOnEveryRank) {
  ReducerWorld w(2, "twice");
  ASSERT_TRUE(w.ok()) << w.error();
  std::vector<Status> out(2);
  (void)w.world().run([&](int r) -> Status {
    auto red = GradientReducer::create(w.world().comm(r), {f32(8), f32(8)});
    if (!red.ok()) return out[size_t(r)] = red.status();
    (void)(*red)->mark_ready(0);
    if (r == 1) (void)(*red)->mark_ready(0);
    (void)(*red)->mark_ready(1);
    out[size_t(r)] = (*red)->finish();
    return Status::Ok();
  });
  for (auto& s : out) EXPECT_NE(s.message().find("rank 1: "), std::string::npos) << all(out);
  EXPECT_NE(out[1].message().find("gradient 0 marked ready twice in step 1"), std::string::npos) << all(out);
}

TEST(GradientReducer, SumWithScalingHooks) {
  ReducerWorld w(2, "hooks");
  ASSERT_TRUE(w.ok()) << w.error();
  std::vector<int> post_calls(2, 0);
  auto st = w.world().run([&](int r) -> Status {
    ReducerOptions o = small_buckets();
    o.op = ReduceOp::kSum;
    o.pre_hook = [](const BucketView& b) {  // e.g. unscaling a loss scale of 4
      for (size_t j = 0; j < b.count; ++j) static_cast<float*>(b.data)[j] *= 0.25f;
      return Status::Ok();
    };
    o.post_hook = [&, r](const BucketView&) {
      ++post_calls[size_t(r)];
      return Status::Ok();
    };
    RankGrads g(kCounts);
    auto red = GradientReducer::create(w.world().comm(r), g.specs, o);
    if (!red.ok()) return red.status();
    for (size_t i = 0; i < kCounts.size(); ++i) {
      std::fill_n(g.grad(**red, int(i)), kCounts[i], 4.0f * float(r + 1));
      GS_RETURN_IF_ERROR((*red)->mark_ready(int(i)));
    }
    const int buckets = int((*red)->buckets().size());  // finish() rebuilds them
    GS_RETURN_IF_ERROR((*red)->finish());
    if (post_calls[size_t(r)] != buckets) return {Code::kInternal, "post hook calls"};
    for (size_t i = 0; i < kCounts.size(); ++i) {
      if (g.grad(**red, int(i))[kCounts[i] - 1] != 3.0f) return {Code::kInternal, "sum of scaled gradients"};
    }
    return Status::Ok();
  });
  for (auto& s : st) EXPECT_TRUE(s.ok()) << all(st);
}

// Compression: every element within the rounding bound of a float64 reference, and not
// equal to it everywhere (the values really went through 16 bits).
void check_compression(Compression c, double unit_roundoff, float magnitude) {
  const int n = 4;
  ReducerWorld w(n, std::string("compress-") + to_string(c));
  ASSERT_TRUE(w.ok()) << w.error();
  const size_t count = 5000;
  auto input = [&](int r, size_t j) {
    std::mt19937 rng(uint32_t(1000 * r + 7));
    std::uniform_real_distribution<float> u(-magnitude, magnitude);
    float v = 0;
    for (size_t k = 0; k <= j % 64; ++k) v = u(rng);
    return v * float(1 + j % 13);
  };
  std::vector<std::vector<float>> got(n);
  auto st = w.world().run([&](int r) -> Status {
    ReducerOptions o;
    o.compression = c;
    o.first_bucket_bytes = 4096;
    std::vector<float> grad(count);
    for (size_t j = 0; j < count; ++j) grad[j] = input(r, j);
    GradientSpec s = f32(count);
    s.data = grad.data();
    auto red = GradientReducer::create(w.world().comm(r), {s, f32(3)}, o);
    if (!red.ok()) return red.status();
    GS_RETURN_IF_ERROR((*red)->mark_ready(1));
    GS_RETURN_IF_ERROR((*red)->mark_ready(0));
    GS_RETURN_IF_ERROR((*red)->finish());
    got[size_t(r)] = grad;
    return Status::Ok();
  });
  for (auto& s : st) ASSERT_TRUE(s.ok()) << all(st);
  double worst = 0;
  size_t inexact = 0;
  for (size_t j = 0; j < count; ++j) {
    double ref = 0, abs_sum = 0;
    for (int r = 0; r < n; ++r) {
      ref += double(input(r, j)) / n;
      abs_sum += std::fabs(double(input(r, j))) / n;
    }
    // Each input rounded once, each of the n-1 partial sums once, plus float32's own rounding.
    const double bound = (n + 1) * unit_roundoff * abs_sum + 1e-7 * abs_sum;
    for (int r = 0; r < n; ++r) {
      const double err = std::fabs(double(got[size_t(r)][j]) - ref);
      ASSERT_LE(err, bound) << to_string(c) << " element " << j << " rank " << r;
      worst = std::max(worst, err / std::max(abs_sum, 1e-30));
      if (err > 1e-6 * abs_sum) ++inexact;
      EXPECT_EQ(got[size_t(r)][j], got[0][j]) << "ranks differ at " << j;
    }
  }
  EXPECT_GT(inexact, count / 10) << "no sign of 16-bit rounding";
  std::printf("%s: worst error %.3g of the mean magnitude (unit roundoff %.3g)\n", to_string(c), worst, unit_roundoff);
}

TEST(GradientReducer, BFloat16CompressionAgainstFloat32) { check_compression(Compression::kBFloat16, 1.0 / 256, 1e3f); }
TEST(GradientReducer, Float16CompressionAgainstFloat32) { check_compression(Compression::kFloat16, 1.0 / 2048, 1.0f); }

}  // namespace
}  // namespace gradsync
