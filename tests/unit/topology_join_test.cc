// A rank learns its job's shape at join: gradsyncd passes the node id of every rank and every
// node's GPU topology (from the coordinator's peer table) in the JoinResponse. A coordinator
// and two gradsyncd objects in this process, each node declared by a topology file.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/daemon_client.h"
#include "common/framing_proto.h"
#include "coordinator/service.h"
#include "daemon/daemon.h"
#include "topology/topology_summary.h"

namespace gradsync {
namespace {

std::string data(const std::string& name) { return std::string(GRADSYNC_TEST_DATA_DIR) + "/topo/" + name; }

TEST(TopologyAtJoin, EveryRankGetsEveryNodesGpuTopology) {
  char tmpl[] = "/tmp/gstopo-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  coordinator::CoordinatorServer coord;
  ASSERT_TRUE(coord.start("127.0.0.1:0").ok());
  std::vector<std::unique_ptr<Daemon>> daemons;
  const char* files[] = {"3x2-node.topo", "pcie-box.topo"};
  for (int i = 0; i < 2; ++i) {
    DaemonConfig cfg;
    cfg.coordinator = "127.0.0.1:" + std::to_string(coord.port());
    cfg.socket_path = dir + "/n" + std::to_string(i) + ".sock";
    cfg.node_name = "n" + std::to_string(i);
    cfg.data_listen = cfg.data_host = "127.0.0.1";
    cfg.transport = "tcp";
    cfg.topo_file = data(files[i]);
    daemons.push_back(std::make_unique<Daemon>(cfg));
    ASSERT_TRUE(daemons.back()->start().ok());
  }
  // Ranks 0 and 1 on n0, rank 2 on n1; each joins on its own thread (a join waits for all).
  std::map<int, v1::JoinResponse> replies;
  std::map<int, std::string> errors;
  std::mutex mu;
  // A rank hangs up only once every rank has its reply: one that hangs up before is a crashed
  // rank to its daemon, which aborts the join of the others (seen once in CI-like runs).
  std::condition_variable all_replied;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 3; ++rank) {
    ranks.emplace_back([&, rank] {
      const int node = rank < 2 ? 0 : 1;
      const Deadline deadline = deadline_after(std::chrono::seconds(30));
      auto client = DaemonClient::connect(dir + "/n" + std::to_string(node) + ".sock", deadline);
      std::string error;
      v1::JoinResponse reply;
      if (client.ok()) {
        // The join as protobuf classes on the attached connection: the library's own reader
        // skips the shapes this test is about.
        v1::ClientMessage req;
        auto* j = req.mutable_join();
        j->set_job_id("topo");
        j->set_token("secret");
        j->set_rank(uint32_t(rank));
        j->set_world_size(3);
        j->set_local_rank(uint32_t(node == 0 ? rank : 0));
        j->set_local_world_size(node == 0 ? 2 : 1);
        j->set_timeout_ms(20'000);
        std::vector<Fd> fds;
        v1::DaemonMessage r;
        Status s = send_frame(client->fd(), req);
        if (s.ok()) s = recv_frame(client->fd(), &r, deadline, &fds);
        if (s.ok() && r.has_join()) reply = r.join();
        else error = s.ok() ? r.DebugString() : s.to_string();
      } else {
        error = client.status().to_string();
      }
      std::unique_lock lock(mu);
      replies[rank] = reply;
      if (!error.empty()) errors[rank] = error;
      all_replied.notify_all();
      all_replied.wait_for(lock, std::chrono::seconds(30), [&] { return replies.size() == 3; });
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_TRUE(errors.empty()) << errors.begin()->second;
  for (int rank = 0; rank < 3; ++rank) {
    const v1::JoinResponse& jr = replies[rank];
    ASSERT_EQ(jr.rank_node_size(), 3) << rank;
    EXPECT_EQ(jr.rank_node(0), jr.rank_node(1));
    EXPECT_NE(jr.rank_node(0), jr.rank_node(2));
    ASSERT_EQ(jr.node_shape_size(), 2) << rank;
    ASSERT_EQ(jr.shapes_size(), 2) << rank << ": two distinct topologies";
    auto shape_of_rank = [&](int r) { return jr.shapes(int(jr.node_shape(int(jr.rank_node(r))))); };
    auto n0 = topology::from_summary(shape_of_rank(0));
    auto n1 = topology::from_summary(shape_of_rank(2));
    ASSERT_TRUE(n0.ok() && n1.ok());
    EXPECT_EQ(n0->gpus.size(), 2u);
    EXPECT_EQ(topology::link_label(n0->links[0][1]), "NV18");
    EXPECT_EQ(n0->rails, (std::vector<int>{0, 1}));
    EXPECT_EQ(n1->gpus.size(), 4u);
    EXPECT_EQ(topology::link_label(n1->links[0][1]), "PIX");
    EXPECT_EQ(n1->source, "file " + data("pcie-box.topo"));
  }
  daemons.clear();
  coord.shutdown();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace gradsync
