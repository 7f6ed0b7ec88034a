// A node's WatchEvents stream as gradsyncd keeps it (and gradsync-loadgen's simulated nodes):
// events from the coordinator one way, the node's heartbeats the other. The first message
// names the node; heartbeat() sends one more, which renews the node's lease at the
// coordinator. Each carries when it was sent (this process's monotonic clock), from which the
// coordinator tells how far its own reads are behind (coordinator/leases.h). An idle node so costs the coordinator one small message on an open stream per
// lease/3, not a unary call (docs/benchmarks.md "The coordinator at scale").
//
// On gRPC's callback API: no thread of its own. Callbacks run on gRPC's threads and must not
// block. Writes never block either: a heartbeat due while the previous one is still being
// written is not sent, and `pending_since()` tells how long the stream has been stuck.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "coordinator.grpc.pb.h"

namespace gradsync {

class EventStream final : public grpc::ClientBidiReactor<v1::WatchRequest, v1::Event>,
                          public std::enable_shared_from_this<EventStream> {
 public:
  using Clock = std::chrono::steady_clock;
  using EventFn = std::function<void(const v1::Event&)>;
  using DoneFn = std::function<void(const grpc::Status&)>;

  // Opens the stream of node `node_id`. `prepare` adds the call's metadata (credentials) to its
  // context; `on_event` runs for every event, `on_done` once with the stream's status. The
  // stream stays alive until on_done has returned, however its owner drops it.
  static std::shared_ptr<EventStream> open(v1::Coordinator::Stub& stub, const std::string& node_id,
                                           const std::function<void(grpc::ClientContext&)>& prepare,
                                           EventFn on_event, DoneFn on_done);

  enum class Sent { kSent, kBusy, kOver };
  // One heartbeat: kBusy when the previous message is still being written (not sent: the
  // coordinator reads every message, so this means the connection is stuck), kOver when the
  // stream has ended.
  Sent heartbeat();
  // Since when the message being written has been waiting; Clock::time_point{} when none is.
  Clock::time_point pending_since() const;
  // When the last message (the naming one or a heartbeat) was handed to the connection.
  Clock::time_point last_sent() const;
  // Ends the stream (on_done follows with CANCELLED, or the coordinator's status if it came first).
  void cancel() { ctx_.TryCancel(); }

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

  EventStream(EventFn on_event, DoneFn on_done) : on_event_(std::move(on_event)), on_done_(std::move(on_done)) {}

 private:
  grpc::ClientContext ctx_;
  v1::WatchRequest first_;      // names the node
  v1::WatchRequest beat_;       // every heartbeat: only its sent_ms
  v1::Event event_;             // the one being read
  const EventFn on_event_;
  const DoneFn on_done_;
  std::shared_ptr<EventStream> self_;  // until OnDone: gRPC holds the reactor

  mutable std::mutex mu_;
  bool over_ = false;           // reads ended: no new writes (the hold is released)
  Clock::time_point pending_{}; // the write in flight started then; {} none
  Clock::time_point last_sent_{};
};

}  // namespace gradsync
