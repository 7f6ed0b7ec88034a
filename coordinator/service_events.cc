// CoordinatorService's event streams (WatchEvents: a node's queued events out, its heartbeats in,
// on gRPC's asynchronous API over kStreamQueues completion queues) and TraceJob/ReportTrace, whose requests travel to the daemons over those streams
// (coordinator/service_internal.h).
#include <algorithm>

#include "common/log.h"
#include "coordinator/service_internal.h"

namespace gradsync::coordinator {
namespace {

// A node that never watches must not grow its queue without bound; the oldest go first.
constexpr size_t kMaxQueuedEventsPerNode = 4096;
// TraceJob: how long to wait for the daemons by default and at most, and the records per rank.
constexpr Millis kTraceDefaultWait{3000};
constexpr Millis kTraceMaxWait{30000};
constexpr uint32_t kTraceMaxRecords = 1u << 20;
constexpr uint32_t kTraceDefaultRecords = 2000;

}  // namespace

// How many WatchEvents calls each stream queue has asked for at any time: a herd of daemons
// opening their streams waits for the next one in gRPC's queue of unmatched calls otherwise.
constexpr int kRequestsPerQueue = 4;

void CoordinatorService::start_streams(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues) {
  std::lock_guard lock(streams_mu_);
  stream_queues_ = std::move(queues);
  start_queue_locked();
}

// Takes the next stream queue into use: its thread, and calls asked for on it.
void CoordinatorService::start_queue_locked() {
  const size_t k = stream_threads_.size();
  if (streams_closing_ || k >= stream_queues_.size()) return;
  for (int i = 0; i < kRequestsPerQueue; ++i) request_stream_locked(k);
  stream_threads_.emplace_back([this, k] { poll_streams(k); });
  started_queues_ = k + 1;
  if (k > 0) {
    log::get("coordinator")->info("{} event streams open: stream queue {} of {} started", open_streams_.load(), k + 1,
                                  stream_queues_.size());
  }
}

void CoordinatorService::stop_streams() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(streams_mu_);
    if (streams_closing_) return;
    streams_closing_ = true;
    for (auto& q : stream_queues_) q->Shutdown();
    threads.swap(stream_threads_);
  }
  for (auto& t : threads) t.join();
  // The queues never started had nothing asked of them: only their shutdown to take.
  for (size_t k = threads.size(); k < stream_queues_.size(); ++k) {
    void* tag = nullptr;
    bool ok = false;
    while (stream_queues_[k]->Next(&tag, &ok)) {
    }
  }
}

// Asks queue `queue` for the next WatchEvents call; none once the queues are shutting down
// (an operation begun on a queue that was shut down is fatal in gRPC).
void CoordinatorService::request_stream(size_t queue) {
  std::lock_guard lock(streams_mu_);
  request_stream_locked(queue);
}

void CoordinatorService::request_stream_locked(size_t queue) {
  if (streams_closing_) return;
  auto* w = new WatchStream(this, queue);
  w->ctx.AsyncNotifyWhenDone(w->tag(WatchStream::kDone));  // delivered only once matched
  grpc::ServerCompletionQueue* cq = stream_queues_[queue].get();
  RequestWatchEvents(&w->ctx, &w->io, cq, cq, w->tag(WatchStream::kMatched));
}

// One stream queue's thread: every completion of the streams on it, in order.
void CoordinatorService::poll_streams(size_t queue) {
  void* tag = nullptr;
  bool ok = false;
  while (stream_queues_[queue]->Next(&tag, &ok)) {
    auto* t = static_cast<WatchStream::Tag*>(tag);
    WatchStream* w = t->stream;
    switch (t->op) {
      case WatchStream::kMatched:
        if (!ok) {  // the server is shutting down: the call never came
          delete w;
          continue;
        }
        if (++open_streams_ > options_.streams_per_queue * started_queues_.load()) {
          std::lock_guard lock(streams_mu_);
          if (open_streams_.load() > options_.streams_per_queue * stream_threads_.size()) start_queue_locked();
        }
        request_stream(queue);
        stream_matched(w);
        continue;
      case WatchStream::kRead:
        watch_read(w, ok);
        break;
      case WatchStream::kWrite:
        write_done(w, ok);
        break;
      case WatchStream::kFinish:
        break;
      case WatchStream::kDone:
        stream_over(w);
        break;
      case WatchStream::kOps:
        break;
    }
    release(w);
  }
}

