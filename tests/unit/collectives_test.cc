// Every collective x type x op x algorithm on ranks-as-threads, world sizes 1..8, against an
// independent float64/int64 reference, with bitwise identity across ranks (the matrix and
// its reference: collective_matrix.h).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <tuple>

#include "kernels/half.h"
#include "collective_matrix.h"
#include "thread_world.h"

namespace gradsync {
namespace {

using testing::ThreadWorld;
using namespace testing;

class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, Algorithm, uint32_t>> {
 protected:
  void SetUp() override {
    auto [n, algo, rings] = GetParam();
    world_ = std::make_unique<ThreadWorld>(n, rings);
    algo_ = algo;
  }
  int n() const { return world_->size(); }

  std::unique_ptr<ThreadWorld> world_;
  Algorithm algo_;
};

TEST_P(CollectivesTest, Allreduce) { testing::allreduce_matrix(*world_, algo_); }

TEST_P(CollectivesTest, ReduceScatterAllGatherBroadcastBarrier) {
  testing::reduce_scatter_all_gather_broadcast_matrix(*world_, algo_);
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(Algorithm::kRing, Algorithm::kTree),
                                            ::testing::Values(1u, 2u)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param)) + "_rings" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(Collectives, MismatchedCountsAreReportedNotReduced) {
  ThreadWorld w(2, 1);
  std::vector<float> a(100, 1), b(200, 1);
  std::vector<CollectiveCall> calls = {
      {CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0},
      {CollectiveKind::kAllreduce, b.data(), b.data(), b.size(), DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0}};
  auto st = w.collective(calls, std::chrono::seconds(2));
  EXPECT_TRUE(st[0].code() == Code::kMismatch || st[1].code() == Code::kMismatch)
      << st[0].to_string() << " | " << st[1].to_string();
}

TEST(Collectives, MismatchedKindsAreReported) {
  ThreadWorld w(2, 1);
  std::vector<float> a(8, 1), b(16, 1);
  std::vector<CollectiveCall> calls = {
      {CollectiveKind::kAllreduce, a.data(), a.data(), 8, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0},
      {CollectiveKind::kBroadcast, b.data(), b.data(), 8, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kRing, 0}};
  auto st = w.collective(calls, std::chrono::seconds(2));
  EXPECT_FALSE(st[0].ok());
  EXPECT_FALSE(st[1].ok());
}

TEST(Collectives, MissingPeerTimesOutNamingIt) {
  ThreadWorld w(2, 1);
  std::vector<float> a(10, 1);
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(w.base());
  wait.deadline = deadline_after(std::chrono::milliseconds(300));
  CollectiveCall c{CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32,
                   ReduceOp::kSum, 0, Algorithm::kRing, 0};
  Status s = run_collective(w.links(0), wait, c);
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
}

// Rings driven by several threads (GRADSYNC_RING_THREADS; on by default only on large
// machines): the same results, bit for bit, for every type and op.
TEST(Collectives, RingsOnSeveralThreadsMatchTheReference) {
  ::setenv("GRADSYNC_RING_THREADS", "3", 1);
  ::setenv("GRADSYNC_RING_THREAD_MIN_BYTES", "0", 1);
  for (int n : {2, 3}) {
    ThreadWorld w(n, 3);
    allreduce_matrix(w, Algorithm::kRing);
    reduce_scatter_all_gather_broadcast_matrix(w, Algorithm::kRing);
  }
  ::unsetenv("GRADSYNC_RING_THREADS");
  ::unsetenv("GRADSYNC_RING_THREAD_MIN_BYTES");
}

// A call uses one ring per quarter slot of data (4096-byte slots: 1 KiB), so a small call is
// not cut into tiny messages: 400 bytes go over ring 0 alone, 4000 bytes over all four.
TEST(Collectives, SmallCallsUseOneRingPerQuarterSlot) {
  ThreadWorld w(2, 4);
  auto published = [&](uint32_t ring) { return w.links(0).ring_send[ring].published(); };
  auto allreduce = [&](size_t count) {
    std::vector<std::vector<float>> v(2, std::vector<float>(count, 1.0f));
    auto st = w.collective({{CollectiveKind::kAllreduce, v[0].data(), v[0].data(), count, DataType::kFloat32,
                             ReduceOp::kSum, 0, Algorithm::kRing, 0},
                            {CollectiveKind::kAllreduce, v[1].data(), v[1].data(), count, DataType::kFloat32,
                             ReduceOp::kSum, 0, Algorithm::kRing, 0}});
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.to_string();
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(v[0][i], 2.0f) << i;
  };
  allreduce(100);
  EXPECT_GT(published(0), 0u);
  for (uint32_t r = 1; r < 4; ++r) EXPECT_EQ(published(r), 0u) << "ring " << r;
  allreduce(1000);
  for (uint32_t r = 1; r < 4; ++r) EXPECT_GT(published(r), 0u) << "ring " << r;
}

// A process that forks after a call on several ring threads: the child has none of the
// parent's helper threads, starts its own for its calls, and exits cleanly (exit() runs the
// calling thread's destructors). SIGALRM ends a child that hangs.
TEST(Collectives, RingHelpersAfterFork) {
  ::setenv("GRADSYNC_RING_THREADS", "3", 1);
  ::setenv("GRADSYNC_RING_THREAD_MIN_BYTES", "0", 1);
  // Rank 0 on this very thread (whose helpers persist), rank 1 on a new one.
  auto allreduce_here = [](ThreadWorld& w, uint32_t seq) -> bool {
    const size_t count = 30000;
    std::vector<std::vector<float>> v(2, std::vector<float>(count, 1.5f));
    Status other;
    auto call = [&](int r) {
      WaitContext wait;
      wait.control = static_cast<const JobControl*>(w.base());
      wait.deadline = deadline_after(std::chrono::seconds(10));
      CollectiveCall c{CollectiveKind::kAllreduce, v[r].data(), v[r].data(), count, DataType::kFloat32,
                       ReduceOp::kSum, 0, Algorithm::kRing, seq};
      return run_collective(w.links(r), wait, c);
    };
    std::thread t([&] { other = call(1); });
    Status mine = call(0);
    t.join();
    return mine.ok() && other.ok() && v[0][0] == 3.0f && v[0][count - 1] == 3.0f && v[1][count / 2] == 3.0f;
  };
  ThreadWorld parent(2, 3);
  ASSERT_TRUE(allreduce_here(parent, 0));
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(20);
    ThreadWorld child(2, 3);
    const bool ok = allreduce_here(child, 0) && allreduce_here(child, 1);
    std::exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "child ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0);
  EXPECT_TRUE(allreduce_here(parent, 1));  // the parent's helpers still serve it
  ::unsetenv("GRADSYNC_RING_THREADS");
  ::unsetenv("GRADSYNC_RING_THREAD_MIN_BYTES");
}

TEST(Collectives, AbortWakesWaitersWithTheReason) {
  ThreadWorld w(3, 1);
  std::vector<float> a(10, 1);
  auto t0 = Clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort_job(w.base(), w.layout(), 2, "rank 2 (host h) died");
  });
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(w.base());
  wait.deadline = deadline_after(std::chrono::seconds(30));
  CollectiveCall c{CollectiveKind::kAllreduce, a.data(), a.data(), a.size(), DataType::kFloat32,
                   ReduceOp::kSum, 0, Algorithm::kTree, 0};
  Status s = run_collective(w.links(0), wait, c);
  aborter.join();
  EXPECT_EQ(s.code(), Code::kAborted);
  EXPECT_NE(s.message().find("rank 2 (host h) died"), std::string::npos) << s.message();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
}

