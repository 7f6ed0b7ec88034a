// Runs the built gradsyncrun binary (it sits next to this test in build/bin). Multi-node
// mode with --daemon needs no daemon or coordinator: that covers rank numbering, environment,
// output prefixes and supervision. --standalone runs against shell-script stand-ins for
// gradsync-coordinator and gradsyncd placed next to a copy of gradsyncrun, which looks for
// them in its own directory first.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kRunLimit = 30s;  // a hung launcher fails the test instead of hanging it

fs::path launcher_path() {
  return fs::read_symlink("/proc/self/exe").parent_path() / "gradsyncrun";
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Outcome {
  int status = -1;  // waitpid status
  std::string out;
  std::string err;
  std::chrono::duration<double> elapsed{};
  int exit_code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

// gradsyncrun as a child process, its stdout and stderr captured in files.
class Launcher {
 public:
  explicit Launcher(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                    const fs::path& launcher = launcher_path()) {
    char tmpl[] = "/tmp/launcher_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    const std::string exe = launcher.string();
    std::vector<std::string> argv = {exe};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    const std::string out = (dir_ / "out").string(), err = (dir_ / "err").string();
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), STDOUT_FILENO);
      dup2(open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), STDERR_FILENO);
      setenv("MARK_DIR", dir_.c_str(), 1);
      setenv("GRADSYNC_JOB_TOKEN", "launcher-test-token", 1);  // `env` may override or clear it
      for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
      execv(exe.c_str(), cargv.data());
      _exit(127);
    }
  }
  ~Launcher() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    fs::remove_all(dir_);
  }

  pid_t pid() const { return pid_; }
  const fs::path& dir() const { return dir_; }

  Outcome wait() {
    Outcome o;
    const auto give_up = start_ + kRunLimit;
    while (waitpid(pid_, &o.status, WNOHANG) == 0) {
      if (Clock::now() > give_up) {
        ADD_FAILURE() << "gradsyncrun still running after " << kRunLimit.count() << " s";
        kill(pid_, SIGKILL);
        waitpid(pid_, &o.status, 0);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    pid_ = -1;
    o.elapsed = Clock::now() - start_;
    o.out = slurp(dir_ / "out");
    o.err = slurp(dir_ / "err");
    return o;
  }

 private:
  fs::path dir_;
  pid_t pid_ = -1;
  Clock::time_point start_;
};

std::vector<std::string> multinode(int nnodes, int node_rank, int nproc,
                                   const std::string& script) {
  return {"--daemon",
          "/tmp/gradsync-launcher-test.sock",
          "--coordinator",
          "127.0.0.1:1",
          "--nnodes",
          std::to_string(nnodes),
          "--node-rank",
          std::to_string(node_rank),
          "--job-id",
          "t",
          "-n",
          std::to_string(nproc),
          "sh",
          "-c",
          script};
}

// multinode(1, 0, 1, script) with `flags` before the program.
std::vector<std::string> multinode_with(const std::vector<std::string>& flags, const std::string& script) {
  std::vector<std::string> args = multinode(1, 0, 1, script);
  args.insert(args.end() - 3, flags.begin(), flags.end());
  return args;
}

Outcome run(const std::vector<std::string>& args) { return Launcher(args).wait(); }

// Stand-ins for the servers: they take the real flags, write what the launcher waits for,
// and exit with $FAKE_EXIT after a moment when it is set.
constexpr const char* kFakeCoordinator = R"(#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --port-file ] && port_file=$2; shift; done
echo "coordinator up" >&2
[ "$FAKE_EXIT_COORDINATOR" = early ] && exit 2
echo 4242 > "$port_file.tmp" && mv "$port_file.tmp" "$port_file"
exec sleep 100
)";
constexpr const char* kFakeDaemon = R"(#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in --ready-file) ready=$2;; --coordinator) coord=$2;; --node-name) node=$2;; esac
  shift
done
echo "daemon of $node for $coord" >&2
touch "$ready"
[ -n "$FAKE_EXIT_DAEMON" ] && { sleep 0.2; exit "$FAKE_EXIT_DAEMON"; }
exec sleep 100
)";

// A directory with a copy of gradsyncrun and the stand-ins; removed at the end of the test.
class FakeInstall {
 public:
  FakeInstall() {
    char tmpl[] = "/tmp/launcher_test_bin.XXXXXX";
    dir_ = mkdtemp(tmpl);
    fs::copy_file(launcher_path(), dir_ / "gradsyncrun");
    for (auto [name, text] : {std::pair{"gradsync-coordinator", kFakeCoordinator},
                              std::pair{"gradsyncd", kFakeDaemon}}) {
      std::ofstream(dir_ / name) << text;
      fs::permissions(dir_ / name, fs::perms::owner_all);
    }
  }
  ~FakeInstall() { fs::remove_all(dir_); }
  fs::path launcher() const { return dir_ / "gradsyncrun"; }

