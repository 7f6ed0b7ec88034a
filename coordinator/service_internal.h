// What the coordinator service's files share: the reactors of the pending calls and the
// CoordinatorService class (coordinator/service.h names it). Its methods live in
// service.cc (restore, stop, the ticker, dispatching the table's events, the server),
// service_jobs.cc (node registration, heartbeats, joins, membership and the operator's queries)
// and service_events.cc (the nodes' event streams and TraceJob, which travels over them).
// Internal to the coordinator library.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator.grpc.pb.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/leases.h"
#include "coordinator/regroup.h"
#include "coordinator/service.h"
#include "coordinator/store_writer.h"
#include "coordinator/trace_gather.h"

namespace gradsync::coordinator {

// A tick this much later than due means the coordinator was stalled, and heartbeats read this
// much later than their stream's best mean its reads are behind (run_ticker): past it, every
// lease is extended by the excess.
constexpr Millis kStallSlack{250};
// Reads further behind than this (a fifth of the default lease) and registrations are refused
// with a retry hint (RegisterNode), more of them the further behind, all from twice it: the
// herd waits at the daemons, not in the coordinator's queues.
constexpr Millis kAdmitBehind{1000};
// The retry hint of a refused registration: how far reads are behind, within these.
constexpr Millis kMinRetryHint{500};
constexpr Millis kMaxRetryHint{3000};

// A Status as the gRPC status a call finishes with.
grpc::Status to_grpc(const Status& s);
// What every call gets once stop() began.
grpc::Status shutting_down();

// A pending JoinJob: finished when the table resolves its ticket, or withdrawn on cancel.
class JoinReactor final : public grpc::ServerUnaryReactor {
 public:
  JoinReactor(CoordinatorService* service, v1::JoinJobResponse* resp) : service_(service), resp_(resp) {}
  void OnCancel() override;
  void OnDone() override { delete this; }
  CoordinatorService* const service_;
  v1::JoinJobResponse* const resp_;
  const TimePoint start = Clock::now();  // for the join latency metric
  JoinTicket ticket = 0;
  bool cancelled = false;  // guarded by the service's mutex
};

// A pending TraceJob: finished when every node answered or at its deadline (the ticker).
class TraceReactor final : public grpc::ServerUnaryReactor {
 public:
  TraceReactor(CoordinatorService* service, v1::TraceJobResponse* resp) : service_(service), resp_(resp) {}
  void OnCancel() override;
  void OnDone() override { delete this; }
  CoordinatorService* const service_;
  v1::TraceJobResponse* const resp_;
  // Guarded by the service's mutex.
  uint64_t id = 0;
  uint32_t world = 0;
  bool cancelled = false;
};

// How many completion queues may carry the nodes' event streams, each polled by a thread of
// its own, and how many streams each takes before the next is taken into use. Debian's gRPC is
// built without NDEBUG, so every completion searches a list of its queue's outstanding
// operations (`cq_check_tag` in completion_queue.cc): one queue holding two operations per
// open stream made each heartbeat cost O(nodes) (docs/benchmarks.md "The coordinator at
// scale"). But every thread waiting on a queue also takes turns at polling the connections,
// and each message then wakes more of them: at 2,048 idle nodes 8 queues cost 30-50% more
// CPU per heartbeat than one. So queues are taken into use as the streams grow, one per
// CoordinatorOptions::streams_per_queue open streams.
constexpr size_t kStreamQueues = 8;

// The service's base: gRPC's callback API for every method but WatchEvents, which is on the
// asynchronous API (WatchStream). Methods in the order of the proto.
using CoordinatorBase = v1::Coordinator::WithCallbackMethod_RegisterNode<
    v1::Coordinator::WithCallbackMethod_Heartbeat<v1::Coordinator::WithCallbackMethod_JoinJob<
        v1::Coordinator::WithCallbackMethod_GetPeerTable<v1::Coordinator::WithAsyncMethod_WatchEvents<
            v1::Coordinator::WithCallbackMethod_LeaveJob<v1::Coordinator::WithCallbackMethod_AbortJob<
                v1::Coordinator::WithCallbackMethod_ListJobs<v1::Coordinator::WithCallbackMethod_DescribeJob<
                    v1::Coordinator::WithCallbackMethod_ReportPath<v1::Coordinator::WithCallbackMethod_TraceJob<
                        v1::Coordinator::WithCallbackMethod_ReportTrace<
                            v1::Coordinator::WithCallbackMethod_Regroup<v1::Coordinator::Service>>>>>>>>>>>>>;

// One node's event stream, both ways, on one of the stream queues: writes the node's queued
// events one at a time (no wake-ups while there is nothing to send) and reads its heartbeats.
// Every completion of a stream's operations comes on its queue's one thread, so its reads
// (started only there) need no lock; a heartbeat takes only the lease table's. Writes and
// Finish are started by whoever holds the service's mutex (CoordinatorService::Locked).
// The stream deletes itself when the last of its operations has completed (`ops`).
class WatchStream {
 public:
  enum Op : uint8_t { kMatched, kRead, kWrite, kFinish, kDone, kOps };
  struct Tag {  // what a completion queue hands back
    WatchStream* stream;
    Op op;
  };
  WatchStream(CoordinatorService* service, size_t queue) : service_(service), queue_(queue) {
    for (int i = 0; i < kOps; ++i) tags_[i] = {this, Op(i)};
  }
  void* tag(Op op) { return &tags_[op]; }

