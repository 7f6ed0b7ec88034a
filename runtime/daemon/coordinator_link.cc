#include "daemon/coordinator_link.h"

#include <random>

#include "common/fd.h"
#include "common/log.h"

namespace gradsync {
namespace {

// Deadline of one short control call (register, heartbeat, leave, abort).
constexpr std::chrono::milliseconds kCallTimeout{5'000};
// Deadline of a ReportTrace call: past it, gradsyncctl trace has stopped waiting anyway.
constexpr std::chrono::milliseconds kTraceCallTimeout{3'000};
// A peer-table page, when thousands of nodes ask at once: the coordinator queues rather than
// fails, so the page gets longer; a busy coordinator is retried (below) until kTableTimeout.
constexpr std::chrono::milliseconds kTablePageTimeout{20'000};
constexpr std::chrono::milliseconds kTableTimeout{60'000};
// Pause before re-opening a broken event stream.
constexpr std::chrono::milliseconds kRetryPause{500};

// Jittered exponential backoff: attempt 0 waits 50-100 ms, doubling up to 1-2 s, so that a
// herd of daemons retrying a busy coordinator spreads out instead of arriving together.
std::chrono::milliseconds backoff(int attempt) {
  static thread_local std::mt19937 rng{std::random_device{}()};
  const int ceiling = 100 << std::min(attempt, 4);
  return std::chrono::milliseconds(std::uniform_int_distribution<int>(ceiling / 2, ceiling)(rng));
}

// The coordinator was busy or unreachable: worth another try.
bool retryable(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

void set_deadline(grpc::ClientContext& ctx, std::chrono::milliseconds timeout) {
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
}

Code to_code(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return Code::kOk;
    case grpc::StatusCode::INVALID_ARGUMENT: return Code::kInvalidArgument;
    case grpc::StatusCode::NOT_FOUND: return Code::kNotFound;
    case grpc::StatusCode::ALREADY_EXISTS: return Code::kAlreadyExists;
    case grpc::StatusCode::PERMISSION_DENIED: return Code::kPermissionDenied;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return Code::kDeadlineExceeded;
    case grpc::StatusCode::UNAVAILABLE: return Code::kUnavailable;
    case grpc::StatusCode::ABORTED: return Code::kAborted;
    case grpc::StatusCode::FAILED_PRECONDITION: return Code::kFailedPrecondition;
    default: return Code::kInternal;
  }
}

}  // namespace

CoordinatorLink::CoordinatorLink(std::string address, std::shared_ptr<grpc::ChannelCredentials> credentials,
                                 std::shared_ptr<CallAuth> auth, v1::NodeInfo node, EventHandler on_event)
    : address_(std::move(address)), node_(std::move(node)), on_event_(std::move(on_event)), auth_(std::move(auth)) {
  // A retried registration (an answer that arrived after our deadline) must not look like a
  // restarted daemon to the coordinator: this process's registrations share one incarnation.
  if (node_.incarnation() == 0) {
    std::random_device rd;
    node_.set_incarnation((uint64_t(rd()) << 32 | rd()) | 1);
  }
  grpc::ChannelArguments args;
  // Reconnect quickly after a coordinator restart instead of gRPC's default backoff (up to 2 min).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // After a failed connection gRPC asks its resolver again, and the DNS resolver answers at
  // most every 30 s by default: calls failed "Connection refused" for seconds after the
  // coordinator was back (issue 17's 7 s gap of new jobs after a coordinator restart).
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 100);
  channel_ = coordinator_channel(address_, credentials, args, auth_);
  stub_ = v1::Coordinator::NewStub(channel_);
}

CoordinatorLink::~CoordinatorLink() { stop(); }

Status CoordinatorLink::from_grpc(const grpc::Status& s, const std::string& what) const {
  if (s.ok()) return Status::Ok();
  std::string msg = s.error_message();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    msg = "coordinator at " + address_ + " unreachable during " + what + " (" + msg +
          "); is gradsync-coordinator running?";
  } else {
    msg = what + ": " + msg;
  }
  return {to_code(s.error_code()), msg};
}

Status CoordinatorLink::register_node() {
  grpc::ClientContext ctx;
  set_deadline(ctx, kCallTimeout);
  v1::RegisterNodeRequest req;
  *req.mutable_node() = node_;
  v1::RegisterNodeResponse resp;
  GS_RETURN_IF_ERROR(from_grpc(stub_->RegisterNode(&ctx, req, &resp), "register"));
  // The key that binds this node's name to this daemon: every later call carries it.
  const auto& md = ctx.GetServerInitialMetadata();
  auto key = md.find(kNodeKeyHeader);
  auth_->set_node(resp.node_id(), key == md.end() ? "" : std::string(key->second.data(), key->second.size()));
  std::lock_guard lock(mu_);
  node_id_ = resp.node_id();
  lease_ms_ = std::max<uint32_t>(resp.lease_ms(), 300);
  log::get("daemon")->info("registered with coordinator {} as node={} lease={}ms", address_,
                           node_id_, lease_ms_);
  return Status::Ok();
}

Status CoordinatorLink::start(std::chrono::milliseconds timeout) {
  Deadline deadline = deadline_after(timeout);
  Status s;
  for (int attempt = 0; !(s = register_node()).ok(); ++attempt) {
    const auto pause = backoff(attempt);
    if (Clock::now() + pause >= deadline) return s;
    std::this_thread::sleep_for(pause);
  }
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  watcher_ = std::thread([this] { watch_loop(); });
  return Status::Ok();
}

void CoordinatorLink::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    if (watch_ctx_) watch_ctx_->TryCancel();
    cv_.notify_all();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (watcher_.joinable()) watcher_.join();
}

std::string CoordinatorLink::node_id() const {
  std::lock_guard lock(mu_);
  return node_id_;
}

void CoordinatorLink::heartbeat_loop() {
  auto log = log::get("daemon");
  std::unique_lock lock(mu_);
  while (!stopping_) {
    // A third of the lease: two heartbeats may be lost before the lease expires.
    cv_.wait_for(lock, std::chrono::milliseconds(lease_ms_ / 3));
    if (stopping_) return;
    std::string id = node_id_;
    lock.unlock();
    grpc::ClientContext ctx;
    set_deadline(ctx, kCallTimeout);
    v1::HeartbeatRequest req;
    req.set_node_id(id);
    v1::HeartbeatResponse resp;
    grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      log->warn("coordinator {} forgot node={} (restarted or lease expired); re-registering",
                address_, id);
      if (on_forgotten_) on_forgotten_(id);
      (void)register_node();
    } else if (!s.ok()) {
      log->warn("heartbeat to coordinator {} failed: {}", address_, s.error_message());
    }
    lock.lock();
  }
}

void CoordinatorLink::watch_loop() {
  auto log = log::get("daemon");
  for (;;) {
    grpc::ClientContext ctx;
    v1::WatchRequest req;
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      req.set_node_id(node_id_);
      watch_ctx_ = &ctx;
    }
    auto reader = stub_->WatchEvents(&ctx, req);
    v1::Event ev;
    while (reader->Read(&ev)) on_event_(ev);
    grpc::Status s = reader->Finish();
    std::unique_lock lock(mu_);
    watch_ctx_ = nullptr;
    if (stopping_) return;
    log->debug("event stream from {} ended: {}", address_, s.error_message());
    cv_.wait_for(lock, kRetryPause);
  }
}

