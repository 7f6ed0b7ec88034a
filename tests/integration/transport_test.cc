// The TCP proxy between daemons: IPv6 endpoints and several rings (several streams per peer).
#include <gtest/gtest.h>

#include "cluster.h"

namespace gradsync::testing {
namespace {

void expect_exact(ClusterOptions opts, const std::string& job, std::vector<std::string> worker_args,
                  Env env = {}) {
  Cluster c(opts);
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto ranks = c.spawn_ranks(job, 4, 2, worker_args, env);
  std::string failures = all_succeeded(ranks, Millis(60'000));
  EXPECT_EQ(failures, "") << c.report(ranks);
}

TEST(Transport, ProxyOverIPv6Loopback) {
  ClusterOptions opts;
  opts.daemon_args = {"--data-listen", "::1", "--data-host", "::1"};
  expect_exact(opts, "ipv6", {"check", "0,1,1000,1048579"});
}

TEST(Transport, SeveralRingsGiveSeveralStreamsPerPeer) {
  ClusterOptions opts;
  opts.daemon_args = {"--rings", "3", "--slot-bytes", "65536"};
  for (const char* algo : {"ring", "tree"}) {
    SCOPED_TRACE(algo);
    expect_exact(opts, std::string("rings-") + algo, {"check", "0,1,3,1000,1048579"},
                 {{"GRADSYNC_ALGO", algo}});
  }
}

}  // namespace
}  // namespace gradsync::testing
