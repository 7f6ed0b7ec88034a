// Test harness for the verbs transport: several gradsyncd (the Daemon class, each with its own
// Unix socket, shared memory and emulated RoCE device: a "node") and a real coordinator in
// this process, and a job of ranks as threads through the public API on top of them. The
// emulated fabric is in-process, which is why the daemons are objects here and not processes.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/collective.h"
#include "../unit/daemon_world.h"
#include "coordinator.grpc.pb.h"
#include "coordinator/service.h"
#include "daemon/daemon.h"
#include "gradsync/gradsync.h"
#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/ibv_api.h"

namespace gradsync::testing {

using namespace std::chrono_literals;

// Every cluster gets fresh device names: the fabric is process-wide and never reset here.
inline std::atomic<int> g_clusters{0};

struct ClusterOptions {
  int nodes = 2;
  std::vector<std::string> transport = {};  // per node; default "verbs" everywhere
  uint32_t slots = 4;
  uint32_t slot_bytes = 4096;
  uint32_t rings = 1;
  verbs::LinkLayer link_layer = verbs::LinkLayer::kEthernet;  // RoCE (GIDs) or InfiniBand (LIDs)
  // The text of a node's topology file (its daemon's --topo-file), given the node and the name
  // of its emulated device; unset: no file.
  std::function<std::string(int node, const std::string& device)> topo = {};
};

class DaemonCluster {
 public:
  explicit DaemonCluster(ClusterOptions o) : opts_(std::move(o)) {
    char tmpl[] = "/tmp/gsverbs-XXXXXX";
    if (char* d = ::mkdtemp(tmpl)) dir_ = d;
    coord_ = std::make_unique<coordinator::CoordinatorServer>();
    if (Status s = coord_->start("127.0.0.1:0"); !s.ok()) {
      error_ = "coordinator: " + s.to_string();
      return;
    }
    const int id = ++g_clusters;
    for (int i = 0; i < opts_.nodes; ++i) {
      std::string dev = "emu" + std::to_string(id) + "n" + std::to_string(i);
      verbs::EmulatedFabric::instance().add_device(dev, 1, opts_.link_layer);
      devices_.push_back(dev);
      DaemonConfig cfg;
      cfg.coordinator = "127.0.0.1:" + std::to_string(coord_->port());
      cfg.socket_path = dir_ + "/node" + std::to_string(i) + ".sock";
      cfg.node_name = "node" + std::to_string(i);
      cfg.data_listen = "127.0.0.1";
      cfg.data_host = "127.0.0.1";
      cfg.slots = opts_.slots;
      cfg.slot_bytes = opts_.slot_bytes;
      cfg.rings = opts_.rings;
      cfg.transport = size_t(i) < opts_.transport.size() ? opts_.transport[i] : "verbs";
      cfg.ibv = verbs::emulated_ibv();
      cfg.verbs_device = dev;
      if (opts_.topo) {
        cfg.topo_file = dir_ + "/node" + std::to_string(i) + ".topo";
        std::ofstream(cfg.topo_file) << opts_.topo(i, dev);
      }
      auto d = std::make_unique<Daemon>(cfg);
      if (Status s = d->start(); !s.ok()) {
        error_ = "gradsyncd node" + std::to_string(i) + ": " + s.to_string();
        return;
      }
      sockets_.push_back(cfg.socket_path);
      daemons_.push_back(std::move(d));
    }
  }
  ~DaemonCluster() {
    daemons_.clear();
    if (coord_) coord_->shutdown();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  Daemon& daemon(int node) { return *daemons_.at(node); }
  const std::string& socket(int node) const { return sockets_.at(node); }
  const std::string& device(int node) const { return devices_.at(node); }

  // The coordinator's DescribeJob (what `gradsyncctl describe` prints), once `paths` ranks
  // reported their data path (each rank reports it right after its join), or after 5 s.
  v1::DescribeJobResponse describe(const std::string& job, int paths) {
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(coord_->port()),
                                                             grpc::InsecureChannelCredentials()));
    const auto until = std::chrono::steady_clock::now() + 5s;
    v1::DescribeJobResponse resp;
    for (;;) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 5s);
      v1::DescribeJobRequest req;
      req.set_job_id(job);
      resp.Clear();
      (void)stub->DescribeJob(&ctx, req, &resp);
      if (resp.paths_size() >= paths || std::chrono::steady_clock::now() > until) return resp;
      std::this_thread::sleep_for(10ms);
    }
  }

 private:
  ClusterOptions opts_;
  std::string dir_;
  std::string error_;
  std::unique_ptr<coordinator::CoordinatorServer> coord_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<std::string> sockets_;
  std::vector<std::string> devices_;
};

}  // namespace gradsync::testing
