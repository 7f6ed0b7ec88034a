// Rank-owned TCP channels (transport/tcp/socket_driver.h): the collectives matrix with every
// rank its own node and every channel a loopback TCP socket, including kernel buffers smaller
// than a slot; and the driver's failure paths (peer gone, deadline, abort, protocol error).
#include <gtest/gtest.h>

#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "collective_matrix.h"
#include "socket_world.h"
#include "transport/tcp/socket_driver.h"

namespace gradsync {
namespace {

using namespace testing;

class SocketCollectives : public ::testing::TestWithParam<std::tuple<int, Algorithm>> {};

TEST_P(SocketCollectives, MatchTheReference) {
  auto [n, algo] = GetParam();
  SocketWorld world(n, 1);
  allreduce_matrix(world, algo);
  reduce_scatter_all_gather_broadcast_matrix(world, algo);
}

INSTANTIATE_TEST_SUITE_P(Worlds, SocketCollectives,
                         ::testing::Combine(::testing::Values(2, 3, 5),
                                            ::testing::Values(Algorithm::kRing, Algorithm::kTree)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// Large float32 sums, three times over, checked against the exact sum and across ranks.
void large_allreduces(SocketWorld& world, Algorithm algo, size_t count) {
  const int n = world.size();
  std::vector<std::vector<float>> in(n, std::vector<float>(count)), out(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) in[r][i] = float((i * 7 + size_t(r)) % 13);
  }
  std::vector<CollectiveCall> calls(n);
  for (int r = 0; r < n; ++r) {
    calls[r] = {CollectiveKind::kAllreduce, in[r].data(), out[r].data(), count, DataType::kFloat32,
                ReduceOp::kSum, 0, algo, 0};
  }
  for (int rep = 0; rep < 3; ++rep) {
    auto st = world.collective(calls);
    for (int r = 0; r < n; ++r) ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < count; i += 997) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += float((i * 7 + size_t(r)) % 13);
      ASSERT_EQ(out[0][i], want) << i;
    }
    for (int r = 1; r < n; ++r) ASSERT_EQ(std::memcmp(out[0].data(), out[r].data(), count * 4), 0) << r;
  }
}

TEST(SocketCollectives, SeveralRingsAndLargeCalls) {
  SocketWorld world(4, 2, 8, 65536);
  large_allreduces(world, Algorithm::kRing, (3u << 20) + 17);  // many slots, a multiple of nothing
}

// A large call's rings on several threads, each moving the sockets of its own rings (lanes),
// with ranks that split the rings differently: one thread for all, two, four, three (rings
// 0 and 3 on one thread), and kernel buffers smaller than a slot, so that frames stay queued
// part-way while their thread waits on its other ring or leaves.
TEST(SocketCollectives, RingThreadsMoveTheirOwnSockets) {
  SocketWorld world(4, 4, 4, 256 << 10, 64 << 10);  // slots larger than the kernel buffers
  const uint32_t threads[] = {1, 2, 4, 3};
  for (int r = 0; r < 4; ++r) world.set_ring_threads(r, threads[r]);
  large_allreduces(world, Algorithm::kRing, (3u << 20) + 17);
  // Small calls (one thread) and tree calls between them use every socket from one thread.
  large_allreduces(world, Algorithm::kTree, 4099);
  large_allreduces(world, Algorithm::kRing, (5u << 20) + 3);
}

// One float32 sum allreduce in place on rank r of `world`, within `timeout`.
Status allreduce_in_place(SocketWorld& world, int r, std::vector<float>& buf, uint32_t seq,
                          std::chrono::seconds timeout) {
  WaitContext wait;
  wait.control = static_cast<const JobControl*>(world.base(r));
  wait.deadline = deadline_after(timeout);
  CollectiveCall c{CollectiveKind::kAllreduce, buf.data(), buf.data(), buf.size(), DataType::kFloat32,
                   ReduceOp::kSum, 0, Algorithm::kRing, seq};
  return run_collective(world.links(r), wait, c);
}

// The ring's helper threads stay with the calling thread between calls: one thread per rank
// makes calls on 3, 1, 4 and 2 threads in turn (helpers parked, woken, some left idle), with
// every rank's split different, each call checked.
TEST(SocketCollectives, RingHelpersAreReusedAcrossCalls) {
  const int n = 3;
  SocketWorld world(n, 4, 4, 65536);
  const size_t count = (1u << 20) + 7;  // 4 MiB and a bit: threads are used
  std::vector<std::vector<float>> in(n, std::vector<float>(count)), out(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) in[r][i] = float((i + size_t(r) * 5) % 17);
  }
  const uint32_t widths[] = {3, 1, 4, 2};
  auto st = world.run([&](int r) -> Status {
    for (uint32_t call = 0; call < 4; ++call) {
      RankLinks links = world.links(r);
      links.ring_threads = widths[(call + uint32_t(r)) % 4];
      WaitContext wait;
      wait.control = static_cast<const JobControl*>(world.base(r));
      wait.deadline = deadline_after(std::chrono::seconds(30));
      CollectiveCall c{CollectiveKind::kAllreduce, in[r].data(), out[r].data(), count, DataType::kFloat32,
                       ReduceOp::kSum, 0, Algorithm::kRing, call};
      GS_RETURN_IF_ERROR(run_collective(links, wait, c));
      for (size_t i = 0; i < count; i += 101) {
        float want = 0;
        for (int p = 0; p < n; ++p) want += float((i + size_t(p) * 5) % 17);
        if (out[r][i] != want) {
          return {Code::kInternal, "call " + std::to_string(call) + " element " + std::to_string(i) + ": " +
                                       std::to_string(out[r][i]) + " != " + std::to_string(want)};
        }
      }
    }
    return Status::Ok();
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
}

// Kernel buffers (64 KiB, doubled by the kernel) smaller than a slot (256 KiB): sends and
// receives stop part-way through frames. (Far smaller buffers stall loopback TCP itself: the
// receiver then announces its window only on a timer.)
TEST(SocketCollectives, SlotsLargerThanTheKernelBuffers) {
  SocketWorld world(3, 1, 4, 256 << 10, 64 << 10);
  large_allreduces(world, Algorithm::kRing, (2u << 20) + 5);
  large_allreduces(world, Algorithm::kTree, (2u << 20) + 5);
}

// Two channel ends in one region, each driven by its own driver over one TCP connection.
struct Pair {
  Pair() {
    layout.num_channels = 2;
    layout.slots = 2;
    layout.slot_bytes = 4096;
    auto m = SharedMemory::create("socket-pair", layout.total_bytes());
    if (!m.ok()) throw std::runtime_error(m.status().to_string());
    shm = std::make_shared<SharedMemory>(std::move(m).value());
    init_job_control(shm->data(), layout);
    send = Channel(shm->data(), layout, 0);
    recv = Channel(shm->data(), layout, 1);
    auto [a, b] = tcp_pair();
    raw_sender = a.get();
    raw_receiver = b.get();
    sender = std::make_unique<SocketDriver>("job=j rank 0 (host a)");
    receiver = std::make_unique<SocketDriver>("job=j rank 1 (host b)");
    sender->add_sender(send, std::move(a), "rank 1 (host b)");
    receiver->add_receiver(recv, std::move(b), "rank 0 (host a)");
    send.set_driver(sender.get(), true);
    recv.set_driver(receiver.get(), true);
    wait.control = static_cast<const JobControl*>(shm->data());
    wait.deadline = deadline_after(std::chrono::seconds(10));
  }
  ShmLayout layout;
  std::shared_ptr<SharedMemory> shm;
  Channel send, recv;
  int raw_sender = -1, raw_receiver = -1;
  std::unique_ptr<SocketDriver> sender, receiver;
  WaitContext wait;
};

TEST(SocketDriver, SlotsArriveInOrderWithTheirMeta) {
  Pair p;
  std::thread producer([&] {
    for (uint32_t i = 0; i < 10; ++i) {
      auto slot = p.send.acquire_send(p.wait);
      ASSERT_TRUE(slot.ok()) << slot.status().to_string();
      std::memset(*slot, int(i), 100 + i);
      p.send.publish(SlotMeta{100 + i, 7, 1000, 0xAB, i});
    }
    EXPECT_TRUE(p.sender->flush(p.wait).ok());
  });
  for (uint32_t i = 0; i < 10; ++i) {
    SlotMeta meta{};
    auto slot = p.recv.acquire_recv(p.wait, &meta);
    ASSERT_TRUE(slot.ok()) << slot.status().to_string();
    EXPECT_EQ(meta.bytes, 100 + i);
    EXPECT_EQ(meta.step, i);
    EXPECT_EQ(meta.seq, 7u);
    EXPECT_EQ((*slot)[0], uint8_t(i));
    EXPECT_EQ((*slot)[99 + i], uint8_t(i));
    p.recv.release();
  }
  producer.join();
}

TEST(SocketDriver, ClosedPeerIsReportedNamingIt) {
  Pair p;
  p.sender.reset();  // rank 0's process is gone: its socket closes
  auto start = Clock::now();
  auto slot = p.recv.acquire_recv(p.wait, nullptr);
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), Code::kUnavailable);
  EXPECT_NE(slot.status().message().find("from rank 0 (host a) at 127.0.0.1:"), std::string::npos)
      << slot.status().message();
  EXPECT_NE(slot.status().message().find("was closed"), std::string::npos) << slot.status().message();
  EXPECT_NE(slot.status().message().find("job=j rank 1 (host b)"), std::string::npos) << slot.status().message();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  // Every later wait reports the same, at once.
  EXPECT_EQ(p.recv.acquire_recv(p.wait, nullptr).status().code(), Code::kUnavailable);
}

