#include "daemon/connection_pool.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <utility>
#include <vector>

namespace gradsync {

// What the pool's threads share with it. A thread left serving after stop() keeps it alive.
struct ConnectionPool::State {
  Serve serve;
  std::chrono::milliseconds linger;
  std::mutex mu;
  std::condition_variable cv;           // threads: a connection or stop; stop(): a thread ended
  std::deque<Fd> pending;               // handed to idle threads; never more than `idle`
  size_t idle = 0;                      // threads waiting for a connection
  bool stopping = false;
  std::vector<std::thread::id> ended;   // returned from run(), not joined yet
};

ConnectionPool::ConnectionPool(size_t limit, Serve serve, std::chrono::milliseconds linger)
    : limit_(limit), st_(std::make_shared<State>()) {
  st_->serve = std::move(serve);
  st_->linger = linger;
}

ConnectionPool::~ConnectionPool() { stop(Clock::now()); }

void ConnectionPool::run(const std::shared_ptr<State>& st, Fd first) {
  Fd sock = std::move(first);
  for (;;) {
    st->serve(std::move(sock));
    std::unique_lock lock(st->mu);
    ++st->idle;
    st->cv.wait_for(lock, st->linger, [&] { return st->stopping || !st->pending.empty(); });
    --st->idle;
    if (st->pending.empty()) {  // lingered long enough, or the pool stops: this thread ends
      st->ended.push_back(std::this_thread::get_id());
      st->cv.notify_all();
      return;
    }
    sock = std::move(st->pending.front());
    st->pending.pop_front();
  }
}

void ConnectionPool::join_ended() {
  // An ended thread pushed its id under the lock and takes it no more: joining here waits only
  // for its teardown.
  for (const auto& id : st_->ended) {
    auto it = threads_.find(id);
    if (it == threads_.end()) continue;  // left detached by stop()
    it->second.join();
    threads_.erase(it);
  }
  st_->ended.clear();
}

bool ConnectionPool::submit(Fd sock) {
  std::lock_guard lock(st_->mu);
  join_ended();
  if (st_->stopping) return false;
  if (st_->idle > st_->pending.size()) {
    st_->pending.push_back(std::move(sock));
    st_->cv.notify_one();
    return true;
  }
  if (threads_.size() >= limit_) return false;
  try {
    // The new thread needs the lock to report its end, so it is in threads_ before that.
    std::thread t(run, st_, std::move(sock));
    const auto id = t.get_id();
    threads_.emplace(id, std::move(t));
  } catch (const std::system_error&) {
    return false;  // no thread to be had (EAGAIN): refused like a connection over the limit
  }
  return true;
}

size_t ConnectionPool::threads() const {
  std::lock_guard lock(st_->mu);
  return threads_.size();
}

size_t ConnectionPool::stop(Deadline deadline) {
  std::unique_lock lock(st_->mu);
  st_->stopping = true;
  st_->pending.clear();  // closes connections no thread took yet
  st_->cv.notify_all();
  st_->cv.wait_until(lock, deadline, [&] { return st_->ended.size() >= threads_.size(); });
  join_ended();
  const size_t left = threads_.size();
  for (auto& [id, t] : threads_) t.detach();
  threads_.clear();
  return left;
}

}  // namespace gradsync
