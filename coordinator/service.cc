#include "coordinator/service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "common/call_auth.h"
#include "common/log.h"
#include "coordinator.grpc.pb.h"
#include "common/metrics_server.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/leases.h"
#include "coordinator/trace_gather.h"
#include "coordinator/regroup.h"
#include "coordinator/store_writer.h"

namespace gradsync::coordinator {
namespace {

// A node that never watches must not grow its queue without bound; the oldest go first.
constexpr size_t kMaxQueuedEventsPerNode = 4096;
// A tick this much later than due means the coordinator was stalled (see run_ticker).
constexpr Millis kStallSlack{250};
// How long shutdown() lets in-flight calls finish before gRPC cancels them.
constexpr Millis kShutdownGrace{2000};
// Server keepalive: finds half-open WatchEvents streams of daemons that vanished.
constexpr int kKeepaliveTimeMs = 30000;
constexpr int kKeepaliveTimeoutMs = 10000;
constexpr int kMinClientPingIntervalMs = 5000;  // daemons may ping this often
// TraceJob: how long to wait for the daemons by default and at most, and the records per rank.
constexpr Millis kTraceDefaultWait{3000};
constexpr Millis kTraceMaxWait{30000};
constexpr uint32_t kTraceMaxRecords = 1u << 20;
constexpr uint32_t kTraceDefaultRecords = 2000;

grpc::Status to_grpc(const Status& s) {
  using grpc::StatusCode;
  StatusCode code = StatusCode::UNKNOWN;
  switch (s.code()) {
    case Code::kOk:
      return grpc::Status::OK;
    case Code::kInvalidArgument:
      code = StatusCode::INVALID_ARGUMENT;
      break;
    case Code::kNotFound:
      code = StatusCode::NOT_FOUND;
      break;
    case Code::kAlreadyExists:
      code = StatusCode::ALREADY_EXISTS;
      break;
    case Code::kPermissionDenied:
      code = StatusCode::PERMISSION_DENIED;
      break;
    case Code::kDeadlineExceeded:
      code = StatusCode::DEADLINE_EXCEEDED;
      break;
    case Code::kUnimplemented:
      code = StatusCode::UNIMPLEMENTED;
      break;
    case Code::kUnavailable:
      code = StatusCode::UNAVAILABLE;
      break;
    case Code::kAborted:
      code = StatusCode::ABORTED;
      break;
    case Code::kInternal:
      code = StatusCode::INTERNAL;
      break;
    case Code::kFailedPrecondition:
    case Code::kMismatch:
      code = StatusCode::FAILED_PRECONDITION;
      break;
  }
  return {code, s.message()};
}

// The name a registration takes, as the job table names it: the node name, else the hostname.
std::string node_name_of(const v1::NodeInfo& n) {
  return !n.node_name().empty() ? n.node_name() : !n.hostname().empty() ? n.hostname() : "node";
}

grpc::Status shutting_down() {
  return {grpc::StatusCode::UNAVAILABLE,
          "coordinator is shutting down; retry against the restarted coordinator"};
}

}  // namespace

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

// One node's event stream, both ways: writes its queued events one at a time (no thread, no
// wake-ups while there is nothing to send) and reads the node's heartbeats. Reads start only in
// the handler and in OnReadDone, so they need no lock; a heartbeat takes only the lease table's.
class WatchReactor final : public grpc::ServerBidiReactor<v1::WatchRequest, v1::Event> {
 public:
  WatchReactor(CoordinatorService* service, grpc::CallbackServerContext* ctx) : service_(service), ctx_(ctx) {}
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;
  CoordinatorService* const service_;
  grpc::CallbackServerContext* const ctx_;  // valid until OnDone
  v1::WatchRequest in;  // the message being read
  bool named = false;   // the first message arrived (touched by reads only)
  // Set under the service's mutex when the first message names the node; read by later reads
  // (after it, through StartRead) and under the service's mutex.
  std::string node_id;
  // Guarded by the service's mutex.
  v1::Event current;
  bool writing = false;
  bool finished = false;  // Finish called, or due once the write in flight is done
  bool finish_due = false;
  grpc::Status final_status;
};

class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  explicit CoordinatorService(const CoordinatorOptions& o)
      : options_(o), authz_(with_client_certs(o)), table_(JobTableOptions{o.lease, o.default_join_timeout}),
        leases_(o.lease) {
    if (o.store) writer_ = std::make_unique<StoreWriter>(o.store);
  }
  ~CoordinatorService() override { stop(); }

