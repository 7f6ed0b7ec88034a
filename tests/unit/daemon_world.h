// Ranks as threads that join through the public API (Session, Communicator): a real
// coordinator and gradsyncd objects in this process (InProcessNode: one node on loopback;
// tests/verbs/daemon_cluster.h: several, over the emulated RDMA fabric), and a job of one
// communicator per rank on top of them.
#pragma once

#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/collective.h"
#include "coordinator/service.h"
#include "daemon/daemon.h"
#include "gradsync/gradsync.h"

namespace gradsync::testing {

using namespace std::chrono_literals;

// A coordinator and one gradsyncd (TCP transport, no RDMA) in this process: every rank of a
// job on it talks through shared memory.
class InProcessNode {
 public:
  InProcessNode() {
    char tmpl[] = "/tmp/gsnode-XXXXXX";
    if (char* d = ::mkdtemp(tmpl)) dir_ = d;
    coord_ = std::make_unique<coordinator::CoordinatorServer>();
    if (Status s = coord_->start("127.0.0.1:0"); !s.ok()) {
      error_ = "coordinator: " + s.to_string();
      return;
    }
    DaemonConfig cfg;
    cfg.coordinator = "127.0.0.1:" + std::to_string(coord_->port());
    cfg.socket_path = dir_ + "/node.sock";
    cfg.node_name = "node0";
    cfg.data_listen = "127.0.0.1";
    cfg.data_host = "127.0.0.1";
    cfg.transport = "tcp";
    daemon_ = std::make_unique<Daemon>(cfg);
    if (Status s = daemon_->start(); !s.ok()) error_ = "gradsyncd: " + s.to_string();
    socket_ = cfg.socket_path;
  }
  ~InProcessNode() {
    daemon_.reset();
    if (coord_) coord_->shutdown();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  const std::string& socket(int) const { return socket_; }

 private:
  std::string dir_, error_, socket_;
  std::unique_ptr<coordinator::CoordinatorServer> coord_;
  std::unique_ptr<Daemon> daemon_;
};

inline Status dispatch(Communicator& c, const CollectiveCall& k) {
  CallOptions o{k.algorithm};
  switch (k.kind) {
    case CollectiveKind::kAllreduce: return c.allreduce(k.send, k.recv, k.count, k.type, k.op, o);
    case CollectiveKind::kReduceScatter: return c.reduce_scatter(k.send, k.recv, k.count, k.type, k.op, o);
    case CollectiveKind::kAllGather: return c.all_gather(k.send, k.recv, k.count, k.type, o);
    case CollectiveKind::kBroadcast: return c.broadcast(k.recv, k.count, k.type, k.root, o);
    case CollectiveKind::kBarrier: return c.barrier();
  }
  return {Code::kInternal, "unknown collective"};
}

// A job of `nodes` x `per_node` ranks on a cluster, one communicator per rank; the World of
// collective_matrix.h.
class DaemonWorld {
 public:
  // `tweak` may adjust each rank's JoinOptions (e.g. a CUDA device). `cluster.socket(node)` is
  // the Unix socket of that node's gradsyncd.
  template <typename Cluster>
  DaemonWorld(Cluster& cluster, int nodes, int per_node, const std::string& job,
              std::chrono::milliseconds op_timeout = 30s,
              std::function<void(int rank, JoinOptions&)> tweak = nullptr)
      : n_(nodes * per_node), comms_(n_), status_(n_) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) {
      threads.emplace_back([&, r] {
        auto session = Session::connect(cluster.socket(r / per_node));
        if (!session.ok()) {
          status_[r] = session.status();
          return;
        }
        JoinOptions o;
        o.job = job;
        o.rank = r;
        o.world_size = n_;
        o.local_rank = r % per_node;
        o.local_world_size = per_node;
        o.token = "daemon-world-token";  // a job over several nodes needs one
        o.join_timeout = 30s;
        o.op_timeout = op_timeout;
        if (tweak) tweak(r, o);
        auto comm = session->join(o);
        if (!comm.ok()) {
          status_[r] = comm.status();
          return;
        }
        comms_[r] = std::make_unique<Communicator>(std::move(comm).value());
      });
    }
    for (auto& t : threads) t.join();
  }
  ~DaemonWorld() {
    std::vector<std::thread> threads;
    for (auto& c : comms_) {
      if (c) threads.emplace_back([&c] { (void)c->leave(); c.reset(); });
    }
    for (auto& t : threads) t.join();
  }

  std::string join_error() const {
    std::string e;
    for (int r = 0; r < n_; ++r) {
      if (!status_[r].ok()) e += "rank " + std::to_string(r) + ": " + status_[r].to_string() + "\n";
    }
    return e;
  }
  int size() const { return n_; }
  Communicator& comm(int r) { return *comms_.at(r); }

  // Runs fn(rank) on one thread per rank.
  std::vector<Status> run(const std::function<Status(int)>& fn) {
    std::vector<Status> out(n_);
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
    for (auto& t : threads) t.join();
    return out;
  }
  std::vector<Status> collective(std::vector<CollectiveCall> calls) {
    return run([&](int r) { return dispatch(*comms_[r], calls[r]); });
  }

 private:
  int n_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<Status> status_;
};

}  // namespace gradsync::testing
