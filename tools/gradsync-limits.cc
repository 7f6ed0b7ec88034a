// gradsync-limits: the physical limits that bound the host path on this machine, measured
// the way the data moves in gradsync, for docs/benchmarks.md:
//   memcpy        one thread, and one thread per core at once (ranks copy into slots)
//   tcp loopback  one stream, 1 MiB writes (the proxy's slot size), sender and receiver threads
//   futex wake    round trip between two threads that sleep on a shared futex (a slot hand-off
//                 when the peer has gone to sleep)
//
//   gradsync-limits [--bytes N]
#include <arpa/inet.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// GB/s of bytes copied (read + write counts once, as busbw does).
double memcpy_gbs(size_t bytes, int threads) {
  std::vector<std::vector<char>> src(threads, std::vector<char>(bytes, 1)), dst(threads, std::vector<char>(bytes, 0));
  constexpr int kReps = 8;
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (int r = 0; r < kReps; ++r) std::memcpy(dst[t].data(), src[t].data(), bytes);
    });
  }
  for (auto& t : ts) t.join();
  return double(bytes) * kReps * threads / seconds_since(t0) / 1e9;
}

double tcp_loopback_gbs(size_t total) {
  int lst = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(lst, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(lst, 1) != 0) return 0;
  getsockname(lst, reinterpret_cast<sockaddr*>(&a), &len);
  constexpr size_t kChunk = 1 << 20;  // the proxy's slot size
  double gbs = 0;
  std::thread rx([&] {
    int s = accept(lst, nullptr, nullptr);
    std::vector<char> buf(kChunk);
    size_t got = 0;
    auto t0 = Clock::now();
    while (got < total) {
      ssize_t n = recv(s, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      got += size_t(n);
    }
    gbs = double(got) / seconds_since(t0) / 1e9;
    close(s);
  });
  int s = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    std::vector<char> buf(kChunk, 7);
    for (size_t sent = 0; sent < total;) {
      ssize_t n = send(s, buf.data(), std::min(kChunk, total - sent), 0);
      if (n <= 0) break;
      sent += size_t(n);
    }
  }
  close(s);
  rx.join();
  close(lst);
  return gbs;
}

long futex(std::atomic<uint32_t>* w, int op, uint32_t v) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), op, v, nullptr, nullptr, 0);
}

// Microseconds per one-way hand-off when the receiver is asleep on a futex.
double futex_handoff_us(int rounds) {
  std::atomic<uint32_t> word{0};
  std::thread peer([&] {
    for (uint32_t i = 1; i <= uint32_t(2 * rounds); i += 2) {
      while (word.load() < i) futex(&word, FUTEX_WAIT, i - 1);
      word.store(i + 1);
      futex(&word, FUTEX_WAKE, 1);
    }
  });
  auto t0 = Clock::now();
  for (uint32_t i = 0; i < uint32_t(2 * rounds); i += 2) {
    word.store(i + 1);
    futex(&word, FUTEX_WAKE, 1);
    while (word.load() < i + 2) futex(&word, FUTEX_WAIT, i + 1);
  }
  double us = seconds_since(t0) * 1e6 / (2.0 * rounds);
  peer.join();
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = 64u << 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--bytes") bytes = std::strtoull(argv[i + 1], nullptr, 10);
  }
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf("# gradsync-limits: %u cpus, buffers of %zu bytes\n", cores, bytes);
  std::printf("memcpy, 1 thread:          %6.2f GB/s\n", memcpy_gbs(bytes, 1));
  std::printf("memcpy, %u threads at once: %6.2f GB/s in total\n", cores, memcpy_gbs(bytes, int(cores)));
  std::printf("tcp loopback, 1 stream:    %6.2f GB/s\n", tcp_loopback_gbs(size_t(4) << 30));
  std::printf("futex hand-off (asleep):   %6.1f us one way\n", futex_handoff_us(20000));
  return 0;
}
