#include "coordinator/election.h"

#include "common/log.h"

namespace gradsync::coordinator {
namespace {
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;
}  // namespace

LeaderElection::LeaderElection(std::shared_ptr<EtcdClient> client, ElectionOptions options)
    : client_(std::move(client)), o_(std::move(options)) {}

LeaderElection::~LeaderElection() { stop(); }

void LeaderElection::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (keeper_.joinable() && keeper_.get_id() != std::this_thread::get_id()) keeper_.join();
}

bool LeaderElection::sleep_for(Millis d) {
  std::unique_lock lock(mu_);
  return !cv_.wait_for(lock, d, [&] { return stopping_; });
}

Fence LeaderElection::fence() const { return {o_.key, create_revision_}; }

// Renews the lease when a third of its TTL has passed; grants a new one when there is none or
// it expired (then *lost is set: anything held under the old one is gone).
Status LeaderElection::renew_or_grant(bool* lost) {
  *lost = false;
  const auto now = Clock::now();
  if (lease_ != 0 && now - renewed_ < Millis(granted_ttl_ * 1000 / 3)) return Status::Ok();
  if (lease_ != 0) {
    auto ttl = client_->keep_alive(lease_);
    if (!ttl.ok()) {
      if (now - renewed_ >= Millis(granted_ttl_ * 1000)) *lost = true;
      return ttl.status();
    }
    if (*ttl > 0) {
      renewed_ = now;
      return Status::Ok();
    }
    *lost = true;
    lease_ = 0;
  }
  auto granted = client_->grant(o_.ttl_seconds);
  if (!granted.ok()) return granted.status();
  lease_ = granted->first;
  granted_ttl_ = std::max<int64_t>(granted->second, 1);
  renewed_ = now;
  return Status::Ok();
}

Status LeaderElection::campaign(const std::function<void(const std::string&)>& on_leader) {
  auto log = log::get("coordinator");
  log::RateLimit errors;
  std::string seen = "\x01";  // nothing seen yet
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return {Code::kAborted, "election for " + o_.key + " stopped"};
    }
    bool lost = false;
    Status s = renew_or_grant(&lost);
    if (s.ok()) {
      etcdserverpb::TxnRequest txn;
      etcdserverpb::Compare* c = txn.add_compare();
      c->set_key(o_.key);
      c->set_target(etcdserverpb::Compare::CREATE);
      c->set_result(etcdserverpb::Compare::EQUAL);
      c->set_create_revision(0);
      auto* put = txn.add_success()->mutable_request_put();
      put->set_key(o_.key);
      put->set_value(o_.me);
      put->set_lease(lease_);
      txn.add_success()->mutable_request_range()->set_key(o_.key);
      txn.add_failure()->mutable_request_range()->set_key(o_.key);
      auto r = client_->txn(txn);
      if (r.ok()) {
        const etcdserverpb::RangeResponse* range = nullptr;
        for (const auto& op : r->responses()) {
          if (op.has_response_range()) range = &op.response_range();
        }
        const bool held = range && range->kvs_size() > 0;
        const std::string leader = held ? range->kvs(0).value() : "";
        if (r->succeeded() && held) {
          create_revision_ = range->kvs(0).create_revision();
          log->info("elected leader through etcd at {} (key {}, lease {:x}, ttl {} s)", client_->address(), o_.key,
                    lease_, granted_ttl_);
          if (on_leader) on_leader(o_.me);
          return Status::Ok();
        }
        if (leader != seen) {
          seen = leader;
          log->info("standing by: the leader is {} (etcd at {}, key {})", leader.empty() ? "none" : leader,
                    client_->address(), o_.key);
          if (on_leader) on_leader(leader);
        }
      } else {
        s = r.status();
      }
    }
    uint64_t held_back = 0;
    if (!s.ok() && errors.allow(&held_back)) log->warn("election: {}; retrying", s.message());
    if (!sleep_for(o_.poll)) return {Code::kAborted, "election for " + o_.key + " stopped"};
  }
}

void LeaderElection::hold(std::function<void(const std::string&)> on_lost) {
  keeper_ = std::thread([this, on_lost = std::move(on_lost)] {
    auto log = log::get("coordinator");
    const Millis period(std::max<int64_t>(granted_ttl_ * 1000 / 3, 100));
    while (sleep_for(period / 4)) {
      bool lost = false;
      Status s = renew_or_grant(&lost);
      if (lost || lease_ == 0) {
        const std::string why = "the leadership lease in etcd at " + client_->address() + " (key " + o_.key +
                                ") expired" + (s.ok() ? "" : ": " + s.message());
        on_lost(why);
        return;
      }
      if (!s.ok()) log->warn("renewing the leadership lease: {}", s.message());
    }
  });
}

void LeaderElection::resign() {
  stop();
  if (create_revision_ == 0 || lease_ == 0) return;
  // Revoking the lease deletes the key with it.
  if (Status s = client_->revoke(lease_); !s.ok()) {
    log::get("coordinator")->warn("resigning the leadership: {}", s.message());
  }
}

}  // namespace gradsync::coordinator
