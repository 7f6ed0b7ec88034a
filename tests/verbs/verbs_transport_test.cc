// Cross-node channels over the verbs transport, on the emulated fabric: several gradsyncd
// (the Daemon class, each with its own Unix socket, shared memory and emulated RoCE device: a
// "node") and a real coordinator in this process, trainers as threads through the public API.
// The emulated fabric is in-process, which is why the daemons are objects here and not
// processes (tests/integration runs the same daemons as processes over TCP).
//
// Covered: the collectives matrix (every collective x type x op x algorithm, counts 0 to 5003,
// 4 KiB slots so that messages span many slots) over RC QPs with WRITE_WITH_IMM and credits;
// per-peer fallback to TCP when one node has no RDMA; fault injection (link down, QP error)
// mid-collective, which must fail every rank within the timeout with an error naming the peer.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../unit/collective_matrix.h"
#include "coordinator/service.h"
#include "daemon/daemon.h"
#include "gradsync/gradsync.h"
#include "transport/verbs/emulated_fabric.h"
#include "transport/verbs/ibv_api.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using verbs::EmulatedFabric;

// Every cluster gets fresh device names: the fabric is process-wide and never reset here.
std::atomic<int> g_clusters{0};

struct ClusterOptions {
  int nodes = 2;
  std::vector<std::string> transport;  // per node; default "verbs" everywhere
  uint32_t slots = 4;
  uint32_t slot_bytes = 4096;
  uint32_t rings = 1;
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
      EmulatedFabric::instance().add_device(dev, 1, verbs::LinkLayer::kEthernet);
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

 private:
  ClusterOptions opts_;
  std::string dir_;
  std::string error_;
  std::unique_ptr<coordinator::CoordinatorServer> coord_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<std::string> sockets_;
  std::vector<std::string> devices_;
};

Status dispatch(Communicator& c, const CollectiveCall& k) {
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
  DaemonWorld(DaemonCluster& cluster, int nodes, int per_node, const std::string& job,
              std::chrono::milliseconds op_timeout = 30s)
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
        o.join_timeout = 30s;
        o.op_timeout = op_timeout;
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

// nodes, ranks per node, algorithm, rings
using Shape = std::tuple<int, int, Algorithm, uint32_t>;

class VerbsCollectives : public ::testing::TestWithParam<Shape> {};

TEST_P(VerbsCollectives, MatrixOverRcQueuePairs) {
  auto [nodes, per_node, algo, rings] = GetParam();
  DaemonCluster cluster({.nodes = nodes, .rings = rings});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (int i = 0; i < nodes; ++i) ASSERT_EQ(cluster.daemon(i).transport(), "verbs");
  DaemonWorld world(cluster, nodes, per_node, "matrix");
  ASSERT_EQ(world.join_error(), "");
  testing::allreduce_matrix(world, algo);
  testing::reduce_scatter_all_gather_broadcast_matrix(world, algo);
}

INSTANTIATE_TEST_SUITE_P(Shapes, VerbsCollectives,
                         ::testing::Values(Shape{2, 1, Algorithm::kRing, 1}, Shape{2, 1, Algorithm::kTree, 1},
                                           Shape{2, 2, Algorithm::kRing, 2}, Shape{2, 2, Algorithm::kTree, 1},
                                           Shape{3, 1, Algorithm::kRing, 1}, Shape{3, 1, Algorithm::kTree, 1}),
                         [](const auto& info) {
                           const Shape& p = info.param;
                           return std::to_string(std::get<0>(p)) + "nodes_x" + std::to_string(std::get<1>(p)) +
                                  "_" + to_string(std::get<2>(p)) + "_rings" + std::to_string(std::get<3>(p));
                         });

// A node without RDMA: channels to and from it run over TCP, the others over verbs.
TEST(VerbsTransport, PeerWithoutRdmaGetsTcpChannels) {
  DaemonCluster cluster({.nodes = 3, .transport = {"verbs", "verbs", "tcp"}});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  EXPECT_EQ(cluster.daemon(0).transport(), "verbs");
  EXPECT_EQ(cluster.daemon(2).transport(), "tcp");
  DaemonWorld world(cluster, 3, 1, "mixed");
  ASSERT_EQ(world.join_error(), "");
  for (Algorithm algo : {Algorithm::kRing, Algorithm::kTree}) {
    const size_t count = 70001;  // many slots of 4 KiB
    std::vector<std::vector<float>> buf(3, std::vector<float>(count));
    auto st = world.run([&](int r) {
      for (size_t i = 0; i < count; ++i) buf[r][i] = float(r + 1) * float(i % 97);
      return world.comm(r).allreduce(buf[r].data(), count, DataType::kFloat32, ReduceOp::kSum, {algo});
    });
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r].to_string();
      for (size_t i = 0; i < count; i += 997) ASSERT_EQ(buf[r][i], 6.0f * float(i % 97)) << "rank " << r << " i " << i;
    }
  }
}

