// The data connections between nodes (common/tcp_socket.h, daemon/proxy.h): a connect to a
// peer that drops it ends by its deadline, naming the peer; a receiver that stops reading
// keeps its connection; a peer host gone silent fails a rank socket within seconds, naming
// the peer and saying that which side is at fault is not known.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "common/tcp_socket.h"
#include "daemon/proxy.h"
#include "socket_world.h"
#include "transport/tcp/socket_driver.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::tcp_pair;

bool has(const Status& s, const std::string& what) { return s.message().find(what) != std::string::npos; }

// A listening socket that answers no new connection: its accept queue (backlog 0) is full
// and nobody accepts, so the kernel drops every further SYN, as a firewall that drops would.
struct BlackHole {
  BlackHole() {
    uint16_t port = 0;
    auto l = tcp_listen("127.0.0.1", 0, &port);
    if (!l.ok() || ::listen(l->get(), 0) != 0) throw std::runtime_error("listen: " + l.status().to_string());
    listener = std::move(l).value();
    endpoint = "127.0.0.1:" + std::to_string(port);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    const socklen_t len = sizeof(a);
    // Fill the queue until a connection stays unanswered.
    for (int i = 0; i < 16; ++i) {
      Fd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      (void)::connect(c.get(), reinterpret_cast<sockaddr*>(&a), len);
      pollfd p{c.get(), POLLOUT, 0};
      const bool answered = ::poll(&p, 1, 200) > 0;
      fillers.push_back(std::move(c));
      if (!answered) return;
    }
    throw std::runtime_error("the listener kept answering connections");
  }
  Fd listener;
  std::vector<Fd> fillers;
  std::string endpoint;
};

TEST(ProxyDial, BlackHoledPeerFailsByItsDeadline) {
  BlackHole hole;
  // Before the deadline came in, this connect waited for the kernel's SYN retries (about 2 min).
  auto began = Clock::now();
  auto fd = proxy_dial(hole.endpoint, deadline_after(500ms));
  ASSERT_FALSE(fd.ok());
  EXPECT_LT(Clock::now() - began, 3s);
  EXPECT_EQ(fd.status().code(), Code::kDeadlineExceeded) << fd.status().to_string();
  EXPECT_TRUE(has(fd.status(), "gradsyncd at " + hole.endpoint + " did not answer a connection within 0.5 s: "
                                "a firewall drops it, or its host is down"))
      << fd.status().to_string();

  // The whole client handshake, as gradsyncd connects a channel, ends by the same deadline.
  began = Clock::now();
  ProxyHello hello{"job", ChannelTransport::kTcpRank, 1, 0, 0, 1};
  auto connected = proxy_connect(hole.endpoint, hello, "token", deadline_after(500ms));
  ASSERT_FALSE(connected.ok());
  EXPECT_LT(Clock::now() - began, 3s);
  EXPECT_EQ(connected.status().code(), Code::kDeadlineExceeded) << connected.status().to_string();

  // The liveness probe shares the connect: no answer is not "gone".
  Status probe = probe_daemon(hole.endpoint, deadline_after(200ms));
  EXPECT_EQ(probe.code(), Code::kDeadlineExceeded) << probe.to_string();
  EXPECT_TRUE(has(probe, "did not answer a connection within")) << probe.to_string();
}

TEST(ProxyDial, RefusedAndAnsweredConnections) {
  uint16_t port = 0;
  auto listener = tcp_listen("127.0.0.1", 0, &port);
  ASSERT_TRUE(listener.ok()) << listener.status().to_string();
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  auto fd = proxy_dial(endpoint, deadline_after(2s));
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  // Blocking, as the handshake and the pumps expect; with the data keepalive on.
  int flags = ::fcntl(fd->get(), F_GETFL);
  EXPECT_EQ(flags & O_NONBLOCK, 0);
  int on = 0;
  socklen_t len = sizeof(on);
  ASSERT_EQ(::getsockopt(fd->get(), SOL_SOCKET, SO_KEEPALIVE, &on, &len), 0);
  EXPECT_EQ(on, 1);
  EXPECT_TRUE(probe_daemon(endpoint, deadline_after(2s)).ok());

  listener->reset();  // nothing listens there now
  auto refused = proxy_dial(endpoint, deadline_after(2s));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kUnavailable) << refused.status().to_string();
  EXPECT_TRUE(has(refused.status(), "refuses connections")) << refused.status().to_string();
  EXPECT_EQ(probe_daemon(endpoint, deadline_after(2s)).code(), Code::kUnavailable);
}