// A new call: a caller without a node credential is refused at once; the stream is named by
// its first message (read in watch_read).
void CoordinatorService::stream_matched(WatchStream* w) {
  w->ops = 1;  // the call's end (kDone), which comes on this thread, so not before this
  if (Status a = authz_.node_call(w->ctx, "", "WatchEvents"); !a.ok()) {
    Locked lock(this);
    finish_watch_locked(w, to_grpc(a));
    return;
  }
  start_read(w);
}

void CoordinatorService::start_read(WatchStream* w) {
  ++w->ops;
  w->io.Read(&w->in, w->tag(WatchStream::kRead));
}

void CoordinatorService::release(WatchStream* w) {
  if (--w->ops == 0) {
    delete w;
    --open_streams_;
  }
}

// Queues a stream's Write of `current` (or its Finish) for after the service's mutex.
void CoordinatorService::defer_stream_locked(WatchStream* w, bool write, grpc::Status status) {
  ++w->ops;
  deferred_.push_back({nullptr, w, write, std::move(status)});
}

// A message on a node's stream: the first names the node, every later one is a heartbeat.
void CoordinatorService::watch_read(WatchStream* r, bool ok) {
  const int64_t now_ms = std::chrono::duration_cast<Millis>(Clock::now().time_since_epoch()).count();
  // How much later than this stream's best the message is read (0 when it sets a new best).
  int64_t late_ms = 0;
  if (ok && r->in.sent_ms() != 0) {
    const int64_t offset = now_ms - int64_t(r->in.sent_ms());
    if (!r->has_offset || offset < r->best_offset_ms) {
      r->best_offset_ms = offset;
      r->has_offset = true;
    }
    late_ms = offset - r->best_offset_ms;
  }
  if (!r->named) {
    r->named = true;
    Locked lock(this);
    if (!ok) {  // the client went before naming its node
      finish_watch_locked(r, {grpc::StatusCode::INVALID_ARGUMENT,
                              "WatchEvents: the stream ended before a WatchRequest named the node"});
      return;
    }
    if (attach_watch_locked(r)) start_read(r);
    return;
  }
  // Not ok: the node half-closed (it keeps the stream for events and heartbeats with unary
  // calls) or the call is over. Either way no more reads.
  if (!ok) return;
  bool known = false;
  {
    std::lock_guard leases(lease_mu_);
    known = leases_.renew(r->node_id, Clock::now());
    if (known && r->in.sent_ms() != 0) leases_.read_lag(Millis(late_ms));
  }
  if (!known) {
    Locked lock(this);
    finish_watch_locked(r, to_grpc(lost_or_unknown(r->node_id)));
    return;
  }
  start_read(r);
}

void CoordinatorService::write_done(WatchStream* r, bool ok) {
  Locked lock(this);
  r->writing = false;
  auto q = queues_.find(r->node_id);
  const bool attached = q != queues_.end() && q->second.watcher == r;
  if (!ok) {
    finish_watch_locked(r, {grpc::StatusCode::CANCELLED, "WatchEvents stream closed by the client"});
    if (q != queues_.end()) {  // the event goes to the node's next watcher
      q->second.events.push_front(std::move(r->current));
      pump_locked(q->second);
    }
  }
  if (r->finish_due) {
    r->finish_due = false;
    if (!r->over) defer_stream_locked(r, false, r->final_status);
    return;
  }
  if (ok && attached) pump_locked(q->second);
}