TEST(Validate, RefusesBadInput) {
  float x[8];
  CollectiveCall ok{CollectiveKind::kAllreduce, x, x, 4, DataType::kFloat32, ReduceOp::kSum, 0, Algorithm::kAuto, 0};
  EXPECT_TRUE(validate(ok, 2, 0).ok());
  auto with = [&](auto mutate) { CollectiveCall c = ok; mutate(c); return validate(c, 2, 0).code(); };
  EXPECT_EQ(with([](auto& c) { c.send = nullptr; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.send = nullptr; c.count = 0; }), Code::kOk);
  EXPECT_EQ(with([](auto& c) { c.count = SIZE_MAX / 2; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.type = static_cast<DataType>(77); }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.op = static_cast<ReduceOp>(77); }), Code::kInvalidArgument);
  EXPECT_EQ(with([&](auto& c) { c.recv = reinterpret_cast<char*>(x) + 1; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.kind = CollectiveKind::kBroadcast; c.root = 2; }), Code::kInvalidArgument);
  EXPECT_EQ(with([](auto& c) { c.kind = CollectiveKind::kAllGather; c.algorithm = Algorithm::kTree; }),
            Code::kInvalidArgument);
  // reduce_scatter with recv == send on rank 1 would overwrite input still to be sent.
  EXPECT_EQ(validate({CollectiveKind::kReduceScatter, x, x, 4, DataType::kFloat32, ReduceOp::kSum, 0,
                      Algorithm::kRing, 0}, 2, 1).code(), Code::kInvalidArgument);
  EXPECT_TRUE(validate({CollectiveKind::kReduceScatter, x, x + 4, 4, DataType::kFloat32, ReduceOp::kSum, 0,
                        Algorithm::kRing, 0}, 2, 1).ok());
}

TEST(Topology, TreesCoverEveryRankAndAreComplementary) {
  for (int n = 2; n <= 16; ++n) {
    std::vector<uint32_t> ring;
    for (int r = 0; r < n; ++r) ring.push_back(uint32_t((r + 1) % n));
    int interior_in_both = 0;
    for (int r = 0; r < n; ++r) {
      int interior = 0;
      for (uint32_t t = 0; t < kNumTrees; ++t) {
        TreeLinks l = tree_links(ring, uint32_t(r), t);
        if (l.children[0] >= 0) ++interior;
        if (l.parent >= 0) {
          TreeLinks p = tree_links(ring, uint32_t(l.parent), t);
          EXPECT_TRUE(p.children[0] == r || p.children[1] == r) << "n=" << n << " t=" << t << " r=" << r;
        }
      }
      if (interior == 2) ++interior_in_both;
    }
    // At most the middle rank of an odd-sized ring is interior in both trees.
    EXPECT_LE(interior_in_both, 1) << "n=" << n;
  }
}

}  // namespace
}  // namespace gradsync
