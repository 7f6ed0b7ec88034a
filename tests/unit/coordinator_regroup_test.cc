// The coordinator's elastic membership (coordinator/regroup.h): every caller of a round gets
// the same member set, renumbered in the old order; failed ranks are not waited for, slow
// ones up to the deadline; newcomers only join a grow.
#include "coordinator/regroup.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace gradsync::coordinator {
namespace {

using std::chrono::milliseconds;
using TimePoint = RegroupTable::TimePoint;

RegroupCall member(int rank, int world, const std::string& node, std::vector<int32_t> failed = {},
                   uint32_t newcomers = 0, milliseconds wait = milliseconds(5000)) {
  RegroupCall c;
  c.node_id = node;
  c.job = "train";
  c.token = "tok";
  c.from_generation = 1;
  c.old_world_size = uint32_t(world);
  c.old_rank = rank;
  c.failed = std::move(failed);
  c.newcomers = newcomers;
  c.wait = wait;
  return c;
}

RegroupCall newcomer(const std::string& node, milliseconds wait = milliseconds(60000)) {
  RegroupCall c;
  c.node_id = node;
  c.job = "train";
  c.token = "tok";
  c.newcomer = true;
  c.wait = wait;
  return c;
}

TEST(Regroup, SurvivorsAgreeAtOnceWhenTheFailedRankIsNamed) {
  RegroupTable t;
  const TimePoint now{};
  // Arrival order 2, 0, 1; rank 3 was killed; ranks 0 and 1 on node a, 2 on node b.
  auto t2 = t.call(member(2, 4, "b", {3}), now);
  auto t0 = t.call(member(0, 4, "a", {3}), now);
  ASSERT_TRUE(t2.ok() && t0.ok());
  EXPECT_FALSE(t.take(*t2)) << "decided before every survivor called";
  auto t1 = t.call(member(1, 4, "a"), now);  // this one does not know the culprit
  ASSERT_TRUE(t1.ok());
  std::vector<RegroupOutcome> got;
  for (RegroupTicket k : {*t0, *t1, *t2}) {
    auto o = t.take(k);
    ASSERT_TRUE(o && o->ok()) << (o ? o->status().to_string() : "undecided");
    got.push_back(**o);
  }
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(got[i].generation, 2u);
    EXPECT_EQ(got[i].world_size, 3u);
    EXPECT_EQ(got[i].rank, i);
    EXPECT_EQ(got[i].old_ranks, (std::vector<int32_t>{0, 1, 2}));
  }
  EXPECT_EQ(got[0].local_rank, 0u);
  EXPECT_EQ(got[1].local_rank, 1u);
  EXPECT_EQ(got[0].local_world_size, 2u);
  EXPECT_EQ(got[2].local_rank, 0u);
  EXPECT_EQ(got[2].local_world_size, 1u);
}

TEST(Regroup, ASlowRankIsWaitedForUntilTheDeadlineThenRefused) {
  RegroupTable t;
  const TimePoint now{};
  // Ranks 0, 2, 3 call; nobody names rank 1 as failed: it is waited for.
  std::vector<RegroupTicket> k;
  for (int r : {0, 2, 3}) k.push_back(*t.call(member(r, 4, "a", {}, 0, milliseconds(1000)), now));
  t.tick(now + milliseconds(999));
  EXPECT_FALSE(t.take(k[0])) << "decided before the deadline without rank 1";
  t.tick(now + milliseconds(1000));
  for (size_t i = 0; i < k.size(); ++i) {
    auto o = t.take(k[i]);
    ASSERT_TRUE(o && o->ok());
    EXPECT_EQ((*o)->world_size, 3u);
    EXPECT_EQ((*o)->rank, i);
    EXPECT_EQ((*o)->old_ranks, (std::vector<int32_t>{0, 2, 3}));
  }
  auto late = t.call(member(1, 4, "a"), now + milliseconds(1200));
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(late.status().message().find("200 ms after"), std::string::npos) << late.status().message();
  EXPECT_NE(late.status().message().find("0,2,3"), std::string::npos) << late.status().message();
}

TEST(Regroup, ARankNamedFailedThatCallsIsKept) {
  RegroupTable t;
  const TimePoint now{};
  auto a = t.call(member(0, 3, "a", {1}), now);  // rank 0 blames rank 1 (a broken socket)
  auto b = t.call(member(1, 3, "b", {2}), now);  // which is alive and blames rank 2
  ASSERT_TRUE(a.ok() && b.ok());
  auto o = t.take(*a);
  ASSERT_TRUE(o && o->ok());
  EXPECT_EQ((*o)->old_ranks, (std::vector<int32_t>{0, 1}));
}

TEST(Regroup, GrowWaitsForTheNewcomerAndPutsItLast) {
  RegroupTable t;
  const TimePoint now{};
  std::vector<RegroupTicket> k;
  for (int r = 0; r < 3; ++r) k.push_back(*t.call(member(r, 3, r < 2 ? "a" : "b", {}, 1), now));
  EXPECT_FALSE(t.take(k[0])) << "a grow decided without its newcomer";
  auto n = t.call(newcomer("b"), now + milliseconds(10));
  ASSERT_TRUE(n.ok());
  k.push_back(*n);
  for (uint32_t i = 0; i < 4; ++i) {
    auto o = t.take(k[i]);
    ASSERT_TRUE(o && o->ok());
    EXPECT_EQ((*o)->world_size, 4u);
    EXPECT_EQ((*o)->rank, i);
    EXPECT_EQ((*o)->old_ranks, (std::vector<int32_t>{0, 1, 2, -1}));
  }
}

