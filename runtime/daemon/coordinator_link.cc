#include "daemon/coordinator_link.h"

#include <random>

#include "common/fd.h"
#include "common/log.h"

namespace gradsync {
namespace {

// Deadline of one short control call (register, leave, abort).
constexpr std::chrono::milliseconds kCallTimeout{5'000};
// Deadline of a ReportTrace call: past it, gradsyncctl trace has stopped waiting anyway.
constexpr std::chrono::milliseconds kTraceCallTimeout{3'000};
// A peer-table page, when thousands of nodes ask at once: the coordinator queues rather than
// fails, so the page gets longer; a busy coordinator is retried (below) until kTableTimeout.
constexpr std::chrono::milliseconds kTablePageTimeout{20'000};
constexpr std::chrono::milliseconds kTableTimeout{60'000};
// Pause before re-opening an event stream that ended (the coordinator is up).
constexpr std::chrono::milliseconds kRetryPause{500};

// Jittered exponential backoff: attempt 0 waits 50-100 ms, doubling up to 1-2 s, so that a
// herd of daemons retrying a busy coordinator spreads out instead of arriving together.
std::chrono::milliseconds backoff(int attempt) {
  static thread_local std::mt19937 rng{std::random_device{}()};
  const int ceiling = 100 << std::min(attempt, 4);
  return std::chrono::milliseconds(std::uniform_int_distribution<int>(ceiling / 2, ceiling)(rng));
}

// The pause a busy coordinator asked for (kRetryAfterHeader), jittered to 0.5-1.5 times it so
// that the refused daemons do not come back together; 0 when it asked for none.
std::chrono::milliseconds jittered(std::chrono::milliseconds hint) {
  if (hint.count() <= 0) return hint;
  static thread_local std::mt19937 rng{std::random_device{}()};
  return std::chrono::milliseconds(std::uniform_int_distribution<long>(hint.count() / 2, hint.count() * 3 / 2)(rng));
}

// How long a call to a single coordinator that is unreachable is tried again (with_failover):
// four of the channel's longest reconnect pauses.
constexpr std::chrono::milliseconds kUnreachableGrace = 4 * kNodeMaxReconnect;

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
    : addresses_(std::move(address)), node_(std::move(node)), on_event_(std::move(on_event)), auth_(std::move(auth)) {
  // A retried registration (an answer that arrived after our deadline) must not look like a
  // restarted daemon to the coordinator: this process's registrations share one incarnation.
  if (node_.incarnation() == 0) {
    std::random_device rd;
    node_.set_incarnation((uint64_t(rd()) << 32 | rd()) | 1);
  }
  const grpc::ChannelArguments args = node_channel_args();  // keepalive pings, quick reconnection
  auto add_target = [&](std::string address) {
    auto channel = coordinator_channel(address, credentials, args, auth_);
    auto stub = v1::Coordinator::NewStub(channel);
    targets_.push_back({std::move(address), std::move(channel), std::move(stub)});
  };
  for (size_t start = 0; start <= addresses_.size();) {
    size_t comma = addresses_.find(',', start);
    if (comma == std::string::npos) comma = addresses_.size();
    std::string one = addresses_.substr(start, comma - start);
    start = comma + 1;
    if (!one.empty()) add_target(std::move(one));
  }
  // The daemon checks its flag; keep one target so calls fail with a message.
  if (targets_.empty()) add_target(addresses_);
}

std::string CoordinatorLink::address() const {
  std::lock_guard lock(mu_);
  return targets_[current_].address;
}

std::pair<size_t, v1::Coordinator::Stub*> CoordinatorLink::current() const {
  std::lock_guard lock(mu_);
  return {current_, targets_[current_].stub.get()};
}

void CoordinatorLink::fail_over(size_t index, const grpc::Status& s) {
  if (targets_.size() < 2) return;
  std::lock_guard lock(mu_);
  if (current_ != index) return;  // another call moved already
  size_t next = (index + 1) % targets_.size();
  // A standby names the leader: "... the leader is HOST:PORT (...".
  const std::string& msg = s.error_message();
  if (size_t at = msg.find(kLeaderIsPhrase); at != std::string::npos) {
    at += std::string(kLeaderIsPhrase).size();
    const std::string leader = msg.substr(at, msg.find_first_of(" ,;)", at) - at);
    for (size_t i = 0; i < targets_.size(); ++i) {
      if (targets_[i].address == leader) next = i;
    }
  }
  current_ = next;
  uint64_t held_back = 0;
  if (failover_logs_.allow(&held_back)) {
    log::get("daemon")->info("coordinator {} unavailable ({}); trying {} ({} more moves not logged)",
                             targets_[index].address, s.error_message(), targets_[next].address, held_back);
  }
}

grpc::Status CoordinatorLink::with_failover(const std::function<grpc::Status(v1::Coordinator::Stub&)>& call,
                                            Deadline deadline, std::string* address) {
  const auto first = Clock::now();
  for (int attempt = 0;; ++attempt) {
    auto [index, stub] = current();
    grpc::Status s = call(*stub);
    if (address) *address = targets_[index].address;
    // CANCELLED: the call reached a standby as it stopped to become the leader (its server's
    // shutdown cancels calls in flight); this side never cancels a call itself.
    const bool cancelled = s.error_code() == grpc::StatusCode::CANCELLED;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE && !cancelled) return s;
    if (targets_.size() < 2) {
      // One coordinator, unreachable: it may have just come back, with this channel still in
      // its reconnect backoff (at most kNodeMaxReconnect), where a call fails at once. A few
      // tries over kUnreachableGrace find it serving; a coordinator that stays down fails the
      // call that much later.
      const auto pause = std::chrono::milliseconds(100);
      if (Clock::now() - first + pause > kUnreachableGrace || Clock::now() + pause >= deadline) return s;
      std::this_thread::sleep_for(pause);
      continue;
    }
    if (!cancelled) fail_over(index, s);
    // Every coordinator tried once: wait a little for an election before the next round. Short
    // (100-200 ms), not growing: a new leader must see the joins as soon as it serves.
    if ((attempt + 1) % targets_.size() == 0) {
      const auto pause = backoff(1);
      if (Clock::now() + pause >= deadline) return s;
      std::this_thread::sleep_for(pause);
    }
    if (Clock::now() >= deadline) return s;
  }
}

CoordinatorLink::~CoordinatorLink() { stop(); }

Status CoordinatorLink::from_grpc(const grpc::Status& s, const std::string& what, const std::string& address) const {
  if (s.ok()) return Status::Ok();
  std::string msg = s.error_message();
  const std::string where = targets_.size() > 1 ? address + " (of " + addresses_ + ")" : address;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    msg = "coordinator at " + where + " unreachable during " + what + " (" + msg +
          "); is gradsync-coordinator running" + (targets_.size() > 1 ? ", and is one of them the leader?" : "?");
  } else {
    msg = what + ": " + msg;
  }
  return {to_code(s.error_code()), msg};
}

Status CoordinatorLink::register_node() {
  v1::RegisterNodeRequest req;
  *req.mutable_node() = node_;
  v1::RegisterNodeResponse resp;
  std::string key, address;
  grpc::Status s = with_failover(
      [&](v1::Coordinator::Stub& stub) {
        grpc::ClientContext ctx;
        set_deadline(ctx, kCallTimeout);
        resp.Clear();
        grpc::Status st = stub.RegisterNode(&ctx, req, &resp);
        register_hint_ = retry_hint(ctx);
        // The key that binds this node's name to this daemon: every later call carries it.
        const auto& md = ctx.GetServerInitialMetadata();
        auto k = md.find(kNodeKeyHeader);
        key = k == md.end() ? "" : std::string(k->second.data(), k->second.size());
        return st;
      },
      deadline_after(kCallTimeout), &address);
  GS_RETURN_IF_ERROR(from_grpc(s, "register", address));
  auth_->set_node(resp.node_id(), key);
  std::lock_guard lock(mu_);
  node_id_ = resp.node_id();
  ++registrations_;
  cv_.notify_all();  // a join that found the node unknown waits for this (join)
  lease_ms_ = std::max<uint32_t>(resp.lease_ms(), 300);
  log::get("daemon")->info("registered with coordinator {} as node={} lease={}ms", address, node_id_, lease_ms_);
  return Status::Ok();
}

Status CoordinatorLink::start(std::chrono::milliseconds timeout) {
  Deadline deadline = deadline_after(timeout);
  Status s;
  for (int attempt = 0; !(s = register_node()).ok(); ++attempt) {
    const auto pause = std::max(backoff(attempt), jittered(register_hint_.load()));
    if (Clock::now() + pause >= deadline) return s;
    std::this_thread::sleep_for(pause);
  }
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
  watcher_ = std::thread([this] { watch_loop(); });
  return Status::Ok();
}

void CoordinatorLink::stop() {
  std::shared_ptr<EventStream> stream;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    stream = stream_;
    cv_.notify_all();
  }
  if (stream) stream->cancel();  // not under mu_: the stream's callbacks take it
  if (heartbeat_.joinable()) heartbeat_.join();
  if (watcher_.joinable()) watcher_.join();
}

std::string CoordinatorLink::node_id() const {
  std::lock_guard lock(mu_);
  return node_id_;
}

namespace {

// Why a coordinator answered a heartbeat NOT_FOUND, from what this daemon saw since its last
// acknowledged heartbeat `silent_ms` ago: a heartbeat thread that did not run for longer than
// the lease (`idle_ms`: this process was paused), heartbeats refused (the coordinator was down),
// failed or unanswered (cut off), or an acknowledgement within the lease (the coordinator
// restarted, losing what it kept in memory).
std::string forgotten_cause(int64_t silent_ms, int64_t idle_ms, int failed, int refused, uint32_t lease_ms) {
  const std::string lease = " (its lease is " + std::to_string(lease_ms) + " ms)";
  const std::string in_memory =
      "(a coordinator keeps them in memory unless it runs with --store etcd://...)";
  if (idle_ms > lease_ms) {
    return "no heartbeat went out for " + std::to_string(idle_ms) + " ms" + lease +
           ": this gradsyncd was paused (SIGSTOP, a debugger) or starved, and the coordinator gave up the node "
           "and its jobs";
  }
  if (silent_ms < lease_ms) {
    return "its last heartbeat was acknowledged " + std::to_string(silent_ms) + " ms ago" + lease +
           ", so the coordinator restarted and lost the node and its jobs " + in_memory;
  }
  if (failed > 0 && refused == failed) {
    return "the coordinator refused every heartbeat for " + std::to_string(silent_ms) + " ms" + lease +
           " (it was down), and came back without the node and its jobs: it restarted and lost them " + in_memory;
  }
  return "it could not reach the coordinator for " + std::to_string(silent_ms) + " ms" + lease + " (" +
         std::to_string(failed) + " heartbeats failed, the others unanswered: a network partition or a coordinator "
         "outage), and the coordinator gave up the node and its jobs, or restarted without a store";
}

}  // namespace

// Every lease/3 one heartbeat on the open event stream (two may be late before the lease runs
// out). Between streams none is sent: opening the next one renews the lease.
void CoordinatorLink::heartbeat_loop() {
  auto log = log::get("daemon");
  std::unique_lock lock(mu_);
  Clock::time_point next_beat = Clock::now() + std::chrono::milliseconds(lease_ms_) / 3;
  for (;;) {
    const std::chrono::milliseconds lease(lease_ms_);
    // Up at the next heartbeat, and also when an outage noted meanwhile passes the lease
    // (note_outage sets outage_due_ and notifies): the node's ranks hear of a cut as soon as
    // the rule allows, not up to a heartbeat period later.
    auto wake = [&] { return outage_due_ == Clock::time_point{} ? next_beat : std::min(next_beat, outage_due_); };
    while (!stopping_ && Clock::now() < wake()) cv_.wait_until(lock, wake());
    if (stopping_) return;
    outage_due_ = {};
    check_reachable(lock);
    if (stopping_) return;
    if (Clock::now() < next_beat) continue;  // woken for the outage alone
    // How long this thread did not run (a paused or starved daemon): forgotten_cause.
    const auto now = Clock::now();
    next_beat = now + lease / 3;
    longest_gap_ = std::max(longest_gap_, std::chrono::duration_cast<std::chrono::milliseconds>(now - heartbeat_ran_));
    heartbeat_ran_ = now;
    std::shared_ptr<EventStream> stream = stream_;
    if (!stream) continue;
    lock.unlock();
    if (stream->heartbeat() == EventStream::Sent::kBusy) {  // not under mu_ (its callbacks take it)
      // The coordinator reads every message, so a write pending this long means the connection
      // is stuck (a partition): end the stream, and the event-stream thread opens another.
      const auto stuck = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - stream->pending_since());
      if (stuck >= lease) {
        log->warn("no heartbeat could be sent to coordinator {} for {} ms (lease {} ms); reopening the event stream",
                  address(), stuck.count(), lease.count());
        stream->cancel();
      }
    }
    lock.lock();
  }
}

void CoordinatorLink::note_outage(const grpc::Status& s, Clock::time_point now) {
  // It answered: the node is unknown there, or a standby names its leader.
  if (s.ok() || s.error_code() == grpc::StatusCode::NOT_FOUND ||
      s.error_message().find(kLeaderIsPhrase) != std::string::npos) {
    return;
  }
  unreachable_why_ = s.error_message();
  if (unreachable_since_ != Clock::time_point{}) return;
  // The connection's last sign of life, at the latest: for a ping, or any data, left
  // unacknowledged (gRPC's keepalive watchdog, or the TCP user timeout it sets on the socket to
  // the same kNodePingTimeout: "Connection timed out"), when that was sent; for a stream the
  // heartbeat thread found stuck, the write that got stuck; else (refused, reset, the
  // coordinator going away) now.
  auto since = now;
  const std::string& msg = s.error_message();
  if (msg.find("keepalive") != std::string::npos || msg.find("timed out") != std::string::npos) since = now - kNodePingTimeout;
  if (stream_stuck_ != Clock::time_point{}) since = std::min(since, stream_stuck_);
  unreachable_since_ = since;
  outage_due_ = since + std::chrono::milliseconds(lease_ms_) + std::chrono::milliseconds(1);
  cv_.notify_all();  // the heartbeat thread: wake up at outage_due_
}

void CoordinatorLink::check_reachable(std::unique_lock<std::mutex>& lock) {
  if (unreachable_since_ == Clock::time_point{}) return;
  const Target& target = targets_[current_];
  // READY: a connection made since, with the server's HTTP/2 settings (a standby's counts too:
  // its leader is on the way, and nothing is aborted while any coordinator answers).
  if (target.channel->GetState(false) == GRPC_CHANNEL_READY) {
    const auto outage = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - unreachable_since_);
    log::get("daemon")->log(outage.count() > lease_ms_ ? spdlog::level::info : spdlog::level::debug,
                            "coordinator {} reachable again after {} ms", target.address, outage.count());
    unreachable_since_ = {};
    return;
  }
  const auto outage = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - unreachable_since_);
  if (outage <= std::chrono::milliseconds(lease_ms_) || !on_unreachable_) return;
  const std::string address = target.address, why = unreachable_why_;
  lock.unlock();
  on_unreachable_(outage, address, why);
  lock.lock();
}

