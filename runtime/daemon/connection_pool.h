// The threads that serve one listener's connections (gradsyncd's trainer socket, its data
// port): at most `limit` of them exist at any time, counting each from its creation until it
// was joined. A thread that served a connection waits up to `linger` for the next one, then
// ends, and is joined by the next submit() or by stop().
//
// Why joined and not merely counted: a detached thread that lowers a counter on its way out
// still exists (in /proc/PID/status, with its stack) until its teardown ends. Under a flood of
// short connections such ending threads piled up beyond the limit, more so under ASan, whose
// thread teardown is slow (ConnectionFlood saw 109 threads where the limit allowed 93).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "common/fd.h"

namespace gradsync {

class ConnectionPool {
 public:
  using Serve = std::function<void(Fd)>;

  ConnectionPool(size_t limit, Serve serve, std::chrono::milliseconds linger);
  // stop() with no wait, where it was not called.
  ~ConnectionPool();
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  // Serves `sock` on an idle thread, or on a new one while fewer than `limit` exist. False
  // (and `sock` closed) when `limit` threads are serving, after stop(), or when no thread
  // could be started. One thread calls submit() (the listener's acceptor).
  bool submit(Fd sock);

  // Threads that exist now: serving, idle, or ended and not joined yet. Never above `limit`.
  size_t threads() const;

  // Refuses further connections, ends the idle threads and waits until `deadline` for the
  // serving ones to return; joins every thread that ended. Returns how many were still
  // serving: those are left detached (they keep only the pool's shared state alive).
  size_t stop(Deadline deadline);

 private:
  struct State;
  static void run(const std::shared_ptr<State>& st, Fd first);
  void join_ended();  // under st_->mu

  const size_t limit_;
  std::shared_ptr<State> st_;
  std::map<std::thread::id, std::thread> threads_;  // guarded by st_->mu
};

}  // namespace gradsync
