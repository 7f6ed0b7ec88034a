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

#include "common/framing_proto.h"
#include "collectives/topology.h"
#include "common/log.h"
#include "common/memory_text.h"
#include "common/socket_path.h"
#include "common/secret.h"
#include "daemon/peer_layout.h"
#include "daemon/daemon_internal.h"
#include "daemon/ring_count.h"
#include "daemon/trace_dump.h"
#include "daemon/trainer_request.h"
#include "daemon/transport_choice.h"
#include "topology/node_info.h"
#include "topology/rail_devices.h"
#include "topology/topology_summary.h"
#if GRADSYNC_HAVE_VERBS
#include "daemon/verbs_pump.h"
#endif

namespace gradsync {
using namespace daemon_internal;

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

Daemon::Daemon(DaemonConfig config)
    : cfg_(std::move(config)),
      hostname_(hostname()),
      trainer_pool_(cfg_.max_connections, [this](Fd s) { serve_trainer(std::move(s)); }, kConnectionThreadLinger),
      peer_pool_(cfg_.max_connections, [this](Fd s) { serve_peer(std::move(s)); }, kConnectionThreadLinger) {
  if (cfg_.node_name.empty()) cfg_.node_name = hostname_;
}

Daemon::~Daemon() {
  stop();
  // Connection threads end when their trainer or peer hangs up. A process exits right after
  // (main.cc); a Daemon object in a test process waits for them, so none outlives `this`.
  const Deadline deadline = deadline_after(kThreadExitWait);
  const size_t left = trainer_pool_.stop(deadline) + peer_pool_.stop(deadline);
  if (left > 0) dlog()->warn("{} connection threads still running at exit", left);
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
  data_host_ = *host;
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
#if GRADSYNC_HAVE_VERBS
  if (verbs_) {
    // Each GPU's own NIC, for its ranks' GPUDirect RDMA queue pairs, where it can stand in for
    // ours (topology/rail_devices.h); checked once here, sent with every join.
    const auto rails = topology::rail_devices(*gpu_topo, [this](const std::string& nic) {
      return verbs_->stand_in_refusal(nic);
    });
    rail_devices_ = rails.devices;
    if (!rails.devices.empty()) log->info("GPUDirect RDMA device per GPU: {}", topology::describe(rails));
  }
#endif

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
  link_->set_on_forgotten([this](const std::string& node_id, const std::string& cause) { forgotten(node_id, cause); });
  link_->set_on_unreachable([this](std::chrono::milliseconds outage, const std::string& address, const std::string& why) {
    coordinator_unreachable(outage, address, why);
  });
  GS_RETURN_IF_ERROR(link_->start(cfg_.register_timeout));

  trainer_acceptor_ = std::thread([this] {
    accept_loop(trainer_listener_.get(), trainer_pool_, trainer_cap_log_, "trainer-socket");
  });
  peer_acceptor_ = std::thread([this] {
    accept_loop(peer_listener_.get(), peer_pool_, peer_cap_log_, "data-port");
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

void Daemon::accept_loop(int listener, ConnectionPool& pool, log::RateLimit& cap_log, const char* what) {
  pollfd fds[2] = {{listener, POLLIN, 0}, {stop_event_.get(), POLLIN, 0}};
  for (;;) {
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    Fd sock(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
    if (!sock.valid()) continue;
    if (pool.submit(std::move(sock))) continue;
    // At the cap: the connection was closed at once.
    warn_limited(cap_log, std::string("refused a ") + what + " connection: " + std::to_string(cfg_.max_connections) +
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
        jr->set_data_host(data_host_);
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
        for (const auto& d : rail_devices_) vd->add_rail_devices(d);
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
        p.set_gpu_memory_bytes(msg.path().gpu_memory_bytes());
        p.set_pinned_host_bytes(msg.path().pinned_host_bytes());
        log->info("{} rank {} data path: {} ({}){}", job->ids(), rank, p.path(), p.why(),
                  memory_text(p.gpu_memory_bytes(), p.pinned_host_bytes()));
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

void Daemon::serve_peer(Fd sock) {
  // Nothing of the job is touched before the connector proved its token: read the Hello,
  // challenge it with a fresh nonce, read its proof, and only then look at the job.
  auto hello = proxy_read_hello(sock.get(), deadline_after(kHelloTimeout));
  char first;
  if (!hello.ok() && ::recv(sock.get(), &first, 1, MSG_PEEK | MSG_DONTWAIT) == 0 &&
      hello.status().message() == "connection closed by peer") {
    return;  // closed before a byte: another gradsyncd's liveness probe (probe_daemon)
  }
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

}  // namespace gradsync
