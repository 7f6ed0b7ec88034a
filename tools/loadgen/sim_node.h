// One simulated node daemon of gradsync-loadgen: the calls runtime/daemon/coordinator_link.cc
// makes (RegisterNode, WatchEvents, a Heartbeat every lease/3, JoinJob, GetPeerTable), on
// gRPC's callback API so that thousands of nodes need no thread each. Every call has a
// deadline, as the daemon's have.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator.grpc.pb.h"

namespace gradsync::loadgen {

using Clock = std::chrono::steady_clock;

// Counters shared by every node of one run; all atomics, read by the main thread.
struct Totals {
  std::atomic<uint64_t> bytes_received{0};        // serialized responses and events
  std::atomic<uint64_t> table_bytes{0};           // GetPeerTable responses only
  std::atomic<uint64_t> table_calls{0};           // GetPeerTable calls (pages included)
  std::atomic<uint64_t> heartbeats{0};
  std::atomic<uint64_t> heartbeat_failures{0};    // any status but OK
  std::atomic<uint64_t> lost{0};                  // heartbeats answered NOT_FOUND
  std::atomic<uint64_t> register_retries{0};
  std::atomic<uint64_t> registered{0};
  std::atomic<uint64_t> joined{0};                // JoinJob answered OK
  std::atomic<uint64_t> tables{0};                // nodes holding their complete table
  std::atomic<uint64_t> failures{0};              // join or table calls that failed
  std::atomic<int64_t> in_flight{0};              // unary calls not yet answered
  std::string cluster_secret;  // what every call presents (the coordinator's --cluster-secret)
  std::mutex mu;
  std::string first_error;
  void error(const std::string& what);
  // Runs `fn` after `delay` on the run's timer thread: a callback of gRPC's must never sleep.
  std::function<void(std::chrono::milliseconds delay, std::function<void()> fn)> later;
};

// What one node saw on its event stream, for the failure fan-out figures.
struct SeenEvent {
  v1::Event::Kind kind = v1::Event::KIND_UNSPECIFIED;
  std::string job;
  Clock::time_point at{};
};

class SimNode {
 public:
  SimNode(uint32_t index, std::shared_ptr<v1::Coordinator::Stub> stub, Totals* totals);
  ~SimNode();

  // RegisterNode, retried after 500 ms (as the daemon does) until `deadline`; then opens the
  // event stream. `done` runs once, with true when registered.
  void start(Clock::time_point deadline, std::function<void(bool)> done);
  // One Heartbeat call (5 s deadline), unless the node is silenced.
  void heartbeat();
  // JoinJob for ranks [first, first + count) of a world of `world`; then GetPeerTable
  // (5 s deadline, pages followed). `done` runs once, with true when the table is held.
  void join(const std::string& job, uint32_t world, uint32_t first, uint32_t count,
            std::function<void(bool)> done);
  // AbortJob of the node's current generation of `job`.
  void abort(const std::string& job, std::function<void(bool)> done);
  void silence() { silent_ = true; }  // stop heartbeating: a node that died
  void stop();                         // cancel the event stream

  const std::string& node_id() const { return node_id_; }
  uint32_t index() const { return index_; }
  Clock::time_point last_heartbeat_ok() const;
  std::vector<SeenEvent> events() const;
  uint64_t generation() const { return generation_; }

 private:
  class Watcher;
  // What a daemon's calls carry (common/call_auth.h): the cluster secret, this node's id and
  // key once registered, and the job's token on job calls.
  void credentials(grpc::ClientContext& ctx, bool job_call = false) const;
  void fetch_table(const std::string& job, uint64_t generation, uint32_t page,
                   std::function<void(bool)> done);
  void watch();

  const uint32_t index_;
  const std::shared_ptr<v1::Coordinator::Stub> stub_;
  Totals* const totals_;
  std::string node_id_;
  std::string node_key_;
  std::atomic<bool> silent_{false};
  std::atomic<uint64_t> generation_{0};
  mutable std::mutex mu_;
  Clock::time_point last_ok_{};
  std::vector<SeenEvent> events_;
  Watcher* watcher_ = nullptr;  // owned by gRPC until its OnDone
};

}  // namespace gradsync::loadgen
