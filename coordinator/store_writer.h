// Writes the coordinator's records to its Store (coordinator/store.h) from a thread of its
// own, so that the service's mutex is never held across a call to etcd: a slow or absent etcd
// delays the records, not the coordinator's answers. Per key the latest record wins; a failed
// write is retried (100 ms, doubling to 2 s) and logged at most once a second, naming the store.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "coordinator/store.h"

namespace gradsync::coordinator {

class StoreWriter {
 public:
  explicit StoreWriter(std::shared_ptr<Store> store);
  ~StoreWriter();  // writes what is queued for up to a second, then stops

  void put(const std::string& key, std::string value);
  void remove(const std::string& key);
  // Blocks until every record queued before the call is written, or `timeout` passes (false).
  bool flush(std::chrono::milliseconds timeout);
  Store& store() { return *store_; }

 private:
  void run();

  const std::shared_ptr<Store> store_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::optional<std::string>> queued_;  // nullopt: remove
  uint64_t queued_seq_ = 0, written_seq_ = 0;  // every queued record up to written_seq_ is written
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace gradsync::coordinator
