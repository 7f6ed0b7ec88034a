// Attack 4 of docs/security.md: a client that talks plaintext to a TLS coordinator, and a
// client without a certificate where one is required. Both are refused (and the coordinator's
// gRPC logs the failed handshakes); daemons with certificates run a job through the same
// coordinator before and after. And certificate rotation: files replaced while everything
// serves are what new connections get. Certificates are made here with the openssl CLI.
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bystander.h"
#include "cluster.h"
#include "etcd_process.h"  // free_loopback_port
#include "test_dir.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// A CA (CN=`ca_name`), a server certificate for 127.0.0.1 and a client certificate, in `dir`.
::testing::AssertionResult make_certificates(const std::string& dir, const std::string& ca_name) {
  const std::string script =
      "set -e; cd '" + dir + "'; "
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=" + ca_name + "; "
      "for who in server node; do "
      "  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who; "
      "  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > $who.ext; "
      "  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem -days 2 "
      "    -extfile $who.ext; "
      "done; chmod 600 *.key";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string cmd = "(" + script + ") > '" + dir + "/openssl.log' 2>&1";
  if (std::system(cmd.c_str()) != 0) return ::testing::AssertionFailure() << "openssl failed: see " << dir << "/openssl.log";
  return ::testing::AssertionSuccess();
}

class CoordinatorTls : public ::testing::Test {
 protected:
  static std::string certs() {
    static const std::string dir = make_test_dir("gradsync-tls");
    return dir;
  }
  // Two sets: a/ (CA gradsync-test-ca) and b/ (CA gradsync-test-ca-b, for the rotation test).
  // Checked in SetUp: ctest counts a test suite whose SetUpTestSuite failed as skipped.
  static ::testing::AssertionResult& made() {
    static ::testing::AssertionResult result = ::testing::AssertionSuccess();
    return result;
  }
  static void SetUpTestSuite() {
    made() = make_certificates(certs() + "/a", "gradsync-test-ca");
    if (made()) made() = make_certificates(certs() + "/b", "gradsync-test-ca-b");
  }
  void SetUp() override { ASSERT_TRUE(made()); }
  static void TearDownTestSuite() { remove_test_dir(certs()); }

  static std::vector<std::string> server_flags(const std::string& dir = certs() + "/a") {
    return {"--tls-cert", dir + "/server.pem", "--tls-key", dir + "/server.key", "--tls-ca", dir + "/ca.pem",
            "--require-client-cert"};
  }
  static std::vector<std::string> node_flags(const std::string& dir = certs() + "/a") {
    return {"--tls-ca", dir + "/ca.pem", "--tls-cert", dir + "/node.pem", "--tls-key", dir + "/node.key"};
  }

