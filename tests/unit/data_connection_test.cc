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

// One channel end in a region of its own, its rank's driver, and a loopback pair (made in
// the calling thread's namespace) whose far end the test keeps.
struct SilencedEnd {
  explicit SilencedEnd(bool send) : driver(send ? "job=j rank 0 (host a)" : "job=j rank 1 (host b)") {
    auto m = SharedMemory::create("silenced-end", layout.total_bytes());
    if (!m.ok()) throw std::runtime_error(m.status().to_string());
    shm = std::make_shared<SharedMemory>(std::move(m).value());
    init_job_control(shm->data(), layout);
    ch = Channel(shm->data(), layout, 0);
    auto [to, from] = tcp_pair();
    if (send) {
      driver.add_sender(ch, std::move(to), "rank 1 (host b)", 1);
      far = std::move(from);
    } else {
      driver.add_receiver(ch, std::move(from), "rank 0 (host a)", 0);
      far = std::move(to);
    }
    ch.set_driver(&driver, true);
    wait.control = static_cast<const JobControl*>(shm->data());
    wait.deadline = deadline_after(30s);  // far past the data connections' limit
  }
  ShmLayout layout{.num_channels = 1, .slots = 2, .slot_bytes = 4096};
  std::shared_ptr<SharedMemory> shm;
  Channel ch;
  SocketDriver driver;
  Fd far;
  WaitContext wait;
};

// From here the calling thread's namespace drops every loopback packet: the peer's host is
// silent, both ways (a cut of the data network as either node sees it). The system() child
// runs in the calling thread's namespace.
bool silence_loopback() {
  return std::system("nft 'add table inet gstest; add chain inet gstest out { type filter hook output priority 0; }; "
                     "add rule inet gstest out oifname lo drop'") == 0;
}

// What a rank saw once its peer went silent, run in a namespace of its own.
struct Silenced {
  std::string skip;  // why it could not run
  Status status;
  Clock::duration took{};
  int culprit = 0;
};

Silenced run_silenced(bool send) {
  Silenced out;
  if (std::system("command -v nft >/dev/null 2>&1") != 0) {
    out.skip = "no nft (nftables) here";
    return out;
  }
  out.skip = in_own_netns([&] {
    SilencedEnd end(send);
    if (!silence_loopback()) {
      out.skip = "nft could not add the drop rule";
      return;
    }
    const auto began = Clock::now();
    if (!send) {
      out.status = end.ch.acquire_recv(end.wait, nullptr).status();
    } else {
      // The slots go into the kernel at once and their credits come back; what the kernel
      // holds never leaves, so the sends block the rank soon.
      for (uint32_t i = 0; out.status.ok() && i < 1000; ++i) {
        auto slot = end.ch.acquire_send(end.wait);
        if (!slot.ok()) {
          out.status = slot.status();
          break;
        }
        end.ch.publish(SlotMeta{4096, 0, 0, 0, i});
        out.status = end.driver.flush(end.wait);
      }
    }
    out.took = Clock::now() - began;
    out.culprit = end.driver.failed_peer();
  });
  return out;
}

void expect_silence_named(const Silenced& r, const std::string& connection) {
  ASSERT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.code(), Code::kUnavailable) << r.status.to_string();
  EXPECT_TRUE(has(r.status, connection)) << r.status.to_string();
  EXPECT_TRUE(has(r.status, "answered nothing for 5 s")) << r.status.to_string();
  EXPECT_TRUE(has(r.status, "which side is at fault is not known")) << r.status.to_string();
  // Neither rank is blamed: the network between them (or a host) is.
  EXPECT_EQ(r.culprit, -1);
  // The limit (about 5 s) plus the 500 ms a rank waits for a job's abort.
  EXPECT_LT(r.took, kDataSilenceLimit + 4s);
}

TEST(DataKeepalive, SilentPeerFailsARankSocketWithinSeconds) {
  Silenced r = run_silenced(false);
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  expect_silence_named(r, "job=j rank 1 (host b): the TCP connection from rank 0 (host a) at 127.0.0.1:");
  EXPECT_GT(r.took, kDataSilenceLimit - 1s);
}

TEST(DataKeepalive, SilentPeerFailsASenderWithDataInFlight) {
  // The keepalive does not probe while data is queued: a rank whose sends its silent peer
  // never acknowledges must find that itself (check_silent_sends), or it waits for the
  // kernel's retransmissions (minutes) while its sends block it.
  Silenced r = run_silenced(true);
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  expect_silence_named(r, "job=j rank 0 (host a): the TCP connection to rank 1 (host b) at 127.0.0.1:");
}

}  // namespace
}  // namespace gradsync
