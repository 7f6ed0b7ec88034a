// CoordinatorService's calls that register nodes and run jobs: RegisterNode, Heartbeat,
// JoinJob, GetPeerTable, LeaveJob, AbortJob, Regroup, ReportPath, and the operator's ListJobs
// and DescribeJob (coordinator/service_internal.h).
#include <algorithm>
#include <atomic>
#include <memory>
#include <random>
#include <thread>

#include "common/call_auth.h"
#include "common/log.h"
#include "coordinator/service_internal.h"

namespace gradsync::coordinator {
namespace {

// The name a registration takes, as the job table names it: the node name, else the hostname.
std::string node_name_of(const v1::NodeInfo& n) {
  return !n.node_name().empty() ? n.node_name() : !n.hostname().empty() ? n.hostname() : "node";
}

// Whether to refuse a registration while reads are `behind` (> kAdmitBehind): with probability
// (behind - kAdmitBehind) / kAdmitBehind.
bool refuse(Millis behind) {
  static thread_local std::mt19937 rng{std::random_device{}()};
  return std::uniform_int_distribution<int64_t>(0, kAdmitBehind.count() - 1)(rng) < (behind - kAdmitBehind).count();
}

}  // namespace

grpc::ServerUnaryReactor* CoordinatorService::RegisterNode(grpc::CallbackServerContext* ctx,
                                                           const v1::RegisterNodeRequest* req,
                                                           v1::RegisterNodeResponse* resp) {
  auto* r = ctx->DefaultReactor();
  // Admission: while the coordinator's reads are behind (a herd of registrations, joins or peer
  // tables queued ahead of the nodes' heartbeats), a registration is refused at once, before
  // any lock, with a retry hint that the daemon honours with jitter. Registrations so wait at
  // the daemons instead of in the queue that the heartbeats of registered nodes wait in. The
  // share refused grows from 0 at kAdmitBehind to all at twice it, so that the rate admitted
  // follows the coordinator's pace instead of swinging between all and none.
  if (const Millis behind{behind_ms_.load()}; behind > kAdmitBehind && refuse(behind)) {
    const Millis retry = std::clamp(behind, kMinRetryHint, kMaxRetryHint);
    ++registrations_refused_;
    ctx->AddTrailingMetadata(kRetryAfterHeader, std::to_string(retry.count()));
    r->Finish({grpc::StatusCode::RESOURCE_EXHAUSTED,
               "RegisterNode of " + node_name_of(req->node()) + " (host " + req->node().hostname() +
                   "): the coordinator is busy (it reads its nodes' heartbeats " + std::to_string(behind.count()) +
                   " ms late); retry in about " + std::to_string(retry.count()) + " ms"});
    return r;
  }
  Locked lock(this);
  if (stopping_) {
    finish_later(r, shutting_down());
    return r;
  }
  const std::string name = node_name_of(req->node());
  auto key = authz_.admit_node(*ctx, name, [this](const std::string& id) { return table_.has_node(id); });
  if (!key.ok()) {
    finish_later(r, to_grpc(key.status()));
    return r;
  }
  const TimePoint now = Clock::now();
  auto id = table_.register_node(req->node(), now);
  if (!id.ok()) {
    finish_later(r, to_grpc(id.status()));
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
    // Two leases for the node's first sign of life (its stream's naming message): the reply to
    // this call and that message both wait in the coordinator's queues, longest in a herd of
    // registrations, and no heartbeat of the node can measure them yet (coordinator/leases.h).
    std::lock_guard leases(lease_mu_);
    leases_.add(*id, now, options_.lease);
  }
  dispatch_locked();
  resp->set_node_id(*id);
  resp->set_lease_ms(static_cast<uint32_t>(options_.lease.count()));
  finish_later(r, grpc::Status::OK);
  return r;
}

// Only the lease table's own mutex: a heartbeat never waits for a join or a peer table.
grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* req,
                                                        v1::HeartbeatResponse* resp) {
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

grpc::ServerUnaryReactor* CoordinatorService::JoinJob(grpc::CallbackServerContext* ctx,
                                                      const v1::JoinJobRequest* req,
                                                      v1::JoinJobResponse* resp) {
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
  Locked lock(this);
  if (stopping_) {
    finish_later(r, shutting_down());
    return r;
  }
  auto ticket = table_.join(j, Clock::now());
  if (!ticket.ok()) {
    log::get("coordinator")->warn("rejected {}", ticket.status().to_string());
    finish_later(r, to_grpc(ticket.status()));
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

void CoordinatorService::cancel_join(JoinReactor* r) {
  Locked lock(this);
  r->cancelled = true;
  if (r->ticket != 0 && joins_.count(r->ticket)) {
    withdraw_locked(r, "the JoinJob call was cancelled or timed out");
    dispatch_locked();
  }
}

grpc::ServerUnaryReactor* CoordinatorService::GetPeerTable(grpc::CallbackServerContext* ctx,
                                                           const v1::PeerTableRequest* req,
                                                           v1::PeerTableResponse* resp) {
  auto* r = ctx->DefaultReactor();
  // The node a table is for is the caller (its credential is checked); a fetch by key needs
  // only the caller to be a member of the job.
  const std::string node = req->node_id().empty() ? Authorizer::node_id_of(*ctx) : req->node_id();
  if (Status a = authz_.job_call(*ctx, node, req->job_id(), "GetPeerTable"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  std::vector<uint32_t> ranks(req->ranks().begin(), req->ranks().end());
  Locked lock(this);
  if (!authz_.open() && !table_.is_member(req->job_id(), node)) {  // the caller must hold a rank of the job
    finish_later(r, to_grpc({Code::kPermissionDenied, "GetPeerTable job=" + req->job_id() + ": node '" + node +
                                                   "' is not a member of the job"}));
    return r;
  }
  auto table = table_.peer_table(req->job_id(), req->generation(), node, req->page(), ranks);
  if (!table.ok()) {
    finish_later(r, to_grpc(table.status()));
    return r;
  }
  *resp = std::move(*table);
  finish_later(r, grpc::Status::OK);  // serialised once the mutex is released (Locked)
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::LeaveJob(grpc::CallbackServerContext* ctx,
                                                       const v1::LeaveJobRequest* req,
                                                       v1::LeaveJobResponse*) {
  auto* r = ctx->DefaultReactor();
  if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "LeaveJob"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  Status s = table_.leave(req->node_id(), req->job_id(), req->generation());
  dispatch_locked();
  finish_later(r, to_grpc(s));
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::AbortJob(grpc::CallbackServerContext* ctx,
                                                       const v1::AbortJobRequest* req,
                                                       v1::AbortJobResponse*) {
  auto* r = ctx->DefaultReactor();
  if (Status a = req->node_id().empty() ? authz_.operator_call(*ctx, "AbortJob")
                                            : authz_.job_call(*ctx, req->node_id(), req->job_id(), "AbortJob"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  Status s = table_.abort(req->node_id(), req->job_id(), req->generation(), req->reason(), req->failed_rank());
  dispatch_locked();
  finish_later(r, to_grpc(s));
  return r;
}

// Elastic membership (coordinator/regroup.h): its own table and lock, apart from the jobs'.
// RegroupService's wait blocks, so each call waits on a thread of its own, not on one of
// gRPC's callback threads (regroup calls are few: one per rank when a job shrinks or grows).
grpc::ServerUnaryReactor* CoordinatorService::Regroup(grpc::CallbackServerContext* ctx,
                                                      const v1::RegroupRequest* req,
                                                      v1::RegroupResponse* resp) {
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
  Locked lock(this);
  if (stopping_) {
    finish_later(r, shutting_down());
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
    r->Finish(outcome.ok() ? grpc::Status::OK : to_grpc(outcome.status()));  // its own thread: no lock held
    done->store(true);
  });
  regroup_waits_.push_back({std::move(t), std::move(done)});
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::ReportPath(grpc::CallbackServerContext* ctx,
                                                         const v1::ReportPathRequest* req,
                                                         v1::ReportPathResponse*) {
  auto* r = ctx->DefaultReactor();
  if (Status a = authz_.job_call(*ctx, req->node_id(), req->job_id(), "ReportPath"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  finish_later(r, to_grpc(table_.report_path(req->node_id(), req->job_id(), req->generation(), req->path())));
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::ListJobs(grpc::CallbackServerContext* ctx,
                                                       const v1::ListJobsRequest*,
                                                       v1::ListJobsResponse* resp) {
  auto* r = ctx->DefaultReactor();
  if (Status a = authz_.operator_call(*ctx, "ListJobs"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  for (auto& job : table_.list_jobs()) *resp->add_jobs() = std::move(job);
  finish_later(r, grpc::Status::OK);
  return r;
}

grpc::ServerUnaryReactor* CoordinatorService::DescribeJob(grpc::CallbackServerContext* ctx,
                                                          const v1::DescribeJobRequest* req,
                                                          v1::DescribeJobResponse* resp) {
  auto* r = ctx->DefaultReactor();
  if (Status a = authz_.operator_call(*ctx, "DescribeJob"); !a.ok()) {
    r->Finish(to_grpc(a));
    return r;
  }
  Locked lock(this);
  auto d = table_.describe(req->job_id(), req->page());
  if (!d.ok()) {
    finish_later(r, to_grpc(d.status()));
    return r;
  }
  *resp = std::move(*d);
  finish_later(r, grpc::Status::OK);
  return r;
}

void CoordinatorService::withdraw_locked(JoinReactor* r, const std::string& why) {
  table_.withdraw(r->ticket, why);
  joins_.erase(r->ticket);
  finish_later(r, stopping_ ? shutting_down() : grpc::Status(grpc::StatusCode::CANCELLED, "JoinJob cancelled"));
}

void JoinReactor::OnCancel() { service_->cancel_join(this); }

}  // namespace gradsync::coordinator