// The call has ended (finished, cancelled by the client, or its connection gone): the node
// has no stream until it opens another.
void CoordinatorService::stream_over(WatchStream* w) {
  Locked lock(this);
  w->over = true;
  finish_watch_locked(w, {grpc::StatusCode::CANCELLED, "WatchEvents cancelled"});
}

// The first message of a stream names its node: checks the caller holds the node's key, makes
// the stream the node's one watcher (a newer one, from a daemon that reconnected, replaces
// the older), renews the lease (opening the stream is a proof of life) and writes what is
// queued. False when the stream was finished instead.
bool CoordinatorService::attach_watch_locked(WatchStream* r) {
  r->node_id = r->in.node_id();
  if (Status a = authz_.node_call(r->ctx, r->node_id, "WatchEvents"); !a.ok()) {
    finish_watch_locked(r, to_grpc(a));
    return false;
  }
  if (stopping_) {
    finish_watch_locked(r, shutting_down());
    return false;
  }
  auto q = queues_.find(r->node_id);
  bool known = q != queues_.end() && table_.has_node(r->node_id);
  if (known) {
    std::lock_guard leases(lease_mu_);
    known = leases_.renew(r->node_id, Clock::now());
  }
  if (!known) {
    finish_watch_locked(r, to_grpc(lost_or_unknown(r->node_id)));
    return false;
  }
  if (q->second.watcher) {
    finish_watch_locked(q->second.watcher,
                        {grpc::StatusCode::ABORTED,
                         "WatchEvents for node " + r->node_id + " was replaced by a newer WatchEvents call"});
  }
  q->second.watcher = r;
  log::get("coordinator")->debug("node={} watching events", r->node_id);
  pump_locked(q->second);
  return true;
}

Status CoordinatorService::lost_or_unknown(const std::string& id) const {
  return {Code::kNotFound, "WatchEvents: node '" + id +
                               "' is not registered (unknown, or lost after its lease of " +
                               std::to_string(options_.lease.count()) +
                               " ms expired); the daemon must RegisterNode again"};
}

// Queues an event for a node (dropping the oldest past the bound) and writes it when the
// node's stream is free.
void CoordinatorService::queue_event_locked(NodeQueue& q, v1::Event ev) {
  if (q.events.size() >= kMaxQueuedEventsPerNode) {
    log::get("coordinator")->warn("a node is not reading its events; dropping the oldest of its {}", q.events.size());
    q.events.pop_front();
  }
  q.events.push_back(std::move(ev));
  pump_locked(q);
}

void CoordinatorService::pump_locked(NodeQueue& q) {
  WatchStream* w = q.watcher;
  if (!w || w->writing || w->finished || q.events.empty()) return;
  w->current = std::move(q.events.front());
  q.events.pop_front();
  w->writing = true;
  defer_stream_locked(w, true);
}

// Finishes a stream now, or after its write in flight; detaches it from its node. A call
// that has ended already is only detached.
void CoordinatorService::finish_watch_locked(WatchStream* w, const grpc::Status& status) {
  auto q = queues_.find(w->node_id);
  if (q != queues_.end() && q->second.watcher == w) q->second.watcher = nullptr;
  if (w->finished) return;
  w->finished = true;
  if (w->over) return;
  if (w->writing) {
    w->finish_due = true;
    w->final_status = status;
  } else {
    defer_stream_locked(w, false, status);
  }
}

