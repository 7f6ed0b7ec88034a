// The coordinator's durable state (coordinator/store.h): a coordinator restarted on the same
// store serves the running jobs and keeps its nodes (in process, MemoryStore, and through gRPC
// with the authorization on); the etcd store and leader election against a real etcd started
// here (skipped with a message where `etcd` is not installed).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "common/call_auth.h"
#include "coordinator.grpc.pb.h"
#include "coordinator/election.h"
#include "coordinator/etcd_store.h"
#include "coordinator/service.h"
#include "coordinator/store.h"
#include "../integration/etcd_process.h"

namespace gradsync::coordinator {
namespace {

using namespace std::chrono_literals;

constexpr auto kRpcDeadline = 5s;

struct Caller {
  std::shared_ptr<CallAuth> auth;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  Caller(int port, const std::string& secret, const std::string& op)
      : Caller(port, std::make_shared<CallAuth>(secret, op)) {}
  Caller(int port, std::shared_ptr<CallAuth> a) : auth(std::move(a)) {
    stub = v1::Coordinator::NewStub(coordinator_channel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials(), {}, auth));
  }
  static void deadline(grpc::ClientContext& ctx) { ctx.set_deadline(std::chrono::system_clock::now() + kRpcDeadline); }
};

std::unique_ptr<CoordinatorServer> start_server(std::shared_ptr<Store> store) {
  CoordinatorOptions o;
  o.lease = 3000ms;
  o.default_join_timeout = 3000ms;
  o.authz.cluster_secret = "cluster";
  o.authz.operator_token = "operator";
  o.store = std::move(store);
  auto server = std::make_unique<CoordinatorServer>(o);
  Status s = server->start("127.0.0.1:0");
  EXPECT_TRUE(s.ok()) << s.to_string();
  return server;
}

TEST(CoordinatorStore, RestartedCoordinatorServesTheRunningJob) {
  auto store = std::make_shared<MemoryStore>();
  auto first = start_server(store);
  Caller node(first->port(), "cluster", "");
  std::string node_id;
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_hostname("host-a");
    req.mutable_node()->set_node_name("a");
    v1::RegisterNodeResponse resp;
    ASSERT_TRUE(node.stub->RegisterNode(&ctx, req, &resp).ok());
    node_id = resp.node_id();
    const auto& md = ctx.GetServerInitialMetadata();
    auto key = md.find(kNodeKeyHeader);
    ASSERT_NE(key, md.end());
    node.auth->set_node(node_id, std::string(key->second.data(), key->second.size()));
  }
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    v1::JoinJobRequest req;
    req.set_node_id(node_id);
    req.set_job_id("train");
    req.set_token("tok");
    req.set_world_size(2);
    for (uint32_t r : {0u, 1u}) {
      req.add_ranks(r);
      req.add_endpoints("ep" + std::to_string(r));
    }
    node.auth->set_job_token("train", "tok");
    v1::JoinJobResponse resp;
    grpc::Status s = node.stub->JoinJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(first->flush_store(5s));
  auto records = store->load();
  ASSERT_TRUE(records.ok());
  std::set<std::string> keys;
  for (const auto& [k, v] : *records) keys.insert(k);
  EXPECT_EQ(keys, (std::set<std::string>{"jobs/train", "meta", "nodes/" + node_id}));
  first->shutdown();
  first->wait();
  first.reset();

  auto second = start_server(store);
  // The same daemon (its node id, node key and job token) goes on: heartbeat and peer table.
  Caller again(second->port(), node.auth);
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    v1::HeartbeatRequest req;
    req.set_node_id(node_id);
    v1::HeartbeatResponse resp;
    grpc::Status s = again.stub->Heartbeat(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    again.auth->add_job_token(ctx, "train");
    v1::PeerTableRequest req;
    req.set_job_id("train");
    req.set_node_id(node_id);
    v1::PeerTableResponse resp;
    grpc::Status s = again.stub->GetPeerTable(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.world_size(), 2u);
    EXPECT_EQ(resp.peers_size(), 2);
  }
  Caller op(second->port(), "", "operator");
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    v1::DescribeJobRequest req;
    req.set_job_id("train");
    v1::DescribeJobResponse resp;
    grpc::Status s = op.stub->DescribeJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.summary().state(), "active");
    EXPECT_EQ(resp.summary().joined(), 2u);
  }
  {
    grpc::ClientContext ctx;
    Caller::deadline(ctx);
    v1::AbortJobRequest req;
    req.set_job_id("train");
    req.set_reason("restore test");
    req.set_failed_rank(-1);
    v1::AbortJobResponse resp;
    grpc::Status s = op.stub->AbortJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(second->flush_store(5s));
  v1::StoredJob job;
  auto after = store->load();
  ASSERT_TRUE(after.ok());
  for (const auto& [k, v] : *after) {
    if (k == "jobs/train") ASSERT_TRUE(job.ParseFromString(v));
  }
  EXPECT_EQ(job.state(), "aborted");
  EXPECT_NE(job.reason().find("restore test"), std::string::npos) << job.reason();
}