// A TCP pair with the data connections' keepalive on both ends.
std::pair<Fd, Fd> data_pair() {
  auto pair = tcp_pair();
  set_data_keepalive(pair.first.get());
  set_data_keepalive(pair.second.get());
  return pair;
}

TEST(DataKeepalive, ReaderThatStopsReadingKeepsItsConnection) {
  // A rank still computing while its peer sends the next call: the sender's data waits behind
  // a zero window for longer than the keepalive's limit. The receiver's kernel still answers,
  // so the connection must live (TCP_USER_TIMEOUT would have killed it).
  auto [to, from] = data_pair();
  ::fcntl(to.get(), F_SETFL, ::fcntl(to.get(), F_GETFL) | O_NONBLOCK);
  std::vector<char> chunk(1 << 16, 'x');
  size_t sent = 0;
  for (;;) {
    ssize_t n = ::send(to.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += size_t(n);
  }
  ASSERT_EQ(errno, EAGAIN);
  std::this_thread::sleep_for(kDataSilenceLimit + 2s);
  int err = -1;
  socklen_t len = sizeof(err);
  ASSERT_EQ(::getsockopt(to.get(), SOL_SOCKET, SO_ERROR, &err, &len), 0);
  EXPECT_EQ(err, 0) << std::strerror(err);
  size_t got = 0;
  while (got < sent) {
    ssize_t n = ::recv(from.get(), chunk.data(), chunk.size(), 0);
    ASSERT_GT(n, 0) << errno_string("recv");
    got += size_t(n);
  }
  EXPECT_EQ(::send(to.get(), "y", 1, MSG_NOSIGNAL), 1) << errno_string("send");
}

// Runs `body` on a thread in a network namespace of its own (its loopback up), so that an
// nftables rule there can drop the loopback traffic. Empty when it ran; else why it cannot.
std::string in_own_netns(const std::function<void()>& body) {
  std::string why;
  std::thread t([&] {
    if (::unshare(CLONE_NEWNET) != 0) {
      why = "no network namespace (" + errno_string("unshare") + "; not root?)";
      return;
    }
    Fd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    ifreq ifr{};
    std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) {
      why = errno_string("SIOCGIFFLAGS lo");
      return;
    }
    ifr.ifr_flags = short(ifr.ifr_flags | IFF_UP);
    if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) {
      why = errno_string("SIOCSIFFLAGS lo");
      return;
    }
    body();
  });
  t.join();
  return why;
}