  CoordinatorService* const service_;
  const size_t queue_;  // which stream queue
  grpc::ServerContext ctx;
  grpc::ServerAsyncReaderWriter<v1::Event, v1::WatchRequest> io{&ctx};
  // Operations begun (or queued to begin after the service's mutex) and not yet completed;
  // from 1 (the call's end, kDone) once the call is matched.
  std::atomic<int> ops{0};
  v1::WatchRequest in;  // the message being read
  bool named = false;   // the first message arrived (touched by reads only)
  // Set under the service's mutex when the first message names the node; read by later reads
  // (after it, through the next read) and under the service's mutex.
  std::string node_id;
  // The smallest (read time - WatchRequest.sent_ms) of this stream so far, in ms: how late a
  // message is read is measured against it (coordinator/leases.h). Touched by reads only.
  int64_t best_offset_ms = 0;
  bool has_offset = false;
  // Guarded by the service's mutex.
  v1::Event current;
  bool writing = false;
  bool finished = false;  // Finish called, or due once the write in flight is done
  bool finish_due = false;
  bool over = false;      // the call has ended (kDone): nothing more to finish
  grpc::Status final_status;

 private:
  Tag tags_[kOps];
};

class CoordinatorService final : public CoordinatorBase {
 public:
  explicit CoordinatorService(const CoordinatorOptions& o)
      : options_(o), authz_(with_client_certs(o)), table_(JobTableOptions{o.lease, o.default_join_timeout}),
        leases_(o.lease) {
    if (o.store) writer_ = std::make_unique<StoreWriter>(o.store);
  }
  ~CoordinatorService() override {
    stop();
    stop_streams();
  }

  // mu_, and after it is released the gRPC operations queued while it was held (finish_later,
  // write_later): finishing a call or starting a write serialises a message and may write it
  // to the socket, and a generation that completes queues one of each per node (tens of
  // thousands), so none of them holds the table's lock.
  class Locked {
   public:
    explicit Locked(CoordinatorService* s) : s_(s), lock_(s->mu_) {}
    ~Locked() { s_->run_deferred(lock_); }
    Locked(const Locked&) = delete;
    Locked& operator=(const Locked&) = delete;

   private:
    CoordinatorService* const s_;
    std::unique_lock<std::mutex> lock_;
  };

  // service.cc: the service's life.
  Status restore();
  // Waits until the records of every change so far are written (tests, shutdown).
  bool flush_store(Millis timeout) { return !writer_ || writer_->flush(timeout); }
  void start() {
    ticker_ = std::thread([this] { run_ticker(); });
  }
  void stop();
  CoordinatorMetrics& metrics() { return metrics_; }
  std::string render_metrics();

  // service_jobs.cc: nodes and jobs.
  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* ctx, const v1::RegisterNodeRequest* req,
                                         v1::RegisterNodeResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* JoinJob(grpc::CallbackServerContext* ctx, const v1::JoinJobRequest* req,
                                    v1::JoinJobResponse* resp) override;
  void cancel_join(JoinReactor* r);
  grpc::ServerUnaryReactor* GetPeerTable(grpc::CallbackServerContext* ctx, const v1::PeerTableRequest* req,
                                         v1::PeerTableResponse* resp) override;
  grpc::ServerUnaryReactor* LeaveJob(grpc::CallbackServerContext* ctx, const v1::LeaveJobRequest* req,
                                     v1::LeaveJobResponse*) override;
  grpc::ServerUnaryReactor* AbortJob(grpc::CallbackServerContext* ctx, const v1::AbortJobRequest* req,
                                     v1::AbortJobResponse*) override;
  grpc::ServerUnaryReactor* Regroup(grpc::CallbackServerContext* ctx, const v1::RegroupRequest* req,
                                    v1::RegroupResponse* resp) override;
  grpc::ServerUnaryReactor* ReportPath(grpc::CallbackServerContext* ctx, const v1::ReportPathRequest* req,
                                       v1::ReportPathResponse*) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx, const v1::ListJobsRequest*,
                                     v1::ListJobsResponse* resp) override;
  grpc::ServerUnaryReactor* DescribeJob(grpc::CallbackServerContext* ctx, const v1::DescribeJobRequest* req,
                                        v1::DescribeJobResponse* resp) override;

