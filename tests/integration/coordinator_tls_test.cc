// Attack 4 of docs/security.md: a client that talks plaintext to a TLS coordinator, and a
// client without a certificate where one is required. Both are refused (and the coordinator's
// gRPC logs the failed handshakes); daemons with certificates run a job through the same
// coordinator before and after. Certificates are made here with the openssl CLI.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "cluster.h"

namespace gradsync::testing {
namespace {

using namespace std::chrono_literals;

// A CA, a server certificate for 127.0.0.1 and a client certificate, in `dir`.
::testing::AssertionResult make_certificates(const std::string& dir) {
  const std::string script =
      "set -e; cd '" + dir + "'; "
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=gradsync-test-ca; "
      "for who in server node; do "
      "  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who; "
      "  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > $who.ext; "
      "  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem -days 2 "
      "    -extfile $who.ext; "
      "done; chmod 600 *.key";
  const std::string cmd = "(" + script + ") > '" + dir + "/openssl.log' 2>&1";
  if (std::system(cmd.c_str()) != 0) return ::testing::AssertionFailure() << "openssl failed: see " << dir << "/openssl.log";
  return ::testing::AssertionSuccess();
}

class CoordinatorTls : public ::testing::Test {
 protected:
  static std::string certs() {
    static const std::string dir = [] {
      char tmpl[] = "/tmp/gradsync-tls-XXXXXX";
      std::string d = ::mkdtemp(tmpl);
      return d;
    }();
    return dir;
  }
  static void SetUpTestSuite() { ASSERT_TRUE(make_certificates(certs())); }
  static void TearDownTestSuite() { std::system(("rm -rf '" + certs() + "'").c_str()); }

  std::vector<std::string> server_flags() const {
    return {"--tls-cert", certs() + "/server.pem", "--tls-key", certs() + "/server.key", "--tls-ca",
            certs() + "/ca.pem", "--require-client-cert"};
  }
  std::vector<std::string> node_flags() const {
    return {"--tls-ca", certs() + "/ca.pem", "--tls-cert", certs() + "/node.pem", "--tls-key", certs() + "/node.key"};
  }

  // gradsyncctl jobs against the cluster's coordinator with `flags`.
  Process ctl(Cluster& c, const std::vector<std::string>& flags) {
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

  Process no_cert = ctl(c, {"--tls-ca", certs() + "/ca.pem"});
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