  // gradsyncctl jobs against the cluster's coordinator with `flags`.
  static Process ctl(Cluster& c, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {binary("gradsyncctl"), "--coordinator", c.coordinator_address()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("jobs");
    Process p = c.spawn("gradsyncctl", argv);
    p.wait_for_exit(20s);
    return p;
  }
};

TEST_F(CoordinatorTls, PlaintextAndCertificateLessClientsAreRefused) {
  Cluster c({.daemons = 2, .coordinator_args = server_flags(), .daemon_args = node_flags()});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto first = c.spawn_ranks("over-tls", 4, 2, {"check", "0,1,1000"});
  EXPECT_EQ(all_succeeded(first, 60s), "") << c.report(first);

  Process plain = ctl(c, {});
  ASSERT_TRUE(plain.exit_status().has_value());
  EXPECT_NE(plain.exit_status()->code, 0) << plain.output();
  EXPECT_NE(plain.output().find("UNAVAILABLE"), std::string::npos) << plain.output();

  Process no_cert = ctl(c, {"--tls-ca", certs() + "/a/ca.pem"});
  ASSERT_TRUE(no_cert.exit_status().has_value());
  EXPECT_NE(no_cert.exit_status()->code, 0) << no_cert.output();

  Process good = ctl(c, node_flags());
  ASSERT_TRUE(good.exit_status().has_value());
  EXPECT_EQ(good.exit_status()->code, 0) << good.output();
  EXPECT_NE(good.output().find("over-tls"), std::string::npos) << good.output();

  // gRPC's own log on the coordinator names the refused handshakes.
  EXPECT_NE(c.coordinator().output().find("Handshake failed"), std::string::npos) << c.report();
  EXPECT_NE(c.coordinator().output().find("serving TLS on 127.0.0.1:0"), std::string::npos) << c.report();

  auto after = c.spawn_ranks("over-tls-after", 4, 2, {"check", "0,1,1000"});
  EXPECT_EQ(all_succeeded(after, 60s), "") << c.report(after);
}

// Certificate rotation while serving, the way a Kubernetes secret volume does it: every process
// reads its files through the directory link `live`, which is switched at once (rename) from
// set a/ to set b/ of another CA. The coordinator's certificate, key and client roots change,
// and so do the daemons' client certificates and roots. gRPC looks at the files every 5 s.
// - New clients get the new certificate: a client that trusts only the new CA (with a client
//   certificate of it) is refused before and served after; one of the old CA the other way round.
// - A job running across the switch completes, and the daemons' established connections carry a
//   new job.
// - The daemons reloaded theirs: the coordinator, killed and started again (it now trusts only the
//   new CA), takes their registrations, and they run a job; with the old files they could not.
TEST_F(CoordinatorTls, CertificateFilesReplacedWhileServing) {
  const std::string live = certs() + "/live";
  auto point_live_at = [&](const std::string& set) {
    const std::string next = live + ".next";
    ::unlink(next.c_str());
    return ::symlink((certs() + "/" + set).c_str(), next.c_str()) == 0 && ::rename(next.c_str(), live.c_str()) == 0;
  };
  ASSERT_TRUE(point_live_at("a"));
  // The coordinator is started here on a fixed port, to be started again on it below.
  ::setenv("GRADSYNC_CLUSTER_SECRET", kTestClusterSecret, 0);
  ::setenv("GRADSYNC_OPERATOR_TOKEN", kTestOperatorToken, 0);
  const std::string address = "127.0.0.1:" + std::to_string(free_loopback_port());
  int started = 0;
  auto coordinator = [&] {
    std::vector<std::string> argv = {binary("gradsync-coordinator"), "--listen", address};
    for (auto& f : server_flags(live)) argv.push_back(f);
    return Process::start({"coordinator", argv, {}, certs() + "/coordinator-" + std::to_string(++started) + ".log"});
  };
  Process first = coordinator();
  ASSERT_TRUE(first.wait_for_output("listening on", 20s)) << first.output();
  Cluster c({.daemons = 2, .daemon_args = node_flags(live), .external_coordinators = address});
  ASSERT_TRUE(c.ok()) << c.error() << c.report() << first.output();
  Bystander bystander(c, "across-rotation");
  ASSERT_TRUE(bystander.joined()) << first.output();

  const auto old_ca = node_flags(certs() + "/a");
  const auto new_ca = node_flags(certs() + "/b");
  Process before_new = ctl(c, new_ca);
  ASSERT_TRUE(before_new.exit_status().has_value());
  EXPECT_NE(before_new.exit_status()->code, 0) << "a client of the new CA was served before the switch\n"
                                               << before_new.output();
  Process before_old = ctl(c, old_ca);
  ASSERT_TRUE(before_old.exit_status().has_value());
  EXPECT_EQ(before_old.exit_status()->code, 0) << before_old.output();

  ASSERT_TRUE(point_live_at("b"));
  const auto switched = std::chrono::steady_clock::now();
  bool served = false;
  while (!served && std::chrono::steady_clock::now() - switched < 30s) {
    Process p = ctl(c, new_ca);
    served = p.exit_status().has_value() && p.exit_status()->code == 0;
    if (!served) std::this_thread::sleep_for(500ms);
  }
  const double reload_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - switched).count();
  ASSERT_TRUE(served) << "a client of the new CA was still refused 30 s after the files changed\n" << first.output();
  Process after_old = ctl(c, old_ca);
  ASSERT_TRUE(after_old.exit_status().has_value());
  EXPECT_NE(after_old.exit_status()->code, 0) << "the old certificate is still served\n" << after_old.output();

  EXPECT_TRUE(bystander.finish()) << first.output();
  EXPECT_TRUE(serves_new_job(c, "after-rotation")) << first.output();

  first.kill(SIGKILL);
  ASSERT_TRUE(first.wait_for_exit(5s).has_value());
  Process second = coordinator();
  ASSERT_TRUE(second.wait_for_output("listening on", 20s)) << second.output();
  // Both daemons notice they were forgotten and register again, over new connections.
  for (int d = 0; d < 2; ++d) {
    EXPECT_TRUE(c.daemon(d).wait_for_output("re-registering", 30s)) << c.report() << second.output();
  }
  EXPECT_TRUE(serves_new_job(c, "after-restart")) << second.output();
  std::printf("[rotation] new certificate served to new clients %.1f s after the files changed (gRPC refresh 5 s)\n",
              reload_s);
}

// Off loopback, plaintext is refused unless asked for by name.
TEST_F(CoordinatorTls, PlaintextOffLoopbackNeedsInsecure) {
  Cluster c({.daemons = 1});
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  Process refused = c.spawn("coordinator on any address", {binary("gradsync-coordinator"), "--listen", "0.0.0.0:0"});
  auto st = refused.wait_for_exit(20s);
  ASSERT_TRUE(st.has_value()) << refused.output();
  EXPECT_EQ(st->code, 1) << refused.output();
  EXPECT_NE(refused.output().find("refusing to serve plaintext gRPC on 0.0.0.0:0"), std::string::npos)
      << refused.output();
  Process ctl_off = c.spawn("gradsyncctl off loopback", {binary("gradsyncctl"), "--coordinator", "192.0.2.200:1", "jobs"});
  st = ctl_off.wait_for_exit(20s);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->code, 2) << ctl_off.output();
  EXPECT_NE(ctl_off.output().find("refusing to talk plaintext gRPC"), std::string::npos) << ctl_off.output();
}

}  // namespace
}  // namespace gradsync::testing