 private:
  fs::path dir_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(LauncherTest, PrefixesOutputAndSetsEnvironment) {
  const Outcome o = run(multinode(
      1, 0, 3,
      "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GRADSYNC_JOB_ID "
      "$GRADSYNC_DAEMON $GRADSYNC_COORDINATOR\"; echo \"oops $RANK\" >&2; printf 'no newline'"));
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  for (int r = 0; r < 3; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    EXPECT_TRUE(contains(o.out, p + "env " + std::to_string(r) + " 3 " + std::to_string(r) +
                                    " 3 t /tmp/gradsync-launcher-test.sock 127.0.0.1:1\n"))
        << o.out;
    EXPECT_TRUE(contains(o.out, p + "no newline\n")) << o.out;
    EXPECT_TRUE(contains(o.err, p + "oops " + std::to_string(r) + "\n")) << o.err;
    EXPECT_FALSE(contains(o.out, "oops")) << "stderr must stay on stderr";
  }
  std::istringstream lines(o.out);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
}

TEST(LauncherTest, NumbersRanksByNode) {
  const Outcome o = run(multinode(2, 1, 2, "echo \"$RANK $WORLD_SIZE $LOCAL_RANK\""));
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.out, "[rank 2] 2 4 0\n")) << o.out;
  EXPECT_TRUE(contains(o.out, "[rank 3] 3 4 1\n")) << o.out;
  EXPECT_FALSE(contains(o.out, "[rank 0]")) << o.out;
}

TEST(LauncherTest, OneFailingRankStopsTheOthers) {
  // "sleep; echo" makes sh fork sleep, so this also checks that helpers of a rank die.
  const Outcome o =
      run(multinode(1, 0, 3, "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 100; echo never"));
  EXPECT_NE(o.exit_code(), 0);
  EXPECT_LT(o.elapsed, 10s);
  EXPECT_TRUE(contains(o.err, "gradsyncrun: rank 1 exited with code 3")) << o.err;
  EXPECT_FALSE(contains(o.out, "never")) << o.out;
}

TEST(LauncherTest, ReportsRankKilledBySignal) {
  const Outcome o = run(multinode(1, 0, 1, "kill -KILL $$"));
  EXPECT_EQ(o.exit_code(), 1);
  EXPECT_TRUE(contains(o.err, "rank 0 killed by signal SIGKILL")) << o.err;
}

TEST(LauncherTest, ReplacesADeadRankWithinItsAllowance) {
  // Rank 1 dies by a signal; its replacement (GRADSYNC_REPLACEMENT=1, same RANK) exits 0 and
  // the job succeeds. With the allowance spent, the next death ends the job as before.
  const std::string script =
      "if [ \"$GRADSYNC_REPLACEMENT\" = 1 ]; then echo \"replaced $RANK\"; exit 0; fi; "
      "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; sleep 0.5; echo \"done $RANK\"";
  auto args = multinode(1, 0, 3, script);
  args.insert(args.begin(), {"--replace-failed", "1"});
  const Outcome o = run(args);
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.err, "rank 1 killed by signal SIGKILL; starting a replacement (0 more allowed)")) << o.err;
  EXPECT_TRUE(contains(o.out, "[replacement 1] replaced 1\n")) << o.out;
  EXPECT_TRUE(contains(o.out, "[rank 0] done 0\n") && contains(o.out, "[rank 2] done 2\n")) << o.out;

  auto twice = multinode(1, 0, 2, "kill -KILL $$");
  twice.insert(twice.begin(), {"--replace-failed", "1"});
  const Outcome t = run(twice);
  EXPECT_EQ(t.exit_code(), 1) << t.err;
  EXPECT_TRUE(contains(t.err, "killed by signal SIGKILL")) << t.err;
}

TEST(LauncherTest, TimeoutStopsTheJob) {
  auto args = multinode(1, 0, 2, "sleep 100");
  args.insert(args.begin(), {"--timeout-s", "0.3"});
  const Outcome o = run(args);
  EXPECT_EQ(o.exit_code(), 124) << o.err;
  EXPECT_LT(o.elapsed, 10s);
}

