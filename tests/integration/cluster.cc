#include "cluster.h"
#include "test_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

extern char** environ;

namespace gradsync::testing {
namespace {

// How often the harness looks at files and child processes.
constexpr Millis kFilePoll{10};
constexpr Millis kExitPoll{2};
// Per process in report(): the tail is what explains a failure.
constexpr size_t kReportTailBytes = 16 * 1024;

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls until `path` exists with a non-empty first line, or the deadline / the watched
// process ends it. Returns the first line, or "" with *why set.
std::string wait_for_file(const std::string& path, SteadyTime deadline, Process& owner,
                          std::string* why) {
  for (;;) {
    std::ifstream in(path);
    std::string line;
    if (in && std::getline(in, line) && !line.empty()) return line;
    if (!owner.alive()) {
      *why = owner.name() + " exited (" + owner.exit_status()->describe() + ") before writing " + path;
      return "";
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      *why = "timed out waiting for " + owner.name() + " to write " + path;
      return "";
    }
    std::this_thread::sleep_for(kFilePoll);
  }
}

}  // namespace

std::string binary_dir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return ".";
  return exe.parent_path().string();
}

std::string binary(const std::string& name) { return binary_dir() + "/" + name; }

std::string ExitStatus::describe() const {
  if (signal != 0) return "signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "exit " + std::to_string(code);
}

std::string line_with(const std::string& text, const std::string& needle) {
  size_t at = text.find(needle);
  if (at == std::string::npos) return "";
  size_t begin = text.rfind('\n', at);
  begin = begin == std::string::npos ? 0 : begin + 1;
  size_t end = text.find('\n', at);
  return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// --- Process ------------------------------------------------------------------------------

Process Process::start(ProcessOptions options) {
  Process p;
  p.opts_ = std::move(options);
  auto fail = [&](const std::string& what) {
    p.error_ = "cannot start " + p.opts_.name + ": " + what + ": " + std::strerror(errno);
    return std::move(p);
  };
  if (p.opts_.argv.empty()) {
    p.error_ = "cannot start " + p.opts_.name + ": empty argv";
    return p;
  }

  // Everything the child needs is prepared before fork: only async-signal-safe calls after.
  Env env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : p.opts_.env) env[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& s : p.opts_.argv) argv.push_back(s.data());
  argv.push_back(nullptr);

  int out = ::open(p.opts_.output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) return fail("open " + p.opts_.output_path);
  int in_pipe[2] = {-1, -1};
  int in = -1;
  if (p.opts_.stdin_pipe) {
    if (::pipe2(in_pipe, O_CLOEXEC) != 0) {
      ::close(out);
      return fail("pipe2");
    }
    in = in_pipe[0];
  } else {
    in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  // Closed by a successful exec; carries errno when exec fails.
  int exec_pipe[2];
  if (::pipe2(exec_pipe, O_CLOEXEC) != 0) {
    ::close(out);
    return fail("pipe2");
  }
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out);
    ::close(in);
    if (in_pipe[1] >= 0) ::close(in_pipe[1]);
    ::close(exec_pipe[0]);
    ::close(exec_pipe[1]);
    return fail("fork");
  }
  if (pid == 0) {
    // Never outlive the test, even when it is killed.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(in, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    ::execve(argv[0], argv.data(), envp.data());
    int err = errno;
    (void)!::write(exec_pipe[1], &err, sizeof(err));
    ::_exit(127);
  }
  ::close(out);
  ::close(in);
  ::close(exec_pipe[1]);
  int err = 0;
  ssize_t n;
  do {
    n = ::read(exec_pipe[0], &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(exec_pipe[0]);
  p.pid_ = pid;
  p.stdin_fd_ = in_pipe[1];
  if (n == sizeof(err)) {
    p.reap(true);
    p.pid_ = -1;
    errno = err;
    return fail("execve " + p.opts_.argv[0]);
  }
  return p;
}

Process::~Process() { terminate(); }

void Process::terminate() {
  close_stdin();
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    reap(true);
  }
}

