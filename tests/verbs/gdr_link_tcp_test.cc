// The step link's TCP peers (gpu/gdr_link.h, gpu/gdr_link_tcp.cc) on the CPU, ranks as
// threads on 127.0.0.1 (gdr_link_world.h): the planner's ring and trees at several shapes with
// every hop between nodes a TCP connection (inside a node direct, or TCP too), every
// collective, odd counts, exact results, the ring's bytes; a connection that cannot prove it
// belongs to the set-up is refused and writes nothing; a rank that dies mid-call fails every
// rank, naming it, well within the op timeout.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gdr_link_world.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using namespace gdr_link_world;

Ring tcp_ring(int nodes, int per, bool direct, std::function<void(int, GdrLinkConfig&, GdrLinkOps&)> tweak = {},
              std::chrono::milliseconds timeout = 10s) {
  return Ring(nodes * per, 2, 256, per, timeout, 1, direct, /*nic=*/false, /*tcp=*/true, std::move(tweak));
}

// Allreduce (ring and trees), reduce_scatter, all_gather and broadcast, exact, at odd counts.
void expect_every_collective(Ring& ring, int n) {
  for (size_t count : {size_t(1), size_t(7), size_t(2053)}) {
    for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
      expect_allreduce(ring, n, count, algo);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  expect_reduce_scatter(ring, n, 333, plan::Algo::kRing);
  expect_all_gather_and_broadcast(ring, n, plan::Algo::kTree);
}

class GdrLinkTcpShapes : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(GdrLinkTcpShapes, RingAndTreesOverTcpPeers) {
  const auto [nodes, per, direct] = GetParam();
  const int n = nodes * per;
  Ring ring = tcp_ring(nodes, per, direct);
  ASSERT_EQ(ring.error(), "");
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < ring.link(r).peer_count(); ++p) {
      const GdrPeer& peer = ring.link(r).peer(p);
      const bool same_node = peer.rank / per == r / per;
      EXPECT_EQ(peer.direct, direct && same_node) << "rank " << r << " peer " << peer.rank;
      EXPECT_EQ(peer.tcp, !peer.direct) << "rank " << r << " peer " << peer.rank;
    }
  }
  EXPECT_NE(ring.link(0).describe().find("TCP from 127.0.0.1:"), std::string::npos) << ring.link(0).describe();
  expect_every_collective(ring, n);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdrLinkTcpShapes,
                         ::testing::Values(std::make_tuple(2, 1, false), std::make_tuple(3, 1, false),
                                           std::make_tuple(2, 2, false), std::make_tuple(2, 2, true),
                                           std::make_tuple(4, 2, true), std::make_tuple(4, 2, false)),
                         [](const auto& info) {
                           return "x" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_direct" : "");
                         });

// The ring's allreduce sends 2 (n-1)/n S per rank over its TCP peers, every byte counted.
TEST(GdrLinkTcp, RingSendsTwoNMinusOneOverNOfTheBuffer) {
  for (int n : {2, 3, 4}) {
    Ring ring = tcp_ring(n, 1, false);
    ASSERT_EQ(ring.error(), "");
    const size_t count = 1200 * size_t(n);  // int64: S = 9600 n bytes, several slots per hop
    auto send = inputs(n, count);
    std::vector<std::vector<int64_t>> recv(n, std::vector<int64_t>(count, -1));
    auto st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, plan::Algo::kRing);
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      ASSERT_EQ(recv[r][count - 1], sum_at(send, count - 1));
      // The worker counts a message once its write returned, which may be after the peer
      // read it and the call ended (seen once in CI): the count settles within a deadline.
      const uint64_t want = 2 * uint64_t(n - 1) * count * 8 / n;
      uint64_t sent = 0;
      for (const auto deadline = std::chrono::steady_clock::now() + 5s;;) {
        sent = 0;
        for (int p = 0; p < ring.link(r).peer_count(); ++p) sent += ring.link(r).bytes_sent(p);
        if (sent >= want || std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::sleep_for(1ms);
      }
      EXPECT_EQ(sent, want) << n << " ranks, rank " << r;
    }
  }
}

