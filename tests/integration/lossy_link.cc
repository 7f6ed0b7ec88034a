// A user-space stand-in for `tc netem` (which this kernel lacks), for scripts/chaos.sh's network
// faults: it creates one TUN device per "node" and forwards IPv4 packets between them, each
// packet held back `--delay-ms` and dropped with probability `--loss-percent`. The script moves
// each TUN device into its node's network namespace and gives node i the address 10.78.0.(i+1);
// a packet for 10.78.0.K leaves on TUN device K-1. A partition is `ip link set DEV down` in
// the namespace (the relay's writes to a down device fail and the packet is lost).
//
//   lossy_link --ready-file F [--delay-ms 50] [--loss-percent 5] [--seed N] DEV0 DEV1 [DEV2...]
//   kill -USR1 PID   # delay and loss on;  kill -USR2 PID: off
//
// Writes "ready" to F once every device exists. Packets pass untouched until SIGUSR1 turns the
// delay and loss on (SIGUSR2 turns them off again); runs until SIGTERM/SIGINT, then prints what
// it forwarded and dropped. Packets leave in the order they came (one FIFO: a packet that
// came after the delay was turned off waits behind the delayed ones); at most kQueueLimit
// packets wait (more are dropped, as netem's limit does).
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPacket = 65536;   // a TUN read never returns more than the MTU; bound anyway
constexpr size_t kQueueLimit = 20000;  // packets in flight: 50 ms at ~400k packets/s

volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_impaired = 0;
void on_signal(int) { g_stop = 1; }
void on_impair(int sig) { g_impaired = sig == SIGUSR1; }

struct Packet {
  Clock::time_point due;
  size_t out;  // index of the device to write to
  std::vector<uint8_t> bytes;
};

// Opens a new TUN device named `name` (IFF_NO_PI: bare IP packets), non-blocking.
int open_tun(const std::string& name) {
  int fd = ::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    std::fprintf(stderr, "lossy_link: open /dev/net/tun: %s (is this root, with /dev/net/tun?)\n", std::strerror(errno));
    return -1;
  }
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name.c_str());
  if (::ioctl(fd, TUNSETIFF, &ifr) < 0) {
    std::fprintf(stderr, "lossy_link: TUNSETIFF %s: %s\n", name.c_str(), std::strerror(errno));
    ::close(fd);
    return -1;
  }
  return fd;
}

int usage() {
  std::fprintf(stderr,
               "usage: lossy_link --ready-file F [--delay-ms MS] [--loss-percent P] [--seed N] DEV0 DEV1 [DEV...]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  long delay_ms = 50;
  double loss_percent = 0;
  unsigned long seed = std::random_device{}();
  std::string ready_file;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--delay-ms" && (v = value())) delay_ms = std::strtol(v, nullptr, 10);
    else if (a == "--loss-percent" && (v = value())) loss_percent = std::strtod(v, nullptr);
    else if (a == "--seed" && (v = value())) seed = std::strtoul(v, nullptr, 10);
    else if (a == "--ready-file" && (v = value())) ready_file = v;
    else if (!a.empty() && a[0] != '-') names.push_back(a);
    else return usage();
  }
  if (names.size() < 2 || names.size() > 250 || ready_file.empty() || delay_ms < 0 || delay_ms > 10'000 ||
      loss_percent < 0 || loss_percent > 100) {
    return usage();
  }
  std::vector<pollfd> fds;
  for (const auto& n : names) {
    int fd = open_tun(n);
    if (fd < 0) return 1;
    fds.push_back({fd, POLLIN, 0});
  }
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  sa.sa_handler = on_impair;
  ::sigaction(SIGUSR1, &sa, nullptr);
  ::sigaction(SIGUSR2, &sa, nullptr);
  if (FILE* f = std::fopen(ready_file.c_str(), "w")) {
    std::fputs("ready\n", f);
    std::fclose(f);
  } else {
    std::fprintf(stderr, "lossy_link: cannot write %s: %s\n", ready_file.c_str(), std::strerror(errno));
    return 1;
  }

  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> percent(0.0, 100.0);
  const auto delay = std::chrono::milliseconds(delay_ms);
  std::deque<Packet> queue;
  uint64_t forwarded = 0, lost = 0, overflow = 0, unroutable = 0, write_failed = 0;
  std::vector<uint8_t> buf(kMaxPacket);
  while (!g_stop) {
    int timeout_ms = -1;
    if (!queue.empty()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(queue.front().due - Clock::now()).count();
      timeout_ms = static_cast<int>(std::max<long>(left, 0));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      std::perror("lossy_link: poll");
      return 1;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      for (;;) {
        ssize_t n = ::read(fds[i].fd, buf.data(), buf.size());
        if (n <= 0) break;
        // IPv4 only: the destination's last byte names the node (10.78.0.K is device K-1).
        if (n < 20 || (buf[0] >> 4) != 4 || buf[19] == 0 || buf[19] > fds.size() || buf[19] - 1u == i) {
          ++unroutable;
          continue;
        }
        const bool impaired = g_impaired;
        if (impaired && percent(rng) < loss_percent) {
          ++lost;
          continue;
        }
        if (queue.size() >= kQueueLimit) {
          ++overflow;
          continue;
        }
        queue.push_back({Clock::now() + (impaired ? delay : Clock::duration::zero()), static_cast<size_t>(buf[19] - 1), {buf.begin(), buf.begin() + n}});
      }
    }
    const auto now = Clock::now();
    while (!queue.empty() && queue.front().due <= now) {
      const Packet& p = queue.front();
      if (::write(fds[p.out].fd, p.bytes.data(), p.bytes.size()) == static_cast<ssize_t>(p.bytes.size())) {
        ++forwarded;
      } else {
        ++write_failed;  // the device is down (a partition) or its queue is full
      }
      queue.pop_front();
    }
  }
  std::printf("lossy_link: forwarded %llu, lost %llu (%.2f%%), over the queue limit %llu, unroutable %llu, "
              "write failed %llu\n",
              static_cast<unsigned long long>(forwarded), static_cast<unsigned long long>(lost),
              forwarded + lost ? 100.0 * lost / (forwarded + lost) : 0.0, static_cast<unsigned long long>(overflow),
              static_cast<unsigned long long>(unroutable), static_cast<unsigned long long>(write_failed));
  for (auto& p : fds) ::close(p.fd);
  return 0;
}