Result<v1::JoinJobResponse> CoordinatorLink::join(v1::JoinJobRequest req,
                                                  std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  // The coordinator fails the join itself at `timeout`; our deadline is a backstop.
  set_deadline(ctx, timeout + kCallTimeout);
  req.set_node_id(node_id());
  req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
  auth_->set_job_token(req.job_id(), req.token());  // the job's later calls carry it
  v1::JoinJobResponse resp;
  Status s = from_grpc(stub_->JoinJob(&ctx, req, &resp), "join of job " + req.job_id());
  if (!s.ok()) return s;
  return resp;
}

Result<v1::PeerTableResponse> CoordinatorLink::peer_table(const std::string& job,
                                                          uint64_t generation) {
  const Deadline deadline = deadline_after(kTableTimeout);
  v1::PeerTableResponse out;
  uint32_t pages = 1;
  for (uint32_t page = 0; page < pages; ++page) {
    v1::PeerTableResponse resp;
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      set_deadline(ctx, kTablePageTimeout);
      auth_->add_job_token(ctx, job);
      v1::PeerTableRequest req;
      req.set_job_id(job);
      req.set_generation(generation);
      req.set_node_id(node_id());
      req.set_page(page);
      resp.Clear();
      grpc::Status s = stub_->GetPeerTable(&ctx, req, &resp);
      if (s.ok()) break;
      const auto pause = backoff(attempt);
      if (!retryable(s.error_code()) || Clock::now() + pause >= deadline) {
        return from_grpc(s, "peer table of job " + job + " (page " + std::to_string(page + 1) + ")");
      }
      log::get("daemon")->info("peer table of job {} from coordinator {}: {}; retrying in {} ms", job, address_,
                               s.error_message(), pause.count());
      std::this_thread::sleep_for(pause);
    }
    if (page == 0) {
      pages = std::max<uint32_t>(resp.pages(), 1);
      if (pages > kMaxTablePages) {
        return Status(Code::kInternal, "coordinator " + address_ + " announced " + std::to_string(pages) +
                                           " peer-table pages for job " + job);
      }
      out = std::move(resp);
      continue;
    }
    for (auto& p : *resp.mutable_peers()) *out.add_peers() = std::move(p);
    for (auto& r : *resp.mutable_runs()) *out.add_runs() = std::move(r);
    for (auto& t : *resp.mutable_shapes()) *out.add_shapes() = std::move(t);
  }
  return out;
}

