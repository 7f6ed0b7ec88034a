// Attack 5 of docs/security.md: calls to the coordinator without the credential they need.
// A RegisterNode under another node's name, list/describe/abort without the operator
// credential (or with a wrong one), job calls with a wrong job token, node calls without the
// cluster secret or a node's key. Each is refused and logged by the coordinator, a job running
// all along completes, and the daemons serve a new job afterwards.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "bystander.h"
#include "cluster.h"
#include "common/call_auth.h"
#include "coordinator.grpc.pb.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// A hostile caller: raw gRPC to the coordinator, presenting exactly the headers given.
class Caller {
 public:
  explicit Caller(const std::string& address)
      : stub_(v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

  grpc::Status register_node(const std::string& name, const std::vector<std::pair<std::string, std::string>>& md,
                             std::string* node_id = nullptr, std::string* key = nullptr) {
    grpc::ClientContext ctx;
    prepare(ctx, md);
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_node_name(name);
    req.mutable_node()->set_hostname("intruder-host");
    req.mutable_node()->set_data_endpoint("127.0.0.1:9");
    v1::RegisterNodeResponse resp;
    grpc::Status s = stub_->RegisterNode(&ctx, req, &resp);
    if (node_id) *node_id = resp.node_id();
    if (key) {
      auto it = ctx.GetServerInitialMetadata().find(kNodeKeyHeader);
      if (it != ctx.GetServerInitialMetadata().end()) *key = std::string(it->second.data(), it->second.size());
    }
    return s;
  }

  grpc::Status peer_table(const std::string& job, const std::vector<std::pair<std::string, std::string>>& md) {
    grpc::ClientContext ctx;
    prepare(ctx, md);
    v1::PeerTableRequest req;
    req.set_job_id(job);
    v1::PeerTableResponse resp;
    return stub_->GetPeerTable(&ctx, req, &resp);
  }

  grpc::Status abort_as_node(const std::string& node, const std::string& job,
                             const std::vector<std::pair<std::string, std::string>>& md) {
    grpc::ClientContext ctx;
    prepare(ctx, md);
    v1::AbortJobRequest req;
    req.set_node_id(node);
    req.set_job_id(job);
    req.set_reason("hostile abort");
    req.set_failed_rank(-1);
    v1::AbortJobResponse resp;
    return stub_->AbortJob(&ctx, req, &resp);
  }

  grpc::Status heartbeat(const std::string& node, const std::vector<std::pair<std::string, std::string>>& md) {
    grpc::ClientContext ctx;
    prepare(ctx, md);
    v1::HeartbeatRequest req;
    req.set_node_id(node);
    v1::HeartbeatResponse resp;
    return stub_->Heartbeat(&ctx, req, &resp);
  }

 private:
  static void prepare(grpc::ClientContext& ctx, const std::vector<std::pair<std::string, std::string>>& md) {
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
  }
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// gradsyncctl ARGS with $GRADSYNC_OPERATOR_TOKEN set to `token` ("" : none).
Process ctl(Cluster& c, const std::string& token, std::vector<std::string> args) {
  std::vector<std::string> argv = {binary("gradsyncctl"), "--coordinator", c.coordinator_address()};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p = c.spawn("gradsyncctl " + args[0], argv, {{"GRADSYNC_OPERATOR_TOKEN", token}});
  p.wait_for_exit(20s);
  return p;
}

::testing::AssertionResult refused(Process& p) {
  if (!p.exit_status()) return ::testing::AssertionFailure() << p.name() << " did not exit";
  if (p.exit_status()->code == 0) return ::testing::AssertionFailure() << p.name() << " succeeded: " << p.output();
  if (p.output().find("PERMISSION_DENIED") == std::string::npos && p.output().find("refused") == std::string::npos) {
    return ::testing::AssertionFailure() << p.name() << " failed for another reason: " << p.output();
  }
  return ::testing::AssertionSuccess();
}

TEST(CoordinatorAuthz, EveryCallNeedsItsCredential) {
  Cluster c({.daemons = 2});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  Bystander bystander(c, "bystander");
  ASSERT_TRUE(bystander.joined());

  Caller caller(c.coordinator_address());
  const std::pair<std::string, std::string> secret{kClusterSecretHeader, kTestClusterSecret};

  // Node calls: no cluster secret, a wrong one.
  EXPECT_EQ(caller.register_node("intruder", {}).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(caller.register_node("intruder", {{kClusterSecretHeader, "guess"}}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Another node's name, with the cluster secret but not that node's key: node0 is daemon 0.
  grpc::Status as_node0 = caller.register_node("node0", {secret});
  EXPECT_EQ(as_node0.error_code(), grpc::StatusCode::PERMISSION_DENIED) << as_node0.error_message();
  const std::string& why = as_node0.error_message();
  const size_t at = why.find("belongs to node node0-");
  ASSERT_NE(at, std::string::npos) << why;
  const std::string node0 = why.substr(at + 16, why.find(',', at) - at - 16);  // "node0-N"

  // A node of its own: allowed, with a key of its own.
  std::string intruder, key;
  ASSERT_TRUE(caller.register_node("intruder", {secret}, &intruder, &key).ok());
  ASSERT_FALSE(key.empty());
  const std::pair<std::string, std::string> as_intruder_id{kNodeIdHeader, intruder}, as_intruder_key{kNodeKeyHeader, key};
  EXPECT_TRUE(caller.heartbeat(intruder, {secret, as_intruder_key}).ok());
  // Its key does not speak for daemon 0's node.
  EXPECT_EQ(caller.heartbeat(node0, {secret, as_intruder_key}).error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // Job calls about the bystander job: without its token, with a wrong one, and with the
  // right one from a node that is not a member.
  EXPECT_EQ(caller.peer_table("bystander", {secret, as_intruder_id, as_intruder_key}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(caller.peer_table("bystander", {secret, as_intruder_id, as_intruder_key, {kJobTokenHeader, "wrong"}})
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(caller.peer_table("bystander", {secret, as_intruder_id, as_intruder_key, {kJobTokenHeader, "secret"}})
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(caller.abort_as_node(intruder, "bystander", {secret, as_intruder_key, {kJobTokenHeader, "wrong"}})
                .error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // Operator calls: no operator credential, a wrong one.
  for (const std::string token : {"", "wrong-operator-token"}) {
    Process jobs = ctl(c, token, {"jobs"});
    EXPECT_TRUE(refused(jobs));
    Process describe = ctl(c, token, {"describe", "bystander"});
    EXPECT_TRUE(refused(describe));
    Process abort = ctl(c, token, {"abort", "bystander"});
    EXPECT_TRUE(refused(abort));
  }
  Process jobs = ctl(c, kTestOperatorToken, {"jobs"});
  ASSERT_TRUE(jobs.exit_status().has_value());
  EXPECT_EQ(jobs.exit_status()->code, 0) << jobs.output();
  EXPECT_NE(jobs.output().find("bystander"), std::string::npos) << jobs.output();

  // Every kind of refusal is in the coordinator's log with the caller's address.
  const std::string& log = c.coordinator().output();
  for (const char* what : {"refused RegisterNode from ipv4:127.0.0.1", "refused Heartbeat from",
                           "refused GetPeerTable from", "refused AbortJob from", "refused ListJobs from",
                           "refused DescribeJob from"}) {
    EXPECT_NE(log.find(what), std::string::npos) << what << "\n" << c.report();
  }

  EXPECT_TRUE(bystander.finish());
  EXPECT_TRUE(serves_new_job(c, "after-authz-attack"));
}

}  // namespace
}  // namespace gradsync::testing
