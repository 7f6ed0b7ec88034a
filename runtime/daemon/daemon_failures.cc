// The Daemon (daemon/daemon.h): how a job ends: a peer connection lost, an abort from any
// side, a member gone, the coordinator forgetting this node; flight-recorder dumps; teardown.
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

PumpFailure Daemon::pump_failure(const std::shared_ptr<LocalJob>& job, const std::string& peer_daemon) {
  std::weak_ptr<LocalJob> weak = job;
  return [this, weak, peer_daemon](int rank, const std::string& why) {
    auto j = weak.lock();
    if (!j) return;
    metrics_.error(rank < 0 ? "peer_channel" : "rank_slot", rank < 0 ? "gradsyncd " + peer_daemon : "rank " + std::to_string(rank));
    std::string reason = j->ids() + " on " + hostname_ + ": " + why;
    if (rank < 0) {
      // A connection the peer closed is most often the echo of an abort its daemon has just told
      // the coordinator (a hostile slot, a crashed rank there): give that named reason time to
      // arrive, so the job's error names the culprit, not the channel that only saw it go. But
      // when the peer daemon's port refuses connections, that daemon is gone and nobody will
      // tell: the job ends at once. It is probed again through the grace: the connection may
      // close a moment before the dying process's listening socket does.
      const Deadline grace_end = deadline_after(kPeerAbortGrace);
      Status alive;
      for (;;) {
        alive = probe_daemon(peer_daemon, std::min(grace_end, deadline_after(kPeerProbeTimeout)));
        if (alive.code() == Code::kUnavailable) break;
        std::unique_lock lock(mu_);
        if (cv_.wait_until(lock, std::min(grace_end, deadline_after(kPeerProbeEvery)), [&] { return j->aborted; })) {
          return;
        }
        if (Clock::now() >= grace_end) break;
      }
      // A daemon gone, or (a cut of the data network) one that does not answer either.
      if (!alive.ok()) reason += "; " + alive.message();
    }
    abort(j, rank, reason, true);
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

void Daemon::forgotten(const std::string& node_id, const std::string& cause) {
  std::vector<std::shared_ptr<LocalJob>> running;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, job] : jobs_) {
      if (job->generation != 0 && !job->aborted && job->state != LocalJob::State::kDone) running.push_back(job);
    }
  }
  for (auto& job : running) {
    // The coordinator aborted these generations when it dropped the node (and the other nodes
    // heard it then), or lost them in a restart; this node's ranks hear it now instead of
    // waiting for their op timeout.
    abort(job, -1,
          job->ids() + ": gradsyncd on " + hostname_ + " (node " + node_id + ") was forgotten by the coordinator at " +
              link_->address() + ": " + cause,
          false);
  }
}

void Daemon::coordinator_unreachable(std::chrono::milliseconds outage, const std::string& address,
                                     const std::string& why) {
  // The running jobs and their peer daemons elsewhere.
  std::vector<std::pair<std::shared_ptr<LocalJob>, std::set<std::string>>> running;
  std::set<std::string> peers;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, job] : jobs_) {
      if (job->generation == 0 || job->aborted || job->state != LocalJob::State::kReady) continue;
      std::set<std::string> theirs;
      for (const auto& ep : job->endpoints) {
        if (!ep.proxy().empty() && ep.proxy() != endpoint_) theirs.insert(ep.proxy());
      }
      if (theirs.empty()) continue;  // every rank here: no partition can touch it
      peers.insert(theirs.begin(), theirs.end());
      running.emplace_back(job, std::move(theirs));
    }
  }
  if (running.empty()) return;
  // A peer daemon that accepts, or refuses (its host answered), is reachable; a connection that
  // times out or finds no route is not.
  std::map<std::string, std::string> silent;  // endpoint -> what the probe saw
  size_t probed = 0;
  for (const auto& peer : peers) {
    if (probed++ == kMaxCutOffProbes) break;
    Status s = probe_daemon(peer, deadline_after(kPeerProbeTimeout));
    if (s.code() == Code::kDeadlineExceeded) silent[peer] = s.message();
  }
  if (silent.empty()) return;  // the coordinator alone is away (down, or a takeover): go on
  const std::string coordinator = "the coordinator at " + address + " has been unreachable for " +
                                  std::to_string(outage.count()) + " ms (" + why + ")";
  for (auto& [job, theirs] : running) {
    std::string names;
    size_t answered = 0;
    for (const auto& peer : theirs) {
      auto it = silent.find(peer);
      if (it == silent.end()) {
        ++answered;
        continue;
      }
      names += (names.empty() ? "" : ", ") + it->second;
    }
    if (names.empty()) continue;
    metrics_.error("cut_off", "coordinator " + address);
    abort(job, -1,
          job->ids() + ": gradsyncd on " + hostname_ + " (data " + endpoint_ + ") is cut off from the network: " +
              coordinator + ", longer than its lease, so the coordinator has given this node up and ended the job " +
              "on the other nodes; and the job's peer daemons do not answer (" + names + ")" +
              (answered ? "; " + std::to_string(answered) + " other peer daemon(s) of the job answered" : ""),
          false);
  }
}

}  // namespace gradsync