grpc::Status CoordinatorLink::watch_once(v1::Coordinator::Stub& stub) {
  std::unique_lock lock(mu_);
  const std::string id = node_id_;
  stream_over_ = false;
  events_.clear();
  lock.unlock();
  // The events are handled here, not on gRPC's threads: a handler may block (ReportTrace).
  auto stream = EventStream::open(
      stub, id, [](grpc::ClientContext&) {},
      [this](const v1::Event& ev) {
        std::lock_guard l(mu_);
        events_.push_back(ev);
        cv_.notify_all();
      },
      [this](const grpc::Status& s) {
        std::lock_guard l(mu_);
        stream_over_ = true;
        stream_status_ = s;
        cv_.notify_all();
      });
  lock.lock();
  stream_ = stream;
  if (stopping_) {
    lock.unlock();
    stream->cancel();
    lock.lock();
  }
  // Bounded: the stream ends when stop() cancels it, when the heartbeat thread finds it stuck
  // for a lease, or when the server's keepalive finds the connection dead.
  for (;;) {
    cv_.wait(lock, [this] { return stream_over_ || !events_.empty(); });
    if (events_.empty()) break;
    v1::Event ev = std::move(events_.front());
    events_.pop_front();
    lock.unlock();
    on_event_(ev);
    lock.lock();
  }
  // The coordinator had this node's heartbeats until the last one written on this stream,
  // unless a write got stuck (a partition): until that one started. A stream that wrote
  // nothing never reached it. (watch_loop takes these unless the stream ended NOT_FOUND.)
  stream_stuck_ = stream->pending_since();
  stream_sent_ = stream->last_sent();
  stream_.reset();
  return stream_status_;
}