Status CoordinatorLink::leave(const std::string& job, uint64_t generation) {
  grpc::ClientContext ctx;
  set_deadline(ctx, kCallTimeout);
  auth_->add_job_token(ctx, job);
  v1::LeaveJobRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  v1::LeaveJobResponse resp;
  return from_grpc(stub_->LeaveJob(&ctx, req, &resp), "leave of job " + job);
}

Status CoordinatorLink::report_path(const std::string& job, uint64_t generation, const v1::RankPath& path) {
  grpc::ClientContext ctx;
  set_deadline(ctx, kCallTimeout);
  auth_->add_job_token(ctx, job);
  v1::ReportPathRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  *req.mutable_path() = path;
  v1::ReportPathResponse resp;
  return from_grpc(stub_->ReportPath(&ctx, req, &resp), "path report of job " + job);
}

Status CoordinatorLink::report_trace(v1::ReportTraceRequest req) {
  grpc::ClientContext ctx;
  set_deadline(ctx, kTraceCallTimeout);
  auth_->add_job_token(ctx, req.job_id());
  req.set_node_id(node_id());
  v1::ReportTraceResponse resp;
  return from_grpc(stub_->ReportTrace(&ctx, req, &resp), "flight recorders of job " + req.job_id());
}

Status CoordinatorLink::abort(const std::string& job, uint64_t generation, int failed_rank,
                              const std::string& reason) {
  grpc::ClientContext ctx;
  set_deadline(ctx, kCallTimeout);
  auth_->add_job_token(ctx, job);
  v1::AbortJobRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  req.set_failed_rank(failed_rank);
  req.set_reason(reason);
  v1::AbortJobResponse resp;
  return from_grpc(stub_->AbortJob(&ctx, req, &resp), "abort of job " + job);
}

Result<v1::RegroupResponse> CoordinatorLink::regroup(v1::RegroupRequest req) {
  grpc::ClientContext ctx;
  // The coordinator answers by the request's wait; our deadline is a backstop.
  set_deadline(ctx, std::chrono::milliseconds(req.wait_ms()) + kCallTimeout);
  req.set_node_id(node_id());
  // The caller's own token, not the one this daemon keeps for the job's calls: a newcomer
  // with a wrong one must not replace it.
  if (!req.token().empty()) ctx.AddMetadata(kJobTokenHeader, req.token());
  v1::RegroupResponse resp;
  Status s = from_grpc(stub_->Regroup(&ctx, req, &resp), "regroup of job " + req.job_id());
  if (!s.ok()) return s;
  return resp;
}

}  // namespace gradsync
