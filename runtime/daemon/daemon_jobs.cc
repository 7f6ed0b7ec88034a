// The Daemon (daemon/daemon.h): a job on this node, from the first rank's join through the
// coordinator's answer to the channels to peer daemons and the ranks' own sockets.
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
#include "daemon/daemon_internal.h"
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

using namespace daemon_internal;

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
  // One deadline for all of them (the connect, then the handshake): a peer host that drops
  // connections costs the join that long once, not once per channel.
  const Deadline connect_by = deadline_after(kPeerAcceptTimeout);
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
    auto sock = proxy_connect(job->endpoints[dst].proxy(), hello, job->token, connect_by);
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

}  // namespace gradsync