  // Loads the store's nodes and jobs (coordinator/store.h) before the service answers: the
  // nodes keep their ids and keys and get a full lease from now, the jobs their generations.
  Status restore() {
    if (!options_.store) return Status::Ok();
    auto records = options_.store->load();
    if (!records.ok()) {
      return Status(records.status().code(), "cannot load the coordinator's state from " +
                                                 options_.store->describe() + ": " + records.status().message());
    }
    std::vector<v1::StoredNode> nodes;
    std::vector<v1::StoredJob> jobs;
    v1::StoredMeta meta;
    for (const auto& [key, value] : *records) {
      bool ok = true;
      if (key.rfind("nodes/", 0) == 0) {
        ok = nodes.emplace_back().ParseFromString(value);
      } else if (key.rfind("jobs/", 0) == 0) {
        ok = jobs.emplace_back().ParseFromString(value);
      } else if (key == "meta") {
        ok = meta.ParseFromString(value);
      }
      if (!ok) return {Code::kInternal, "record '" + key + "' in " + options_.store->describe() + " does not parse"};
    }
    std::lock_guard lock(mu_);
    GS_RETURN_IF_ERROR(table_.restore(nodes, jobs, meta.next_node_number()));
    const TimePoint now = Clock::now();
    for (const auto& n : nodes) {
      authz_.bound(n.name(), n.node_id(), n.key());
      queues_[n.node_id()];
      std::lock_guard leases(lease_mu_);
      leases_.add(n.node_id(), now);
    }
    for (const auto& j : jobs) {
      if (!j.token().empty()) authz_.job_token(j.job_id(), j.token());
    }
    log::get("coordinator")->info("restored {} node(s) and {} job(s) from {}; each node has {} ms to heartbeat",
                                  nodes.size(), jobs.size(), options_.store->describe(), options_.lease.count());
    dispatch_locked();
    return Status::Ok();
  }

  // Waits until the records of every change so far are written (tests, shutdown).
  bool flush_store(Millis timeout) { return !writer_ || writer_->flush(timeout); }

