// Leader election among coordinators through etcd: the leader is whoever holds the leader key
// ("<prefix>/election/leader", value: the coordinator's address as daemons reach it), created
// in a Txn only if it does not exist (create_revision == 0) and attached to the candidate's
// etcd lease. The leader renews the lease every third of its TTL; when it dies the lease
// expires, etcd deletes the key, and a standby's next attempt (every `poll`) creates it.
// A takeover therefore comes at most one TTL plus one poll after the leader's last renewal.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "coordinator/etcd_client.h"
#include "coordinator/etcd_store.h"
#include "gradsync/status.h"

namespace gradsync::coordinator {

struct ElectionOptions {
  std::string key;            // the leader key
  std::string me;             // this coordinator's address (HOST:PORT), the key's value
  int64_t ttl_seconds = 2;    // of the lease; etcd 3.4 raises values below its minimum (~2 s)
  std::chrono::milliseconds poll{200};  // a standby's attempt period
};

class LeaderElection {
 public:
  LeaderElection(std::shared_ptr<EtcdClient> client, ElectionOptions options);
  ~LeaderElection();  // stop(); the lease is left to expire unless resign() was called

  // Blocks until this coordinator holds the leader key (Ok) or stop() is called (kAborted).
  // `on_leader(address)` is called whenever the leader seen changes ("" when none). etcd errors
  // are retried and logged (at most once a second).
  Status campaign(const std::function<void(const std::string&)>& on_leader);
  // The leader key as this coordinator created it: its store's writes are fenced by it.
  Fence fence() const;
  // After campaign(): renews the lease in a thread; `on_lost(why)` is called once (from that
  // thread) if the lease is gone or cannot be renewed before it expires.
  void hold(std::function<void(const std::string&)> on_lost);
  // Deletes the key and revokes the lease: a standby takes over at its next poll.
  void resign();
  void stop();

 private:
  Status renew_or_grant(bool* lost);
  bool sleep_for(std::chrono::milliseconds d);  // false when stopped

  const std::shared_ptr<EtcdClient> client_;
  const ElectionOptions o_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  int64_t lease_ = 0;
  int64_t granted_ttl_ = 0;
  std::chrono::steady_clock::time_point renewed_{};
  int64_t create_revision_ = 0;
  std::thread keeper_;
};

}  // namespace gradsync::coordinator