TEST(LauncherTest, ForwardsSigtermToRanks) {
  Launcher l(multinode(1, 0, 2, "touch \"$MARK_DIR/started.$RANK\"; sleep 100; echo never"));
  const auto give_up = Clock::now() + kRunLimit;
  while (!(fs::exists(l.dir() / "started.0") && fs::exists(l.dir() / "started.1"))) {
    ASSERT_LT(Clock::now(), give_up) << "ranks did not start";
    std::this_thread::sleep_for(10ms);
  }
  kill(l.pid(), SIGTERM);
  const Outcome o = l.wait();
  EXPECT_EQ(o.exit_code(), 128 + SIGTERM) << o.err;
  EXPECT_LT(o.elapsed, 10s);
  EXPECT_FALSE(contains(o.out, "never")) << o.out;
}

TEST(LauncherTest, StandaloneStartsCoordinatorAndDaemon) {
  FakeInstall install;
  const Outcome o = Launcher({"--standalone", "--node-name", "n0", "-n", "2", "sh", "-c",
                              "echo \"$GRADSYNC_COORDINATOR $GRADSYNC_DAEMON\" $GRADSYNC_JOB_ID"},
                             {}, install.launcher())
                        .wait();
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.err, "[coordinator] coordinator up\n")) << o.err;
  EXPECT_TRUE(contains(o.err, "[gradsyncd] daemon of n0 for 127.0.0.1:4242\n")) << o.err;
  const std::string prefix = "[rank 1] 127.0.0.1:4242 ";
  const size_t at = o.out.find(prefix);
  ASSERT_NE(at, std::string::npos) << o.out;
  // "<tmpdir>/gradsyncd.sock job-<pid>-<hex>": the temporary directory is gone afterwards.
  std::istringstream rest(o.out.substr(at + prefix.size()));
  std::string socket, job;
  rest >> socket >> job;
  EXPECT_EQ(fs::path(socket).filename(), "gradsyncd.sock");
  EXPECT_FALSE(fs::exists(fs::path(socket).parent_path())) << socket;
  EXPECT_EQ(job.rfind("job-", 0), 0u) << job;
}

TEST(LauncherTest, StartDaemonStartsOnlyADaemon) {
  FakeInstall install;
  const Outcome o =
      Launcher({"--start-daemon", "--coordinator", "10.1.2.3:5000", "--nnodes", "2", "--node-rank", "1", "--job-id",
                "j", "--node-name", "n1", "sh", "-c", "echo \"$RANK $GRADSYNC_COORDINATOR\""},
               {}, install.launcher())
          .wait();
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.err, "[gradsyncd] daemon of n1 for 10.1.2.3:5000\n")) << o.err;
  EXPECT_FALSE(contains(o.err, "[coordinator]")) << o.err;
  EXPECT_TRUE(contains(o.out, "[rank 1] 1 10.1.2.3:5000\n")) << o.out;
}

// Without --standalone or --start-daemon the ranks use the node's running daemon; none is an error.
TEST(LauncherTest, WithoutARunningDaemonNamesThePathsTried) {
  FakeInstall install;
  const Outcome o = Launcher({"--job-id", "j", "true"}, {"GRADSYNC_DAEMON=/nonexistent/gradsyncd.sock"},
                             install.launcher())
                        .wait();
  EXPECT_EQ(o.exit_code(), 1) << o.err;
  EXPECT_TRUE(contains(o.err, "no running gradsyncd on this node")) << o.err;
  EXPECT_TRUE(contains(o.err, "/run/gradsync/gradsyncd.sock")) << o.err;
  EXPECT_TRUE(contains(o.err, "--standalone")) << o.err;
  EXPECT_FALSE(contains(o.err, "[gradsyncd]")) << "started a daemon of its own: " << o.err;
}

TEST(LauncherTest, UsesTheDefaultSocketWhenItExists) {
  const fs::path sock = fs::temp_directory_path() / ("gradsync-launcher-default-" + std::to_string(getpid()));
  { std::ofstream touch(sock); }
  const Outcome o = Launcher({"--job-id", "j", "-n", "2", "sh", "-c", "echo \"$GRADSYNC_DAEMON $GRADSYNC_LAUNCHER\""},
                             {"GRADSYNC_DAEMON=" + sock.string()})
                        .wait();
  fs::remove(sock);
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.out, "[rank 1] " + sock.string() + " gradsyncrun\n")) << o.out;
}