TEST(CoordinatorStore, InconsistentRecordsAreRefused) {
  JobTable table(JobTableOptions{});
  v1::StoredJob job;
  job.set_job_id("j");
  job.set_state("active");
  job.set_world_size(2);
  auto* c = job.add_claims();
  c->set_rank(0);
  c->set_node_id("n-1");
  Status s = table.restore({}, {job}, 1);
  EXPECT_EQ(s.code(), Code::kInternal) << s.to_string();
  EXPECT_NE(s.message().find("holds 1 of 2 ranks"), std::string::npos) << s.message();
}

// --- against a real etcd ----------------------------------------------------------------

// One etcd per test (tests/integration/etcd_process.h).
class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::EtcdProcess::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server)";
    etcd_ = std::make_unique<testing::EtcdProcess>();
    ASSERT_TRUE(etcd_->ok()) << etcd_->error();
    client_ = std::make_shared<EtcdClient>(etcd_->address(), 2000ms);
  }
  std::unique_ptr<testing::EtcdProcess> etcd_;
  std::shared_ptr<EtcdClient> client_;
};

TEST_F(EtcdTest, StorePutLoadRemove) {
  EtcdStore store(client_, "/unit");
  ASSERT_TRUE(store.put("jobs/a", "1").ok());
  ASSERT_TRUE(store.put("nodes/n-1", std::string("\0\xff", 2)).ok());
  ASSERT_TRUE(client_->put("/unitx/other", "not ours").ok());  // beside the prefix: not loaded
  auto all = store.load();
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0], (std::pair<std::string, std::string>{"jobs/a", "1"}));
  EXPECT_EQ((*all)[1].second, std::string("\0\xff", 2));
  ASSERT_TRUE(store.remove("jobs/a").ok());
  EXPECT_EQ(store.load()->size(), 1u);
}

TEST_F(EtcdTest, OneLeaderStandbyTakesOverAndFencesTheOld) {
  LeaderElection first(client_, {"/unit/election/leader", "a:1", 2, 50ms});
  ASSERT_TRUE(first.campaign(nullptr).ok());
  EtcdStore fenced(client_, "/unit", first.fence());
  ASSERT_TRUE(fenced.put("jobs/x", "by a").ok());

  LeaderElection second(client_, {"/unit/election/leader", "b:2", 2, 50ms});
  std::string seen;
  std::thread standby([&] {
    Status s = second.campaign([&](const std::string& leader) {
      if (seen.empty()) seen = leader;
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
  });
  std::this_thread::sleep_for(300ms);
  // The leader dies (no more renewals): its lease expires within its TTL, the standby leads.
  const auto stopped = std::chrono::steady_clock::now();
  first.stop();
  standby.join();
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - stopped);
  EXPECT_EQ(seen, "a:1");
  EXPECT_LE(took.count(), 3000) << "takeover later than the 2 s lease plus a margin";
  auto key = client_->get("/unit/election/leader");
  ASSERT_TRUE(key.ok() && key->has_value());
  EXPECT_EQ((*key)->value(), "b:2");
  // The old leader's writes are refused; the new one's go through.
  Status stale = fenced.put("jobs/x", "late write by a");
  EXPECT_EQ(stale.code(), Code::kFailedPrecondition) << stale.to_string();
  EXPECT_NE(stale.message().find("no longer holds the leader key"), std::string::npos) << stale.message();
  EtcdStore now(client_, "/unit", second.fence());
  ASSERT_TRUE(now.put("jobs/x", "by b").ok());
  auto x = client_->get("/unit/jobs/x");
  ASSERT_TRUE(x.ok() && x->has_value());
  EXPECT_EQ((*x)->value(), "by b");
  // Resigning hands over at once (no TTL wait).
  second.resign();
  EXPECT_FALSE(client_->get("/unit/election/leader")->has_value());
}

TEST(EtcdClient, UnreachableEtcdNamesItsAddress) {
  EtcdClient nowhere("127.0.0.1:" + std::to_string(testing::free_loopback_port()), 500ms);
  Status s = nowhere.put("/k", "v");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("etcd at 127.0.0.1:"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace gradsync::coordinator
