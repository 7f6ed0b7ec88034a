// gradsyncd's side of the coordinator: registration, the event stream that carries the
// node's heartbeats (daemon/event_stream.h), and the per-node job calls. Every call has a
// deadline; an unreachable coordinator is an error naming its address, never a hang.
//
// Several coordinators ("a:29500,b:29500", elected through etcd: coordinator/election.h): the
// link talks to one at a time. A call answered UNAVAILABLE (a dead coordinator, or a standby,
// whose answer names the leader) moves the link to the named leader, else to the next address,
// and is retried within its deadline. The node keeps its id and key: the new leader loaded
// them from the store, so the daemon is not a new node and its jobs go on.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/call_auth.h"
#include "common/fd.h"
#include "common/log.h"
#include "coordinator.grpc.pb.h"
#include "daemon/event_stream.h"
#include "gradsync/status.h"

namespace gradsync {

class CoordinatorLink {
 public:
  using EventHandler = std::function<void(const v1::Event&)>;

  // `credentials`: how to reach the coordinator (common/grpc_security.h); `auth`: what every
  // call presents (common/call_auth.h), given this node's key once it registered.
  CoordinatorLink(std::string address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                  std::shared_ptr<CallAuth> auth, v1::NodeInfo node, EventHandler on_event);
  ~CoordinatorLink();

  // Registers (retrying until `timeout`), then keeps the event stream open and heartbeats on
  // it every lease/3 (two threads), re-registering if the coordinator forgot this node.
  Status start(std::chrono::milliseconds timeout);
  // Called (on the event-stream thread, before re-registering) when the coordinator no longer
  // knows this node: its lease expired (the daemon was paused or cut off) or it restarted
  // without a store. `cause` says which, as far as the stream and heartbeats tell (forgotten_cause).
  // Set before start().
  using ForgottenHandler = std::function<void(const std::string& node_id, const std::string& cause)>;
  void set_on_forgotten(ForgottenHandler fn) { on_forgotten_ = std::move(fn); }
  // Called (on the heartbeat thread: as the outage passes the lease, then every lease/3) while
  // no coordinator has been reachable for longer than the lease: `outage` since the connection
  // was last known to work, `why` the last failure seen (e.g. "Connection timed out", a ping
  // left unanswered; "Network is unreachable"). The coordinator has given
  // the node up by then, unless it is only down or changing leaders: the handler tells the
  // two apart (Daemon::coordinator_unreachable). Set before start().
  using UnreachableHandler =
      std::function<void(std::chrono::milliseconds outage, const std::string& address, const std::string& why)>;
  void set_on_unreachable(UnreachableHandler fn) { on_unreachable_ = std::move(fn); }
  void stop();

  std::string node_id() const;
  // The coordinator the link talks to now.
  std::string address() const;

  Result<v1::JoinJobResponse> join(v1::JoinJobRequest req, std::chrono::milliseconds timeout);
  // What this node needs of the job (see PeerTableRequest), every page of it, retrying a
  // busy coordinator with jittered backoff for up to a minute.
  Result<v1::PeerTableResponse> peer_table(const std::string& job, uint64_t generation);
  // A bound on the pages a coordinator may announce: 1 << 20 ranks at 4096 a page.
  static constexpr uint32_t kMaxTablePages = 256;
  Status leave(const std::string& job, uint64_t generation);
  Status report_path(const std::string& job, uint64_t generation, const v1::RankPath& path);
  // The answer to a TRACE_REQUESTED event (node_id is filled in here). Runs on the event
  // stream's thread, so its deadline is short: gradsyncctl trace waits only a few seconds.
  Status report_trace(v1::ReportTraceRequest req);
  Status abort(const std::string& job, uint64_t generation, int failed_rank,
               const std::string& reason);
  // Elastic membership of one rank (RegroupRequest): blocks until the coordinator decided.
  Result<v1::RegroupResponse> regroup(v1::RegroupRequest req);

 private:
  Status register_node();
  void heartbeat_loop();
  void watch_loop();
  // Opens one event stream and handles its events on this thread until it ends; its status.
  grpc::Status watch_once(v1::Coordinator::Stub& stub);
  Status from_grpc(const grpc::Status& s, const std::string& what, const std::string& address) const;
  struct Target {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;  // its connectivity state tells reachability
    std::unique_ptr<v1::Coordinator::Stub> stub;
  };
  // A stream ended with `s` at `now` (under mu_): notes the start of an outage if none is noted.
  void note_outage(const grpc::Status& s, Clock::time_point now);
  // On the heartbeat thread, under `lock`: ends a noted outage once the current coordinator's
  // channel is connected again, else calls on_unreachable_ (without the lock) past the lease.
  void check_reachable(std::unique_lock<std::mutex>& lock);
  // The current coordinator: its index and stub (stubs live as long as the link).
  std::pair<size_t, v1::Coordinator::Stub*> current() const;
  // Call `index` answered UNAVAILABLE with `s`: move to the leader it names, else the next one.
  void fail_over(size_t index, const grpc::Status& s);
  // One unary call, `call(stub)` (which sets its own context and deadline), retried on
  // UNAVAILABLE against the other coordinators until `deadline`; with one coordinator, against
  // it for up to a second (a channel that has not reconnected yet to a coordinator just back).
  grpc::Status with_failover(const std::function<grpc::Status(v1::Coordinator::Stub&)>& call, Deadline deadline,
                             std::string* address);

  Status job_call(const std::string& job, const std::string& what,
                  const std::function<grpc::Status(v1::Coordinator::Stub&, grpc::ClientContext&)>& call);

  const std::string addresses_;  // as given, for messages
  v1::NodeInfo node_;  // set once in the constructor
  const EventHandler on_event_;
  const std::shared_ptr<CallAuth> auth_;
  ForgottenHandler on_forgotten_;
  UnreachableHandler on_unreachable_;
  std::vector<Target> targets_;  // fixed after the constructor
  size_t current_ = 0;           // guarded by mu_
  log::RateLimit failover_logs_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string node_id_;
  uint64_t registrations_ = 0;  // RegisterNode calls that succeeded (cv_ is notified)
  // The retry hint of the last RegisterNode (common/call_auth.h: a busy coordinator's); 0: none.
  std::atomic<std::chrono::milliseconds> register_hint_{std::chrono::milliseconds{0}};
  uint32_t lease_ms_ = 5000;
  bool stopping_ = false;
  // The open event stream (heartbeats go on it), its events not yet handled, and its end.
  std::shared_ptr<EventStream> stream_;
  // For forgotten_cause: when the coordinator was last known to have this node's heartbeats,
  // when the heartbeat thread last ran and its longest gap since (a paused daemon), and the
  // streams that failed since (with a refused connection: nobody listened).
  std::chrono::steady_clock::time_point last_known_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point heartbeat_ran_ = std::chrono::steady_clock::now();
  std::chrono::milliseconds longest_gap_{0};
  int failed_ = 0, refused_ = 0;
  std::chrono::steady_clock::time_point stream_sent_{}, stream_stuck_{};  // of the last stream (watch_once)
  // Since when no coordinator has been reachable (the connection's last sign of life); {}
  // while one is, and why the last stream ended.
  std::chrono::steady_clock::time_point unreachable_since_{};
  std::chrono::steady_clock::time_point outage_due_{};  // when that passes the lease; {} once checked
  std::string unreachable_why_;
  std::deque<v1::Event> events_;
  bool stream_over_ = false;
  grpc::Status stream_status_;
  std::thread heartbeat_;
  std::thread watcher_;
};

}  // namespace gradsync
