#include "daemon/daemon.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "common/framing.h"
#include "collectives/topology.h"
#include "common/log.h"
#include "common/socket_path.h"
#include "common/secret.h"
#include "daemon/peer_layout.h"
#include "daemon/ring_count.h"
#include "daemon/trace_dump.h"
#include "daemon/trainer_request.h"
#include "daemon/transport_choice.h"
#include "topology/node_info.h"
#include "topology/topology_summary.h"
#if GRADSYNC_HAVE_VERBS
#include "daemon/verbs_pump.h"
#endif

namespace gradsync {
namespace {

// How long a peer daemon's channel connection may wait for this node's side of the job.
constexpr std::chrono::milliseconds kPeerAcceptTimeout{30'000};
// The least time the coordinator is given to complete a join whose local ranks came late.
constexpr std::chrono::milliseconds kMinCoordinatorJoin{1'000};
// How long local ranks wait past their deadline for the leader's coordinator answer; less than
// the slack trainers add to their own deadline (Session::join), so they get the answer.
constexpr std::chrono::milliseconds kLeaderSlack{3'000};
// How long a finished job may take to flush its last slots to peers before it is cut.
constexpr std::chrono::milliseconds kDrainTimeout{30'000};
// How long a connection on the trainer socket may stay silent before it joined a job, and how
// long a peer daemon may take to send its Hello.
constexpr std::chrono::milliseconds kIdleBeforeJoin{10'000};
constexpr std::chrono::milliseconds kHelloTimeout{10'000};
// How long ~Daemon waits for its connection threads to see their peers hang up.
constexpr std::chrono::milliseconds kThreadExitWait{10'000};
// How long a channel that lost its peer waits for the reason the peer's daemon may have given
// the coordinator, before it reports the lost connection as the job's failure.
constexpr std::chrono::milliseconds kPeerAbortGrace{500};

std::shared_ptr<spdlog::logger> dlog() { return log::get("daemon"); }

v1::DaemonMessage error_message(const Status& s) {
  v1::DaemonMessage m;
  m.mutable_error()->set_code(static_cast<uint32_t>(s.code()));
  m.mutable_error()->set_message(s.message());
  return m;
}

Status write_file_atomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text << "\n";
    if (!f) return {Code::kInternal, "cannot write " + tmp};
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return {Code::kInternal, errno_string("rename")};
  return Status::Ok();
}

// How a channel from a rank on node `src` to a rank on node `dst` moves its slots: both
// daemons of the channel compute this from the endpoints they exchanged, so they agree.
ChannelTransport channel_transport(const v1::ChannelEndpoint& src, const v1::ChannelEndpoint& dst) {
  if (src.transport() == "verbs" && dst.transport() == "verbs") return ChannelTransport::kVerbs;
  if (src.rank_sockets() && dst.rank_sockets()) return ChannelTransport::kTcpRank;
  return ChannelTransport::kTcp;
}

}  // namespace

Result<std::string> Daemon::choose_data_host(const topology::NodeInfo& topo, std::string* why) const {
  if (!cfg_.data_host.empty()) {
    *why = "--data-host";
    return cfg_.data_host;
  }
  // "eth0=10.1.2.3" -> ("eth0", "10.1.2.3"); IPv4 first, then global IPv6 (not fe80::).
  auto pick = [&](const std::string& ifname) -> std::string {
    std::string v6;
    for (const auto& a : topo.addresses) {
      auto eq = a.find('=');
      if (eq == std::string::npos || (!ifname.empty() && a.substr(0, eq) != ifname)) continue;
      std::string ip = a.substr(eq + 1);
      if (ip.find(':') == std::string::npos) return ip;
      if (v6.empty() && ip.rfind("fe80", 0) != 0) v6 = ip;
    }
    return v6;
  };
  if (!cfg_.ifname.empty()) {
    std::string ip = pick(cfg_.ifname);
    if (ip.empty()) {
      return Status(Code::kInvalidArgument, "GRADSYNC_SOCKET_IFNAME/--ifname " + cfg_.ifname +
                                                ": no usable address on that interface (have: " +
                                                topology::describe(topo) + ")");
    }
    *why = "address of interface " + cfg_.ifname;
    return ip;
  }
  if (is_loopback_address(cfg_.coordinator)) {
    *why = "the coordinator is on loopback, so every node is this machine";
    return std::string("127.0.0.1");
  }
  std::string ip = pick("");
  if (!ip.empty()) {
    *why = "first non-loopback address; set GRADSYNC_SOCKET_IFNAME or --data-host to choose";
    return ip;
  }
  *why = "no non-loopback address: advertising the hostname";
  return hostname_;
}

Daemon::Daemon(DaemonConfig config) : cfg_(std::move(config)), hostname_(hostname()) {
  if (cfg_.node_name.empty()) cfg_.node_name = hostname_;
}

Daemon::~Daemon() {
  stop();
  // Connection threads end when their trainer or peer hangs up. A process exits right after
  // (main.cc); a Daemon object in a test process waits for them, so none outlives `this`.
  std::unique_lock lock(mu_);
  if (!cv_.wait_until(lock, deadline_after(kThreadExitWait), [&] { return threads_ == 0; })) {
    dlog()->warn("{} connection threads still running at exit", threads_);
  }
}

Status Daemon::start() {
  auto log = dlog();
  stop_event_.reset(::eventfd(0, EFD_CLOEXEC));
  auto transport = choose_transport(cfg_.transport, cfg_.ibv, cfg_.verbs_device);
  if (!transport.ok()) return transport.status();
#if GRADSYNC_HAVE_VERBS
  if (transport->name == "verbs") {
    const verbs::IbvApi* api = cfg_.ibv;
    Status opened = Status::Ok();
    if (api == nullptr) {
      auto loaded = verbs::load_libibverbs();
      if (loaded.ok()) api = *loaded; else opened = loaded.status();
    }
    if (opened.ok()) {
      auto node = VerbsNode::open(api, cfg_.verbs_device, cfg_.verbs_port, cfg_.gid_index);
      if (node.ok()) verbs_ = std::move(node).value(); else opened = node.status();
    }
    if (!opened.ok()) {
      if (cfg_.transport == "verbs") {
        return {Code::kFailedPrecondition, "GRADSYNC_TRANSPORT=verbs: " + opened.message()};
      }
      transport = TransportChoice{"tcp", "an RDMA port is ACTIVE but cannot be used: " + opened.message()};
    } else {
      transport->why += "; channels use " + verbs_->describe();
    }
  }
#endif
  transport_ = transport->name;
  transport_why_ = transport->why;
  log->info("transport {} between nodes: {}", transport->name, transport->why);
  topology::NodeInfo topo = topology::discover();
  if (cfg_.rings == 0) {
    const RingCount rc = default_ring_count(topo.cpus, cfg_.slots, cfg_.slot_bytes);
    cfg_.rings = rc.rings;
    rings_chosen_ = true;
    log->info("rings: {}", rc.why);
  } else if (cfg_.rings > kMaxRings) {
    return {Code::kInvalidArgument, "rings=" + std::to_string(cfg_.rings) + " is above the limit of " +
                                        std::to_string(kMaxRings) + " rings"};
  } else {
    log->info("rings: {} (--rings/GRADSYNC_NRINGS): {} MiB of ring channels per rank", cfg_.rings,
              ring_memory_per_rank(cfg_.rings, cfg_.slots, cfg_.slot_bytes) >> 20);
  }

  // Proxy listener first: its port goes into the registration. The default listens on every
  // IPv6 and IPv4 address ("::" is dual-stack on Linux), falling back to IPv4 only.
  // A coordinator on loopback means every node is this machine (standalone, tests): then the
  // data port is not reachable from other machines at all.
  uint16_t port = 0;
  std::string listen_on = cfg_.data_listen;
  if (listen_on.empty() && is_loopback_address(cfg_.coordinator) && cfg_.data_host.empty() && cfg_.ifname.empty()) {
    listen_on = "127.0.0.1";
    log->info("data port on loopback only: the coordinator is on loopback, so every node is this machine");
  }
  auto listener = tcp_listen(listen_on.empty() ? "::" : listen_on, cfg_.data_port, &port);
  if (!listener.ok() && listen_on.empty()) listener = tcp_listen("0.0.0.0", cfg_.data_port, &port);
  if (!listener.ok()) return listener.status();
  peer_listener_ = std::move(listener).value();
  std::string why;
  auto host = choose_data_host(topo, &why);
  if (!host.ok()) return host.status();
  endpoint_ = (host->find(':') != std::string::npos ? "[" + *host + "]" : *host) + ":" + std::to_string(port);
  log->info("proxy endpoint {} ({})", endpoint_, why);

  // Trainer socket: 0660, so only this user and group can reach the daemon.
  sockaddr_un addr{};
  if (cfg_.socket_path.size() >= sizeof(addr.sun_path)) {
    return {Code::kInvalidArgument, "socket path too long: " + cfg_.socket_path};
  }
  if (Status s = prepare_socket_dir(cfg_.socket_path); !s.ok()) return s;
  ::unlink(cfg_.socket_path.c_str());
  trainer_listener_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, cfg_.socket_path.data(), cfg_.socket_path.size());
  if (::bind(trainer_listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::chmod(cfg_.socket_path.c_str(), 0660) != 0 || ::listen(trainer_listener_.get(), 128) != 0) {
    return {Code::kUnavailable, "cannot serve on " + cfg_.socket_path + ": " + errno_string("bind/listen")};
  }

  auto gpu_topo = topology::node_gpu_topology(cfg_.topo_file);
  if (!gpu_topo.ok()) return gpu_topo.status();
  log->info("GPU topology {}", topology::describe(*gpu_topo));

  v1::NodeInfo node;
  *node.mutable_gpu_topology() = topology::summarize(*gpu_topo);
  node.set_hostname(hostname_);
  node.set_node_name(cfg_.node_name);
  for (const auto& a : topo.addresses) node.add_addresses(a);
  node.set_cpus(topo.cpus);
  for (const auto& g : topo.gpus) node.add_gpus(g);
  for (const auto& n : topo.nics) node.add_nics(n);
  node.set_data_endpoint(endpoint_);
  node.set_pid(static_cast<uint32_t>(::getpid()));
  node.set_transport(transport_);
  node.set_transport_why(transport_why_);
  auto credentials = channel_credentials(cfg_.tls, cfg_.coordinator);
  if (!credentials.ok()) return credentials.status();
  link_ = std::make_unique<CoordinatorLink>(cfg_.coordinator, *credentials,
                                            std::make_shared<CallAuth>(cfg_.cluster_secret, ""), node,
                                            [this](const v1::Event& ev) { on_event(ev); });
  link_->set_on_forgotten([this](const std::string& node_id) { forgotten(node_id); });
  GS_RETURN_IF_ERROR(link_->start(cfg_.register_timeout));

  trainer_acceptor_ = std::thread([this] {
    accept_loop(trainer_listener_.get(), &Daemon::serve_trainer, &trainer_threads_, "trainer-socket");
  });
  peer_acceptor_ = std::thread([this] {
    accept_loop(peer_listener_.get(), &Daemon::serve_peer, &peer_threads_, "data-port");
  });
  log->info("gradsyncd node={} serving trainers on {} proxy on {} topology: {}",
            cfg_.node_name, cfg_.socket_path, endpoint_, topology::describe(topo));
  if (!cfg_.metrics_listen.empty()) {
    metrics_server_ = std::make_unique<MetricsServer>();
    GS_RETURN_IF_ERROR(metrics_server_->start(cfg_.metrics_listen, [this] { return render_metrics(); }));
    log->info("metrics on {}", metrics_server_->url());
  }
  if (!cfg_.ready_file.empty()) GS_RETURN_IF_ERROR(write_file_atomically(cfg_.ready_file, endpoint_));
  return Status::Ok();
}

std::vector<RankCounters> Daemon::rank_counters(const LocalJob& job) const {
  std::vector<RankCounters> out;
  if (!job.shm || job.layout.recorders == 0) return out;
  for (uint32_t i = 0; i < job.local_ranks.size() && i < job.layout.recorders; ++i) {
    RankCounters r;
    r.job = job.id;
    r.generation = job.generation;
    r.rank = job.local_ranks[i];
    r.transport = transport_;
    const void* at = static_cast<const char*>(job.shm->data()) + job.layout.recorder_offset(i);
    if (read_stats(at, job.layout.recorder_entries, r.rank, &r.stats)) out.push_back(std::move(r));
  }
  return out;
}

std::string Daemon::render_metrics() {
  std::lock_guard lock(mu_);
  std::vector<RankCounters> live;
  std::vector<JobGauge> gauges;
  for (const auto& [id, job] : jobs_) {
    for (auto& r : rank_counters(*job)) live.push_back(std::move(r));
    JobGauge g;
    g.job = id;
    g.state = job->aborted                                  ? "aborted"
              : job->state == LocalJob::State::kCollecting ? "collecting"
              : job->state == LocalJob::State::kJoining    ? "joining"
              : job->state == LocalJob::State::kReady      ? "ready"
              : job->state == LocalJob::State::kFailed     ? "failed"
                                                            : "done";
    g.incoming = uint32_t(job->incoming.size());
    g.staging = uint32_t(job->staging.size());
    g.transport = transport_;
    gauges.push_back(std::move(g));
  }
  return metrics_.render(live, gauges);
}

void Daemon::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (metrics_server_) metrics_server_->stop();
  if (stop_event_.valid()) {
    uint64_t one = 1;
    if (::write(stop_event_.get(), &one, sizeof(one)) < 0) { /* acceptors also see shutdown */ }
  }
  if (trainer_acceptor_.joinable()) trainer_acceptor_.join();
  if (peer_acceptor_.joinable()) peer_acceptor_.join();
  std::vector<std::shared_ptr<LocalJob>> jobs;
  {
    // Jobs whose ranks all left are finishing: let them flush their last slots to peers and
    // leave at the coordinator, instead of aborting them under ranks still in their last
    // collective on other nodes. Jobs with ranks still inside are aborted: the daemon goes.
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, deadline_after(kDrainTimeout), [&] {
      return std::none_of(jobs_.begin(), jobs_.end(), [](const auto& kv) {
        const LocalJob& j = *kv.second;
        return j.state == LocalJob::State::kReady && !j.aborted && j.all_left();
      });
    });
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) abort(job, -1, "gradsyncd on " + hostname_ + " is shutting down", true);
  if (link_) link_->stop();
  ::unlink(cfg_.socket_path.c_str());
}

bool Daemon::spawn(std::function<void()> fn, int* running) {
  {
    std::lock_guard lock(mu_);
    if (*running >= static_cast<int>(cfg_.max_connections)) return false;
    ++*running;
    ++threads_;
  }
  std::thread([this, running, fn = std::move(fn)] {
    fn();
    std::lock_guard lock(mu_);
    --*running;
    --threads_;
    cv_.notify_all();
  }).detach();
  return true;
}

void Daemon::accept_loop(int listener, void (Daemon::*serve)(Fd), int* running, const char* what) {
  pollfd fds[2] = {{listener, POLLIN, 0}, {stop_event_.get(), POLLIN, 0}};
  for (;;) {
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    Fd sock(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (!sock.valid()) continue;
    auto shared = std::make_shared<Fd>(std::move(sock));
    if (spawn([this, serve, shared]() mutable { (this->*serve)(std::move(*shared)); }, running)) continue;
    // At the cap: the connection is closed at once (when `shared` goes).
    warn_limited(running == &trainer_threads_ ? trainer_cap_log_ : peer_cap_log_, std::string("refused a ") + what + " connection: " + std::to_string(cfg_.max_connections) +
                               " are open, the limit (--max-connections): a flood of connections, or raise the limit");
  }
}

void Daemon::warn_limited(log::RateLimit& limit, const std::string& message) {
  uint64_t held = 0;
  if (!limit.allow(&held)) return;
  if (held == 0) dlog()->warn("{}", message);
  else dlog()->warn("{} (and {} more like it since the last such warning)", message, held);
}

namespace {

// Whether the peer of a Unix socket has `gid` among its supplementary groups (SO_PEERGROUPS,
// Linux 4.13): a member of the `gradsync` group whose own primary group is another.
bool peer_in_group(int fd, gid_t gid) {
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t len = socklen_t(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return std::find(groups.begin(), groups.end(), gid) != groups.end();
    }
    if (errno != ERANGE || len / sizeof(gid_t) > 65536) return false;
    groups.resize(len / sizeof(gid_t));
  }
  return false;
}

}  // namespace

void Daemon::serve_trainer(Fd sock) {
  auto log = dlog();
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  if (cred.uid != 0 && cred.uid != ::geteuid() && cred.gid != ::getegid() &&
      !peer_in_group(sock.get(), ::getegid())) {
    warn_limited(trainer_log_, "refused trainer pid=" + std::to_string(cred.pid) + " uid=" + std::to_string(cred.uid) +
                                   ": neither this daemon's user nor group");
    (void)send_frame(sock.get(), error_message({Code::kPermissionDenied,
        "gradsyncd on " + hostname_ + " serves only uid " + std::to_string(::geteuid()) +
        " or gid " + std::to_string(::getegid())}));
    return;
  }
  const uint32_t pid = static_cast<uint32_t>(cred.pid);
  std::shared_ptr<LocalJob> job;
  uint32_t rank = 0;
  for (;;) {
    v1::ClientMessage msg;
    // Until it joined, a connection holds one of the limited connection threads for nothing:
    // it must say something every kIdleBeforeJoin. A member of a job may stay quiet.
    Status s = read_trainer_request(sock.get(), &msg, job ? Deadline::max() : deadline_after(kIdleBeforeJoin));
    if (!s.ok()) {
      if (!job && s.code() == Code::kDeadlineExceeded) {
        warn_limited(trainer_log_, "closed the trainer-socket connection of pid " + std::to_string(cred.pid) +
                                       ": nothing sent for " + std::to_string(kIdleBeforeJoin.count() / 1000) +
                                       " s before a join");
      } else if (!job && s.code() != Code::kUnavailable) {
        warn_limited(trainer_log_, "closed the trainer-socket connection of pid " + std::to_string(cred.pid) +
                                       ": " + s.message());
      }
      break;  // EOF: the trainer is gone
    }
    v1::DaemonMessage reply;
    if (msg.has_attach()) {
      reply.mutable_attach()->set_node_name(cfg_.node_name);
      reply.mutable_attach()->set_hostname(hostname_);
      reply.mutable_attach()->set_protocol_version(msg.attach().protocol_version());
      s = send_frame(sock.get(), reply);
    } else if (msg.has_join()) {
      if (job) {
        s = send_frame(sock.get(), error_message({Code::kFailedPrecondition,
                                                  "this connection already joined job " + job->id}));
        continue;
      }
      auto joined = join(msg.join(), pid);
      if (!joined.ok()) {
        s = send_frame(sock.get(), error_message(joined.status()));
        continue;
      }
      job = joined.value();
      rank = msg.join().rank();
      v1::JoinResponse* jr = reply.mutable_join();
      std::vector<Fd> rank_socks;
      {
        std::lock_guard lock(mu_);
        jr->set_generation(job->generation);
        jr->mutable_ring()->Add(job->ring.begin(), job->ring.end());
        for (uint32_t r = 0; r < job->world_size; ++r) jr->add_rank_hosts(job->host_of(r));
        jr->mutable_rank_node()->Add(job->rank_node.begin(), job->rank_node.end());
        jr->mutable_node_shape()->Add(job->node_shape.begin(), job->node_shape.end());
        for (const auto& shape : job->shapes) *jr->add_shapes() = shape;
        *jr->mutable_setup() = job->setup_for(rank);
        rank_socks = job->take_rank_sockets(jr->mutable_setup());
      }
#if GRADSYNC_HAVE_VERBS
      if (verbs_) {
        v1::VerbsDevice* vd = jr->mutable_verbs();
        vd->set_device(verbs_->context().name());
        vd->set_port(verbs_->port());
        vd->set_gid_index(verbs_->sgid_index());
        vd->set_api(verbs_->context().api()->name);
      }
#endif
      // The job's memory, then this rank's channel sockets; ours close when the frame is out.
      std::vector<int> fds{job->shm->fd()};
      for (const Fd& f : rank_socks) fds.push_back(f.get());
      s = send_frame(sock.get(), reply, fds);
      rank_socks.clear();
    } else if (msg.has_regroup()) {
      // Elastic membership (gradsync/elastic.h), before this connection joins the next
      // generation: one rank's call, passed to the coordinator, which answers once decided.
      if (job) {
        s = send_frame(sock.get(), error_message({Code::kFailedPrecondition,
                                                  "regroup on a connection that already joined job " + job->id}));
        continue;
      }
      if (Status bad = check_regroup_request(msg.regroup(), pid, hostname_); !bad.ok()) {
        s = send_frame(sock.get(), error_message(bad));
        continue;
      }
      auto decided = link_->regroup(msg.regroup());
      if (!decided.ok()) {
        s = send_frame(sock.get(), error_message(decided.status()));
        continue;
      }
      log->info("job={} rank {} (pid {}) regrouped: rank {} of {} in generation {}", msg.regroup().job_id(),
                msg.regroup().old_rank(), pid, decided->rank(), decided->world_size(), decided->generation());
      *reply.mutable_regroup() = std::move(decided).value();
      s = send_frame(sock.get(), reply);
    } else if (msg.has_leave()) {
      if (job) {
        std::lock_guard lock(mu_);
        job->members[rank].left = true;
        if (job->all_left()) job->drain.store(true);
      }
      reply.mutable_leave();
      s = send_frame(sock.get(), reply);
    } else if (msg.has_path()) {
      if (job) {
        v1::RankPath p;
        p.set_rank(rank);
        p.set_path(msg.path().path());
        p.set_why(msg.path().why());
        log->info("{} rank {} data path: {} ({})", job->ids(), rank, p.path(), p.why());
        // For `gradsyncctl describe`; a coordinator that cannot take it costs only the report.
        if (Status r = link_->report_path(job->id, job->generation, p); !r.ok()) {
          log->warn("{} rank {}: {}", job->ids(), rank, r.message());
        }
      }
    } else if (msg.has_abort() && msg.abort().failure()) {
      // The rank's collective failed: it wrote this reason into the job's memory already (any
      // rank of the job may), so it is passed on as it is; only the culprit is checked.
      if (job) {
        int culprit = msg.abort().culprit();
        if (culprit < -1 || culprit >= static_cast<int>(job->world_size)) culprit = -1;
        std::string reason = msg.abort().reason().substr(0, kAbortReasonBytes - 1);
        if (reason.empty()) reason = job->ids() + ": rank " + std::to_string(rank) + " failed (no reason given)";
        abort(job, culprit, reason, true);
      }
    } else if (msg.has_trace_dump()) {
      if (job) {
        // The reason is the trainer's text: bounded and only written into the file.
        std::string path = dump_traces(job, "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                                                ") reported a failed collective: " +
                                                msg.trace_dump().reason().substr(0, 1024));
        if (!path.empty()) log->warn("{} rank {} failed a collective; flight recorders in {}", job->ids(), rank, path);
      }
    } else if (msg.has_abort()) {
      if (job) {
        metrics_.error("rank_abort", "rank " + std::to_string(rank));
        abort(job, static_cast<int>(rank),
              job->ids() + ": rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                  ", host " + hostname_ + ") aborted the job: " + msg.abort().reason(),
              true);
      }
    } else {
      s = send_frame(sock.get(), error_message({Code::kInvalidArgument, "unknown request"}));
    }
    if (!s.ok()) break;
  }
  if (job) member_gone(job, rank);
}

Result<std::shared_ptr<LocalJob>> Daemon::join(const v1::JoinRequest& req, uint32_t pid) {
  const std::string who = "job=" + req.job_id() + " rank " + std::to_string(req.rank()) +
                          " (pid " + std::to_string(pid) + ") on " + hostname_ + ": ";
  GS_RETURN_IF_ERROR(check_join_request(req, pid, hostname_));
  auto timeout = std::chrono::milliseconds(req.timeout_ms() ? req.timeout_ms() : 60'000);

  std::unique_lock lock(mu_);
  auto& slot = jobs_[req.job_id()];
  if (!slot || slot->state == LocalJob::State::kFailed || slot->state == LocalJob::State::kDone ||
      slot->aborted) {
    slot = std::make_shared<LocalJob>();
    slot->id = req.job_id();
    slot->token = req.token();
    slot->world_size = req.world_size();
    slot->local_world_size = req.local_world_size();
    slot->join_deadline = deadline_after(timeout);
  }
  std::shared_ptr<LocalJob> job = slot;
  // The whole join, local collection and coordinator rendezvous, fits in the first local
  // rank's timeout, so trainers (who wait a little longer) hear the reason, not a timeout.
  const Deadline deadline = job->join_deadline;
  if (job->state != LocalJob::State::kCollecting) {
    return Status(Code::kAlreadyExists, who + "job already has its " +
                                            std::to_string(job->local_world_size) +
                                            " local ranks on this node and is running");
  }
  // A join that cannot be part of this job fails it for the local ranks already waiting too:
  // they would otherwise wait for their join deadline. Later joins start afresh.
  auto refuse_all = [&](Status why) {
    if (!job->members.empty()) {
      job->state = LocalJob::State::kFailed;
      job->failure = Status(why.code(), why.message() + "; the job's join is refused for every local rank");
      cv_.notify_all();
    }
    return why;
  };
  if (!same_secret(job->token, req.token())) {
    return refuse_all(Status(Code::kPermissionDenied, who + "wrong token for job " + req.job_id()));
  }
  if (job->world_size != req.world_size() || job->local_world_size != req.local_world_size()) {
    return refuse_all(Status(Code::kInvalidArgument,
                             who + "world size " + std::to_string(req.world_size()) + " / local world size " +
                                 std::to_string(req.local_world_size()) + " differ from the other local ranks' " +
                                 std::to_string(job->world_size) + " / " + std::to_string(job->local_world_size)));
  }
  if (auto it = job->members.find(req.rank()); it != job->members.end()) {
    return Status(Code::kAlreadyExists, who + "rank " + std::to_string(req.rank()) +
                                            " already claimed by pid " + std::to_string(it->second.pid));
  }
  job->members[req.rank()] = LocalMember{req.rank(), pid, req.local_rank()};

  if (job->members.size() == job->local_world_size) {
    job->state = LocalJob::State::kJoining;
    lock.unlock();
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    Status s = connect_job(job, std::max(left, kMinCoordinatorJoin));
    if (!s.ok()) {
      metrics_.error("join", "");
      abort(job, -1, s.message(), false);
    }
    lock.lock();
    job->state = s.ok() ? LocalJob::State::kReady : LocalJob::State::kFailed;
    job->failure = s;
    cv_.notify_all();
  } else {
    auto finished = [&] {
      return job->state != LocalJob::State::kCollecting && job->state != LocalJob::State::kJoining;
    };
    bool done = cv_.wait_until(lock, deadline, finished);
    if (!done && job->state == LocalJob::State::kJoining) {
      // Every local rank came; the leader is at the coordinator, whose answer (naming the
      // ranks that never came) is due at the same deadline. Wait for it a little longer.
      done = cv_.wait_until(lock, deadline + kLeaderSlack, finished);
    }
    if (!done) {
      std::string missing = job->missing_local_ranks();
      std::string present;
      for (auto& [r, m] : job->members) present += (present.empty() ? "" : ",") + std::to_string(r);
      size_t count = job->members.size();
      if (job->state == LocalJob::State::kCollecting) job->members.erase(req.rank());
      return Status(Code::kDeadlineExceeded,
                    who + "join timed out after " + std::to_string(timeout.count()) + " ms: only " +
                        std::to_string(count) + " of the " + std::to_string(job->local_world_size) +
                        " local ranks of this node (LOCAL_WORLD_SIZE) joined (" + present + ")" +
                        (missing.empty() ? "" : "; ranks that never joined: " + missing));
    }
  }
  if (job->state == LocalJob::State::kFailed) return job->failure;
  return job;
}

Status Daemon::connect_job(const std::shared_ptr<LocalJob>& job, std::chrono::milliseconds timeout) {
  auto log = dlog();
  std::vector<uint32_t> ranks;
  {
    std::lock_guard lock(mu_);
    for (auto& [r, m] : job->members) ranks.push_back(r);
  }
  v1::ChannelEndpoint mine;
  mine.set_proxy(endpoint_);
  mine.set_transport(transport_);
  mine.set_rings(cfg_.rings);
  mine.set_rings_chosen(rings_chosen_);
  mine.set_slots(cfg_.slots);
  mine.set_slot_bytes(cfg_.slot_bytes);
  mine.set_rank_sockets(cfg_.rank_sockets);
  v1::JoinJobRequest req;
  req.set_job_id(job->id);
  req.set_token(job->token);
  req.set_world_size(job->world_size);
  for (uint32_t r : ranks) {
    req.add_ranks(r);
    req.add_endpoints(mine.SerializeAsString());
  }
  v1::ChannelOffer* offer = req.mutable_offer();
  offer->set_rings(cfg_.rings);
  offer->set_rings_chosen(rings_chosen_);
  offer->set_slots(cfg_.slots);
  offer->set_slot_bytes(cfg_.slot_bytes);
  auto joined = link_->join(req, timeout);
  if (!joined.ok()) return joined.status();
  // What this node needs of the job: its own ranks, the peers its channels connect to, the
  // layout in runs and the agreement the coordinator folded from every node's offer.
  auto table = link_->peer_table(job->id, joined->generation());
  if (!table.ok()) return table.status();
  if (!table->agreement().error().empty()) {
    return {Code::kInvalidArgument, "job=" + job->id + ": " + table->agreement().error()};
  }
  if (table->world_size() != job->world_size) {
    return {Code::kInternal, "coordinator returned a peer table of world size " + std::to_string(table->world_size()) +
                                 " for job " + job->id + " of " + std::to_string(job->world_size)};
  }
  auto layout = expand_layout(*table);
  if (!layout.ok()) return {layout.status().code(), "job=" + job->id + ": " + layout.status().message()};
  std::vector<v1::ChannelEndpoint> endpoints(job->world_size);
  std::map<uint32_t, std::string> hosts;
  for (const auto& peer : table->peers()) {
    if (peer.rank() >= job->world_size) {
      return {Code::kInternal, "coordinator returned rank " + std::to_string(peer.rank()) + " for job " + job->id};
    }
    auto& ep = endpoints[peer.rank()];
    if (!ep.ParseFromString(peer.endpoint()) || ep.slots() != cfg_.slots || ep.slot_bytes() != cfg_.slot_bytes) {
      return {Code::kInvalidArgument,
              "job=" + job->id + ": rank " + std::to_string(peer.rank()) + " (host " +
                  peer.hostname() + ") has channel geometry slots=" + std::to_string(ep.slots()) +
                  " slot_bytes=" + std::to_string(ep.slot_bytes()) + " but this node (" + hostname_ +
                  ") has slots=" + std::to_string(cfg_.slots) + " slot_bytes=" + std::to_string(cfg_.slot_bytes) +
                  ": start every gradsyncd with the same --slots/--slot-bytes"};
    }
    hosts[peer.rank()] = peer.hostname();
  }
  const uint32_t rings = table->agreement().rings();
  if (rings < 1 || rings > kMaxRings) {
    return {Code::kInternal, "job=" + job->id + ": the coordinator agreed on " + std::to_string(rings) + " rings"};
  }
  if (rings != cfg_.rings) {
    log->info("job={}: {} ring(s), as agreed with the job's other nodes (this node offered {}: a count given "
              "to a node wins, else the smallest choice)",
              job->id, rings, cfg_.rings);
  }
  {
    std::lock_guard lock(mu_);
    job->local_ranks = ranks;
    job->rings = rings;
    job->ring = std::move(layout->ring);
    job->rank_node = std::move(layout->rank_node);
    job->node_shape = std::move(layout->node_shape);
    job->shapes.assign(table->shapes().begin(), table->shapes().end());
    job->hosts = std::move(hosts);
    job->endpoints = std::move(endpoints);
    job->plan_channels(cfg_.slots, cfg_.slot_bytes, cfg_.recorder_entries);
  }
  auto shm = SharedMemory::create("gradsync-" + job->id, job->layout.total_bytes());
  if (!shm.ok()) return shm.status();
  init_job_control(shm->data(), job->layout);
#if GRADSYNC_HAVE_VERBS
  std::shared_ptr<verbs::MemoryRegion> mr;
  if (verbs_ && job->local_ranks.size() < job->world_size) {  // some channels cross nodes
    auto registered = register_job_memory(*verbs_, *shm);
    if (!registered.ok()) {
      return {registered.status().code(), job->ids() + " on " + hostname_ + ": registering the job's " +
                                              std::to_string(shm->size() >> 20) + " MiB with " +
                                              verbs_->describe() + ": " + registered.status().message()};
    }
    mr = std::move(registered).value();
  }
#endif
  {
    std::lock_guard lock(mu_);
#if GRADSYNC_HAVE_VERBS
    job->verbs_mr = mr;
#endif
    job->shm = std::make_shared<SharedMemory>(std::move(shm).value());
    job->init_recorders();
    job->generation = joined->generation();
    cv_.notify_all();  // peer daemons waiting to attach their channels
  }
  log->info("{} joined: {} local ranks of {}, {} channels ({} through the proxy), {} MiB", job->ids(),
            ranks.size(), job->world_size, job->layout.num_channels, job->staging.size(),
            job->layout.total_bytes() >> 20);

  // One outgoing connection per channel whose destination lives on another node; over verbs
  // when both nodes have it (the peer's choice came with its endpoint), else TCP.
  std::set<std::string> logged;
  for (const auto& [key, index] : job->staging) {
    auto [tag, src, dst] = key;
    const std::string& theirs = job->endpoints[dst].transport();
    ChannelTransport via = channel_transport(job->endpoints[src], job->endpoints[dst]);
    if (logged.insert(job->endpoints[dst].proxy()).second) {
      std::string no_rdma = transport_ != "verbs" ? "this node has no usable RDMA port"
                                                  : "that node has no usable RDMA port (it offers " +
                                                        (theirs.empty() ? std::string("tcp") : theirs) + ")";
      log->info("{} channels to gradsyncd {} (host {}): {} ({})", job->ids(), job->endpoints[dst].proxy(),
                job->host_of(dst), to_string(via),
                via == ChannelTransport::kVerbs     ? "both nodes have RDMA"
                : via == ChannelTransport::kTcpRank ? no_rdma + "; both nodes hand the sockets to their ranks"
                : !cfg_.rank_sockets                ? no_rdma + "; this node's proxy pumps them (--proxy-tcp)"
                                                    : no_rdma + "; that node's proxy pumps them");
    }
    ProxyHello hello{job->id, via, job->generation, tag, src, dst};
    auto sock = proxy_connect(job->endpoints[dst].proxy(), hello, job->token, deadline_after(kPeerAcceptTimeout));
    if (!sock.ok()) {
      return {sock.status().code(), job->ids() + " rank " + std::to_string(src) + " -> " +
                                        job->peer_name(dst) + ": " + sock.status().message()};
    }
    if (via == ChannelTransport::kTcpRank) {
      std::lock_guard lock(mu_);
      job->rank_sockets[index] = std::move(sock).value();
      continue;
    }
    std::string local;
    {
      std::lock_guard lock(mu_);
      local = job->member_name(src, hostname_);
    }
    PumpContext ctx{job->shm, job->layout, index, &job->stop, &job->drain, job->peer_name(dst),
                    job->ids() + " ch=" + std::to_string(index), static_cast<int>(src), local,
                    metrics_.pumped(job->endpoints[dst].proxy(), true)};
    std::unique_ptr<ChannelPump> pump;
#if GRADSYNC_HAVE_VERBS
    if (via == ChannelTransport::kVerbs) {
      auto started = VerbsPump::start_sender(verbs_, job->verbs_mr, std::move(ctx), tag, std::move(sock).value(),
                                             pump_failure(job, job->endpoints[dst].proxy()), deadline_after(kPeerAcceptTimeout));
      if (!started.ok()) {
        return {started.status().code(), job->ids() + " rank " + std::to_string(src) + " -> " +
                                              job->peer_name(dst) + ": " + started.status().message()};
      }
      pump = std::move(started).value();
    }
#endif
    if (!pump) pump = Pump::start_sender(std::move(ctx), std::move(sock).value(), pump_failure(job, job->endpoints[dst].proxy()));
    std::lock_guard lock(mu_);
    job->pumps.push_back(std::move(pump));
  }
  return await_rank_sockets(job);
}

Status Daemon::await_rank_sockets(const std::shared_ptr<LocalJob>& job) {
  // The incoming rank sockets: peer daemons connect them (serve_peer) while this node connects
  // its own; a local rank's join reply carries them, so the join waits for all of them.
  std::unique_lock lock(mu_);
  auto missing = [&] {
    std::vector<LocalJob::EdgeKey> out;
    for (const auto& [key, index] : job->incoming) {
      auto [tag, src, dst] = key;
      if (job->is_local(src)) continue;
      if (channel_transport(job->endpoints[src], job->endpoints[dst]) != ChannelTransport::kTcpRank) continue;
      if (!job->rank_sockets.count(index)) out.push_back(key);
    }
    return out;
  };
  if (cv_.wait_until(lock, deadline_after(kPeerAcceptTimeout), [&] { return missing().empty() || job->stop; })) {
    if (job->stop) {
      return {Code::kAborted, job->ids() + " on " + hostname_ + ": aborted while connecting channels" +
                                  (job->abort_reason.empty() ? "" : ": " + job->abort_reason)};
    }
    return Status::Ok();
  }
  std::string which;
  for (auto [tag, src, dst] : missing()) {
    if (!which.empty()) which += ", ";
    which += job->peer_name(src) + " -> rank " + std::to_string(dst) + " (tag " + std::to_string(tag) + ")";
  }
  return {Code::kDeadlineExceeded, job->ids() + " on " + hostname_ + ": after " +
                                       std::to_string(kPeerAcceptTimeout.count() / 1000) +
                                       " s these peers never connected their channels: " + which +
                                       " (their gradsyncd stuck or unreachable from it?)"};
}

void Daemon::serve_peer(Fd sock) {
  // Nothing of the job is touched before the connector proved its token: read the Hello,
  // challenge it with a fresh nonce, read its proof, and only then look at the job.
  auto hello = proxy_read_hello(sock.get(), deadline_after(kHelloTimeout));
  if (!hello.ok()) {
    warn_limited(peer_log_, "rejected a data-port connection: " + hello.status().message());
    return;
  }
  const std::string channel = "job=" + hello->job + " gen=" + std::to_string(hello->generation) + " channel " +
                              std::to_string(hello->src_rank) + " -> " + std::to_string(hello->dst_rank) +
                              " (tag " + std::to_string(hello->tag) + ")";
  auto challenge = hello_challenge(sock.get());
  if (!challenge.ok()) return;
  auto proof = hello_read_proof(sock.get(), deadline_after(kHelloTimeout));
  if (!proof.ok()) {
    warn_limited(peer_log_, "rejected a data-port connection for " + channel + ": no proof of the job token (" +
                                proof.status().message() + ")");
    return;
  }
  auto refuse = [&](const Status& why) {
    warn_limited(peer_log_, "rejected a data-port connection for " + channel + ": " + why.message());
    (void)proxy_reply(sock.get(), why);
  };
  std::unique_lock lock(mu_);
  std::shared_ptr<LocalJob> job;
  bool found = cv_.wait_until(lock, deadline_after(kPeerAcceptTimeout), [&] {
    auto it = jobs_.find(hello->job);
    if (it == jobs_.end()) return false;
    job = it->second;
    return job->generation == hello->generation && job->shm != nullptr;
  });
  if (!found) {
    lock.unlock();
    return refuse({Code::kNotFound, "no generation " + std::to_string(hello->generation) + " of job " + hello->job +
                                        " is running on " + hostname_});
  }
  if (!same_mac(*proof, hello_proof(job->token, *hello, *challenge, HelloRole::kConnector))) {
    lock.unlock();
    return refuse({Code::kPermissionDenied, "the proof of the job token is wrong (a wrong token, or a forged or "
                                            "replayed Hello)"});
  }
  int idx = -1;
  auto it = job->incoming.find({hello->tag, hello->src_rank, hello->dst_rank});
  if (it != job->incoming.end() && !job->is_local(hello->src_rank)) idx = static_cast<int>(it->second);
  if (idx < 0) {
    lock.unlock();
    return refuse({Code::kNotFound, "no such cross-node channel into " + hostname_});
  }
  // The transport is the one both daemons derive from the peer table, nothing else.
  const ChannelTransport agreed = channel_transport(job->endpoints[hello->src_rank], job->endpoints[hello->dst_rank]);
  if (hello->transport != agreed) {
    lock.unlock();
    return refuse({Code::kFailedPrecondition, std::string("asked for a channel over ") + to_string(hello->transport) +
                                                  ", but the two nodes agreed on " + to_string(agreed)});
  }
  // One connection per channel: a second one (a replay, or a confused peer) is refused and the
  // first keeps the channel.
  if (!job->connected.insert(static_cast<uint32_t>(idx)).second) {
    lock.unlock();
    return refuse({Code::kAlreadyExists, "the channel is already connected; this second connection is refused "
                                         "and the first one keeps it"});
  }
  const Mac accept = hello_proof(job->token, *hello, *challenge, HelloRole::kAcceptor);
  PumpContext ctx{job->shm, job->layout, static_cast<uint32_t>(idx), &job->stop, &job->drain,
                  job->peer_name(hello->src_rank), job->ids() + " ch=" + std::to_string(idx), -1, "",
                  metrics_.pumped(job->endpoints[hello->src_rank].proxy(), false)};
  if (agreed == ChannelTransport::kVerbs) {
#if GRADSYNC_HAVE_VERBS
    if (verbs_ && job->verbs_mr) {
      auto vmr = job->verbs_mr;
      lock.unlock();  // the set-up talks to the peer; pump_failure takes mu_
      if (!hello_accept(sock.get(), accept).ok()) return;
      auto started = VerbsPump::start_receiver(verbs_, std::move(vmr), std::move(ctx), hello->tag, std::move(sock),
                                               pump_failure(job, job->endpoints[hello->src_rank].proxy()),
                                               deadline_after(kPeerAcceptTimeout));
      if (!started.ok()) {
        abort(job, -1, job->ids() + " on " + hostname_ + ": " + started.status().message(), true);
        return;
      }
      std::lock_guard relock(mu_);
      job->pumps.push_back(std::move(started).value());
      return;
    }
#endif
    lock.unlock();
    return refuse({Code::kFailedPrecondition, hostname_ + " cannot run a verbs channel (" +
                                                  (verbs_ ? "the job's memory is not registered" : "no usable RDMA port") +
                                                  ")"});
  }
  if (!hello_accept(sock.get(), accept).ok()) return;
  if (agreed == ChannelTransport::kTcpRank) {
    job->rank_sockets[static_cast<uint32_t>(idx)] = std::move(sock);
    cv_.notify_all();  // connect_job waits for every incoming one
    return;
  }
  job->pumps.push_back(Pump::start_receiver(std::move(ctx), std::move(sock),
                                            pump_failure(job, job->endpoints[hello->src_rank].proxy())));
}

PumpFailure Daemon::pump_failure(const std::shared_ptr<LocalJob>& job, const std::string& peer_daemon) {
  std::weak_ptr<LocalJob> weak = job;
  return [this, weak, peer_daemon](int rank, const std::string& why) {
    auto j = weak.lock();
    if (!j) return;
    metrics_.error(rank < 0 ? "peer_channel" : "rank_slot", rank < 0 ? "gradsyncd " + peer_daemon : "rank " + std::to_string(rank));
    if (rank < 0) {
      // A connection the peer closed is most often the echo of an abort its daemon has just told
      // the coordinator (a hostile slot, a crashed rank there): give that named reason time to
      // arrive, so the job's error names the culprit, not the channel that only saw it go.
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, kPeerAbortGrace, [&] { return j->aborted; })) return;
    }
    abort(j, rank, j->ids() + " on " + hostname_ + ": " + why, true);
  };
}

void Daemon::abort(const std::shared_ptr<LocalJob>& job, int failed_rank, const std::string& reason,
                   bool tell) {
  uint64_t generation;
  {
    std::lock_guard lock(mu_);
    if (job->aborted) return;
    job->aborted = true;
    job->abort_reason = reason;
    generation = job->generation;
    if (job->shm) abort_job(job->shm->data(), job->layout, failed_rank, reason);
    job->stop.store(true);
    cv_.notify_all();
  }
  dlog()->error("{} aborted: {}", job->ids(), reason);
  if (tell && generation != 0) {
    Status s = link_->abort(job->id, generation, failed_rank, reason);
    if (!s.ok()) dlog()->warn("{} could not tell the coordinator: {}", job->ids(), s.message());
  }
  if (std::string path = dump_traces(job, "the job was aborted: " + reason); !path.empty()) {
    dlog()->info("{} flight recorders in {}", job->ids(), path);
  }
}

std::string Daemon::log_dir() const {
  if (!cfg_.log_dir.empty()) return cfg_.log_dir;
  auto slash = cfg_.socket_path.rfind('/');
  return slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : cfg_.socket_path.substr(0, slash);
}

std::string Daemon::dump_traces(const std::shared_ptr<LocalJob>& job, const std::string& why) {
  std::vector<v1::RankTrace> traces;
  {
    std::lock_guard lock(mu_);
    if (!job->shm || job->layout.recorders == 0) return "";
    traces = read_local_traces(*job, hostname_, cfg_.node_name, cfg_.recorder_entries);
  }
  auto path = gradsync::dump_traces(log_dir(), *job, cfg_.node_name, traces, why);
  if (!path.ok()) {
    dlog()->warn("{}: {}", job->ids(), path.status().message());
    return "";
  }
  return *path;
}

void Daemon::report_traces(const v1::Event& ev) {
  v1::ReportTraceRequest req;
  req.set_request_id(ev.request_id());
  req.set_job_id(ev.job_id());
  req.set_generation(ev.generation());
  std::shared_ptr<LocalJob> job;
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(ev.job_id());
    if (it != jobs_.end() && it->second->generation == ev.generation()) job = it->second;
    if (!job) {
      req.set_error("gradsyncd on " + hostname_ + " has no generation " + std::to_string(ev.generation()) +
                    " of job " + ev.job_id() + " (its ranks here left, or it was torn down)");
    } else if (!job->shm || job->layout.recorders == 0) {
      req.set_error("gradsyncd on " + hostname_ + " keeps no flight recorders (--trace-entries 0)");
    } else {
      const uint32_t max = ev.max_records() ? std::min(ev.max_records(), cfg_.recorder_entries) : cfg_.recorder_entries;
      for (auto& t : read_local_traces(*job, hostname_, cfg_.node_name, max)) *req.add_ranks() = std::move(t);
    }
  }
  if (job && req.ranks_size() > 0 && !ev.quiet()) {
    std::vector<v1::RankTrace> all(req.ranks().begin(), req.ranks().end());
    auto path = gradsync::dump_traces(log_dir(), *job, cfg_.node_name, all, "gradsyncctl trace (on demand)");
    if (path.ok()) req.set_dump_path(*path);
    else dlog()->warn("{}: {}", job->ids(), path.status().message());
  }
  if (Status s = link_->report_trace(std::move(req)); !s.ok()) {
    dlog()->warn("job={}: sending the flight recorders to the coordinator: {}", ev.job_id(), s.message());
  }
}

void Daemon::member_gone(const std::shared_ptr<LocalJob>& job, uint32_t rank) {
  bool crashed = false;
  bool last = false;
  uint32_t pid = 0;
  {
    std::lock_guard lock(mu_);
    auto& m = job->members[rank];
    m.connected = false;
    pid = m.pid;
    crashed = !m.left && job->state == LocalJob::State::kReady;
    last = job->all_disconnected();
  }
  if (crashed) {
    metrics_.error("rank_exit", "rank " + std::to_string(rank));
    abort(job, static_cast<int>(rank),
          "job=" + job->id + " gen=" + std::to_string(job->generation) + ": rank " +
              std::to_string(rank) + " (pid " + std::to_string(pid) + ", host " + hostname_ +
              ") exited without leaving the job (crashed or killed?)",
          true);
  }
  if (last) teardown(job);
}

void Daemon::teardown(const std::shared_ptr<LocalJob>& job) {
  std::vector<std::unique_ptr<ChannelPump>> pumps;
  bool clean;
  {
    std::lock_guard lock(mu_);
    clean = !job->aborted && job->state == LocalJob::State::kReady;
    job->drain.store(true);
    pumps = std::move(job->pumps);
  }
  if (clean) {
    // Senders flush their last slots and say Bye before anything is stopped; bounded in case
    // a peer stopped reading. They notice `drain` within one pump poll period.
    Deadline deadline = deadline_after(kDrainTimeout);
    auto senders_done = [&] {
      return std::all_of(pumps.begin(), pumps.end(),
                         [](auto& p) { return !p->is_sender() || p->finished(); });
    };
    while (!senders_done() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  job->stop.store(true);
  for (auto& p : pumps) p->stop_and_join();
  if (clean && job->generation != 0) {
    Status s = link_->leave(job->id, job->generation);
    if (!s.ok()) dlog()->warn("{} leave: {}", job->ids(), s.message());
  }
  {
    std::lock_guard lock(mu_);
    // Its ranks' counters outlive the memory (under mu_: a scrape sees them live or kept, once).
    metrics_.retire(rank_counters(*job));
    job->state = LocalJob::State::kDone;
    auto it = jobs_.find(job->id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
  }
  cv_.notify_all();  // stop() may be waiting for finishing jobs
  dlog()->info("{} torn down ({})", job->ids(), clean ? "finished" : "aborted");
}

void Daemon::on_event(const v1::Event& ev) {
  if (ev.kind() == v1::Event::TRACE_REQUESTED) return report_traces(ev);
  if (ev.kind() != v1::Event::JOB_ABORTED) return;
  std::shared_ptr<LocalJob> job;
  {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(ev.job_id());
    if (it == jobs_.end()) return;
    job = it->second;
    if (job->generation != 0 && job->generation != ev.generation()) return;
    if (job->generation == 0 && job->state == LocalJob::State::kCollecting) return;
  }
  metrics_.error("coordinator_abort", ev.failed_rank() >= 0 ? "rank " + std::to_string(ev.failed_rank()) : ev.failed_node());
  abort(job, ev.failed_rank(), ev.reason(), false);
}

void Daemon::forgotten(const std::string& node_id) {
  std::vector<std::shared_ptr<LocalJob>> running;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, job] : jobs_) {
      if (job->generation != 0 && !job->aborted && job->state != LocalJob::State::kDone) running.push_back(job);
    }
  }
  for (auto& job : running) {
    // The coordinator aborted these generations when it dropped the node (and the other nodes
    // heard it then); this node's ranks hear it now instead of waiting for their op timeout.
    abort(job, -1,
          job->ids() + ": gradsyncd on " + hostname_ + " (node " + node_id + ") was forgotten by the coordinator at " +
              link_->address() + ": it was paused or cut off from it for longer than its lease, and the coordinator "
              "gave up the node's jobs",
          false);
  }
}

}  // namespace gradsync
