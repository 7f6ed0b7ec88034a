// Attacks 1 and 2 of docs/security.md: a stranger who can reach a daemon's data port tries to
// open a channel of a running job, to inject gradients into it. A Hello without a proof of the
// job token (the old version), with a zero proof, with a proof under a wrong token, or with a
// proof replayed from another connection is refused; so is a correct proof for a channel that
// is already connected, or for another transport than the one the daemons agreed. Each is
// logged by the daemon, the job runs on unaffected, and the daemons serve a new job.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "bystander.h"
#include "cluster.h"
#include "daemon/proxy.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

std::string data_endpoint(const Cluster& c, int d) {
  std::ifstream f(c.dir() + "/d" + std::to_string(d) + ".ready");
  std::string ep;
  std::getline(f, ep);
  return ep;
}

class DataPortAttack : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(c_.ok()) << c_.error() << c_.report();
    ASSERT_TRUE(bystander_.joined());
    endpoint_ = data_endpoint(c_, 1);
    // The bystander's channel from rank 0 (daemon 0) into rank 1 (daemon 1): connected.
    hello_.job = "bystander-hello";
    hello_.transport = ChannelTransport::kTcpRank;
    hello_.generation = 1;
    hello_.tag = 0;
    hello_.src_rank = 0;
    hello_.dst_rank = 1;
    hello_.nonce.fill(7);
  }

  void TearDown() override {
    EXPECT_TRUE(bystander_.finish());
    EXPECT_TRUE(serves_new_job(c_, "after-hello"));
  }

  // One connection: Hello, the daemon's challenge, then `proof(challenge)`; the daemon's reply.
  template <typename ProofOf>
  Status attempt(const ProxyHello& hello, ProofOf proof) {
    // The daemon logs one rejection a second: space the attempts so that each is logged.
    std::this_thread::sleep_for(1100ms);
    auto fd = proxy_dial(endpoint_, deadline_after(10s));
    if (!fd.ok()) return fd.status();
    GS_RETURN_IF_ERROR(hello_send(fd->get(), hello));
    auto challenge = hello_read_challenge(fd->get(), deadline_after(10s));
    if (!challenge.ok()) return challenge.status();
    last_challenge_ = *challenge;
    GS_RETURN_IF_ERROR(hello_send_proof(fd->get(), proof(*challenge)));
    return proxy_read_reply(fd->get(), deadline_after(40s));
  }

  ::testing::AssertionResult logged(const std::string& what) {
    if (c_.daemon(1).wait_for_output(what, 5s)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "gradsyncd 1 did not log '" << what << "'" << c_.report();
  }

  // "--data-listen ''" undoes the harness's explicit loopback: the daemons' own default applies.
  Cluster c_{ClusterOptions{.daemons = 2, .daemon_args = {"--data-listen", ""}}};
  Bystander bystander_{c_, "bystander-hello"};
  std::string endpoint_;
  ProxyHello hello_;
  HelloNonce last_challenge_{};
};

TEST_F(DataPortAttack, HelloWithoutProofIsRefused) {
  std::this_thread::sleep_for(1100ms);
  auto fd = proxy_dial(endpoint_, deadline_after(10s));
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  ASSERT_TRUE(hello_send(fd->get(), hello_, /*version=*/3).ok());
  // No challenge, no reply: the connection is closed.
  auto challenge = hello_read_challenge(fd->get(), deadline_after(10s));
  EXPECT_FALSE(challenge.ok());
  EXPECT_TRUE(logged("rejected a data-port connection: a Hello of version 3"));
}

TEST_F(DataPortAttack, ZeroWrongAndReplayedProofsAreRefused) {
  Status zero = attempt(hello_, [](const HelloNonce&) { return Mac{}; });
  EXPECT_EQ(zero.code(), Code::kPermissionDenied) << zero.to_string();
  EXPECT_TRUE(logged("job=bystander-hello gen=1 channel 0 -> 1 (tag 0): the proof of the job token is wrong"));

  Status wrong = attempt(hello_, [&](const HelloNonce& n) {
    return hello_proof("not-the-token", hello_, n, HelloRole::kConnector);
  });
  EXPECT_EQ(wrong.code(), Code::kPermissionDenied) << wrong.to_string();

  // A proof that was right for another connection (its challenge), sent again: the daemon's
  // fresh challenge makes it worthless. The proof is made with the real token ("secret", the
  // harness's), so only the replay is wrong: the channel's transport is not the agreed one,
  // so the first, correct, connection is refused only after its proof was checked.
  ProxyHello other = hello_;
  other.transport = ChannelTransport::kTcp;
  Status first = attempt(other, [&](const HelloNonce& n) { return hello_proof("secret", other, n, HelloRole::kConnector); });
  EXPECT_EQ(first.code(), Code::kFailedPrecondition) << first.to_string();
  EXPECT_TRUE(logged("asked for a channel over tcp, but the two nodes agreed on tcp, on sockets the ranks move"));
  const Mac recorded = hello_proof("secret", other, last_challenge_, HelloRole::kConnector);
  Status replayed = attempt(other, [&](const HelloNonce&) { return recorded; });
  EXPECT_EQ(replayed.code(), Code::kPermissionDenied) << replayed.to_string();
  EXPECT_TRUE(logged("forged or replayed Hello"));
}

TEST_F(DataPortAttack, SecondConnectionForAConnectedChannelIsRefused) {
  Status second = attempt(hello_, [&](const HelloNonce& n) { return hello_proof("secret", hello_, n, HelloRole::kConnector); });
  EXPECT_EQ(second.code(), Code::kAlreadyExists) << second.to_string();
  EXPECT_TRUE(logged("the channel is already connected; this second connection is refused"));
}

// With the coordinator on loopback (one machine), the data port listens on loopback only:
// another machine cannot even connect.
TEST_F(DataPortAttack, DataPortIsLoopbackOnlyOnOneMachine) {
  ifaddrs* all = nullptr;
  ASSERT_EQ(::getifaddrs(&all), 0);
  std::string outside;
  for (ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || (a->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    outside = text;
    break;
  }
  ::freeifaddrs(all);
  if (outside.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  const std::string port = endpoint_.substr(endpoint_.rfind(':') + 1);
  auto fd = proxy_dial(outside + ":" + port, deadline_after(10s));
  EXPECT_FALSE(fd.ok()) << "the data port answers on " << outside;
  EXPECT_TRUE(c_.daemon(1).output().find("data port on loopback only") != std::string::npos) << c_.report();
}

}  // namespace
}  // namespace gradsync::testing