TEST(VerbsTransport, ForcedVerbsOnAMissingDeviceFailsAtStart) {
  // Another device exists, so the error is about the name, not about an empty fabric.
  EmulatedFabric::instance().add_device("present-hca" + std::to_string(++g_clusters), 1, verbs::LinkLayer::kEthernet);
  coordinator::CoordinatorServer coord;
  ASSERT_TRUE(coord.start("127.0.0.1:0").ok());
  DaemonConfig cfg;
  cfg.coordinator = "127.0.0.1:" + std::to_string(coord.port());
  cfg.socket_path = "/tmp/gsverbs-missing-" + std::to_string(::getpid()) + ".sock";
  cfg.transport = "verbs";
  cfg.ibv = verbs::emulated_ibv();
  cfg.verbs_device = "no-such-hca";
  Daemon d(cfg);
  Status s = d.start();
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_NE(s.message().find("no-such-hca"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("GRADSYNC_TRANSPORT=verbs"), std::string::npos) << s.to_string();
}

// Runs large allreduces on every rank until one fails, injects `fault` after the first few,
// and checks that every rank fails within the deadline with an error that names a peer.
void expect_fault_fails_every_rank(const std::function<void(DaemonCluster&)>& fault,
                                   const std::vector<std::string>& must_mention) {
  DaemonCluster cluster({.nodes = 2});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  DaemonWorld world(cluster, 2, 2, "fault", 20s);
  ASSERT_EQ(world.join_error(), "");
  std::atomic<int> calls{0};
  std::atomic<bool> injected{false};
  const auto start = std::chrono::steady_clock::now();
  std::thread injector([&] {
    while (calls.load() < 8 && std::chrono::steady_clock::now() - start < 20s) std::this_thread::sleep_for(1ms);
    fault(cluster);
    injected = true;
  });
  std::vector<Clock::time_point> failed_at(4);
  auto st = world.run([&](int r) {
    std::vector<float> buf(1 << 18, 1.0f);  // 1 MiB: 256 slots of 4 KiB per call
    for (int i = 0; i < 100000; ++i) {
      Status s = world.comm(r).allreduce(buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      calls.fetch_add(1);
      if (!s.ok()) {
        failed_at[r] = Clock::now();
        return s;
      }
      if (injected && std::chrono::steady_clock::now() - start > 60s) break;
    }
    return Status::Ok();
  });
  injector.join();
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(st[r].ok()) << "rank " << r << " never saw the fault";
    const std::string& m = st[r].message();
    for (const auto& word : must_mention) EXPECT_NE(m.find(word), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_NE(m.find("rank "), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_LT(failed_at[r] - start, 40s) << "rank " << r;
  }
}

TEST(VerbsFaults, LinkDownMidCollectiveFailsEveryRankNamingThePeer) {
  expect_fault_fails_every_rank(
      [](DaemonCluster& c) { EmulatedFabric::instance().set_link_down(c.device(1), 1); },
      {"transport retry counter exceeded", "gradsyncd 127.0.0.1:"});
}

TEST(VerbsFaults, QpErrorMidCollectiveFailsEveryRankNamingThePeer) {
  expect_fault_fails_every_rank(
      [](DaemonCluster& c) { EXPECT_GT(EmulatedFabric::instance().force_device_qp_errors(c.device(0)), 0); },
      {"RDMA", "gradsyncd 127.0.0.1:"});
}

}  // namespace
}  // namespace gradsync