// One gradsyncrun per node under srun: --nnodes and --node-rank from SLURM_NNODES/SLURM_NODEID.
TEST(LauncherTest, TakesTheNodeFromSlurm) {
  const std::vector<std::string> slurm = {"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=0", "SLURM_NODEID=1",
                                          "SLURM_NNODES=2"};
  Outcome o = Launcher({"--daemon", "/tmp/gradsync-launcher-test.sock", "--job-id", "t", "-n", "2", "sh", "-c",
                        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK\""},
                       slurm)
                  .wait();
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.out, "[rank 2] 2 4 0\n")) << o.out;
  EXPECT_TRUE(contains(o.out, "[rank 3] 3 4 1\n")) << o.out;

  o = Launcher({"--daemon", "/tmp/gradsync-launcher-test.sock", "--job-id", "t", "--node-rank", "0", "--nnodes",
                "2", "true"},
               slurm)
          .wait();
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "contradict the slurm variables")) << o.err;
  EXPECT_TRUE(contains(o.err, "SLURM_NODEID=1")) << o.err;

  // srun -n 4 on one node: each task is a rank already.
  o = Launcher({"--daemon", "/tmp/gradsync-launcher-test.sock", "--job-id", "t", "true"},
               {"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=0", "SLURM_NNODES=1"})
          .wait();
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "started 4 tasks on this node")) << o.err;
}

TEST(LauncherTest, DaemonDeathStopsTheJob) {
  FakeInstall install;
  const Outcome o = Launcher({"--standalone", "-n", "2", "sh", "-c", "sleep 100; echo never"},
                             {"FAKE_EXIT_DAEMON=5"}, install.launcher())
                        .wait();
  EXPECT_EQ(o.exit_code(), 1);
  EXPECT_LT(o.elapsed, 10s);
  EXPECT_TRUE(contains(o.err, "gradsyncrun: gradsyncd exited with code 5 while ranks were running"))
      << o.err;
  EXPECT_FALSE(contains(o.out, "never")) << o.out;
}

TEST(LauncherTest, CoordinatorFailingAtStartupIsReported) {
  FakeInstall install;
  const Outcome o =
      Launcher({"--standalone", "true"}, {"FAKE_EXIT_COORDINATOR=early"}, install.launcher())
          .wait();
  EXPECT_EQ(o.exit_code(), 1);
  EXPECT_TRUE(contains(o.err,
                       "gradsync-coordinator exited with code 2 before it could write its "
                       "port file"))
      << o.err;
}

TEST(LauncherTest, RejectsBadCommandLines) {
  Outcome o = run({"--no-such-flag", "true"});
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "unknown option --no-such-flag")) << o.err;
  EXPECT_TRUE(contains(o.err, "usage:")) << o.err;

  o = run({"--coordinator", "127.0.0.1:1", "--job-id", "t"});
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "missing PROGRAM")) << o.err;

  o = run({"--coordinator", "127.0.0.1:1", "true"});
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "--job-id")) << o.err;
}

// The token never comes from argv (ps shows it to every user); a multi-node job must have one.
TEST(LauncherTest, TokenComesFromAFileOrTheEnvironmentNeverArgv) {
  Outcome o = run({"--daemon", "/tmp/x.sock", "--coordinator", "127.0.0.1:1", "--job-id", "t", "--token",
                   "visible", "true"});
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "--token is gone")) << o.err;
  EXPECT_TRUE(contains(o.err, "--token-file")) << o.err;

  o = Launcher({"--daemon", "/tmp/x.sock", "--coordinator", "127.0.0.1:1", "--job-id", "t", "true"},
               {"GRADSYNC_JOB_TOKEN="})
          .wait();
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "a multi-node job needs a job token")) << o.err;

  const fs::path file = fs::temp_directory_path() / ("gradsync-token-" + std::to_string(getpid()));
  {
    std::ofstream f(file);
    f << "from-the-file\n";
  }
  fs::permissions(file, fs::perms::owner_read | fs::perms::owner_write);
  o = Launcher(multinode_with({"--token-file", file.string()}, "echo \"token=$GRADSYNC_JOB_TOKEN\""),
               {"GRADSYNC_JOB_TOKEN="})
          .wait();
  EXPECT_EQ(o.exit_code(), 0) << o.err;
  EXPECT_TRUE(contains(o.out, "token=from-the-file\n")) << o.out;

  fs::permissions(file, fs::perms::others_read, fs::perm_options::add);
  o = run(multinode_with({"--token-file", file.string()}, "true"));
  EXPECT_EQ(o.exit_code(), 2);
  EXPECT_TRUE(contains(o.err, "readable by every user")) << o.err;
  fs::remove(file);
}

TEST(LauncherTest, NamesThePathsTriedForAMissingProgram) {
  const Outcome o = run({"--daemon", "/tmp/x.sock", "--coordinator", "127.0.0.1:1", "--job-id", "t",
                         "gradsync-no-such-program"});
  EXPECT_EQ(o.exit_code(), 1);
  EXPECT_TRUE(contains(o.err, "cannot find 'gradsync-no-such-program'; tried ")) << o.err;
}

}  // namespace