Process::Process(Process&& o) noexcept
    : opts_(std::move(o.opts_)),
      pid_(std::exchange(o.pid_, -1)),
      stdin_fd_(std::exchange(o.stdin_fd_, -1)),
      error_(std::move(o.error_)),
      status_(o.status_),
      exit_time_(o.exit_time_) {}

Process& Process::operator=(Process&& o) noexcept {
  if (this != &o) {
    terminate();
    opts_ = std::move(o.opts_);
    pid_ = std::exchange(o.pid_, -1);
    stdin_fd_ = std::exchange(o.stdin_fd_, -1);
    error_ = std::move(o.error_);
    status_ = o.status_;
    exit_time_ = o.exit_time_;
  }
  return *this;
}

void Process::reap(bool block) {
  if (pid_ <= 0 || status_) return;
  int st = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &st, block ? 0 : WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == 0) return;
  ExitStatus es;
  if (r == pid_) {
    if (WIFEXITED(st)) es.code = WEXITSTATUS(st);
    if (WIFSIGNALED(st)) es.signal = WTERMSIG(st);
  }
  status_ = es;
  exit_time_ = std::chrono::steady_clock::now();
}

bool Process::alive() {
  reap(false);
  return pid_ > 0 && !status_;
}

std::optional<ExitStatus> Process::wait_for_exit(Millis timeout) {
  const SteadyTime deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    reap(false);
    if (status_ || pid_ <= 0) return status_;
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(kExitPoll);
  }
}

void Process::kill(int sig) {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

void Process::close_stdin() {
  if (stdin_fd_ >= 0) ::close(stdin_fd_);
  stdin_fd_ = -1;
}

std::string Process::output() const {
  return opts_.output_path.empty() ? "" : read_file(opts_.output_path);
}

bool Process::wait_for_output(const std::string& needle, Millis timeout) {
  const SteadyTime deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool running = alive();
    if (contains(output(), needle)) return true;
    if (!running || std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kFilePoll);
  }
}

bool wait_all_exit(std::vector<Process*> procs, Millis timeout) {
  const SteadyTime deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool all = true;
    for (Process* p : procs) all = !p->alive() && all;
    if (all) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kExitPoll);
  }
}

bool wait_all_exit(std::vector<Process>& procs, Millis timeout) {
  std::vector<Process*> ptrs;
  for (auto& p : procs) ptrs.push_back(&p);
  return wait_all_exit(ptrs, timeout);
}

std::string all_succeeded(std::vector<Process>& procs, Millis timeout, const std::string& needle) {
  wait_all_exit(procs, timeout);
  std::string problems;
  for (auto& p : procs) {
    if (p.pid() < 0) {
      problems += p.name() + ": " + p.error() + "\n";
    } else if (!p.exit_status()) {
      problems += p.name() + ": still running after " + std::to_string(timeout.count()) + " ms\n";
    } else if (!p.exit_status()->success()) {
      problems += p.name() + ": " + p.exit_status()->describe() + "\n";
    } else if (!contains(p.output(), needle)) {
      problems += p.name() + ": exited 0 without printing " + needle + "\n";
    }
  }
  return problems;
}

// --- Cluster ------------------------------------------------------------------------------

Cluster::Cluster(ClusterOptions options) : opts_(std::move(options)) {
  // The credentials of the coordinator's callers (coordinator/authz.h), in the environment every
  // process of the test inherits (daemons, gradsyncctl, gradsyncrun), as a deployment would
  // give them; a test that plays a caller without them overrides the variable for that process.
  ::setenv("GRADSYNC_CLUSTER_SECRET", kTestClusterSecret, 0);
  ::setenv("GRADSYNC_OPERATOR_TOKEN", kTestOperatorToken, 0);
  dir_ = make_test_dir("gradsync-it");
  if (dir_.empty()) {
    error_ = std::string("mkdtemp gradsync-it-XXXXXX: ") + std::strerror(errno);
    return;
  }
  const SteadyTime deadline = std::chrono::steady_clock::now() + opts_.start_timeout;

  if (opts_.external_coordinators.empty()) {
    if (!start_coordinator(deadline)) return;
  }
  start_daemons(deadline);
}

