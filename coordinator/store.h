// The coordinator's durable state, apart from the job table: one record per registered node
// (its info, id and key), one per job (its current generation, v1::StoredJob) and a counter
// record, under keys "nodes/<id>", "jobs/<id>" and "meta". A coordinator started on a store
// that holds records serves those nodes and jobs: describe, abort and leave of a running job
// work across a restart, and a daemon keeps its node id.
//
// Without --store the coordinator keeps its state in memory only and writes no records (the
// standalone default, unchanged). MemoryStore is the interface's reference (tests restore a
// table from it); EtcdStore (etcd_store.h) keeps the records in etcd.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/status.h"

namespace gradsync::coordinator {

class Store {
 public:
  using Records = std::vector<std::pair<std::string, std::string>>;  // key -> serialized record
  virtual ~Store() = default;
  // For logs and errors: "memory", "etcd at 10.0.0.5:2379 under /gradsync".
  virtual std::string describe() const = 0;
  // One record written or removed, atomically. A store shared by elected coordinators refuses
  // writes once this process is no longer the leader (kFailedPrecondition).
  virtual Status put(const std::string& key, const std::string& value) = 0;
  virtual Status remove(const std::string& key) = 0;
  // Every record, in key order.
  virtual Result<Records> load() = 0;
};

class MemoryStore final : public Store {
 public:
  std::string describe() const override { return "memory"; }
  Status put(const std::string& key, const std::string& value) override {
    std::lock_guard lock(mu_);
    records_[key] = value;
    return Status::Ok();
  }
  Status remove(const std::string& key) override {
    std::lock_guard lock(mu_);
    records_.erase(key);
    return Status::Ok();
  }
  Result<Records> load() override {
    std::lock_guard lock(mu_);
    return Records(records_.begin(), records_.end());
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> records_;
};

}  // namespace gradsync::coordinator