// gradsyncctl trace: asks every member node's daemon for its ranks' flight recorders
// (coordinator/trace_gather.h); answered when every node has, or at the deadline (the ticker).
grpc::ServerUnaryReactor* CoordinatorService::TraceJob(grpc::CallbackServerContext* ctx,
                                                       const v1::TraceJobRequest* req,
                                                       v1::TraceJobResponse* resp) {
  auto* r = new TraceReactor(this, resp);
  if (Status a = authz_.operator_call(*ctx, "TraceJob"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  const Millis wait = req->timeout_ms() ? std::min(Millis(req->timeout_ms()), kTraceMaxWait) : kTraceDefaultWait;
  const uint32_t max_records = req->max_records() ? std::min(req->max_records(), kTraceMaxRecords) : kTraceDefaultRecords;
  Locked lock(this);
  if (stopping_) {
    finish_later(r, shutting_down());
    return r;
  }
  auto holders = table_.holders(req->job_id());
  if (!holders.ok()) {
    finish_later(r, to_grpc(holders.status()));
    return r;
  }
  *resp->mutable_summary() = holders->summary;
  r->world = holders->summary.world_size();
  const uint64_t generation = holders->summary.generation();
  r->id = traces_.open(req->job_id(), generation, holders->nodes, max_records, Clock::now() + wait);
  trace_calls_[r->id] = r;
  for (const auto& [node, ranks] : holders->nodes) {
    auto q = queues_.find(node);
    if (q == queues_.end() || !table_.has_node(node)) {
      traces_.unreachable(r->id, node, "not registered any more (its lease expired?)");
      continue;
    }
    v1::Event ev;
    ev.set_kind(v1::Event::TRACE_REQUESTED);
    ev.set_job_id(req->job_id());
    ev.set_generation(generation);
    ev.set_request_id(r->id);
    ev.set_max_records(max_records);
    ev.set_quiet(req->quiet());
    queue_event_locked(q->second, std::move(ev));
  }
  if (r->cancelled || ctx->IsCancelled()) {  // cancelled before it was registered above
    cancel_trace_locked(r);
    return r;
  }
  finish_traces_locked(Clock::now());  // every node may have been unreachable
  return r;
}

void CoordinatorService::cancel_trace(TraceReactor* r) {
  Locked lock(this);
  r->cancelled = true;
  cancel_trace_locked(r);
}

grpc::ServerUnaryReactor* CoordinatorService::ReportTrace(grpc::CallbackServerContext* ctx,
                                                          const v1::ReportTraceRequest* req,
                                                          v1::ReportTraceResponse*) {
  auto* r = ctx->DefaultReactor();
  if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportTrace"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  if (!table_.has_node(req->node_id())) {
    finish_later(r, to_grpc(lost_or_unknown(req->node_id())));
    return r;
  }
  Status s = traces_.report(*req);
  finish_traces_locked(Clock::now());
  finish_later(r, to_grpc(s));
  return r;
}

// Answers the TraceJob calls whose requests are complete or past their deadline.
void CoordinatorService::finish_traces_locked(TimePoint now) {
  for (auto& [id, got] : traces_.take_finished(now)) {
    auto it = trace_calls_.find(id);
    if (it == trace_calls_.end()) continue;
    TraceReactor* r = it->second;
    trace_calls_.erase(it);
    std::sort(got.ranks.begin(), got.ranks.end(), [](const auto& a, const auto& b) { return a.rank() < b.rank(); });
    for (auto& t : got.ranks) {
      if (t.rank() < r->world) *r->resp_->add_ranks() = std::move(t);
    }
    for (auto& m : got.missing) r->resp_->add_missing_nodes(std::move(m));
    for (auto& p : got.dumps) r->resp_->add_dumps(std::move(p));
    finish_later(r, grpc::Status::OK);
  }
}

void CoordinatorService::cancel_trace_locked(TraceReactor* r) {
  auto it = trace_calls_.find(r->id);
  if (r->id == 0 || it == trace_calls_.end() || it->second != r) return;  // answered already
  trace_calls_.erase(it);
  traces_.cancel(r->id);
  finish_later(r, stopping_ ? shutting_down() : grpc::Status(grpc::StatusCode::CANCELLED, "TraceJob cancelled"));
}

void TraceReactor::OnCancel() { service_->cancel_trace(this); }

}  // namespace gradsync::coordinator
