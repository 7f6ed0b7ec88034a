#include "coordinator/store_writer.h"

#include <algorithm>

#include "common/log.h"

namespace gradsync::coordinator {

StoreWriter::StoreWriter(std::shared_ptr<Store> store) : store_(std::move(store)) {
  thread_ = std::thread([this] { run(); });
}

StoreWriter::~StoreWriter() {
  (void)flush(std::chrono::seconds(1));
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StoreWriter::put(const std::string& key, std::string value) {
  std::lock_guard lock(mu_);
  queued_[key] = std::move(value);
  ++queued_seq_;
  cv_.notify_all();
}

void StoreWriter::remove(const std::string& key) {
  std::lock_guard lock(mu_);
  queued_[key] = std::nullopt;
  ++queued_seq_;
  cv_.notify_all();
}

bool StoreWriter::flush(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const uint64_t target = queued_seq_;
  return cv_.wait_for(lock, timeout, [&] { return written_seq_ >= target || stopping_; }) && written_seq_ >= target;
}

void StoreWriter::run() {
  auto log = log::get("coordinator");
  log::RateLimit errors;
  std::chrono::milliseconds pause{100};
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queued_.empty(); });
    if (stopping_) return;
    const uint64_t seq = queued_seq_;
    auto batch = std::exchange(queued_, {});
    lock.unlock();
    Status failed;
    for (auto it = batch.begin(); it != batch.end();) {
      Status s = it->second ? store_->put(it->first, *it->second) : store_->remove(it->first);
      if (!s.ok()) {
        failed = s;
        break;
      }
      it = batch.erase(it);
    }
    lock.lock();
    if (failed.ok()) {
      written_seq_ = seq;
      pause = std::chrono::milliseconds(100);
      cv_.notify_all();
      continue;
    }
    for (auto& [key, value] : batch) queued_.try_emplace(key, std::move(value));  // newer ones win
    uint64_t held_back = 0;
    if (errors.allow(&held_back)) {
      log->error("cannot write the coordinator's state to {}: {}; retrying in {} ms", store_->describe(),
                 failed.message(), pause.count());
    }
    cv_.wait_for(lock, pause, [&] { return stopping_; });
    pause = std::min(pause * 2, std::chrono::milliseconds(2000));
  }
}

}  // namespace gradsync::coordinator