bool Cluster::start_coordinator(SteadyTime deadline) {
  const std::string port_file = dir_ + "/coordinator.port";
  std::vector<std::string> argv = {binary("gradsync-coordinator"), "--listen", "127.0.0.1:0",
                                   "--port-file", port_file};
  if (opts_.lease_ms > 0) argv.insert(argv.end(), {"--lease-ms", std::to_string(opts_.lease_ms)});
  if (opts_.join_timeout_ms > 0) {
    argv.insert(argv.end(), {"--join-timeout-ms", std::to_string(opts_.join_timeout_ms)});
  }
  argv.insert(argv.end(), opts_.coordinator_args.begin(), opts_.coordinator_args.end());
  coordinator_ = spawn("coordinator", argv);
  if (coordinator_.pid() < 0) {
    error_ = coordinator_.error();
    return false;
  }
  std::string port = wait_for_file(port_file, deadline, coordinator_, &error_);
  if (port.empty()) return false;
  port_ = std::atoi(port.c_str());
  if (port_ <= 0) {
    error_ = "coordinator wrote a bad port file: '" + port + "'";
    return false;
  }
  return true;
}

void Cluster::start_daemons(SteadyTime deadline) {
  // Start every daemon first, then wait for all of them: they register in parallel.
  std::vector<std::string> ready;
  for (int i = 0; i < opts_.daemons; ++i) {
    sockets_.push_back(dir_ + "/d" + std::to_string(i) + ".sock");
    ready.push_back(dir_ + "/d" + std::to_string(i) + ".ready");
    std::vector<std::string> dargv = {binary("gradsyncd"),   "--coordinator", coordinator_address(),
                                      "--socket",            sockets_.back(),
                                      "--node-name",         "node" + std::to_string(i),
                                      "--data-listen",       "127.0.0.1",
                                      "--ready-file",        ready.back()};
    dargv.insert(dargv.end(), opts_.daemon_args.begin(), opts_.daemon_args.end());
    if (auto it = opts_.per_daemon_args.find(i); it != opts_.per_daemon_args.end()) {
      dargv.insert(dargv.end(), it->second.begin(), it->second.end());
    }
    daemons_.push_back(spawn("gradsyncd-" + std::to_string(i), dargv));
    if (daemons_.back().pid() < 0) {
      error_ = daemons_.back().error();
      return;
    }
  }
  for (int i = 0; i < opts_.daemons; ++i) {
    if (wait_for_file(ready[i], deadline, daemons_[i], &error_).empty()) return;
  }
}

Cluster::~Cluster() {
  for (auto& d : daemons_) d.kill(SIGKILL);
  coordinator_.kill(SIGKILL);
  for (auto& d : daemons_) d.wait_for_exit(Millis(5000));
  coordinator_.wait_for_exit(Millis(5000));
  remove_test_dir(dir_);
}

std::string Cluster::coordinator_address() const {
  return opts_.external_coordinators.empty() ? "127.0.0.1:" + std::to_string(port_) : opts_.external_coordinators;
}

void Cluster::kill_coordinator() {
  coordinator_.kill(SIGKILL);
  coordinator_.wait_for_exit(Millis(5000));
}

std::string Cluster::fresh_output_path(const std::string& name) {
  std::string safe;
  for (char c : name) safe += std::isalnum(static_cast<unsigned char>(c)) || c == '-' ? c : '_';
  return dir_ + "/" + std::to_string(next_output_++) + "-" + safe + ".log";
}

Process Cluster::spawn(const std::string& name, std::vector<std::string> argv, Env env,
                       bool stdin_pipe) {
  ProcessOptions o;
  o.name = name;
  o.argv = std::move(argv);
  o.env = std::move(env);
  o.output_path = fresh_output_path(name);
  o.stdin_pipe = stdin_pipe;
  return Process::start(std::move(o));
}