TEST(SocketDriver, SendingToAClosedPeerFails) {
  Pair p;
  p.receiver.reset();
  Status s;
  for (int i = 0; i < 100 && s.ok(); ++i) {
    auto slot = p.send.acquire_send(p.wait);
    if (!slot.ok()) {
      s = slot.status();
      break;
    }
    p.send.publish(SlotMeta{4096, 0, 0, 0, uint32_t(i)});
    s = p.sender->flush(p.wait);
  }
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_NE(s.message().find("to rank 1 (host b)"), std::string::npos) << s.message();
}

TEST(SocketDriver, SilentPeerTimesOut) {
  Pair p;
  p.wait.deadline = deadline_after(std::chrono::milliseconds(300));
  auto start = Clock::now();
  auto slot = p.recv.acquire_recv(p.wait, nullptr);
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), Code::kDeadlineExceeded);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
}

TEST(SocketDriver, AbortWakesAWaiterWithTheReason) {
  Pair p;
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort_job(p.shm->data(), p.layout, 0, "rank 0 (host a) died");
  });
  auto start = Clock::now();
  auto slot = p.recv.acquire_recv(p.wait, nullptr);
  aborter.join();
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), Code::kAborted);
  EXPECT_NE(slot.status().message().find("rank 0 (host a) died"), std::string::npos);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
}

