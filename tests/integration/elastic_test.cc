// Elastic shrink modes (gradsync/elastic.h) against a real coordinator and gradsyncd; the
// ranks are threads of this process. The kill -9 case is examples/train_logreg_elastic's
// CTests.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "cluster.h"
#include "gradsync/elastic.h"
#include "gradsync/gradsync.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

JoinOptions options(const std::string& job, int rank, int world) {
  JoinOptions o;
  o.job = job;
  o.rank = rank;
  o.world_size = world;
  o.local_rank = rank;
  o.local_world_size = world;
  o.join_timeout = 20s;
  o.op_timeout = 30s;
  return o;
}

// Rank 0 has an allreduce in flight that the others never join: kDefault refuses to shrink,
// kAbort ends it (kAborted, saying why) and aborts the job without naming rank 0, so the
// others wait for it: all three ranks form generation 2, where an allreduce works.
TEST(Elastic, DefaultModeRefusesWorkInFlightAbortModeEndsItAndKeepsEveryRank) {
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error();
  setenv("GRADSYNC_TUNE", "0", 1);
  constexpr int kWorld = 3;
  std::vector<std::string> errors(kWorld);
  std::vector<int> new_rank(kWorld, -1), new_world(kWorld, -1);
  std::vector<uint64_t> gen(kWorld, 0);
  std::vector<float> sums(kWorld, -1);
  std::atomic<bool> aborting{false};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      auto session = Session::connect(c.socket(0));
      if (!session.ok()) return void(errors[r] = session.status().to_string());
      auto comm = session->join(options("modes", r, kWorld));
      if (!comm.ok()) return void(errors[r] = comm.status().to_string());
      ShrinkOptions so;
      so.wait = 10s;
      Result<Communicator> next = Status(Code::kInternal, "not run");
      if (r == 0) {
        float x = 1;
        Work pending = comm->allreduce_async(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum);
        auto refused = shrink(*comm, so);
        if (refused.ok() || refused.status().code() != Code::kFailedPrecondition) {
          return void(errors[r] = "kDefault with work in flight: " +
                                  (refused.ok() ? std::string("accepted") : refused.status().to_string()));
        }
        so.mode = ShrinkMode::kAbort;
        aborting = true;
        next = shrink(*comm, so);
        Status ended = pending.wait(10s);
        if (ended.code() != Code::kAborted || ended.message().find("ShrinkMode::kAbort") == std::string::npos) {
          return void(errors[r] = "pending work: " + ended.to_string());
        }
      } else {
        // Idle (no collective: one would meet rank 0's); shrink once rank 0 has aborted.
        while (!aborting.load()) std::this_thread::sleep_for(5ms);
        std::this_thread::sleep_for(200ms);
        next = shrink(*comm, so);
      }
      if (!next.ok()) return void(errors[r] = "shrink: " + next.status().to_string());
      new_rank[r] = next->rank();
      new_world[r] = next->world_size();
      gen[r] = next->generation();
      float v = float(next->rank());
      Status s = next->allreduce(&v, 1, DataType::kFloat32, ReduceOp::kSum);
      if (!s.ok()) return void(errors[r] = "allreduce in generation 2: " + s.to_string());
      sums[r] = v;
      Status left = next->leave();
      if (!left.ok()) errors[r] = "leave: " + left.to_string();
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r << "\n" << c.report();
    EXPECT_EQ(new_rank[r], r);
    EXPECT_EQ(new_world[r], kWorld);
    EXPECT_EQ(gen[r], 2u);
    EXPECT_EQ(sums[r], 3.0f);
  }
}

}  // namespace
}  // namespace gradsync::testing