  void start() {
    ticker_ = std::thread([this] { run_ticker(); });
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      if (!stopping_) {
        stopping_ = true;
        for (auto& [ticket, r] : joins_) {
          table_.withdraw(ticket, "coordinator shutting down");
          r->Finish(shutting_down());
        }
        joins_.clear();
        for (auto& [id, r] : trace_calls_) {
          traces_.cancel(id);
          r->Finish(shutting_down());
        }
        trace_calls_.clear();
        for (auto& [id, q] : queues_) {
          if (q.watcher) finish_watch_locked(q.watcher, shutting_down());
        }
      }
    }
    regroup_.stop();  // wakes the Regroup waits; no new one starts once stopping_
    std::list<RegroupWait> waits;
    {
      std::lock_guard lock(mu_);
      waits.swap(regroup_waits_);
    }
    for (auto& w : waits) w.thread.join();
    ticker_cv_.notify_all();
    if (ticker_.joinable()) ticker_.join();
  }

  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* ctx, const v1::RegisterNodeRequest* req,
                                         v1::RegisterNodeResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    std::lock_guard lock(mu_);
    if (stopping_) {
      r->Finish(shutting_down());
      return r;
    }
    const std::string name = node_name_of(req->node());
    auto key = authz_.admit_node(*ctx, name, [this](const std::string& id) { return table_.has_node(id); });
    if (!key.ok()) {
      r->Finish(to_grpc(key.status()));
      return r;
    }
    const TimePoint now = Clock::now();
    auto id = table_.register_node(req->node(), now);
    if (!id.ok()) {
      r->Finish(to_grpc(id.status()));
      return r;
    }
    authz_.bound(name, *id, *key);
    if (!key->empty()) ctx->AddInitialMetadata(kNodeKeyHeader, *key);
    if (writer_) {
      v1::StoredNode record;
      record.set_node_id(*id);
      *record.mutable_info() = req->node();
      record.mutable_info()->set_node_name(name);
      record.set_name(name);
      record.set_key(*key);
      writer_->put("nodes/" + *id, record.SerializeAsString());
      v1::StoredMeta meta;
      meta.set_next_node_number(table_.next_node_number());
      writer_->put("meta", meta.SerializeAsString());
    }
    queues_[*id];  // queue events from now on, even before the node starts watching
    {
      std::lock_guard leases(lease_mu_);
      leases_.add(*id, now);
    }
    dispatch_locked();
    resp->set_node_id(*id);
    resp->set_lease_ms(static_cast<uint32_t>(options_.lease.count()));
    r->Finish(grpc::Status::OK);
    return r;
  }

  // Only the lease table's own mutex: a heartbeat never waits for a join or a peer table.
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.node_call(*ctx, req->node_id(), "Heartbeat"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    bool known = false;
    {
      std::lock_guard lock(lease_mu_);
      known = leases_.renew(req->node_id(), Clock::now());
    }
    if (!known) {
      r->Finish(to_grpc({Code::kNotFound, "Heartbeat: node '" + req->node_id() +
                                              "' is not registered with the coordinator (its lease of " +
                                              std::to_string(options_.lease.count()) +
                                              " ms expired, or the coordinator restarted); the daemon must "
                                              "RegisterNode again"}));
      return r;
    }
    resp->set_lease_ms(static_cast<uint32_t>(options_.lease.count()));
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerUnaryReactor* JoinJob(grpc::CallbackServerContext* ctx, const v1::JoinJobRequest* req,
                                    v1::JoinJobResponse* resp) override {
    JoinRequest j;
    j.node_id = req->node_id();
    j.job_id = req->job_id();
    j.token = req->token();
    j.world_size = req->world_size();
    j.ranks.assign(req->ranks().begin(), req->ranks().end());
    j.endpoints.assign(req->endpoints().begin(), req->endpoints().end());
    j.timeout = Millis(req->timeout_ms());
    j.offer = req->offer();
    auto* r = new JoinReactor(this, resp);
    if (Status a = authz_.node_call(*ctx, req->node_id(), "JoinJob"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    if (stopping_) {
      r->Finish(shutting_down());
      return r;
    }
    auto ticket = table_.join(j, Clock::now());
    if (!ticket.ok()) {
      log::get("coordinator")->warn("rejected {}", ticket.status().to_string());
      r->Finish(to_grpc(ticket.status()));
      return r;
    }
    authz_.job_token(j.job_id, j.token);  // the table accepted it: the job's token
    r->ticket = *ticket;
    joins_[*ticket] = r;
    if (r->cancelled || ctx->IsCancelled()) {  // cancelled before it was registered above
      withdraw_locked(r, "the JoinJob call was cancelled or timed out");
    }
    dispatch_locked();  // this join may have completed the generation
    return r;
  }

  void cancel_join(JoinReactor* r) {
    std::lock_guard lock(mu_);
    r->cancelled = true;
    if (r->ticket != 0 && joins_.count(r->ticket)) {
      withdraw_locked(r, "the JoinJob call was cancelled or timed out");
      dispatch_locked();
    }
  }

  grpc::ServerUnaryReactor* GetPeerTable(grpc::CallbackServerContext* ctx, const v1::PeerTableRequest* req,
                                         v1::PeerTableResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    // The node a table is for is the caller (its credential is checked); a fetch by key needs
    // only the caller to be a member of the job.
    const std::string node = req->node_id().empty() ? Authorizer::node_id_of(*ctx) : req->node_id();
    if (Status a = authz_.job_call(*ctx, node, req->job_id(), "GetPeerTable"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::vector<uint32_t> ranks(req->ranks().begin(), req->ranks().end());
    std::lock_guard lock(mu_);
    if (!authz_.open() && !table_.is_member(req->job_id(), node)) {  // the caller must hold a rank of the job
      r->Finish(to_grpc({Code::kPermissionDenied, "GetPeerTable job=" + req->job_id() + ": node '" + node +
                                                     "' is not a member of the job"}));
      return r;
    }
    auto table = table_.peer_table(req->job_id(), req->generation(), node, req->page(), ranks);
    if (!table.ok()) {
      r->Finish(to_grpc(table.status()));
      return r;
    }
    *resp = std::move(*table);
    r->Finish(grpc::Status::OK);  // serialised after the handler returns, outside the mutex
    return r;
  }

  // The stream is named by its first message (read in watch_read); a caller without a node
  // credential is refused at once.
  grpc::ServerBidiReactor<v1::WatchRequest, v1::Event>* WatchEvents(grpc::CallbackServerContext* ctx) override {
    auto* r = new WatchReactor(this, ctx);
    if (Status a = authz_.node_call(*ctx, "", "WatchEvents"); !a.ok()) {
      std::lock_guard lock(mu_);
      r->finished = true;
      r->Finish(to_grpc(a));
      return r;
    }
    r->StartRead(&r->in);
    return r;
  }

  // A message on a node's stream: the first names the node, every later one is a heartbeat.
  void watch_read(WatchReactor* r, bool ok) {
    if (!r->named) {
      r->named = true;
      std::lock_guard lock(mu_);
      if (!ok) {  // the client went before naming its node
        finish_watch_locked(r, {grpc::StatusCode::INVALID_ARGUMENT,
                                "WatchEvents: the stream ended before a WatchRequest named the node"});
        return;
      }
      if (attach_watch_locked(r)) r->StartRead(&r->in);
      return;
    }
    // Not ok: the node half-closed (it keeps the stream for events and heartbeats with unary
    // calls) or the call is over. Either way no more reads.
    if (!ok) return;
    bool known = false;
    {
      std::lock_guard leases(lease_mu_);
      known = leases_.renew(r->node_id, Clock::now());
    }
    if (!known) {
      std::lock_guard lock(mu_);
      finish_watch_locked(r, to_grpc(lost_or_unknown(r->node_id)));
      return;
    }
    r->StartRead(&r->in);
  }

  void write_done(WatchReactor* r, bool ok) {
    std::lock_guard lock(mu_);
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
      r->Finish(r->final_status);
      return;
    }
    if (ok && attached) pump_locked(q->second);
  }

  void watch_cancelled(WatchReactor* r) {
    std::lock_guard lock(mu_);
    finish_watch_locked(r, {grpc::StatusCode::CANCELLED, "WatchEvents cancelled"});
  }

  void watch_done(WatchReactor* r) {
    std::lock_guard lock(mu_);
    auto q = queues_.find(r->node_id);
    if (q != queues_.end() && q->second.watcher == r) q->second.watcher = nullptr;
  }

  grpc::ServerUnaryReactor* LeaveJob(grpc::CallbackServerContext* ctx, const v1::LeaveJobRequest* req,
                                     v1::LeaveJobResponse*) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "LeaveJob"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    Status s = table_.leave(req->node_id(), req->job_id(), req->generation());
    dispatch_locked();
    r->Finish(to_grpc(s));
    return r;
  }

  grpc::ServerUnaryReactor* AbortJob(grpc::CallbackServerContext* ctx, const v1::AbortJobRequest* req,
                                     v1::AbortJobResponse*) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = req->node_id().empty() ? authz_.operator_call(*ctx, "AbortJob")
                                              : authz_.job_call(*ctx, req->node_id(), req->job_id(), "AbortJob"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    Status s = table_.abort(req->node_id(), req->job_id(), req->generation(), req->reason(), req->failed_rank());
    dispatch_locked();
    r->Finish(to_grpc(s));
    return r;
  }

  // Elastic membership (coordinator/regroup.h): its own table and lock, apart from the jobs'.
  // RegroupService's wait blocks, so each call waits on a thread of its own, not on one of
  // gRPC's callback threads (regroup calls are few: one per rank when a job shrinks or grows).
  grpc::ServerUnaryReactor* Regroup(grpc::CallbackServerContext* ctx, const v1::RegroupRequest* req,
                                    v1::RegroupResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    // The base job's token: the same for every generation of the job.
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "Regroup"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    RegroupCall c;
    c.node_id = req->node_id();
    c.job = req->job_id();
    c.token = req->token();
    c.from_generation = req->from_generation();
    c.old_world_size = req->old_world_size();
    c.old_rank = req->old_rank();
    c.failed.assign(req->failed().begin(), req->failed().end());
    c.newcomer = req->newcomer();
    c.newcomers = req->newcomers();
    c.wait = Millis(req->wait_ms());
    // The caller's deadline, at most a little past the longest wait (no deadline: "forever").
    const auto call_left = std::min<std::chrono::system_clock::duration>(
        ctx->deadline() - std::chrono::system_clock::now(), std::chrono::minutes(11));
    const TimePoint give_up = Clock::now() + std::chrono::duration_cast<Millis>(call_left);
    std::lock_guard lock(mu_);
    if (stopping_) {
      r->Finish(shutting_down());
      return r;
    }
    // Joins the waits that are over.
    regroup_waits_.remove_if([](RegroupWait& w) {
      if (!w.done->load()) return false;
      w.thread.join();
      return true;
    });
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread t([this, ctx, r, resp, c, give_up, done] {
      auto outcome = regroup_.run(c, give_up, [ctx] { return ctx->IsCancelled(); });
      if (outcome.ok()) {
        resp->set_generation(outcome->generation);
        resp->set_world_size(outcome->world_size);
        resp->set_rank(outcome->rank);
        resp->set_local_rank(outcome->local_rank);
        resp->set_local_world_size(outcome->local_world_size);
        for (int32_t old : outcome->old_ranks) resp->add_old_ranks(old);
      }
      r->Finish(outcome.ok() ? grpc::Status::OK : to_grpc(outcome.status()));
      done->store(true);
    });
    regroup_waits_.push_back({std::move(t), std::move(done)});
    return r;
  }

  grpc::ServerUnaryReactor* ReportPath(grpc::CallbackServerContext* ctx, const v1::ReportPathRequest* req,
                                       v1::ReportPathResponse*) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportPath"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    r->Finish(to_grpc(table_.report_path(req->node_id(), req->job_id(), req->generation(), req->path())));
    return r;
  }

  // gradsyncctl trace: asks every member node's daemon for its ranks' flight recorders
  // (coordinator/trace_gather.h); answered when every node has, or at the deadline (the ticker).
  grpc::ServerUnaryReactor* TraceJob(grpc::CallbackServerContext* ctx, const v1::TraceJobRequest* req,
                                     v1::TraceJobResponse* resp) override {
    auto* r = new TraceReactor(this, resp);
    if (Status a = authz_.operator_call(*ctx, "TraceJob"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    const Millis wait = req->timeout_ms() ? std::min(Millis(req->timeout_ms()), kTraceMaxWait) : kTraceDefaultWait;
    const uint32_t max_records = req->max_records() ? std::min(req->max_records(), kTraceMaxRecords) : kTraceDefaultRecords;
    std::lock_guard lock(mu_);
    if (stopping_) {
      r->Finish(shutting_down());
      return r;
    }
    auto holders = table_.holders(req->job_id());
    if (!holders.ok()) {
      r->Finish(to_grpc(holders.status()));
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

  void cancel_trace(TraceReactor* r) {
    std::lock_guard lock(mu_);
    r->cancelled = true;
    cancel_trace_locked(r);
  }

  grpc::ServerUnaryReactor* ReportTrace(grpc::CallbackServerContext* ctx, const v1::ReportTraceRequest* req,
                                        v1::ReportTraceResponse*) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportTrace"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    if (!table_.has_node(req->node_id())) {
      r->Finish(to_grpc(lost_or_unknown(req->node_id())));
      return r;
    }
    Status s = traces_.report(*req);
    finish_traces_locked(Clock::now());
    r->Finish(to_grpc(s));
    return r;
  }

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx, const v1::ListJobsRequest*,
                                     v1::ListJobsResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.operator_call(*ctx, "ListJobs"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    for (auto& job : table_.list_jobs()) *resp->add_jobs() = std::move(job);
    r->Finish(grpc::Status::OK);
    return r;
  }

  grpc::ServerUnaryReactor* DescribeJob(grpc::CallbackServerContext* ctx, const v1::DescribeJobRequest* req,
                                        v1::DescribeJobResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    if (Status a = authz_.operator_call(*ctx, "DescribeJob"); !a.ok()) {
      r->Finish(to_grpc(a));
      return r;
    }
    std::lock_guard lock(mu_);
    auto d = table_.describe(req->job_id(), req->page());
    if (!d.ok()) {
      r->Finish(to_grpc(d.status()));
      return r;
    }
    *resp = std::move(*d);
    r->Finish(grpc::Status::OK);
    return r;
  }

  CoordinatorMetrics& metrics() { return metrics_; }
  // /metrics (coordinator/coordinator_metrics.h): the table's part read under mu_.
  std::string render_metrics() {
    std::lock_guard lock(mu_);
    uint64_t expired = 0;
    {
      std::lock_guard leases(lease_mu_);
      expired = leases_expired_;
    }
    return metrics_.render(table_.node_count(), expired, table_.list_jobs());
  }

 private:
  struct NodeQueue {
    std::deque<v1::Event> events;
    WatchReactor* watcher = nullptr;  // the node's current stream, if any
  };

  // The first message of a stream names its node: checks the caller holds the node's key, makes
  // the stream the node's one watcher (a newer one, from a daemon that reconnected, replaces
  // the older), renews the lease (opening the stream is a proof of life) and writes what is
  // queued. False when the stream was finished instead.
  bool attach_watch_locked(WatchReactor* r) {
    r->node_id = r->in.node_id();
    if (Status a = authz_.node_call(*r->ctx_, r->node_id, "WatchEvents"); !a.ok()) {
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

  Status lost_or_unknown(const std::string& id) const {
    return {Code::kNotFound, "WatchEvents: node '" + id +
                                 "' is not registered (unknown, or lost after its lease of " +
                                 std::to_string(options_.lease.count()) +
                                 " ms expired); the daemon must RegisterNode again"};
  }

  void withdraw_locked(JoinReactor* r, const std::string& why) {
    table_.withdraw(r->ticket, why);
    joins_.erase(r->ticket);
    r->Finish(stopping_ ? shutting_down() : grpc::Status(grpc::StatusCode::CANCELLED, "JoinJob cancelled"));
  }

  // Queues an event for a node (dropping the oldest past the bound) and writes it when the
  // node's stream is free.
  void queue_event_locked(NodeQueue& q, v1::Event ev) {
    if (q.events.size() >= kMaxQueuedEventsPerNode) {
      log::get("coordinator")->warn("a node is not reading its events; dropping the oldest of its {}", q.events.size());
      q.events.pop_front();
    }
    q.events.push_back(std::move(ev));
    pump_locked(q);
  }

  // Answers the TraceJob calls whose requests are complete or past their deadline.
  void finish_traces_locked(TimePoint now) {
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
      r->Finish(grpc::Status::OK);
    }
  }

  void cancel_trace_locked(TraceReactor* r) {
    auto it = trace_calls_.find(r->id);
    if (r->id == 0 || it == trace_calls_.end() || it->second != r) return;  // answered already
    trace_calls_.erase(it);
    traces_.cancel(r->id);
    r->Finish(stopping_ ? shutting_down() : grpc::Status(grpc::StatusCode::CANCELLED, "TraceJob cancelled"));
  }

  void pump_locked(NodeQueue& q) {
    WatchReactor* w = q.watcher;
    if (!w || w->writing || w->finished || q.events.empty()) return;
    w->current = std::move(q.events.front());
    q.events.pop_front();
    w->writing = true;
    w->StartWrite(&w->current);
  }

  // Finishes a stream now, or after its write in flight; detaches it from its node.
  void finish_watch_locked(WatchReactor* w, const grpc::Status& status) {
    auto q = queues_.find(w->node_id);
    if (q != queues_.end() && q->second.watcher == w) q->second.watcher = nullptr;
    if (w->finished) return;
    w->finished = true;
    if (w->writing) {
      w->finish_due = true;
      w->final_status = status;
    } else {
      w->Finish(status);
    }
  }

  // Moves the table's new events into the node queues and onto their streams, ends the
  // streams and leases of removed nodes, and answers the joins the table resolved.
  void dispatch_locked() {
    for (auto& d : table_.take_events()) {
      auto qit = queues_.find(d.node_id);
      if (qit == queues_.end()) continue;
      queue_event_locked(qit->second, std::move(d.event));
    }
    for (const auto& id : table_.take_removed_nodes()) {
      auto q = queues_.find(id);
      if (q != queues_.end()) {
        if (q->second.watcher) finish_watch_locked(q->second.watcher, to_grpc(lost_or_unknown(id)));
        queues_.erase(q);
      }
      authz_.forget(id);
      std::lock_guard leases(lease_mu_);
      leases_.remove(id);
      if (writer_) writer_->remove("nodes/" + id);
    }
    if (writer_) {  // each changed job once, however often it changed
      auto dirty = table_.take_dirty_jobs();
      std::sort(dirty.begin(), dirty.end());
      dirty.erase(std::unique(dirty.begin(), dirty.end()), dirty.end());
      for (const auto& job : dirty) {
        auto record = table_.stored_job(job);
        if (record) writer_->put("jobs/" + job, record->SerializeAsString());
        else writer_->remove("jobs/" + job);
      }
    }
    for (JoinTicket t : table_.take_resolved()) {
      auto outcome = table_.take_join_result(t);
      auto it = joins_.find(t);
      if (!outcome || it == joins_.end()) continue;
      JoinReactor* r = it->second;
      joins_.erase(it);
      metrics_.join(std::chrono::duration<double>(Clock::now() - r->start).count(), outcome->ok());
      if (!outcome->ok()) {
        r->Finish(to_grpc(outcome->status()));
        continue;
      }
      r->resp_->set_generation((*outcome)->generation);
      r->resp_->set_world_size((*outcome)->world_size);
      r->Finish(grpc::Status::OK);
    }
  }

  // Every tick: lease expiry (a heap: O(expiring)), join deadlines (O(jobs)). It wakes nothing
  // else. A tick that comes late means the coordinator itself was stalled: that time is
  // added to every lease rather than blamed on the nodes.
  void run_ticker() {
    auto log = log::get("coordinator");
    TimePoint due = Clock::now() + options_.tick;
    std::unique_lock lock(ticker_mu_);
    while (!stopping_flag()) {
      ticker_cv_.wait_until(lock, due);
      if (stopping_flag()) break;
      const TimePoint now = Clock::now();
      const auto late = std::chrono::duration_cast<Millis>(now - due);
      due = now + options_.tick;
      std::vector<std::pair<std::string, Millis>> expired;
      {
        std::lock_guard leases(lease_mu_);
        if (late > kStallSlack) {
          leases_.stalled(late);
          log->warn("the coordinator was stalled for {} ms (no CPU?): every lease is extended by that", late.count());
        }
        expired = leases_.expire(now);
        leases_expired_ += expired.size();
      }
      std::lock_guard table(mu_);
      for (const auto& [id, silent] : expired) {
        table_.lose_node(id, leases_.expiry_reason(silent));
      }
      table_.tick(now);
      dispatch_locked();
      finish_traces_locked(now);
    }
  }

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
  std::mutex ticker_mu_;
  std::condition_variable ticker_cv_;  // only to stop the ticker early
  std::thread ticker_;
  std::unique_ptr<StoreWriter> writer_;  // with a store: its records, written off the mutex
};

void JoinReactor::OnCancel() { service_->cancel_join(this); }
void TraceReactor::OnCancel() { service_->cancel_trace(this); }
void WatchReactor::OnReadDone(bool ok) { service_->watch_read(this, ok); }
void WatchReactor::OnWriteDone(bool ok) { service_->write_done(this, ok); }
void WatchReactor::OnCancel() { service_->watch_cancelled(this); }
void WatchReactor::OnDone() {
  service_->watch_done(this);
  delete this;
}

// --- CoordinatorServer ------------------------------------------------------------------

CoordinatorServer::CoordinatorServer(CoordinatorOptions options) : options_(options) {}

CoordinatorServer::~CoordinatorServer() {
  shutdown();
  wait();
}

Status CoordinatorServer::start(const std::string& listen_addr) {
  std::lock_guard lock(mu_);
  if (server_ || shut_down_) {
    return {Code::kFailedPrecondition, "CoordinatorServer::start called twice"};
  }
  service_ = std::make_unique<CoordinatorService>(options_);
  if (Status s = service_->restore(); !s.ok()) {
    service_.reset();
    return s;
  }
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second coordinator silently share
  // the port; a busy port must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kMinClientPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // No bandwidth-delay probes: every message received on a connection idle for a while starts
  // one (a PING and its answer), which tripled the cost of an idle node's heartbeat. The
  // coordinator receives only small messages, so the default receive window is enough.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto credentials = server_credentials(options_.tls, listen_addr);
  if (!credentials.ok()) {
    service_.reset();
    return credentials.status();
  }
  builder.AddListeningPort(listen_addr, *credentials, &port_);
  builder.RegisterService(service_.get());
  builder.experimental().SetInterceptorCreators(service_->metrics().interceptors());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    server_.reset();
    service_.reset();
    port_ = 0;
    return {Code::kUnavailable, "coordinator cannot listen on '" + listen_addr +
                                    "': the port is in use, the host is not an address of this "
                                    "machine, or the address is not HOST:PORT"};
  }
  service_->start();
  if (!options_.metrics_listen.empty()) {
    metrics_ = std::make_unique<MetricsServer>();
    CoordinatorService* service = service_.get();
    if (Status s = metrics_->start(options_.metrics_listen, [service] { return service->render_metrics(); }); !s.ok()) {
      metrics_.reset();
      server_->Shutdown();
      server_.reset();
      service_.reset();
      port_ = 0;
      return s;
    }
    log::get("coordinator")->info("metrics on {}", metrics_->url());
  }
  log::get("coordinator")
      ->info("listening on {} (port {}), lease {} ms, join timeout {} ms", listen_addr, port_,
             options_.lease.count(), options_.default_join_timeout.count());
  return Status::Ok();
}

void CoordinatorServer::shutdown() {
  std::lock_guard lock(mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (!server_) return;
  log::get("coordinator")->info("shutting down");
  if (metrics_) metrics_->stop();
  // Ending blocked calls first lets Shutdown() complete without waiting out the grace.
  service_->stop();
  server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
}

int CoordinatorServer::metrics_port() const { return metrics_ ? metrics_->port() : 0; }

bool CoordinatorServer::flush_store(Millis timeout) {
  std::lock_guard lock(mu_);
  return !service_ || service_->flush_store(timeout);
}

void CoordinatorServer::wait() {
  grpc::Server* server = nullptr;
  {
    std::lock_guard lock(mu_);
    server = server_.get();
  }
  if (server) server->Wait();
}

}  // namespace gradsync::coordinator