TEST(SocketDriver, OversizedFrameIsAProtocolError) {
  Pair p;
  SlotMeta meta{1u << 20, 0, 0, 0, 0};  // more than a 4096-byte slot
  ASSERT_EQ(::send(p.raw_sender, &meta, sizeof(meta), MSG_NOSIGNAL), ssize_t(sizeof(meta)));
  auto slot = p.recv.acquire_recv(p.wait, nullptr);
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), Code::kInternal);
  EXPECT_NE(slot.status().message().find("protocol error"), std::string::npos) << slot.status().message();
}

// A rank whose job ended (here: it lost its daemon) tells both of its peers, the one it sends
// to and the one it receives from: each fails at once with that reason and the rank it names,
// instead of finding the socket closed later and waiting for a reason from elsewhere.
TEST(SocketDriver, AbortToldOnASocketReachesBothEndsAtOnce) {
  for (bool from_receiver : {true, false}) {
    Pair p;
    SocketDriver& teller = from_receiver ? *p.receiver : *p.sender;
    SocketDriver& hearer = from_receiver ? *p.sender : *p.receiver;
    std::thread tell([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      teller.tell_abort("job=j rank 1 (host b): lost the connection to gradsyncd", 3, deadline_after(std::chrono::seconds(1)));
    });
    auto start = Clock::now();
    // The sender waits on nothing of its own (a rank waiting for some other peer); the
    // receiver for its next slot.
    Status s = from_receiver ? hearer.progress_until([] { return false; }, p.wait, -1)
                             : p.recv.acquire_recv(p.wait, nullptr).status();
    tell.join();
    EXPECT_EQ(s.code(), Code::kAborted) << s.to_string();
    EXPECT_NE(s.message().find("ended the job: job=j rank 1 (host b): lost the connection to gradsyncd"), std::string::npos)
        << s.message();
    EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(400)) << "from_receiver " << from_receiver;
    const ChannelDriver::ToldAbort told = hearer.told_abort();
    EXPECT_TRUE(told.told);
    EXPECT_EQ(told.culprit, 3);
    EXPECT_NE(told.from.find(from_receiver ? "rank 1 (host b)" : "rank 0 (host a)"), std::string::npos) << told.from;
  }
}

