// A small client of etcd's v3 gRPC API (proto/etcd/rpc.proto) for the coordinator's store and
// leader election: KV Range/Put/DeleteRange/Txn and Lease Grant/KeepAlive/Revoke. Every call
// has a deadline; a failure names etcd's address, the call and the likely cause. Plaintext
// gRPC: etcd is reached on loopback or a trusted network (client TLS to etcd is not built).
// Thread-safe (gRPC stubs are).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "etcd/rpc.grpc.pb.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

// "etcd://HOST:PORT[/PREFIX]" -> address "HOST:PORT" and key prefix ("/gradsync" by default;
// no trailing slash).
struct EtcdUrl {
  std::string address;
  std::string prefix;
  static Result<EtcdUrl> parse(const std::string& url);
};

// The first key after every key that starts with `prefix` (etcd's range_end of a prefix).
std::string prefix_end(const std::string& prefix);

class EtcdClient {
 public:
  using Millis = std::chrono::milliseconds;
  explicit EtcdClient(std::string address, Millis call_timeout = Millis(3000));

  const std::string& address() const { return address_; }

  // Every key under `prefix` with its value, in key order (one Range; fine below etcd's
  // request limit of about 1.5 MiB a value).
  Result<std::vector<std::pair<std::string, std::string>>> range_prefix(const std::string& prefix);
  // The key, or nullopt when it does not exist.
  Result<std::optional<mvccpb::KeyValue>> get(const std::string& key);
  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status remove(const std::string& key);
  Status remove_prefix(const std::string& prefix);
  Result<etcdserverpb::TxnResponse> txn(const etcdserverpb::TxnRequest& request);

  // A lease of `ttl_seconds` (etcd may raise it to its minimum): its id and granted TTL.
  Result<std::pair<int64_t, int64_t>> grant(int64_t ttl_seconds);
  // Renews a lease once (one short LeaseKeepAlive stream). Returns its remaining TTL in
  // seconds; 0 when the lease no longer exists.
  Result<int64_t> keep_alive(int64_t lease);
  Status revoke(int64_t lease);

 private:
  Status check(const grpc::Status& s, const std::string& what) const;
  void set_deadline(grpc::ClientContext& ctx) const;

  const std::string address_;
  const Millis timeout_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease_;
};

}  // namespace gradsync::coordinator
