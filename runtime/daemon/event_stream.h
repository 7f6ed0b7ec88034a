// A node's WatchEvents stream as gradsyncd keeps it (and gradsync-loadgen's simulated nodes):
// events from the coordinator one way, the node's heartbeats the other. The first message
// names the node; heartbeat() sends one more, which renews the node's lease at the
// coordinator. Each carries when it was sent (this process's monotonic clock), from which the
// coordinator tells how far its own reads are behind (coordinator/leases.h). An idle node so
// costs the coordinator one small message on an open stream per lease/3, not a unary call
// (docs/benchmarks.md "The coordinator at scale").
//
// On gRPC's asynchronous API over StreamQueues: completion queues, each polled by a thread of
// its own, on which the stream's callbacks run (they must not block). Debian's gRPC is built
// without NDEBUG, so every completion searches a list of its queue's outstanding operations;
// a process with thousands of streams (the load generator) spreads them over several queues
// instead of gRPC's one callback queue, and a stream keeps one operation outstanding while
// idle (its read; the status is asked for only once the reads end). Writes never block: a
// heartbeat due while the previous one is still being written is not sent, and
// `pending_since()` tells how long the stream has been stuck.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator.grpc.pb.h"

namespace gradsync {

// A node's connection to the coordinator, as gradsyncd makes it (CoordinatorLink) and the load
// generator's simulated nodes too, so that those cost the coordinator what daemons do.
//  - A node cut off from the network (issue 17) must see its connection fail, not keep an
//    open event stream whose heartbeat writes complete into the socket's buffer while TCP
//    retransmits for minutes. The keepalive arguments make gRPC set TCP_USER_TIMEOUT to
//    kNodePingTimeout on the socket: a heartbeat (every lease/3) unacknowledged for that long
//    closes the connection and its streams end UNAVAILABLE ("timed out"). With no data in
//    flight, a ping goes once nothing was read for kNodePingPeriod, and one unanswered for
//    kNodePingTimeout closes it too. The period is longer than a heartbeat's, so a node that
//    heartbeats pings seldom: at 1 s (once per heartbeat, the window updates resetting the
//    timer) the pings cost 2,048 idle nodes' coordinator 4-5 points of a core
//    (docs/benchmarks.md "The coordinator at scale"). The coordinator admits pings every 500 ms
//    (coordinator/service.cc).
//  - Reconnection within kNodeMaxReconnect of a restarted coordinator, and the DNS resolver
//    asked again at once after a failed connection.
constexpr std::chrono::milliseconds kNodePingPeriod{5000};
constexpr std::chrono::milliseconds kNodePingTimeout{1000};
constexpr std::chrono::milliseconds kNodeMaxReconnect{250};
grpc::ChannelArguments node_channel_args();

// Completion queues for event streams, each polled by a thread of its own; a stream stays on
// the queue it was opened on.
class StreamQueues {
 public:
  explicit StreamQueues(size_t count);
  // Shuts the queues down and joins their threads: every stream on them must have ended.
  ~StreamQueues();
  StreamQueues(const StreamQueues&) = delete;
  StreamQueues& operator=(const StreamQueues&) = delete;
  // The next queue, round robin.
  grpc::CompletionQueue* next();
  // One queue for a process with few streams (gradsyncd); made on first use, never destroyed.
  static StreamQueues& shared();

 private:
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues_;
  std::vector<std::thread> threads_;
  std::atomic<size_t> next_{0};
};

class EventStream final : public std::enable_shared_from_this<EventStream> {
 public:
  using Clock = std::chrono::steady_clock;
  using EventFn = std::function<void(const v1::Event&)>;
  using DoneFn = std::function<void(const grpc::Status&)>;

  // Opens the stream of node `node_id` on one of `queues` (StreamQueues::shared() when null).
  // `prepare` adds the call's metadata (credentials) to its context; `on_event` runs for every
  // event, `on_done` once with the stream's status, both on the queue's thread. The stream
  // stays alive until on_done has returned, however its owner drops it.
  static std::shared_ptr<EventStream> open(v1::Coordinator::Stub& stub, const std::string& node_id,
                                           const std::function<void(grpc::ClientContext&)>& prepare,
                                           EventFn on_event, DoneFn on_done, StreamQueues* queues = nullptr);

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

  EventStream(EventFn on_event, DoneFn on_done) : on_event_(std::move(on_event)), on_done_(std::move(on_done)) {}

 private:
  friend class StreamQueues;
  enum Op : uint8_t { kRead, kWrite, kFinish, kOps };
  struct Tag {  // what a completion queue hands back
    EventStream* stream;
    Op op;
  };
  void* tag(Op op) { return &tags_[op]; }
  // A completion, on the queue's thread.
  void completed(Op op, bool ok);
  void finish_locked();  // asks for the status once the reads are over and no write is in flight

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::WatchRequest, v1::Event>> io_;
  Tag tags_[kOps] = {{this, kRead}, {this, kWrite}, {this, kFinish}};
  v1::WatchRequest first_;      // names the node
  // A heartbeat: empty, or only its sent_ms on every kClockEvery-th. A message with a payload
  // makes gRPC 1.51's coordinator send a WINDOW_UPDATE back for each one (a socket write per
  // heartbeat, a quarter of an idle node's cost there); the coordinator's estimate of how far
  // its reads are behind (coordinator/leases.h) is a median over all nodes' samples and needs
  // no more than one in four.
  static constexpr uint64_t kClockEvery = 4;
  v1::WatchRequest beat_;
  uint64_t beats_ = 0;
  v1::Event event_;             // the one being read
  grpc::Status status_;         // the call's, once kFinish completed
  const EventFn on_event_;
  const DoneFn on_done_;
  std::shared_ptr<EventStream> self_;  // until the last operation completed

  mutable std::mutex mu_;
  int ops_ = 0;                 // operations begun and not completed
  bool over_ = false;           // reads ended: no new writes
  bool finishing_ = false;      // the status was asked for
  Clock::time_point pending_{}; // the write in flight started then; {} none
  Clock::time_point last_sent_{};
};

}  // namespace gradsync