void CoordinatorLink::watch_loop() {
  auto log = log::get("daemon");
  for (;;) {
    auto [index, stub] = current();
    const std::string id = node_id();
    grpc::Status s = watch_once(*stub);
    std::unique_lock lock(mu_);
    if (stopping_) return;
    lock.unlock();
    log->debug("event stream from {} ended: {}", targets_[index].address, s.error_message());
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) fail_over(index, s);
    bool registered = false;
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      std::string cause;
      {
        std::lock_guard l(mu_);
        const auto now = Clock::now();
        // The heartbeat thread may not have run yet since a pause ended: count that gap too.
        const auto idle = std::max(longest_gap_, std::chrono::duration_cast<std::chrono::milliseconds>(now - heartbeat_ran_));
        cause = forgotten_cause(std::chrono::duration_cast<std::chrono::milliseconds>(now - last_known_).count(),
                                idle.count(), failed_, refused_, lease_ms_);
      }
      log->warn("coordinator {} forgot node={}: {}; re-registering", targets_[index].address, id, cause);
      if (on_forgotten_) on_forgotten_(id, cause);
      Status r = register_node();
      registered = r.ok();
      if (!registered) log->warn("{}", r.to_string());
    }
    lock.lock();
    if (registered) {
      last_known_ = heartbeat_ran_ = Clock::now();
      longest_gap_ = std::chrono::milliseconds(0);
      failed_ = refused_ = 0;
      unreachable_since_ = {};
    } else if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
      note_outage(s, Clock::now());
      const bool reached = stream_sent_ != Clock::time_point{};
      if (reached) last_known_ = std::max(last_known_, stream_stuck_ != Clock::time_point{} ? stream_stuck_ : stream_sent_);
      if (!reached || stream_stuck_ != Clock::time_point{}) {  // could not reach the coordinator
        ++failed_;
        if (s.error_message().find("refused") != std::string::npos) ++refused_;
      }
    }
    // Registered again: a stream at once. Another coordinator to try: soon (a standby may name a
    // leader that just died, so never at once: that would spin). A coordinator that is down
    // (or forgot the node and refused it again): soon too (gRPC's reconnect backoff, at most
    // kNodeMaxReconnect, bounds the connection attempts), so that every node finds a restarted one
    // within about that and the nodes end the jobs it lost together. The same one: a longer pause.
    const bool down = s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::NOT_FOUND;
    const auto pause = registered          ? std::chrono::milliseconds(0)
                       : current_ != index ? backoff(1)
                       : down              ? std::max(backoff(0), jittered(register_hint_.load()))
                                           : kRetryPause;
    if (cv_.wait_for(lock, pause, [this] { return stopping_; })) return;
  }
}

