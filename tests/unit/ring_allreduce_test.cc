// Ring allreduce with ranks as threads over real shared-memory channels in one process.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

#include "channel/channel.h"
#include "channel/shared_memory.h"
#include "collectives/ring.h"

namespace gradsync {
namespace {

// n ranks in a ring 0 -> 1 -> ... -> n-1 -> 0; channel i is rank i's incoming channel.
struct ThreadRing {
  ThreadRing(int n, uint32_t slots, uint32_t slot_bytes) : n(n) {
    layout.num_channels = static_cast<uint32_t>(n);
    layout.slots = slots;
    layout.slot_bytes = slot_bytes;
    auto created = SharedMemory::create("ring-test", layout.total_bytes());
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    shm = std::move(created).value();
    init_job_control(shm.data(), layout);
  }

  RingPeers peers(int r) const {
    RingPeers p;
    p.job = "t";
    p.rank = p.position = r;
    p.world_size = n;
    p.prev_rank = (r + n - 1) % n;
    p.next_rank = (r + 1) % n;
    p.prev_host = p.next_host = "localhost";
    return p;
  }

  // Runs fn(rank) on n threads and returns their statuses.
  template <typename Fn>
  std::vector<Status> run(Fn fn) {
    std::vector<Status> out(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
    for (auto& t : threads) t.join();
    return out;
  }

  Status allreduce(int r, const float* in, float* out, size_t count, uint32_t seq,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    Channel send(shm.data(), layout, static_cast<uint32_t>((r + 1) % n));
    Channel recv(shm.data(), layout, static_cast<uint32_t>(r));
    WaitContext wait;
    wait.control = static_cast<const JobControl*>(shm.data());
    wait.deadline = deadline_after(timeout);
    CollectiveCall call{in, out, count, DataType::kFloat32, ReduceOp::kSum, seq};
    return ring_allreduce(peers(r), send, recv, wait, call);
  }

  int n;
  ShmLayout layout;
  SharedMemory shm;
};

float value(int r, size_t i) { return float((r + 1) * int(i % 13 + 1)); }

class RingAllreduceTest
    : public ::testing::TestWithParam<std::tuple<int, size_t, bool, uint32_t>> {};

TEST_P(RingAllreduceTest, ExactAndBitwiseIdentical) {
  auto [n, count, inplace, slots] = GetParam();
  ThreadRing ring(n, slots, 4096);  // small slots: many pipeline pieces
  std::vector<std::vector<float>> in(n, std::vector<float>(count)), out(n, std::vector<float>(count, -1));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) in[r][i] = value(r, i);
  }
  // Two collectives in a row: sequence numbers and channel counters carry over.
  for (uint32_t seq = 0; seq < 2; ++seq) {
    auto st = ring.run([&](int r) {
      float* dst = inplace ? in[r].data() : out[r].data();
      if (inplace) {
        for (size_t i = 0; i < count; ++i) in[r][i] = value(r, i);
      }
      return ring.allreduce(r, in[r].data(), dst, count, seq);
    });
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    for (int r = 0; r < n; ++r) {
      const auto& res = inplace ? in[r] : out[r];
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(res[i], float(int(i % 13 + 1) * n * (n + 1) / 2)) << "rank " << r << " i " << i;
      }
      const auto& res0 = inplace ? in[0] : out[0];
      ASSERT_EQ(0, std::memcmp(res.data(), res0.data(), count * sizeof(float)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsCountsSlots, RingAllreduceTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                       ::testing::Values(size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{1023},
                                         size_t{1024}, size_t{65537}),
                       ::testing::Bool(), ::testing::Values(2u, 8u)));

TEST(RingAllreduce, MismatchedCountsAreReportedNotReduced) {
  ThreadRing ring(2, 4, 4096);
  std::vector<float> a(100, 1), b(200, 1);
  auto st = ring.run([&](int r) {
    return r == 0 ? ring.allreduce(0, a.data(), a.data(), a.size(), 0, std::chrono::seconds(2))
                  : ring.allreduce(1, b.data(), b.data(), b.size(), 0, std::chrono::seconds(2));
  });
  bool mismatch = false;
  for (auto& s : st) mismatch |= s.code() == Code::kMismatch;
  EXPECT_TRUE(mismatch) << st[0].to_string() << " | " << st[1].to_string();
  EXPECT_FALSE(st[0].ok());
  EXPECT_FALSE(st[1].ok());
}

TEST(RingAllreduce, MissingPeerTimesOutNamingIt) {
  ThreadRing ring(2, 4, 4096);
  std::vector<float> a(10, 1);
  Status s = ring.allreduce(0, a.data(), a.data(), a.size(), 0, std::chrono::milliseconds(300));
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded);
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
}

TEST(RingAllreduce, AbortWakesWaitersWithTheReason) {
  ThreadRing ring(3, 4, 4096);
  std::vector<float> a(10, 1);
  auto t0 = Clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort_job(ring.shm.data(), ring.layout, 2, "rank 2 (host h) died");
  });
  Status s = ring.allreduce(0, a.data(), a.data(), a.size(), 0, std::chrono::seconds(30));
  aborter.join();
  EXPECT_EQ(s.code(), Code::kAborted);
  EXPECT_NE(s.message().find("rank 2 (host h) died"), std::string::npos) << s.message();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
}

TEST(ValidateAllreduce, RefusesBadInput) {
  float x[4];
  CollectiveCall ok{x, x, 4, DataType::kFloat32, ReduceOp::kSum, 0};
  EXPECT_TRUE(validate_allreduce(ok).ok());
  CollectiveCall null_send = ok;
  null_send.send = nullptr;
  EXPECT_EQ(validate_allreduce(null_send).code(), Code::kInvalidArgument);
  CollectiveCall zero = null_send;
  zero.count = 0;
  EXPECT_TRUE(validate_allreduce(zero).ok());
  CollectiveCall overflow = ok;
  overflow.count = SIZE_MAX / 2;
  EXPECT_EQ(validate_allreduce(overflow).code(), Code::kInvalidArgument);
  CollectiveCall bad_type = ok;
  bad_type.type = static_cast<DataType>(77);
  EXPECT_EQ(validate_allreduce(bad_type).code(), Code::kInvalidArgument);
  CollectiveCall misaligned = ok;
  misaligned.recv = reinterpret_cast<char*>(x) + 1;
  EXPECT_EQ(validate_allreduce(misaligned).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace gradsync
