// One simulated node daemon of gradsync-loadgen: the calls runtime/daemon/coordinator_link.cc
// makes (RegisterNode, the event stream with a heartbeat on it every lease/3 through the
// daemon's own daemon/event_stream.h, JoinJob, GetPeerTable), on gRPC's callback API (the
// streams on the asynchronous API over Totals::streams) so that thousands of nodes need no
// thread each. Every unary call has a deadline, as the daemon's have.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator.grpc.pb.h"
#include "daemon/event_stream.h"

namespace gradsync::loadgen {

using Clock = std::chrono::steady_clock;

// Counters shared by every node of one run; all atomics, read by the main thread.
struct Totals {
  std::atomic<uint64_t> bytes_received{0};        // serialized responses and events
  std::atomic<uint64_t> table_bytes{0};           // GetPeerTable responses only
  std::atomic<uint64_t> table_calls{0};           // GetPeerTable calls (pages included)
  std::atomic<uint64_t> heartbeats{0};            // sent on the event streams
  std::atomic<uint64_t> heartbeat_failures{0};    // not sent: the previous one pending, or no stream
  std::atomic<uint64_t> heartbeats_busy{0};       // of those: the previous one still pending
  std::atomic<uint64_t> lost{0};                  // event streams ended NOT_FOUND (node dropped)
  std::atomic<uint64_t> register_retries{0};
  std::atomic<uint64_t> register_refused{0};      // of those: refused busy (RESOURCE_EXHAUSTED)
  std::atomic<uint64_t> registered{0};
  std::atomic<uint64_t> joined{0};                // JoinJob answered OK
  std::atomic<uint64_t> tables{0};                // nodes holding their complete table
  std::atomic<uint64_t> failures{0};              // join or table calls that failed
  std::atomic<int64_t> in_flight{0};              // unary calls not yet answered
  std::string cluster_secret;  // what every call presents (the coordinator's --cluster-secret)
  StreamQueues* streams = nullptr;  // the completion queues the event streams are spread over
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
  // One heartbeat on the event stream, unless the node is silenced.
  void heartbeat();
  // JoinJob for ranks [first, first + count) of a world of `world`; then GetPeerTable
  // (the daemon's 20 s deadline per page, pages followed). `done` runs once, with true when the table is held.
  void join(const std::string& job, uint32_t world, uint32_t first, uint32_t count,
            std::function<void(bool)> done);
  // AbortJob of the node's current generation of `job`.
  void abort(const std::string& job, std::function<void(bool)> done);
  // Stop heartbeating, the stream left open: a daemon that hangs (SIGSTOP) or whose
  // connection stopped carrying anything.
  void silence() { silent_ = true; }
  void stop();  // cancels the event stream and waits (10 s at most) until it ended

  const std::string& node_id() const { return node_id_; }
  uint32_t index() const { return index_; }
  // When the last heartbeat (or the stream's naming message) was handed to the connection.
  Clock::time_point last_heartbeat_ok() const;
  std::vector<SeenEvent> events() const;
  uint64_t generation() const { return generation_; }

 private:
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
  Clock::time_point registered_at_{};
  std::vector<SeenEvent> events_;
  std::shared_ptr<EventStream> stream_;
  bool stream_over_ = false;
  std::condition_variable stream_cv_;  // stream_over_
};

}  // namespace gradsync::loadgen
