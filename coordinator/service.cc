// CoordinatorServer and the CoordinatorService's life (coordinator/service_internal.h): its
// restore from the store, stop, the ticker, and dispatching the job table's events and answers.
#include "coordinator/service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <list>

#include "common/log.h"
#include "common/metrics_server.h"
#include "coordinator/service_internal.h"

namespace gradsync::coordinator {
namespace {

// How long shutdown() lets in-flight calls finish before gRPC cancels them.
constexpr Millis kShutdownGrace{2000};
// Server keepalive: finds half-open WatchEvents streams of daemons that vanished.
constexpr int kKeepaliveTimeMs = 30000;
constexpr int kKeepaliveTimeoutMs = 10000;
// Daemons may ping this often: gradsyncd pings every second to find a partition within its
// lease (kNodePingPeriod, daemon/event_stream.h). A ping is answered by the transport, not the service.
constexpr int kMinClientPingIntervalMs = 500;

}  // namespace

void set_keepalive_policy(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kMinClientPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
}

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

grpc::Status shutting_down() {
  return {grpc::StatusCode::UNAVAILABLE,
          "coordinator is shutting down; retry against the restarted coordinator"};
}

// Loads the store's nodes and jobs (coordinator/store.h) before the service answers: the
// nodes keep their ids and keys and get a full lease from now, the jobs their generations.
Status CoordinatorService::restore() {
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
  Locked lock(this);
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

void CoordinatorService::stop() {
  {
    Locked lock(this);
    if (!stopping_) {
      stopping_ = true;
      for (auto& [ticket, r] : joins_) {
        table_.withdraw(ticket, "coordinator shutting down");
        finish_later(r, shutting_down());
      }
      joins_.clear();
      for (auto& [id, r] : trace_calls_) {
        traces_.cancel(id);
        finish_later(r, shutting_down());
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

// /metrics (coordinator/coordinator_metrics.h): the table's part read under mu_.
std::string CoordinatorService::render_metrics() {
  std::lock_guard lock(mu_);
  CoordinatorMetrics::LeaseFigures figures;
  {
    std::lock_guard leases(lease_mu_);
    figures.expired = leases_expired_;
    figures.behind_s = std::chrono::duration<double>(leases_.behind()).count();
    figures.extended_s = std::chrono::duration<double>(leases_.stalled_total()).count();
  }
  return metrics_.render(table_.node_count(), figures, table_.list_jobs());
}

void CoordinatorService::run_deferred(std::unique_lock<std::mutex>& lock) {
  if (deferred_.empty()) return;
  std::vector<Deferred> ops;
  ops.swap(deferred_);
  lock.unlock();
  for (Deferred& op : ops) {
    if (op.unary) op.unary->Finish(std::move(op.status));
    else if (op.write) op.watch->io.Write(op.watch->current, op.watch->tag(WatchStream::kWrite));
    else {
      metrics_.rpc(kWatchEventsMethod, op.status.error_code());  // no interceptor on the streams
      op.watch->io.Finish(op.status, op.watch->tag(WatchStream::kFinish));
    }
  }
}

// Moves the table's new events into the node queues and onto their streams, ends the
// streams and leases of removed nodes, and answers the joins the table resolved.
void CoordinatorService::dispatch_locked() {
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
      finish_later(r, to_grpc(outcome->status()));
      continue;
    }
    r->resp_->set_generation((*outcome)->generation);
    r->resp_->set_world_size((*outcome)->world_size);
    finish_later(r, grpc::Status::OK);
  }
}

// Every tick: lease expiry (a heap: O(expiring)), join deadlines (O(jobs)). It wakes nothing
// else. Two delays of the coordinator's own are added to every lease rather than blamed on the
// nodes (coordinator/leases.h): a tick that comes late (the coordinator itself was stalled),
// and heartbeats read late (its reads are behind: a queue of unread messages).
void CoordinatorService::run_ticker() {
  auto log = log::get("coordinator");
  TimePoint due = Clock::now() + options_.tick;
  Millis reported{0};  // the last "behind" figure logged
  std::unique_lock lock(ticker_mu_);
  while (!stopping_flag()) {
    ticker_cv_.wait_until(lock, due);
    if (stopping_flag()) break;
    const TimePoint now = Clock::now();
    const auto late = std::chrono::duration_cast<Millis>(now - due);
    due = now + options_.tick;
    std::vector<std::pair<std::string, Millis>> expired;
    Millis behind{0};
    {
      std::lock_guard leases(lease_mu_);
      if (late > kStallSlack) {
        leases_.stalled(late);
        log->warn("the coordinator was stalled for {} ms (no CPU?): every lease is extended by that", late.count());
      }
      behind = leases_.update_behind(now, kStallSlack);
      expired = leases_.expire(now);
      leases_expired_ += expired.size();
    }
    behind_ms_.store(behind.count());
    if (behind > kStallSlack && behind >= 2 * reported) {
      log->warn("the coordinator reads heartbeats {} ms late (median of the last window): every lease is "
                "extended by that{}", behind.count(),
                behind > kAdmitBehind ? ", and registrations are refused with a retry hint until it catches up" : "");
      reported = behind;
    } else if (behind <= kStallSlack && reported > Millis{0}) {
      log->info("the coordinator has caught up with its reads ({} ms late); {} registration(s) were refused "
                "meanwhile", behind.count(), registrations_refused_.load());
      reported = Millis{0};
    }
    Locked table(this);
    for (const auto& [id, silent] : expired) {
      table_.lose_node(id, leases_.expiry_reason(silent));
    }
    table_.tick(now);
    dispatch_locked();
    finish_traces_locked(now);
  }
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
  set_keepalive_policy(builder);
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
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> stream_queues;
  for (size_t k = 0; k < kStreamQueues; ++k) stream_queues.push_back(builder.AddCompletionQueue());
  server_ = builder.BuildAndStart();
  if (!server_ || port_ == 0) {
    if (server_) server_->Shutdown();
    for (auto& q : stream_queues) q->Shutdown();
    for (auto& q : stream_queues) {
      void* tag = nullptr;
      bool ok = false;
      while (q->Next(&tag, &ok)) {
      }
    }
    server_.reset();
    service_.reset();
    port_ = 0;
    return {Code::kUnavailable, "coordinator cannot listen on '" + listen_addr +
                                    "': the port is in use, the host is not an address of this "
                                    "machine, or the address is not HOST:PORT"};
  }
  service_->start();
  service_->start_streams(std::move(stream_queues));
  if (!options_.metrics_listen.empty()) {
    metrics_ = std::make_unique<MetricsServer>();
    CoordinatorService* service = service_.get();
    if (Status s = metrics_->start(options_.metrics_listen, [service] { return service->render_metrics(); }); !s.ok()) {
      metrics_.reset();
      service_->stop();
      server_->Shutdown();
      service_->stop_streams();
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
  // Every call has ended: nothing begins an operation on the stream queues any more.
  service_->stop_streams();
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
