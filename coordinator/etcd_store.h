// Store (coordinator/store.h) in etcd through its v3 API: record "jobs/x" is key
// "<prefix>/jobs/x". With a fence (the leader key and its create revision, from
// coordinator/election.h), every write is a Txn that runs only while that key is the one this
// coordinator created: a coordinator that lost its leadership cannot overwrite its successor.
#pragma once

#include <memory>
#include <string>

#include "coordinator/etcd_client.h"
#include "coordinator/store.h"

namespace gradsync::coordinator {

struct Fence {
  std::string key;               // the leader key
  int64_t create_revision = 0;   // 0: no fence
};

class EtcdStore final : public Store {
 public:
  EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix, Fence fence = {});
  std::string describe() const override;
  Status put(const std::string& key, const std::string& value) override;
  Status remove(const std::string& key) override;
  Result<Records> load() override;

 private:
  std::string full(const std::string& key) const { return prefix_ + "/" + key; }
  Status fenced(etcdserverpb::RequestOp op, const std::string& what);

  const std::shared_ptr<EtcdClient> client_;
  const std::string prefix_;
  const Fence fence_;
};

}  // namespace gradsync::coordinator
