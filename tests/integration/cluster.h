// A small harness for the multi-process integration tests: real gradsync-coordinator,
// gradsyncd and trainer processes on loopback, all owned by RAII objects so that a failing
// test never leaves a process or a temporary directory behind.
//
//   Cluster c({.daemons = 2});
//   ASSERT_TRUE(c.ok()) << c.error();
//   auto ranks = c.spawn_ranks("job", 4, 2, {"check", "0,1,1000"});
//   for (auto& p : ranks) { auto st = p.wait_for_exit(60s); ... p.output() ... }
//
// Binaries (gradsync-coordinator, gradsyncd, allreduce_worker) are looked up in the directory
// of the running test executable: tests and tools all land in <build>/bin.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace gradsync::testing {

using Env = std::map<std::string, std::string>;
using Millis = std::chrono::milliseconds;
using SteadyTime = std::chrono::steady_clock::time_point;

// Directory of /proc/self/exe.
std::string binary_dir();
// binary_dir() + "/" + name.
std::string binary(const std::string& name);

struct ExitStatus {
  int code = -1;   // exit code when the process exited normally, else -1
  int signal = 0;  // terminating signal, else 0
  bool success() const { return signal == 0 && code == 0; }
  std::string describe() const;  // "exit 1", "signal 9 (Killed)"
};

struct ProcessOptions {
  std::string name;                // for reports: "coordinator", "gradsyncd-1", "rank 2"
  std::vector<std::string> argv;   // argv[0] is the path of the executable
  Env env;                         // overrides on top of this process's environment
  std::string output_path;         // stdout and stderr both go here
  bool stdin_pipe = false;         // else stdin is /dev/null
};

// One child process. Its stdout and stderr are captured in one file; the destructor kills
// (SIGKILL) and reaps it if it is still running.
class Process {
 public:
  // Starts the process; on failure the returned Process has pid() == -1 and error() says why.
  static Process start(ProcessOptions options);

  Process() = default;
  ~Process();
  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& name() const { return opts_.name; }
  const std::string& error() const { return error_; }
  const std::string& output_path() const { return opts_.output_path; }

  // True while the process has not been seen to exit (reaps it when it has).
  bool alive();
  // Waits up to `timeout` for the process to exit; nullopt if it is still running then.
  std::optional<ExitStatus> wait_for_exit(Millis timeout);
  // The exit status if the process has been reaped.
  std::optional<ExitStatus> exit_status() const { return status_; }
  // When the harness first saw it exited (polling every few ms).
  std::optional<SteadyTime> exit_time() const { return exit_time_; }
  void kill(int sig);
  // Closes the write end of the stdin pipe (the child then reads EOF).
  void close_stdin();

  // Everything the process wrote so far.
  std::string output() const;
  // Polls the output (every 10 ms) until it contains `needle`; false on timeout or when the
  // process exited without printing it.
  bool wait_for_output(const std::string& needle, Millis timeout);

 private:
  void reap(bool block);
  void terminate();  // SIGKILL and reap if still running

  ProcessOptions opts_;
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  std::string error_;
  std::optional<ExitStatus> status_;
  std::optional<SteadyTime> exit_time_;
};

// Waits until every process in `procs` exited or `timeout` passed, polling them together so
// that exit_time() of each is accurate to a few ms. True if all exited.
bool wait_all_exit(std::vector<Process*> procs, Millis timeout);
bool wait_all_exit(std::vector<Process>& procs, Millis timeout);

// The line of `text` that contains `needle` (first one), or "".
std::string line_with(const std::string& text, const std::string& needle);

// Waits up to `timeout` for every process to exit; "" if each exited 0 and printed `needle`,
// else one line per process that did not.
std::string all_succeeded(std::vector<Process>& procs, Millis timeout,
                          const std::string& needle = "PASS");

