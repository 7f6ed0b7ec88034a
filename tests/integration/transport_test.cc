// The TCP proxy between daemons: IPv6 endpoints and several rings (several streams per peer).
#include <gtest/gtest.h>

#include <fstream>

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

// Each rank reports its data path at join; gradsyncd logs it and `gradsyncctl describe`
// shows it, also after the job finished; and each node's GPU topology (from topology files
// here: this machine has no GPU), as `nvidia-smi topo -m` lays it out, with the rails.
TEST(Transport, DescribeShowsEachRanksDataPathAndEachNodesGpus) {
  const std::string topo = std::string(GRADSYNC_TEST_DATA_DIR) + "/topo/";
  ClusterOptions opts;
  opts.per_daemon_args = {{0, {"--topo-file", topo + "2x4-node.topo"}}, {1, {"--topo-file", topo + "pcie-box.topo"}}};
  Cluster c(opts);
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  auto ranks = c.spawn_ranks("paths", 3, std::vector<int>{2, 1}, {"check", "0,1,1000"});
  ASSERT_EQ(all_succeeded(ranks, Millis(60'000)), "") << c.report(ranks);
  EXPECT_TRUE(c.daemon(1).wait_for_output("rank 2 data path: host-channels", Millis(5'000))) << c.report();
  Process ctl = c.spawn("gradsyncctl", {binary("gradsyncctl"), "--coordinator", c.coordinator_address(),
                                        "describe", "paths"});
  auto st = ctl.wait_for_exit(Millis(10'000));
  ASSERT_TRUE(st.has_value() && st->success()) << ctl.output();
  const std::string out = ctl.output();
  EXPECT_NE(out.find("rank 0 data path: host-channels (shared-memory channels; 1 rank(s) on other nodes "
                     "over TCP sockets this rank moves itself ("),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("rank 2 data path: host-channels (shared-memory channels; 2 rank(s) on other nodes"),
            std::string::npos)
      << out;
  for (const std::string& want : std::vector<std::string>{
           "  GPUs (file " + topo + "2x4-node.topo): 4\n",
        "    GPU0   X      NV6    NV6    NV6    PIX    SYS    SYS    SYS    mlx5_0\n",
        "    GPU3   NV6    NV6    NV6    X      SYS    SYS    SYS    PIX    mlx5_3\n",
        "    NV6 = 150 GB/s per direction\n", "  GPUs (file " + topo + "pcie-box.topo): 4\n",
        "    GPU1   PIX    X      SYS    SYS    PXB    SYS    mlx5_0\n", "    NIC1 mlx5_1 100 Gb/s\n"}) {
    EXPECT_NE(out.find(want), std::string::npos) << "wanted: " << want << "\n" << out;
  }
  EXPECT_TRUE(c.daemon(0).wait_for_output("GPU topology file ", Millis(1'000))) << c.report();

  // The same view of one node without a coordinator; a bad file is refused naming its line.
  Process node = c.spawn("topology", {binary("gradsyncctl"), "topology", "--topo-file", topo + "3x2-node.topo"});
  auto node_st = node.wait_for_exit(Millis(10'000));
  ASSERT_TRUE(node_st.has_value() && node_st->success()) << node.output();
  EXPECT_NE(node.output().find("GPU1   NV18   X      NODE   PXB    mlx5_1\n"), std::string::npos) << node.output();
  const std::string bad = c.dir() + "/bad.topo";
  std::ofstream(bad) << "gpu 0000:19:00.0\nnvlink 0 1 18\n";
  Process refused = c.spawn("topology-bad", {binary("gradsyncctl"), "topology", "--topo-file", bad});
  auto refused_st = refused.wait_for_exit(Millis(10'000));
  ASSERT_TRUE(refused_st.has_value()) << refused.output();
  EXPECT_EQ(refused_st->code, 1) << refused.output();
  EXPECT_NE(refused.output().find(bad + " line 2: 'nvlink 0 1 18': GPU 1 is not declared"), std::string::npos)
      << refused.output();
}

// gradsyncd --proxy-tcp keeps the daemons' proxy in the data path (design §2 as first built):
// on both nodes, and on one only, where the other node then pumps too.
TEST(Transport, ProxyTcpKeepsTheDaemonsInThePath) {
  for (bool both : {true, false}) {
    SCOPED_TRACE(both ? "both nodes --proxy-tcp" : "node 1 --proxy-tcp");
    ClusterOptions opts;
    if (both) opts.daemon_args = {"--proxy-tcp"};
    else opts.per_daemon_args = {{1, {"--proxy-tcp"}}};
    Cluster c(opts);
    ASSERT_TRUE(c.ok()) << c.error() << c.report();
    auto ranks = c.spawn_ranks("proxied", 4, 2, {"check", "0,1,1000,1048579"}, {{"GRADSYNC_ALGO", "ring"}});
    ASSERT_EQ(all_succeeded(ranks, Millis(60'000)), "") << c.report(ranks);
    EXPECT_TRUE(c.daemon(0).wait_for_output("through gradsyncd over TCP", Millis(5'000))) << c.report();
    EXPECT_EQ(c.daemon(0).output().find("TCP sockets this rank moves itself"), std::string::npos) << c.report();
    EXPECT_NE(c.daemon(0).output().find(both ? "this node's proxy pumps them (--proxy-tcp)"
                                             : "that node's proxy pumps them"),
              std::string::npos)
        << c.report();
  }
}

// The rank-owned sockets (the default): gradsyncd connects them and says so; every type, op
// and algorithm runs over them (collectives_processes_test runs the full matrix).
TEST(Transport, RanksMoveTheirOwnTcpSockets) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  for (const char* algo : {"ring", "tree"}) {
    auto ranks = c.spawn_ranks(std::string("own-") + algo, 4, 2, {"check", "0,1,3,1000,1048579"},
                               {{"GRADSYNC_ALGO", algo}});
    ASSERT_EQ(all_succeeded(ranks, Millis(60'000)), "") << c.report(ranks);
  }
  EXPECT_NE(c.daemon(0).output().find("both nodes hand the sockets to their ranks"), std::string::npos) << c.report();
  EXPECT_NE(c.daemon(1).output().find("over TCP sockets this rank moves itself"), std::string::npos) << c.report();
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

namespace gradsync::testing {
namespace {

// Without an RDMA device gradsyncd uses TCP and says why; forcing verbs fails at start.
TEST(Transport, ChoiceIsLoggedAndForcedVerbsFailsClearly) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  EXPECT_TRUE(c.daemon(0).wait_for_output("transport tcp between nodes: ", Millis(5'000)))
      << c.report();
  Process forced = c.spawn("forced-verbs",
                           {binary("gradsyncd"), "--coordinator", c.coordinator_address(),
                            "--socket", c.dir() + "/forced.sock"},
                           {{"GRADSYNC_TRANSPORT", "verbs"}});
  auto st = forced.wait_for_exit(Millis(10'000));
  ASSERT_TRUE(st.has_value()) << "gradsyncd with GRADSYNC_TRANSPORT=verbs did not exit" << forced.output();
  EXPECT_NE(st->code, 0);
  EXPECT_NE(forced.output().find("GRADSYNC_TRANSPORT=verbs"), std::string::npos) << forced.output();
}

// The ring count: chosen at start and logged when none is given; above the tag space's 16 an
// error at start naming the limit (it was clamped to 8 without a word before).
TEST(Transport, RingCountIsLoggedAndOneAboveTheLimitFailsAtStart) {
  Cluster c;
  ASSERT_TRUE(c.ok()) << c.error() << c.report();
  EXPECT_TRUE(c.daemon(0).wait_for_output("ring(s) by default: ", Millis(5'000))) << c.report();
  const std::vector<std::pair<std::vector<std::string>, Env>> bad = {
      {{"--rings", "17"}, {}}, {{}, {{"GRADSYNC_NRINGS", "32"}}}};
  for (const auto& [args, env] : bad) {
    std::vector<std::string> argv = {binary("gradsyncd"), "--coordinator", c.coordinator_address(), "--socket",
                                     c.dir() + "/bad-rings.sock"};
    argv.insert(argv.end(), args.begin(), args.end());
    Process p = c.spawn("bad-rings", argv, env);
    auto st = p.wait_for_exit(Millis(10'000));
    ASSERT_TRUE(st.has_value()) << "gradsyncd with too many rings did not exit" << p.output();
    EXPECT_EQ(st->code, 2) << p.output();
    EXPECT_NE(p.output().find("above the limit of 16 rings"), std::string::npos) << p.output();
  }
}

}  // namespace
}  // namespace gradsync::testing
