// gradsyncd's connection threads (daemon/connection_pool.h): at most `limit` threads exist,
// counted until joined, so the process's thread count stays within the limit while connections
// come and go as fast as one thread can hand them over; over the limit a connection is refused;
// idle threads are reused; stop() reports the threads that would not end.
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "daemon/connection_pool.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;

// "Threads:" of /proc/self/status.
long process_threads() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stol(line.substr(8));
  }
  return -1;
}

// A connection: one end of a socket pair (the other is closed at once).
Fd connection() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return Fd();
  ::close(sv[1]);
  return Fd(sv[0]);
}

// Holds every serve() until open().
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool opened = false;
  int inside = 0;
  void pass() {
    std::unique_lock lock(mu);
    ++inside;
    cv.notify_all();
    cv.wait(lock, [&] { return opened; });
  }
  bool wait_inside(int n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 10s, [&] { return inside >= n; });
  }
  void open() {
    std::lock_guard lock(mu);
    opened = true;
    cv.notify_all();
  }
};

TEST(ConnectionPool, RefusesOverTheLimitAndReusesIdleThreads) {
  auto gate = std::make_shared<Gate>();
  std::atomic<int> served{0};
  ConnectionPool pool(3, [gate, &served](Fd) { gate->pass(); ++served; }, 10s);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(pool.submit(connection()));
  ASSERT_TRUE(gate->wait_inside(3));
  EXPECT_FALSE(pool.submit(connection())) << "a fourth connection was served with a limit of 3";
  EXPECT_EQ(pool.threads(), 3u);
  gate->open();
  // The three threads go idle and take the next connections: no new thread.
  for (int i = 0; i < 100; ++i) {
    while (!pool.submit(connection())) std::this_thread::sleep_for(1ms);
    EXPECT_LE(pool.threads(), 3u);
  }
  // stop() closes connections handed over but not yet taken: wait for the last to be served.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (served.load() < 103 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(served.load(), 103);
  EXPECT_EQ(pool.stop(deadline_after(10s)), 0u);
  EXPECT_EQ(pool.threads(), 0u);
  EXPECT_FALSE(pool.submit(connection())) << "served after stop()";
}

// Threads that end at once (no linger) after each connection: every one is joined before
// another may start, so the process never holds more than the limit. The old detached threads
// were counted out before their teardown ended, and piled up past the limit under ASan.
TEST(ConnectionPool, ProcessThreadsStayWithinTheLimitUnderChurn) {
  constexpr size_t kLimit = 4;
  const long before = process_threads();
  ConnectionPool pool(kLimit, [](Fd) {}, 0ms);
  long peak = before;
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    // Refused while all four are still busy: tried again, as a client would.
    while (!pool.submit(connection())) {
      ++refused;
      peak = std::max(peak, process_threads());
    }
    ASSERT_LE(pool.threads(), kLimit);
    peak = std::max(peak, process_threads());
  }
  EXPECT_EQ(pool.stop(deadline_after(10s)), 0u);
  std::printf("[pool] 2000 connections served, %d refused at the limit; threads before %ld, peak %ld\n", refused, before,
              peak);
  // One more than the limit: the kernel counts a joined thread until its exit is reaped, a
  // moment after pthread_join returned.
  EXPECT_LE(peak, before + long(kLimit) + 1);
}

TEST(ConnectionPool, StopReportsThreadsThatWouldNotEnd) {
  auto gate = std::make_shared<Gate>();
  auto pool = std::make_unique<ConnectionPool>(2, [gate](Fd) { gate->pass(); }, 10s);
  ASSERT_TRUE(pool->submit(connection()));
  ASSERT_TRUE(gate->wait_inside(1));
  EXPECT_EQ(pool->stop(deadline_after(100ms)), 1u);
  pool.reset();  // the stuck thread keeps only the pool's shared state (and `gate`)
  gate->open();
  // It ends on its own; nothing here may touch the destroyed pool (ASan would say so).
  std::this_thread::sleep_for(100ms);
}

}  // namespace
}  // namespace gradsync