// What the Cluster's coordinator expects of node daemons and of operators (unless the test's
// environment already set GRADSYNC_CLUSTER_SECRET / GRADSYNC_OPERATOR_TOKEN).
inline constexpr char kTestClusterSecret[] = "it-cluster-secret";
inline constexpr char kTestOperatorToken[] = "it-operator-token";

struct ClusterOptions {
  int daemons = 2;
  int lease_ms = 0;          // 0: coordinator default
  int join_timeout_ms = 0;   // 0: coordinator default
  std::vector<std::string> coordinator_args = {};  // extra flags, e.g. {"--log-level", "debug"}
  std::vector<std::string> daemon_args = {};       // extra flags for every daemon
  std::map<int, std::vector<std::string>> per_daemon_args = {};  // and for daemon i only
  Millis start_timeout{20'000};               // for the port and ready files
  // Non-empty: no coordinator is started; the daemons get this --coordinator (coordinators the
  // test runs itself, e.g. several elected through etcd: "127.0.0.1:p1,127.0.0.1:p2").
  std::string external_coordinators = {};
};

// What spawn_ranks starts: ranks are placed in order, ranks [0, k0) on daemon 0, the next
// k1 on daemon 1, and so on, with LOCAL_RANK / LOCAL_WORLD_SIZE set accordingly.
struct JobSpec {
  std::string job;
  int world = 0;
  std::vector<int> ranks_per_daemon;       // must sum to `world`
  std::vector<std::string> args;           // worker arguments, e.g. {"check", "0,1,1000"}
  Env env;                                 // on top of the defaults, for every rank
  std::function<void(int rank, Env&)> per_rank;  // last word on one rank's environment
  std::set<int> skip;                      // ranks that are not started ("never come")
  bool stdin_pipe = false;
  std::string token = "secret";
  std::string program = "allreduce_worker";  // a binary beside the test
};

// A coordinator and N daemons in a private temporary directory (under $TMPDIR or /tmp),
// removed by the destructor after every process was killed.
class Cluster {
 public:
  explicit Cluster(ClusterOptions options = {});
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  const std::string& dir() const { return dir_; }
  int coordinator_port() const { return port_; }
  std::string coordinator_address() const;
  int num_daemons() const { return static_cast<int>(daemons_.size()); }
  const std::string& socket(int i) const { return sockets_.at(i); }

  Process& coordinator() { return coordinator_; }
  Process& daemon(int i) { return daemons_.at(i); }
  void kill_coordinator();

  // The environment a trainer of `spec` with `rank` on daemon `d` gets (before per_rank).
  Env rank_env(const JobSpec& spec, int rank, int d, int local_rank, int local_world) const;
  // Starts the trainers of a job (allreduce_worker); returned in rank order, skipped ranks
  // omitted. A Process that failed to start has pid() == -1.
  std::vector<Process> spawn_ranks(const JobSpec& spec);
  std::vector<Process> spawn_ranks(const std::string& job, int world, int ranks_per_daemon,
                                   std::vector<std::string> args, Env extra_env = {});
  std::vector<Process> spawn_ranks(const std::string& job, int world,
                                   std::vector<int> ranks_per_daemon,
                                   std::vector<std::string> args, Env extra_env = {});
  // Any other process, with its output in the cluster's directory.
  Process spawn(const std::string& name, std::vector<std::string> argv, Env env = {},
                bool stdin_pipe = false);

  // Captured output of the coordinator, every daemon and `extra`, with headers: for
  // failure messages.
  std::string report(const std::vector<Process>& extra = {}) const;
  std::string report(const std::vector<const Process*>& extra) const;

 private:
  std::string fresh_output_path(const std::string& name);
  bool start_coordinator(SteadyTime deadline);
  void start_daemons(SteadyTime deadline);

  ClusterOptions opts_;
  std::string error_;
  std::string dir_;
  int port_ = 0;
  int next_output_ = 0;
  Process coordinator_;
  std::vector<Process> daemons_;
  std::vector<std::string> sockets_;
};

}  // namespace gradsync::testing