Env Cluster::rank_env(const JobSpec& spec, int rank, int d, int local_rank, int local_world) const {
  Env env = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(spec.world)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
      {"GRADSYNC_DAEMON", sockets_.at(d)},
      {"GRADSYNC_JOB_ID", spec.job},
      {"GRADSYNC_JOB_TOKEN", spec.token},
      // Bounded by default so a broken runtime fails a test instead of hanging it.
      {"GRADSYNC_JOIN_TIMEOUT_MS", "30000"},
      {"GRADSYNC_OP_TIMEOUT_MS", "60000"},
  };
  for (const auto& [k, v] : spec.env) env[k] = v;
  return env;
}

std::vector<Process> Cluster::spawn_ranks(const JobSpec& spec) {
  int sum = std::accumulate(spec.ranks_per_daemon.begin(), spec.ranks_per_daemon.end(), 0);
  if (sum != spec.world || spec.ranks_per_daemon.size() > daemons_.size()) {
    throw std::invalid_argument("spawn_ranks: ranks_per_daemon must sum to the world size (" +
                                std::to_string(spec.world) + ") over at most " +
                                std::to_string(daemons_.size()) + " daemons");
  }
  std::vector<Process> out;
  int rank = 0;
  for (size_t d = 0; d < spec.ranks_per_daemon.size(); ++d) {
    const int local_world = spec.ranks_per_daemon[d];
    for (int local = 0; local < local_world; ++local, ++rank) {
      if (spec.skip.count(rank)) continue;
      Env env = rank_env(spec, rank, static_cast<int>(d), local, local_world);
      if (spec.per_rank) spec.per_rank(rank, env);
      std::vector<std::string> argv = {binary(spec.program)};
      argv.insert(argv.end(), spec.args.begin(), spec.args.end());
      out.push_back(spawn("rank " + std::to_string(rank), std::move(argv), std::move(env),
                          spec.stdin_pipe));
    }
  }
  return out;
}

std::vector<Process> Cluster::spawn_ranks(const std::string& job, int world, int ranks_per_daemon,
                                          std::vector<std::string> args, Env extra_env) {
  std::vector<int> placement;
  for (int left = world; left > 0; left -= ranks_per_daemon) {
    placement.push_back(std::min(left, ranks_per_daemon));
  }
  return spawn_ranks(job, world, placement, std::move(args), std::move(extra_env));
}

std::vector<Process> Cluster::spawn_ranks(const std::string& job, int world,
                                          std::vector<int> ranks_per_daemon,
                                          std::vector<std::string> args, Env extra_env) {
  JobSpec spec;
  spec.job = job;
  spec.world = world;
  spec.ranks_per_daemon = std::move(ranks_per_daemon);
  spec.args = std::move(args);
  spec.env = std::move(extra_env);
  return spawn_ranks(spec);
}

std::string Cluster::report(const std::vector<Process>& extra) const {
  std::vector<const Process*> ptrs;
  for (const auto& p : extra) ptrs.push_back(&p);
  return report(ptrs);
}

std::string Cluster::report(const std::vector<const Process*>& extra) const {
  std::vector<const Process*> all = {&coordinator_};
  for (const auto& d : daemons_) all.push_back(&d);
  all.insert(all.end(), extra.begin(), extra.end());
  std::string out = "\n";
  for (const Process* p : all) {
    if (p->name().empty()) continue;
    std::string status = p->exit_status() ? p->exit_status()->describe() : "running";
    out += "===== " + p->name() + " (pid " + std::to_string(p->pid()) + ", " + status + ") =====\n";
    if (!p->error().empty()) out += p->error() + "\n";
    std::string text = p->output();
    if (text.size() > kReportTailBytes) {
      text = "[... " + std::to_string(text.size() - kReportTailBytes) + " bytes cut ...]\n" +
             text.substr(text.size() - kReportTailBytes);
    }
    out += text;
    if (!text.empty() && text.back() != '\n') out += '\n';
  }
  return out;
}

}  // namespace gradsync::testing
