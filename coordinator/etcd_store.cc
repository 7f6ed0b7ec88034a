#include "coordinator/etcd_store.h"

namespace gradsync::coordinator {

EtcdStore::EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix, Fence fence)
    : client_(std::move(client)), prefix_(std::move(prefix)), fence_(std::move(fence)) {}

std::string EtcdStore::describe() const { return "etcd at " + client_->address() + " under " + prefix_; }

Status EtcdStore::fenced(etcdserverpb::RequestOp op, const std::string& what) {
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* c = txn.add_compare();
  c->set_key(fence_.key);
  c->set_target(etcdserverpb::Compare::CREATE);
  c->set_result(etcdserverpb::Compare::EQUAL);
  c->set_create_revision(fence_.create_revision);
  *txn.add_success() = std::move(op);
  auto r = client_->txn(txn);
  if (!r.ok()) return r.status();
  if (!r->succeeded()) {
    return {Code::kFailedPrecondition, "etcd at " + client_->address() + ": " + what +
                                           " refused: this coordinator no longer holds the leader key " +
                                           fence_.key + " (its lease expired; another coordinator leads)"};
  }
  return Status::Ok();
}

Status EtcdStore::put(const std::string& key, const std::string& value) {
  if (fence_.create_revision == 0) return client_->put(full(key), value);
  etcdserverpb::RequestOp op;
  op.mutable_request_put()->set_key(full(key));
  op.mutable_request_put()->set_value(value);
  return fenced(std::move(op), "Put " + full(key));
}

Status EtcdStore::remove(const std::string& key) {
  if (fence_.create_revision == 0) return client_->remove(full(key));
  etcdserverpb::RequestOp op;
  op.mutable_request_delete_range()->set_key(full(key));
  return fenced(std::move(op), "DeleteRange " + full(key));
}

Result<Store::Records> EtcdStore::load() {
  auto r = client_->range_prefix(prefix_ + "/");
  if (!r.ok()) return r.status();
  Records out;
  out.reserve(r->size());
  const size_t skip = prefix_.size() + 1;
  for (auto& [key, value] : *r) out.emplace_back(key.substr(skip), std::move(value));
  return out;
}

}  // namespace gradsync::coordinator