// The peer tells, then its process exits: the reason wins over the closed socket.
TEST(SocketDriver, AbortToldBeforeTheSocketClosesIsTheReason) {
  Pair p;
  p.sender->tell_abort("rank 0 gave up", -1, deadline_after(std::chrono::seconds(1)));
  p.sender.reset();
  auto slot = p.recv.acquire_recv(p.wait, nullptr);
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), Code::kAborted) << slot.status().to_string();
  EXPECT_NE(slot.status().message().find("rank 0 gave up"), std::string::npos) << slot.status().message();
  EXPECT_EQ(p.receiver->told_abort().culprit, -1);
}

// A rank that dies fails the rank waiting for its data at once, naming it. (The others learn
// it from the job's abort, which gradsyncd raises when the process goes: not part of this test.)
TEST(SocketCollectives, DeadRankFailsItsSuccessorNamingIt) {
  SocketWorld world(3, 1);  // ring order 1 -> 2 -> 0 -> 1
  std::vector<std::vector<float>> buf(3, std::vector<float>(1 << 20, 1.0f));
  world.kill_rank(1);
  auto start = Clock::now();
  auto st = world.run([&](int r) -> Status {
    if (r == 1) return Status::Ok();
    return allreduce_in_place(world, r, buf[r], 0, std::chrono::seconds(3));
  });
  EXPECT_EQ(st[2].code(), Code::kUnavailable) << st[2].to_string();
  EXPECT_NE(st[2].message().find("from rank 1 (host node1) at 127.0.0.1:"), std::string::npos) << st[2].to_string();
  EXPECT_FALSE(st[0].ok());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

// The same with the rings on several threads (lanes): whichever thread's socket breaks, the
// call fails naming the dead rank, the other threads stop, and the helpers serve the next
// call, which fails at once with the same error (the driver remembers it).
TEST(SocketCollectives, DeadRankFailsEveryLaneNamingIt) {
  SocketWorld world(3, 4);  // ring order 1 -> 2 -> 0 -> 1, four rings
  for (int r = 0; r < 3; ++r) world.set_ring_threads(r, 2);
  std::vector<std::vector<float>> buf(3, std::vector<float>(2 << 20, 1.0f));  // 8 MiB: threads
  world.kill_rank(1);
  auto start = Clock::now();
  std::vector<Status> second(3);
  auto st = world.run([&](int r) -> Status {
    if (r == 1) return Status::Ok();
    Status first = allreduce_in_place(world, r, buf[r], 0, std::chrono::seconds(3));
    second[r] = allreduce_in_place(world, r, buf[r], 1, std::chrono::seconds(3));
    return first;
  });
  EXPECT_EQ(st[2].code(), Code::kUnavailable) << st[2].to_string();
  EXPECT_NE(st[2].message().find("from rank 1 (host node1) at 127.0.0.1:"), std::string::npos) << st[2].to_string();
  EXPECT_FALSE(st[0].ok());
  EXPECT_EQ(second[2].code(), Code::kUnavailable) << second[2].to_string();
  EXPECT_NE(second[2].message().find("rank 1 (host node1)"), std::string::npos) << second[2].to_string();
  EXPECT_FALSE(second[0].ok());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

// A peer that finished and closed its sockets is no error for a rank that needs nothing more
// from it.
TEST(SocketDriver, PeerThatClosedAfterItsLastSlotIsNoError) {
  Pair p;
  auto slot = p.send.acquire_send(p.wait);
  ASSERT_TRUE(slot.ok());
  p.send.publish(SlotMeta{16, 0, 0, 0, 0});
  ASSERT_TRUE(p.sender->flush(p.wait).ok());
  p.sender.reset();
  auto got = p.recv.acquire_recv(p.wait, nullptr);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  p.recv.release();
  EXPECT_TRUE(p.receiver->poke(WaitContext{}).ok());
  EXPECT_TRUE(p.receiver->flush(p.wait).ok());
  // Only waiting for more from it fails.
  EXPECT_EQ(p.recv.acquire_recv(p.wait, nullptr).status().code(), Code::kUnavailable);
}

}  // namespace
}  // namespace gradsync