// A connection to rank 1's port that comes first with a hello whose MAC is wrong (and a frame
// behind it) is refused: closed without an answer, logged, and nothing of it lands in a slot;
// the real rank 0 then connects and the collectives are exact.
TEST(GdrLinkTcp, AConnectionWithAWrongMacIsRefused) {
  std::atomic<int> impostor{-1};
  auto tweak = [&](int r, GdrLinkConfig&, GdrLinkOps& ops) {
    if (r != 1) return;
    ops.tcp_listening = [&](const std::string& address, int port) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(uint16_t(port));
      ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
      ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
      // The hello's layout (magic "GSTH", version 1, from 0, to 1) with a forged proof, then a
      // frame of message 0 full of 0x5a.
      uint8_t bytes[48 + 16 + 64];
      std::memset(bytes, 0x5a, sizeof(bytes));
      const uint32_t head[4] = {0x47535448, 1, 0, 1};
      std::memcpy(bytes, head, sizeof(head));
      const uint32_t frame[4] = {0x47534d31, 64, 0, 0};
      std::memcpy(bytes + 48, frame, sizeof(frame));
      ASSERT_EQ(::send(fd, bytes, sizeof(bytes), MSG_NOSIGNAL), ssize_t(sizeof(bytes)));
      impostor = fd;
    };
  };
  Ring ring = tcp_ring(2, 1, false, tweak);
  ASSERT_EQ(ring.error(), "");
  ASSERT_GE(impostor.load(), 0);
  // Refused: the connection ends with nothing sent back (no acceptor proof): closed, or reset
  // since the refusing end closed with the impostor's frame unread.
  uint8_t got[64];
  const ssize_t n = ::recv(impostor, got, sizeof(got), 0);
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << n << " bytes came back";
  ::close(impostor);
  GdrLink& l1 = ring.link(1);
  const int p = l1.peer_index(0);
  ASSERT_GE(p, 0);
  for (uint64_t m = 0; m < l1.slots(); ++m) {
    const uint8_t* s = l1.slot(p, true, m);
    EXPECT_TRUE(std::all_of(s, s + l1.slot_bytes(), [](uint8_t b) { return b == 0; })) << "receive slot " << m;
  }
  auto send = inputs(2, 501);
  std::vector<std::vector<int64_t>> recv(2, std::vector<int64_t>(501, -1));
  auto st = ring.collective(CollectiveKind::kAllreduce, {501}, 0, send, recv, plan::Algo::kRing);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r].to_string();
    for (size_t i = 0; i < 501; ++i) ASSERT_EQ(recv[r][i], sum_at(send, i));
  }
}

// Keys of two set-ups differ: a rank whose job token differs from its peer's cannot connect,
// and every rank learns the link is not there (nothing half-connected).
TEST(GdrLinkTcp, APeerOfAnotherTokenCannotConnect) {
  auto tweak = [](int r, GdrLinkConfig& c, GdrLinkOps&) { c.tcp_token = r == 0 ? "token-a" : "token-b"; };
  Ring ring = tcp_ring(2, 1, false, tweak, 2s);
  EXPECT_NE(ring.error().find("rank 0: UNAVAILABLE: TCP steps: connecting the TCP connections"), std::string::npos)
      << ring.error();
  EXPECT_NE(ring.error().find("rank 1:"), std::string::npos) << ring.error();
}

// Rank 2 of 3 dies (its connections close) while ranks 0 and 1 are in an allreduce with it:
// both fail long before the 10 s op timeout, their errors naming rank 2.
TEST(GdrLinkTcp, APeerThatDiesMidCallFailsEveryRankNamingIt) {
  for (plan::Algo algo : {plan::Algo::kRing, plan::Algo::kTree}) {
    Ring ring = tcp_ring(3, 1, false);
    ASSERT_EQ(ring.error(), "");
    ring.sit_out[2] = true;
    std::thread killer([&] {
      std::this_thread::sleep_for(300ms);
      ring.kill(2);
    });
    const size_t count = 4001;
    auto send = inputs(3, count);
    std::vector<std::vector<int64_t>> recv(3, std::vector<int64_t>(count, -1));
    const auto t0 = Clock::now();
    // Rank 2 never makes the call (its worker takes in what lands) and dies 300 ms in.
    std::vector<Status> st(3);
    std::thread caller([&] { st = ring.collective(CollectiveKind::kAllreduce, {count}, 0, send, recv, algo); });
    killer.join();
    caller.join();
    const auto took = Clock::now() - t0;
    EXPECT_LT(took, 5s) << plan::to_string(algo);
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(st[r].ok()) << plan::to_string(algo) << " rank " << r;
      EXPECT_NE(st[r].message().find("rank 2 (host n2)"), std::string::npos) << st[r].to_string();
    }
    // The failing link sets its error, then aborts the job: a stream may see the first.
    for (auto until = Clock::now() + 2s; ring.abort_reason().empty() && Clock::now() < until;) {
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_NE(ring.abort_reason().find("rank 2 (host n2)"), std::string::npos) << ring.abort_reason();
    EXPECT_NE(ring.abort_reason().find("closed"), std::string::npos) << ring.abort_reason();
  }
}

}  // namespace
}  // namespace gradsync