TEST(DataKeepalive, SilentPeerFailsARankSocketWithinSeconds) {
  if (std::system("command -v nft >/dev/null 2>&1") != 0) GTEST_SKIP() << "no nft (nftables) here";
  Status s;
  Clock::duration took{};
  int culprit = 0;
  std::string nft_failed;
  std::string why = in_own_netns([&] {
    ShmLayout layout;
    layout.num_channels = 1;
    layout.slots = 2;
    layout.slot_bytes = 4096;
    auto m = SharedMemory::create("silent-peer", layout.total_bytes());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    init_job_control(m->data(), layout);
    Channel recv(m->data(), layout, 0);
    auto [to, from] = tcp_pair();
    SocketDriver receiver("job=j rank 1 (host b)");
    receiver.add_receiver(recv, std::move(from), "rank 0 (host a)", 0);
    recv.set_driver(&receiver, true);
    // From here the namespace's loopback drops everything: the peer's host is silent, both ways
    // (a cut of the data network as either node sees it). The system() child runs in this
    // thread's namespace.
    if (std::system("nft 'add table inet gstest; add chain inet gstest out { type filter hook output priority 0; }; "
                    "add rule inet gstest out oifname lo drop'") != 0) {
      nft_failed = "nft could not add the drop rule";
      return;
    }
    WaitContext wait;
    wait.control = static_cast<const JobControl*>(m->data());
    wait.deadline = deadline_after(30s);  // far past the keepalive's limit
    const auto began = Clock::now();
    auto slot = recv.acquire_recv(wait, nullptr);
    took = Clock::now() - began;
    s = slot.status();
    culprit = receiver.failed_peer();
    (void)to;
  });
  if (!why.empty()) GTEST_SKIP() << why;
  ASSERT_TRUE(nft_failed.empty()) << nft_failed;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_TRUE(has(s, "job=j rank 1 (host b): the TCP connection from rank 0 (host a) at 127.0.0.1:")) << s.to_string();
  EXPECT_TRUE(has(s, "answered nothing for 5 s")) << s.to_string();
  EXPECT_TRUE(has(s, "which side is at fault is not known")) << s.to_string();
  // Neither rank is blamed: the network between them (or a host) is.
  EXPECT_EQ(culprit, -1);
  // The keepalive's limit (about 5 s) plus the 500 ms this rank waits for a job's abort.
  EXPECT_GT(took, kDataSilenceLimit - 1s);
  EXPECT_LT(took, kDataSilenceLimit + 4s);
}

TEST(DataKeepalive, SilentPeerFailsASenderWithDataInFlight) {
  // The keepalive does not probe while data is queued: a rank whose sends its silent peer
  // never acknowledges must find that itself (check_silent_sends), or it waits for the
  // kernel's retransmissions (minutes) while its sends block it.
  if (std::system("command -v nft >/dev/null 2>&1") != 0) GTEST_SKIP() << "no nft (nftables) here";
  Status s;
  Clock::duration took{};
  std::string nft_failed;
  std::string why = in_own_netns([&] {
    ShmLayout layout;
    layout.num_channels = 1;
    layout.slots = 2;
    layout.slot_bytes = 4096;
    auto m = SharedMemory::create("silent-sends", layout.total_bytes());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    init_job_control(m->data(), layout);
    Channel send(m->data(), layout, 0);
    auto [to, from] = tcp_pair();
    SocketDriver sender("job=j rank 0 (host a)");
    sender.add_sender(send, std::move(to), "rank 1 (host b)", 1);
    send.set_driver(&sender, true);
    if (std::system("nft 'add table inet gstest; add chain inet gstest out { type filter hook output priority 0; }; "
                    "add rule inet gstest out oifname lo drop'") != 0) {
      nft_failed = "nft could not add the drop rule";
      return;
    }
    WaitContext wait;
    wait.control = static_cast<const JobControl*>(m->data());
    wait.deadline = deadline_after(30s);
    const auto began = Clock::now();
    auto slot = send.acquire_send(wait);
    ASSERT_TRUE(slot.ok()) << slot.status().to_string();
    send.publish(SlotMeta{4096, 0, 0, 0, 0});
    s = sender.flush(wait);  // the slot is in the kernel at once: the flush ends
    for (int i = 1; s.ok() && i < 1000; ++i) {
      auto next = send.acquire_send(wait);  // credits come back; the kernel holds what never leaves
      if (!next.ok()) {
        s = next.status();
        break;
      }
      send.publish(SlotMeta{4096, 0, 0, 0, uint32_t(i)});
      s = sender.flush(wait);
    }
    took = Clock::now() - began;
    (void)from;
  });
  if (!why.empty()) GTEST_SKIP() << why;
  ASSERT_TRUE(nft_failed.empty()) << nft_failed;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_TRUE(has(s, "the TCP connection to rank 1 (host b) at 127.0.0.1:")) << s.to_string();
  EXPECT_TRUE(has(s, "answered nothing for 5 s")) << s.to_string();
  EXPECT_TRUE(has(s, "which side is at fault is not known")) << s.to_string();
  EXPECT_LT(took, kDataSilenceLimit + 4s);
}

}  // namespace
}  // namespace gradsync