  // service_events.cc: the nodes' event streams and TraceJob.
  // Takes the stream queues the server was built with (kStreamQueues) and starts the first:
  // asks it for WatchEvents calls and polls it on a thread of its own. The next is started
  // whenever the open streams pass options.streams_per_queue per started queue.
  void start_streams(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues);
  // After the server's Shutdown: shuts the queues down, drains them and joins their threads.
  // Idempotent.
  void stop_streams();
  grpc::ServerUnaryReactor* TraceJob(grpc::CallbackServerContext* ctx, const v1::TraceJobRequest* req,
                                     v1::TraceJobResponse* resp) override;
  void cancel_trace(TraceReactor* r);
  grpc::ServerUnaryReactor* ReportTrace(grpc::CallbackServerContext* ctx, const v1::ReportTraceRequest* req,
                                        v1::ReportTraceResponse*) override;

 private:
  struct NodeQueue {
    std::deque<v1::Event> events;
    WatchStream* watcher = nullptr;  // the node's current stream, if any
  };

  // A gRPC operation queued under mu_ (see Locked): Finish of a unary call or of a stream,
  // or a stream's Write of its `current` event. A stream's counts in its `ops` from here.
  struct Deferred {
    grpc::ServerUnaryReactor* unary = nullptr;
    WatchStream* watch = nullptr;
    bool write = false;  // watch: Write instead of Finish
    grpc::Status status;
  };

  // service.cc
  void finish_later(grpc::ServerUnaryReactor* r, grpc::Status status) { deferred_.push_back({r, nullptr, false, std::move(status)}); }
  void run_deferred(std::unique_lock<std::mutex>& lock);
  void dispatch_locked();
  void run_ticker();
  // service_jobs.cc
  void withdraw_locked(JoinReactor* r, const std::string& why);
  // service_events.cc
  void request_stream(size_t queue);
  void request_stream_locked(size_t queue);
  void start_queue_locked();
  void poll_streams(size_t queue);
  void stream_matched(WatchStream* w);
  void watch_read(WatchStream* w, bool ok);
  void write_done(WatchStream* w, bool ok);
  void stream_over(WatchStream* w);
  void start_read(WatchStream* w);
  void release(WatchStream* w);
  void defer_stream_locked(WatchStream* w, bool write, grpc::Status status = grpc::Status::OK);
  bool attach_watch_locked(WatchStream* w);
  Status lost_or_unknown(const std::string& id) const;
  void queue_event_locked(NodeQueue& q, v1::Event ev);
  void pump_locked(NodeQueue& q);
  void finish_watch_locked(WatchStream* w, const grpc::Status& status);
  void finish_traces_locked(TimePoint now);
  void cancel_trace_locked(TraceReactor* r);

  bool stopping_flag() {
    std::lock_guard lock(mu_);
    return stopping_;
  }

  static AuthzOptions with_client_certs(const CoordinatorOptions& o) {
    AuthzOptions a = o.authz;
    a.client_certs = a.client_certs || o.tls.require_client_cert;
    return a;
  }

  const CoordinatorOptions options_;
  Authorizer authz_;
  std::mutex mu_;  // the table, the queues, the pending joins; taken before lease_mu_
  std::vector<Deferred> deferred_;  // under mu_: run by the Locked that holds it
  JobTable table_;
  RegroupService regroup_;
  struct RegroupWait {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<RegroupWait> regroup_waits_;  // under mu_; stop() joins them
  std::map<std::string, NodeQueue> queues_;
  std::map<JoinTicket, JoinReactor*> joins_;
  TraceGather traces_;  // open TraceJob requests (own mutex)
  std::map<uint64_t, TraceReactor*> trace_calls_;  // their calls, by request id
  CoordinatorMetrics metrics_;  // own mutex
  bool stopping_ = false;
  std::mutex lease_mu_;
  Leases leases_;
  uint64_t leases_expired_ = 0;  // under lease_mu_, for /metrics
  // How far the coordinator's reads are behind (Leases::behind), set by the ticker; read
  // without a lock by RegisterNode's admission control.
  std::atomic<int64_t> behind_ms_{0};
  std::atomic<uint64_t> registrations_refused_{0};
  std::mutex ticker_mu_;
  std::condition_variable ticker_cv_;  // only to stop the ticker early
  std::thread ticker_;
  std::unique_ptr<StoreWriter> writer_;  // with a store: its records, written off the mutex
  // The event streams' queues and the threads of those started (start_streams). streams_mu_
  // orders asking a queue for a call and starting a queue against shutting them down.
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> stream_queues_;
  std::vector<std::thread> stream_threads_;  // one per started queue, in order; under streams_mu_
  std::mutex streams_mu_;
  bool streams_closing_ = false;  // under streams_mu_
  std::atomic<size_t> open_streams_{0};  // matched and not yet deleted
  std::atomic<size_t> started_queues_{0};  // stream_threads_.size(), read without the lock
};

}  // namespace gradsync::coordinator