Result<v1::JoinJobResponse> CoordinatorLink::join(v1::JoinJobRequest req,
                                                  std::chrono::milliseconds timeout) {
  // The coordinator fails the join itself at `timeout`; our deadline is a backstop. A join cut
  // off by the leader's death is made again at the new leader, with what is left of `timeout`.
  const Deadline deadline = deadline_after(timeout);
  auth_->set_job_token(req.job_id(), req.token());  // the job's later calls carry it
  v1::JoinJobResponse resp;
  std::string address;
  grpc::Status st;
  for (int attempt = 0;; ++attempt) {
    uint64_t registered;
    {
      std::lock_guard lock(mu_);
      req.set_node_id(node_id_);
      registered = registrations_;
    }
    st = with_failover(
        [&](v1::Coordinator::Stub& stub) {
          grpc::ClientContext ctx;
          const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                                     std::chrono::milliseconds(1));
          set_deadline(ctx, left + kCallTimeout);
          req.set_timeout_ms(static_cast<uint32_t>(left.count()));
          return stub.JoinJob(&ctx, req, &resp);
        },
        deadline, &address);
    if (st.error_code() != grpc::StatusCode::NOT_FOUND || attempt > 0) break;
    // The coordinator does not know this node (it restarted before the event stream found
    // out): the event-stream thread registers again (its next stream ends NOT_FOUND); then
    // join once more.
    // At most a lease (three heartbeat periods): the heartbeat may be in a call just now.
    std::unique_lock lock(mu_);
    cv_.notify_all();
    const Deadline until = std::min(deadline, Clock::now() + std::chrono::milliseconds(lease_ms_));
    if (!cv_.wait_until(lock, until, [&] { return registrations_ != registered || stopping_; }) || stopping_) break;
  }
  Status s = from_grpc(st, "join of job " + req.job_id(), address);
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
      auto [index, stub] = current();
      grpc::Status s = stub->GetPeerTable(&ctx, req, &resp);
      if (s.ok()) break;
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) fail_over(index, s);
      const auto pause = backoff(attempt);
      if (!retryable(s.error_code()) || Clock::now() + pause >= deadline) {
        return from_grpc(s, "peer table of job " + job + " (page " + std::to_string(page + 1) + ")",
                         targets_[index].address);
      }
      log::get("daemon")->info("peer table of job {} from coordinator {}: {}; retrying in {} ms", job,
                               targets_[index].address, s.error_message(), pause.count());
      std::this_thread::sleep_for(pause);
    }
    if (page == 0) {
      pages = std::max<uint32_t>(resp.pages(), 1);
      if (pages > kMaxTablePages) {
        return Status(Code::kInternal, "coordinator " + address() + " announced " + std::to_string(pages) +
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

// A short call about `job` (its token attached), with failover, as a Status naming the coordinator.
Status CoordinatorLink::job_call(const std::string& job, const std::string& what,
                                 const std::function<grpc::Status(v1::Coordinator::Stub&, grpc::ClientContext&)>& call) {
  std::string address;
  grpc::Status s = with_failover(
      [&](v1::Coordinator::Stub& stub) {
        grpc::ClientContext ctx;
        set_deadline(ctx, kCallTimeout);
        auth_->add_job_token(ctx, job);
        return call(stub, ctx);
      },
      deadline_after(kCallTimeout), &address);
  return from_grpc(s, what + " of job " + job, address);
}

Status CoordinatorLink::leave(const std::string& job, uint64_t generation) {
  v1::LeaveJobRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  v1::LeaveJobResponse resp;
  return job_call(job, "leave", [&](v1::Coordinator::Stub& stub, grpc::ClientContext& ctx) {
    return stub.LeaveJob(&ctx, req, &resp);
  });
}

Status CoordinatorLink::report_path(const std::string& job, uint64_t generation, const v1::RankPath& path) {
  v1::ReportPathRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  *req.mutable_path() = path;
  v1::ReportPathResponse resp;
  return job_call(job, "path report", [&](v1::Coordinator::Stub& stub, grpc::ClientContext& ctx) {
    return stub.ReportPath(&ctx, req, &resp);
  });
}

Status CoordinatorLink::report_trace(v1::ReportTraceRequest req) {
  grpc::ClientContext ctx;
  set_deadline(ctx, kTraceCallTimeout);
  auth_->add_job_token(ctx, req.job_id());
  req.set_node_id(node_id());
  v1::ReportTraceResponse resp;
  auto [index, stub] = current();
  return from_grpc(stub->ReportTrace(&ctx, req, &resp), "flight recorders of job " + req.job_id(),
                   targets_[index].address);
}

Status CoordinatorLink::abort(const std::string& job, uint64_t generation, int failed_rank,
                              const std::string& reason) {
  v1::AbortJobRequest req;
  req.set_node_id(node_id());
  req.set_job_id(job);
  req.set_generation(generation);
  req.set_failed_rank(failed_rank);
  req.set_reason(reason);
  v1::AbortJobResponse resp;
  return job_call(job, "abort", [&](v1::Coordinator::Stub& stub, grpc::ClientContext& ctx) {
    return stub.AbortJob(&ctx, req, &resp);
  });
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
  auto [index, stub] = current();
  Status s = from_grpc(stub->Regroup(&ctx, req, &resp), "regroup of job " + req.job_id(), targets_[index].address);
  if (!s.ok()) return s;
  return resp;
}

}  // namespace gradsync
