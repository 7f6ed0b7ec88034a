#include "coordinator/service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "common/call_auth.h"
#include "common/log.h"
#include "coordinator.grpc.pb.h"
#include "common/metrics_server.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/trace_gather.h"
#include "coordinator/regroup.h"

namespace gradsync::coordinator {
namespace {

// A node that never watches must not grow its queue without bound; the oldest go first.
constexpr size_t kMaxQueuedEventsPerNode = 4096;
// Blocked calls are woken by every tick; this is only a safety net in case one is missed.
constexpr Millis kSafetyWake{1000};
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

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  explicit CoordinatorService(const CoordinatorOptions& o)
      : options_(o), authz_(with_client_certs(o)), table_(JobTableOptions{o.lease, o.default_join_timeout}) {}
  ~CoordinatorService() override { stop(); }

  void start() {
    ticker_ = std::thread([this] { run_ticker(); });
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    regroup_.stop();
    join_cv_.notify_all();
    event_cv_.notify_all();
    ticker_cv_.notify_all();
    if (ticker_.joinable()) ticker_.join();
  }

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override {
    std::lock_guard lock(mu_);
    if (stopping_) return shutting_down();
    const std::string name = node_name_of(req->node());
    auto key = authz_.admit_node(*ctx, name, [this](const std::string& id) { return table_.has_node(id); });
    if (!key.ok()) return to_grpc(key.status());
    auto id = table_.register_node(req->node(), Clock::now());
    if (!id.ok()) return to_grpc(id.status());
    authz_.bound(name, *id, *key);
    if (!key->empty()) ctx->AddInitialMetadata(kNodeKeyHeader, *key);
    queues_[*id];  // queue events from now on, even before the node starts watching
    dispatch_locked();
    resp->set_node_id(*id);
    resp->set_lease_ms(static_cast<uint32_t>(options_.lease.count()));
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    if (Status a = authz_.node_call(*ctx, req->node_id(), "Heartbeat"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    Status s = table_.heartbeat(req->node_id(), Clock::now());
    if (!s.ok()) return to_grpc(s);
    resp->set_lease_ms(static_cast<uint32_t>(options_.lease.count()));
    return grpc::Status::OK;
  }

  grpc::Status JoinJob(grpc::ServerContext* ctx, const v1::JoinJobRequest* req,
                       v1::JoinJobResponse* resp) override {
    if (Status a = authz_.node_call(*ctx, req->node_id(), "JoinJob"); !a.ok()) return to_grpc(a);
    JoinRequest r;
    r.node_id = req->node_id();
    r.job_id = req->job_id();
    r.token = req->token();
    r.world_size = req->world_size();
    r.ranks.assign(req->ranks().begin(), req->ranks().end());
    r.endpoints.assign(req->endpoints().begin(), req->endpoints().end());
    r.timeout = Millis(req->timeout_ms());
    const Millis timeout = r.timeout.count() > 0 ? r.timeout : options_.default_join_timeout;

    std::unique_lock lock(mu_);
    if (stopping_) return shutting_down();
    const TimePoint start = Clock::now();
    auto ticket = table_.join(r, start);
    dispatch_locked();  // this join may have completed the generation
    if (!ticket.ok()) {
      log::get("coordinator")->warn("rejected {}", ticket.status().to_string());
      return to_grpc(ticket.status());
    }
    authz_.job_token(r.job_id, r.token);  // the table accepted it: the job's token
    // Wake at the join deadline (to fail it without waiting for the next tick) or at the
    // caller's own deadline, whichever is first; ticks wake us in between.
    TimePoint wake = start + timeout;
    const auto call_left = ctx->deadline() - std::chrono::system_clock::now();
    if (call_left < timeout) wake = start + std::chrono::duration_cast<Millis>(call_left);
    for (;;) {
      if (auto outcome = table_.take_join_result(*ticket)) {
        metrics_.join(std::chrono::duration<double>(Clock::now() - start).count(), outcome->ok());
        if (!outcome->ok()) return to_grpc(outcome->status());
        resp->set_generation((*outcome)->generation);
        resp->set_world_size((*outcome)->world_size);
        return grpc::Status::OK;
      }
      if (stopping_ || ctx->IsCancelled()) {
        table_.withdraw(*ticket, stopping_ ? "coordinator shutting down"
                                           : "the JoinJob call was cancelled or timed out");
        dispatch_locked();
        return stopping_ ? shutting_down()
                         : grpc::Status(grpc::StatusCode::CANCELLED, "JoinJob cancelled");
      }
      if (join_cv_.wait_until(lock, wake) == std::cv_status::timeout) {
        advance_locked(Clock::now());
        wake = Clock::now() + kSafetyWake;  // from now on the ticker wakes us
      }
    }
  }

  grpc::Status GetPeerTable(grpc::ServerContext* ctx, const v1::PeerTableRequest* req,
                            v1::PeerTableResponse* resp) override {
    const std::string node = Authorizer::node_id_of(*ctx);
    if (Status a = authz_.job_call(*ctx, node, req->job_id(), "GetPeerTable"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    auto table = table_.peer_table(req->job_id(), req->generation());
    if (!table.ok()) return to_grpc(table.status());
    if (!authz_.open() && std::none_of(table->peers().begin(), table->peers().end(),
                                       [&](const v1::PeerEntry& p) { return p.node_id() == node; })) {
      return to_grpc({Code::kPermissionDenied, "GetPeerTable job=" + req->job_id() + ": node '" + node +
                                                   "' is not a member of the job"});
    }
    *resp = std::move(*table);
    return grpc::Status::OK;
  }

  grpc::Status WatchEvents(grpc::ServerContext* ctx, const v1::WatchRequest* req,
                           grpc::ServerWriter<v1::Event>* writer) override {
    const std::string& id = req->node_id();
    if (Status a = authz_.node_call(*ctx, id, "WatchEvents"); !a.ok()) return to_grpc(a);
    std::unique_lock lock(mu_);
    if (stopping_) return shutting_down();
    if (!table_.has_node(id)) return to_grpc(lost_or_unknown(id));
    // One watcher per node: a newer WatchEvents (a daemon that reconnected) replaces this one.
    const uint64_t epoch = ++queues_[id].watch_epoch;
    event_cv_.notify_all();
    log::get("coordinator")->debug("node={} watching events", id);
    for (;;) {
      if (stopping_) return shutting_down();
      if (ctx->IsCancelled()) return {grpc::StatusCode::CANCELLED, "WatchEvents cancelled"};
      auto q = queues_.find(id);
      if (q == queues_.end() || !table_.has_node(id)) return to_grpc(lost_or_unknown(id));
      if (q->second.watch_epoch != epoch) {
        return {grpc::StatusCode::ABORTED,
                "WatchEvents for node " + id + " was replaced by a newer WatchEvents call"};
      }
      if (q->second.events.empty()) {
        event_cv_.wait_until(lock, Clock::now() + kSafetyWake);
        continue;
      }
      v1::Event ev = std::move(q->second.events.front());
      q->second.events.pop_front();
      lock.unlock();  // Write may block on flow control; never hold the table meanwhile
      const bool written = writer->Write(ev);
      lock.lock();
      if (!written) {
        q = queues_.find(id);  // keep the event for the node's next watcher
        if (q != queues_.end()) q->second.events.push_front(std::move(ev));
        return {grpc::StatusCode::CANCELLED, "WatchEvents stream closed by the client"};
      }
    }
  }

  grpc::Status LeaveJob(grpc::ServerContext* ctx, const v1::LeaveJobRequest* req,
                        v1::LeaveJobResponse*) override {
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "LeaveJob"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    Status s = table_.leave(req->node_id(), req->job_id(), req->generation());
    dispatch_locked();
    return to_grpc(s);
  }

  grpc::Status AbortJob(grpc::ServerContext* ctx, const v1::AbortJobRequest* req,
                        v1::AbortJobResponse*) override {
    // Without a node id the caller is an operator; a node must also hold the job's token.
    Status a = req->node_id().empty() ? authz_.operator_call(*ctx, "AbortJob")
                                      : authz_.job_call(*ctx, req->node_id(), req->job_id(), "AbortJob");
    if (!a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    Status s = table_.abort(req->node_id(), req->job_id(), req->generation(), req->reason(),
                            req->failed_rank());
    dispatch_locked();
    return to_grpc(s);
  }

  // Elastic membership (coordinator/regroup.h): its own table and lock, apart from the jobs'.
  grpc::Status Regroup(grpc::ServerContext* ctx, const v1::RegroupRequest* req, v1::RegroupResponse* resp) override {
    // The base job's token: the same for every generation of the job.
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "Regroup"); !a.ok()) return to_grpc(a);
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
    auto outcome = regroup_.run(c, Clock::now() + std::chrono::duration_cast<Millis>(call_left),
                                [ctx] { return ctx->IsCancelled(); });
    if (!outcome.ok()) return to_grpc(outcome.status());
    resp->set_generation(outcome->generation);
    resp->set_world_size(outcome->world_size);
    resp->set_rank(outcome->rank);
    resp->set_local_rank(outcome->local_rank);
    resp->set_local_world_size(outcome->local_world_size);
    for (int32_t r : outcome->old_ranks) resp->add_old_ranks(r);
    return grpc::Status::OK;
  }

  grpc::Status ReportPath(grpc::ServerContext* ctx, const v1::ReportPathRequest* req,
                          v1::ReportPathResponse*) override {
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportPath"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    return to_grpc(table_.report_path(req->node_id(), req->job_id(), req->generation(), req->path()));
  }

  // gradsyncctl trace: asks every member node's daemon for its ranks' flight recorders
  // (coordinator/trace_gather.h) and returns what came in time.
  grpc::Status TraceJob(grpc::ServerContext* ctx, const v1::TraceJobRequest* req,
                        v1::TraceJobResponse* resp) override {
    if (Status a = authz_.operator_call(*ctx, "TraceJob"); !a.ok()) return to_grpc(a);
    const Millis wait = req->timeout_ms() ? std::min(Millis(req->timeout_ms()), kTraceMaxWait) : kTraceDefaultWait;
    const uint32_t max_records = req->max_records() ? std::min(req->max_records(), kTraceMaxRecords) : kTraceDefaultRecords;
    uint64_t id = 0;
    uint32_t world = 0;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return shutting_down();
      auto d = table_.describe(req->job_id());
      if (!d.ok()) return to_grpc(d.status());
      *resp->mutable_summary() = d->summary();
      world = d->summary().world_size();
      std::map<std::string, std::set<uint32_t>> nodes;
      for (const auto& p : d->peers()) nodes[p.node_id()].insert(p.rank());
      id = traces_.open(req->job_id(), d->summary().generation(), nodes, max_records);
      for (const auto& [node, ranks] : nodes) {
        auto q = queues_.find(node);
        if (q == queues_.end() || !table_.has_node(node)) {
          traces_.unreachable(id, node, "not registered any more (its lease expired?)");
          continue;
        }
        v1::Event ev;
        ev.set_kind(v1::Event::TRACE_REQUESTED);
        ev.set_job_id(req->job_id());
        ev.set_generation(d->summary().generation());
        ev.set_request_id(id);
        ev.set_max_records(max_records);
        ev.set_quiet(req->quiet());
        q->second.events.push_back(std::move(ev));
      }
      event_cv_.notify_all();
    }
    auto got = traces_.wait(id, Clock::now() + wait, [ctx] { return ctx->IsCancelled(); });
    std::sort(got.ranks.begin(), got.ranks.end(), [](const auto& a, const auto& b) { return a.rank() < b.rank(); });
    for (auto& t : got.ranks) {
      if (t.rank() < world) *resp->add_ranks() = std::move(t);
    }
    for (auto& m : got.missing) resp->add_missing_nodes(std::move(m));
    for (auto& p : got.dumps) resp->add_dumps(std::move(p));
    return grpc::Status::OK;
  }

  grpc::Status ReportTrace(grpc::ServerContext* ctx, const v1::ReportTraceRequest* req,
                           v1::ReportTraceResponse*) override {
    if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportTrace"); !a.ok()) return to_grpc(a);
    {
      std::lock_guard lock(mu_);
      if (!table_.has_node(req->node_id())) return to_grpc(lost_or_unknown(req->node_id()));
    }
    return to_grpc(traces_.report(*req));
  }

  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest*,
                        v1::ListJobsResponse* resp) override {
    if (Status a = authz_.operator_call(*ctx, "ListJobs"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    for (auto& job : table_.list_jobs()) *resp->add_jobs() = std::move(job);
    return grpc::Status::OK;
  }

  grpc::Status DescribeJob(grpc::ServerContext* ctx, const v1::DescribeJobRequest* req,
                           v1::DescribeJobResponse* resp) override {
    if (Status a = authz_.operator_call(*ctx, "DescribeJob"); !a.ok()) return to_grpc(a);
    std::lock_guard lock(mu_);
    auto d = table_.describe(req->job_id());
    if (!d.ok()) return to_grpc(d.status());
    *resp = std::move(*d);
    return grpc::Status::OK;
  }

  CoordinatorMetrics& metrics() { return metrics_; }
  // /metrics (coordinator/coordinator_metrics.h): the table's part read under mu_.
  std::string render_metrics() {
    std::lock_guard lock(mu_);
    return metrics_.render(table_.node_count(), table_.leases_expired(), table_.list_jobs());
  }

 private:
  struct NodeQueue {
    std::deque<v1::Event> events;
    uint64_t watch_epoch = 0;  // bumped by each WatchEvents; older watchers then end
  };

  Status lost_or_unknown(const std::string& id) const {
    return {Code::kNotFound, "WatchEvents: node '" + id +
                                 "' is not registered (unknown, or lost after its lease of " +
                                 std::to_string(options_.lease.count()) +
                                 " ms expired); the daemon must RegisterNode again"};
  }

  // Moves the table's new events into the node queues and wakes whoever may care.
  void dispatch_locked() {
    std::vector<Delivery> events = table_.take_events();
    for (auto& d : events) {
      auto& q = queues_[d.node_id].events;
      if (q.size() >= kMaxQueuedEventsPerNode) {
        log::get("coordinator")
            ->warn("node={} is not reading its events; dropping the oldest", d.node_id);
        q.pop_front();
      }
      q.push_back(std::move(d.event));
    }
    for (const auto& id : table_.take_removed_nodes()) queues_.erase(id);
    event_cv_.notify_all();
    join_cv_.notify_all();
  }

  void advance_locked(TimePoint now) {
    table_.tick(now);
    dispatch_locked();
  }

  void run_ticker() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      ticker_cv_.wait_until(lock, Clock::now() + options_.tick, [this] { return stopping_; });
      if (stopping_) break;
      advance_locked(Clock::now());  // also wakes blocked calls to check for cancellation
    }
  }

  static AuthzOptions with_client_certs(const CoordinatorOptions& o) {
    AuthzOptions a = o.authz;
    a.client_certs = a.client_certs || o.tls.require_client_cert;
    return a;
  }

  const CoordinatorOptions options_;
  Authorizer authz_;
  std::mutex mu_;
  std::condition_variable join_cv_;    // a join outcome may be ready
  std::condition_variable event_cv_;   // an event queue changed
  std::condition_variable ticker_cv_;  // only to stop the ticker early
  JobTable table_;
  RegroupService regroup_;
  std::map<std::string, NodeQueue> queues_;
  TraceGather traces_;  // open TraceJob requests (own mutex)
  CoordinatorMetrics metrics_;  // own mutex
  bool stopping_ = false;
  std::thread ticker_;
};

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
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second coordinator silently share
  // the port; a busy port must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kMinClientPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
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

void CoordinatorServer::wait() {
  grpc::Server* server = nullptr;
  {
    std::lock_guard lock(mu_);
    server = server_.get();
  }
  if (server) server->Wait();
}

}  // namespace gradsync::coordinator
