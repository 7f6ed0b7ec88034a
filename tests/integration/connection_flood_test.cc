// Attack 7 of docs/security.md: 10,000 connections opened and dropped on a daemon's trainer
// socket and 10,000 on its data port, within a minute, with more connections held open than
// the daemon serves at once (--max-connections) and some that never say anything. The daemon
// stays within its thread and memory bounds (read from /proc/PID/status while it happens),
// refuses and logs what is over its limit, closes silent connections after its deadline, and a
// job running on it all along completes; then it serves a new job.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <poll.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "bystander.h"
#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

constexpr int kCap = 32;             // --max-connections of the flooded daemon
constexpr int kFlood = 10'000;       // connections per listener
constexpr int kFloodThreads = 4;
// Threads the daemon may start during the flood that serve no connection: gRPC's own (timers,
// executor) under load. Connection threads are counted until joined (daemon/connection_pool.h),
// so at most kCap per listener exist, in any build (docs/security.md has the measured peaks).
constexpr int kOtherThreadsSlack = 4;

// "Threads" and "VmRSS" (KiB) of a process.
struct Usage {
  long threads = 0;
  long rss_kib = 0;
};

Usage usage_of(pid_t pid) {
  Usage u;
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Threads:", 0) == 0) u.threads = std::stol(line.substr(8));
    if (line.rfind("VmRSS:", 0) == 0) u.rss_kib = std::stol(line.substr(6));
  }
  return u;
}

int connect_unix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int connect_tcp(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  // Drop it the hard way (RST), as a scanner does.
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  return fd;
}

// The data port of daemon `d` (its ready file holds "127.0.0.1:PORT").
int data_port(const Cluster& c, int d) {
  std::ifstream f(c.dir() + "/d" + std::to_string(d) + ".ready");
  std::string ep;
  std::getline(f, ep);
  return std::stoi(ep.substr(ep.rfind(':') + 1));
}

// True once the daemon closed `fd` (EOF or reset) within `timeout`.
bool closed_by_peer(int fd, Millis timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
  char b;
  return ::recv(fd, &b, 1, MSG_DONTWAIT) <= 0;
}

TEST(ConnectionFlood, DaemonStaysWithinBoundsAndKeepsServing) {
  Cluster c({.daemons = 2, .per_daemon_args = {{0, {"--max-connections", std::to_string(kCap)}}}});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  Bystander bystander(c, "bystander-flood");
  ASSERT_TRUE(bystander.joined());
  const pid_t pid = c.daemon(0).pid();
  const int port = data_port(c, 0);
  const Usage before = usage_of(pid);
  std::printf("[flood] gradsyncd before: %ld threads, %ld KiB resident\n", before.threads, before.rss_kib);

  // Silent connections: the daemon must close them itself (10 s deadline before a join or a
  // Hello). Then more than the cap held open at once: the rest are refused and logged.
  const auto silent_since = std::chrono::steady_clock::now();
  std::vector<int> silent = {connect_unix(c.socket(0)), connect_tcp(port)};
  std::vector<int> held;
  for (int i = 0; i < 2 * kCap; ++i) {
    held.push_back(connect_unix(c.socket(0)));
    held.push_back(connect_tcp(port));
  }
  ASSERT_TRUE(c.daemon(0).wait_for_output("refused a trainer-socket connection", 10s)) << c.report();
  ASSERT_TRUE(c.daemon(0).wait_for_output("refused a data-port connection", 10s)) << c.report();

  std::atomic<bool> sampling{true};
  Usage peak = usage_of(pid);
  std::thread sampler([&] {
    while (sampling.load()) {
      Usage u = usage_of(pid);
      peak.threads = std::max(peak.threads, u.threads);
      peak.rss_kib = std::max(peak.rss_kib, u.rss_kib);
      std::this_thread::sleep_for(5ms);
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> failed_connects{0};
  std::vector<std::thread> flooders;
  for (int t = 0; t < kFloodThreads; ++t) {
    flooders.emplace_back([&, t] {
      for (int i = t; i < kFlood; i += kFloodThreads) {
        for (int fd : {connect_unix(c.socket(0)), connect_tcp(port)}) {
          if (fd < 0) ++failed_connects; else ::close(fd);
        }
        if (i == kFlood / 2 && t == 0) {  // halfway: let go of the held ones
          for (int fd : held) if (fd >= 0) ::close(fd);
          held.clear();
        }
      }
    });
  }
  for (auto& f : flooders) f.join();
  const double flood_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::this_thread::sleep_for(200ms);
  sampling.store(false);
  sampler.join();
  std::printf("[flood] %d + %d connections in %.1f s (%d connects failed); gradsyncd peak: %ld threads, "
              "%ld KiB resident\n",
              kFlood, kFlood, flood_s, failed_connects.load(), peak.threads, peak.rss_kib);
  EXPECT_LT(flood_s, 60.0);
  // At most kCap connection threads per listener exist at any time (the ones `before` counts
  // for the bystander's connections among them).
  EXPECT_LE(peak.threads, before.threads + 2 * kCap + kOtherThreadsSlack);
  EXPECT_LE(peak.rss_kib, before.rss_kib + 64 * 1024);

  // The silent ones are closed by the daemon, about 10 s after they were opened.
  for (int fd : silent) {
    ASSERT_GE(fd, 0);
    auto left = Millis(15'000) - std::chrono::duration_cast<Millis>(std::chrono::steady_clock::now() - silent_since);
    EXPECT_TRUE(closed_by_peer(fd, std::max(left, Millis(0)))) << "a silent connection was kept open";
    ::close(fd);
  }
  EXPECT_NE(c.daemon(0).output().find("nothing sent for 10 s before a join"), std::string::npos) << c.report();
  EXPECT_NE(c.daemon(0).output().find("rejected a data-port connection"), std::string::npos) << c.report();
  // Logged at most about once a second per kind, not once per connection.
  const std::string log = c.daemon(0).output();
  size_t lines = 0;
  for (size_t at = log.find("refused a "); at != std::string::npos; at = log.find("refused a ", at + 1)) ++lines;
  EXPECT_LE(lines, static_cast<size_t>(2 * (flood_s + 20)));

  EXPECT_TRUE(bystander.finish());
  EXPECT_TRUE(serves_new_job(c, "after-flood"));
  const Usage after = usage_of(pid);
  std::printf("[flood] gradsyncd after: %ld threads, %ld KiB resident\n", after.threads, after.rss_kib);
}

}  // namespace
}  // namespace gradsync::testing