TEST(Regroup, AShrinkNeverAdmitsAWaitingNewcomer) {
  RegroupTable t;
  const TimePoint now{};
  auto n = t.call(newcomer("c", milliseconds(60000)), now);
  ASSERT_TRUE(n.ok());
  auto a = t.call(member(0, 3, "a", {2}), now);
  auto b = t.call(member(1, 3, "a", {2}), now);
  ASSERT_TRUE(a.ok() && b.ok());
  auto o = t.take(*a);
  ASSERT_TRUE(o && o->ok());
  EXPECT_EQ((*o)->world_size, 2u);
  EXPECT_FALSE(t.take(*n)) << "the newcomer should still wait for a grow";
  // The next generation grows and takes it.
  RegroupCall g0 = member(0, 2, "a", {}, 1);
  g0.from_generation = 2;
  RegroupCall g1 = member(1, 2, "a", {}, 1);
  g1.from_generation = 2;
  auto x = t.call(g0, now);
  auto y = t.call(g1, now);
  ASSERT_TRUE(x.ok() && y.ok());
  auto on = t.take(*n);
  ASSERT_TRUE(on && on->ok());
  EXPECT_EQ((*on)->generation, 3u);
  EXPECT_EQ((*on)->rank, 2u);
}

TEST(Regroup, RefusesWrongTokenOtherWorldDuplicatesAndStaleGenerations) {
  RegroupTable t;
  const TimePoint now{};
  ASSERT_TRUE(t.call(member(0, 4, "a"), now).ok());
  RegroupCall bad = member(1, 4, "a");
  bad.token = "nope";
  EXPECT_EQ(t.call(bad, now).status().code(), Code::kPermissionDenied);
  EXPECT_EQ(t.call(member(1, 5, "a"), now).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(t.call(member(0, 4, "a"), now).status().code(), Code::kAlreadyExists);
  EXPECT_EQ(t.call(member(4, 4, "a"), now).status().code(), Code::kInvalidArgument);
  RegroupCall other = member(1, 4, "a");
  other.from_generation = 7;
  EXPECT_EQ(t.call(other, now).status().code(), Code::kFailedPrecondition);
  RegroupCall long_wait = member(1, 4, "a");
  long_wait.wait = std::chrono::hours(1);
  EXPECT_EQ(t.call(long_wait, now).status().code(), Code::kInvalidArgument);
  RegroupCall bad_id = member(1, 4, "a");
  bad_id.job = "bad job id";
  EXPECT_EQ(t.call(bad_id, now).status().code(), Code::kInvalidArgument);
}

TEST(Regroup, ANewcomerWithoutAGrowTimesOut) {
  RegroupTable t;
  const TimePoint now{};
  auto n = t.call(newcomer("a", milliseconds(500)), now);
  ASSERT_TRUE(n.ok());
  t.tick(now + milliseconds(499));
  EXPECT_FALSE(t.take(*n));
  t.tick(now + milliseconds(500));
  auto o = t.take(*n);
  ASSERT_TRUE(o);
  EXPECT_EQ(o->status().code(), Code::kDeadlineExceeded);
}

// Ranks as threads through the blocking service: 8 survivors of 9 (rank 4 killed), one of
// them slower than the deadline. Every rank that is in the set learns the same set; the slow
// one is refused.
TEST(Regroup, ThreadsAgreeOnOneSetAndTheSlowRankIsRefused) {
  RegroupService svc;
  constexpr int kWorld = 9;
  std::vector<Result<RegroupOutcome>> out(kWorld, Status(Code::kInternal, "not run"));
  std::vector<std::thread> th;
  for (int r = 0; r < kWorld; ++r) {
    if (r == 4) continue;
    th.emplace_back([&, r] {
      if (r == 7) std::this_thread::sleep_for(milliseconds(2500));
      RegroupCall c = member(r, kWorld, r < 5 ? "a" : "b", {4}, 0, milliseconds(1000));
      out[size_t(r)] = svc.run(c, RegroupTable::Clock::now() + milliseconds(5000), [] { return false; });
    });
  }
  for (auto& t : th) t.join();
  const std::vector<int32_t> want{0, 1, 2, 3, 5, 6, 8};
  int next = 0;
  for (int r = 0; r < kWorld; ++r) {
    if (r == 4) continue;
    if (r == 7) {
      ASSERT_FALSE(out[size_t(r)].ok());
      EXPECT_EQ(out[size_t(r)].status().code(), Code::kFailedPrecondition);
      continue;
    }
    ASSERT_TRUE(out[size_t(r)].ok()) << out[size_t(r)].status().to_string();
    EXPECT_EQ(out[size_t(r)]->old_ranks, want);
    EXPECT_EQ(out[size_t(r)]->rank, uint32_t(next++));
    EXPECT_EQ(out[size_t(r)]->generation, 2u);
  }
}

}  // namespace
}  // namespace gradsync::coordinator
