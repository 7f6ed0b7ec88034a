// gradsyncrun: runs one process per local rank with the gradsync environment set, like
// torchrun. --standalone also starts a coordinator and a daemon so one command runs a job
// on one machine; in a multi-node job each node runs gradsyncrun with its --node-rank.
// It prefixes rank output, and when one rank fails it stops the rest and fails too.
#include <signal.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/log.h"
#include "common/secret.h"
#include "common/socket_path.h"
#include "launcher/options.h"
#include "launcher/process.h"
#include "launcher/supervisor.h"

namespace gradsync::launcher {
namespace {

using namespace std::chrono_literals;

constexpr auto kStartupTimeout = 30s;  // for the coordinator's port and the daemon's ready file
constexpr auto kFilePollInterval = 20ms;
constexpr auto kStopGrace = 5s;    // SIGTERM, then SIGKILL after this
constexpr auto kReapTimeout = 5s;  // after SIGKILL; only a process stuck in D state is slower
constexpr int kExitFailed = 1;
constexpr int kExitTimeout = 124;  // like timeout(1)

void say(const std::string& message) {
  const std::string line = "gradsyncrun: " + message + "\n";
  (void)!::write(STDERR_FILENO, line.data(), line.size());
}

bool read_file(const std::string& path, std::string* text) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *text = ss.str();
  return true;
}

class Launcher {
 public:
  explicit Launcher(Options o) : o_(std::move(o)), replacements_left_(o_.replace_failed) {
    if (o_.timeout_s)
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(*o_.timeout_s));
  }

  int run() {
    int rc = start();
    if (rc == 0) rc = supervise();
    shutdown();
    return rc;
  }

 private:
  // Starts servers (as needed) and ranks; 0, or the exit status to leave with.
  int start() {
    if (Status s = sup_.init(); !s.ok()) return fail(s.message());
    if (o_.standalone || o_.start_daemon) {
      if (int rc = make_tmpdir(); rc != 0) return rc;
    }
    coordinator_addr_ = o_.coordinator;
    if (o_.standalone) {
      if (int rc = make_secrets(); rc != 0) return rc;
      if (int rc = start_coordinator(); rc != 0) return rc;
    }
    daemon_socket_ = o_.daemon_socket;
    if (o_.standalone || o_.start_daemon) {
      if (int rc = start_daemon(); rc != 0) return rc;
    } else if (daemon_socket_.empty()) {
      // The node's running daemon (gradsyncd.service, or a user's own): common/socket_path.h.
      daemon_socket_ = client_daemon_socket();
      if (access(daemon_socket_.c_str(), F_OK) != 0) {
        std::string tried;
        for (const auto& c : daemon_socket_candidates()) tried += (tried.empty() ? "" : ", ") + c;
        return fail("no running gradsyncd on this node (tried $GRADSYNC_DAEMON, " + tried +
                    "): start it (systemctl start gradsyncd, or gradsyncd --coordinator HOST:PORT), pass "
                    "--daemon SOCKET, or use --standalone for a one-node job with its own daemon");
      }
      log::get("launcher")->info("using the running gradsyncd at {}", daemon_socket_);
    } else if (access(daemon_socket_.c_str(), F_OK) != 0) {
      log::get("launcher")->warn("daemon socket {} does not exist (yet)", daemon_socket_);
    }
    if (!o_.launcher.empty()) {
      log::get("launcher")->info("node {} of {} from the {} variables", o_.node_rank, o_.nnodes, o_.launcher);
    }
    return start_ranks();
  }

  int make_tmpdir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/gradsyncrun.XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return fail("mkdtemp " + tmpl + ": " + strerror(errno));
    tmpdir_ = tmpl;
    return 0;
  }

  Result<std::string> find(const std::string& name) {
    const std::string dir = self_dir();
    return find_executable(name, dir.empty() ? std::vector<std::string>{} : std::vector{dir});
  }

  // argv for a server: its flags, plus --log-level when the user gave one.
  Command server_command(const std::string& path, std::vector<std::string> argv) {
    if (!o_.log_level.empty()) argv.insert(argv.end(), {"--log-level", o_.log_level});
    argv.insert(argv.begin(), path);
    return Command{path, std::move(argv), environment_with(server_env_), true};
  }

  // Standalone: a cluster secret and an operator token of its own for the coordinator and
  // the daemon it starts (their environment), the operator token also in a file only this
  // user reads, for gradsyncctl --operator-token-file.
  int make_secrets() {
    auto secret = random_token();
    auto op = random_token();
    if (!secret.ok() || !op.ok()) return fail("cannot make the standalone credentials: no random bytes");
    server_env_ = {"GRADSYNC_CLUSTER_SECRET=" + *secret, "GRADSYNC_OPERATOR_TOKEN=" + *op};
    const std::string path = tmpdir_ + "/operator.token";
    {
      std::ofstream f(path, std::ios::trunc);  // in the launcher's own 0700 directory
      f << *op << '\n';
      if (!f || ::chmod(path.c_str(), 0600) != 0) return fail("cannot write " + path);
    }
    log::get("launcher")->info("operator credential for gradsyncctl: --operator-token-file {}", path);
    return 0;
  }

  std::vector<std::string> with_tls(std::vector<std::string> argv) const {
    argv.insert(argv.end(), o_.daemon_tls_flags.begin(), o_.daemon_tls_flags.end());
    return argv;
  }

  int start_coordinator() {
    auto path = find("gradsync-coordinator");
    if (!path.ok()) return fail(path.status().message());
    const std::string port_file = tmpdir_ + "/coord.port";
    auto idx =
        sup_.start("gradsync-coordinator",
                   server_command(*path, {"--listen", "127.0.0.1:0", "--port-file", port_file}),
                   "[coordinator] ", STDERR_FILENO, STDERR_FILENO);
    if (!idx.ok()) return fail("cannot start " + *path + ": " + idx.status().message());
    coordinator_ = *idx;
    std::string text;
    if (int rc = wait_for_file(coordinator_, port_file, "write its port file", &text); rc != 0) {
      return rc;
    }
    int port = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
    if (ec != std::errc() || end != text.data() + text.size() || port < 1 || port > 65535) {
      return fail("gradsync-coordinator wrote '" + text + "' to " + port_file + ", not a port");
    }
    coordinator_addr_ = "127.0.0.1:" + std::to_string(port);
    log::get("launcher")->info("coordinator listening on {}", coordinator_addr_);
    return 0;
  }

  int start_daemon() {
    auto path = find("gradsyncd");
    if (!path.ok()) return fail(path.status().message());
    const std::string ready_file = tmpdir_ + "/daemon.ready";
    daemon_socket_ = tmpdir_ + "/gradsyncd.sock";
    auto idx = sup_.start(
        "gradsyncd",
        server_command(*path, with_tls({"--coordinator", coordinator_addr_, "--socket", daemon_socket_,
                                         "--node-name", o_.node_name, "--ready-file", ready_file})),
        "[gradsyncd] ", STDERR_FILENO, STDERR_FILENO);
    if (!idx.ok()) return fail("cannot start " + *path + ": " + idx.status().message());
    daemon_ = *idx;
    if (int rc = wait_for_file(daemon_, ready_file, "become ready", nullptr); rc != 0) return rc;
    log::get("launcher")->info("gradsyncd ready on {}", daemon_socket_);
    return 0;
  }

  int start_ranks() {
    auto path = find(o_.program[0]);
    if (!path.ok()) return fail(path.status().message());
    const int n = o_.nproc_per_node;
    for (int local = 0; local < n; ++local) {
      if (int rc = start_rank(*path, local, false); rc != 0) return rc;
    }
    log::get("launcher")
        ->debug("job {}: started ranks {}..{} of {}", o_.job_id, o_.node_rank * n,
                o_.node_rank * n + n - 1, o_.nnodes * n);
    return 0;
  }

  // One rank process; a replacement (--replace-failed) takes the place of the one that died.
  int start_rank(const std::string& path, int local, bool replacement) {
    const int n = o_.nproc_per_node;
    {
      const int rank = o_.node_rank * n + local;
      std::vector<std::string> vars = {
          "RANK=" + std::to_string(rank),        "WORLD_SIZE=" + std::to_string(o_.nnodes * n),
          "LOCAL_RANK=" + std::to_string(local), "LOCAL_WORLD_SIZE=" + std::to_string(n),
          "GRADSYNC_DAEMON=" + daemon_socket_,   "GRADSYNC_JOB_ID=" + o_.job_id,
          "GRADSYNC_JOB_TOKEN=" + o_.token,      "GRADSYNC_COORDINATOR=" + coordinator_addr_,
          // JoinOptions::from_env() reads only RANK... then, not the variables of whatever
          // launched this gradsyncrun (common/launch_env.h).
          "GRADSYNC_LAUNCHER=gradsyncrun"};
      if (!o_.log_level.empty()) vars.push_back("GRADSYNC_LOG_LEVEL=" + o_.log_level);
      if (replacement) vars.push_back("GRADSYNC_REPLACEMENT=1");
      Command cmd{path, o_.program, environment_with(vars), !o_.no_prefix};
      const std::string label = (replacement ? "replacement " : "rank ") + std::to_string(rank);
      auto idx =
          sup_.start(label, std::move(cmd), "[" + label + "] ", STDOUT_FILENO, STDERR_FILENO);
      if (!idx.ok()) return fail("cannot start " + label + ": " + idx.status().message());
      if (replacement) {
        ranks_[size_t(local)] = *idx;
      } else {
        ranks_.push_back(*idx);
      }
    }
    return 0;
  }

  // Waits until `child` created `path`; with `content`, until the file holds a complete
  // value, which goes there without surrounding whitespace.
  int wait_for_file(int child, const std::string& path, const char* what, std::string* content) {
    const Deadline give_up = Clock::now() + kStartupTimeout;
    std::string previous;
    waiting_for_ = {child, what};  // so that check_events() can say what an exit interrupted
    while (true) {
      if (int rc = check_events(); rc != 0) return rc;
      std::string text;
      if (read_file(path, &text) && (content == nullptr || complete(text, &previous))) {
        if (content != nullptr) {
          const size_t first = text.find_first_not_of(" \t\r\n");
          const size_t last = text.find_last_not_of(" \t\r\n");
          *content = first == std::string::npos ? "" : text.substr(first, last + 1 - first);
        }
        waiting_for_ = {-1, ""};
        return 0;
      }
      if (Clock::now() >= give_up) {
        return fail(sup_.name(child) + " did not " + what + " (" + path + ") within " +
                    std::to_string(kStartupTimeout.count()) + " s");
      }
      sup_.step(std::min({Clock::now() + kFilePollInterval, give_up, deadline_}));
    }
  }

  // A file is complete once it ends in a newline or reads the same twice: a writer that
  // does not write-and-rename could be caught halfway through "12345".
  static bool complete(const std::string& text, std::string* previous) {
    if (!text.empty() && text.back() == '\n') return true;
    const bool same = !text.empty() && text == *previous;
    *previous = text;
    return same;
  }

  int supervise() {
    while (true) {
      if (int rc = check_events(); rc != 0) return rc;
      const bool done = std::none_of(ranks_.begin(), ranks_.end(),
                                     [&](int r) { return sup_.alive(r) || sup_.output_open(r); });
      if (done) return 0;
      sup_.step(deadline_);
    }
  }

  // Reacts to launcher signals, the timeout and child exits; 0 while the job may go on.
  int check_events() {
    if (int sig = sup_.take_signal()) {
      say(std::string("received SIG") + sigabbrev_np(sig) + ", stopping the job");
      for (int c : all_children()) sup_.kill_group(c, sig);
      return 128 + sig;  // the shell's convention for "ended by signal"
    }
    if (Clock::now() >= deadline_) {
      say(fmt::format("timed out after {:g} s, stopping the job", *o_.timeout_s));
      return kExitTimeout;
    }
    for (const ChildExit& e : sup_.take_exits()) {
      const bool is_rank = std::find(ranks_.begin(), ranks_.end(), e.child) != ranks_.end();
      if (is_rank && e.status == 0) continue;
      if (is_rank && replacements_left_ > 0) {
        --replacements_left_;
        const int local = int(std::find(ranks_.begin(), ranks_.end(), e.child) - ranks_.begin());
        say(sup_.name(e.child) + " " + describe_wait_status(e.status) + "; starting a replacement (" +
            std::to_string(replacements_left_) + " more allowed)");
        auto path = find(o_.program[0]);
        if (!path.ok()) return fail(path.status().message());
        if (int rc = start_rank(*path, local, true); rc != 0) return rc;
        continue;
      }
      if (is_rank) return fail(sup_.name(e.child) + " " + describe_wait_status(e.status));
      const auto [waited, what] = waiting_for_;
      const std::string when = waited < 0 ? "while ranks were running"
                               : waited == e.child
                                   ? "before it could " + what
                                   : "while waiting for " + sup_.name(waited) + " to " + what;
      return fail(sup_.name(e.child) + " " + describe_wait_status(e.status) + " " + when);
    }
    return 0;
  }

  // Ranks first, so they can still reach the daemon while they exit; daemon before
  // coordinator, so it can leave the job cleanly.
  void shutdown() {
    stop(ranks_);
    if (daemon_ >= 0) stop({daemon_});
    if (coordinator_ >= 0) stop({coordinator_});
    if (!tmpdir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(tmpdir_, ec);
    }
  }

  void stop(const std::vector<int>& children) {
    auto pending = [&] {
      return std::any_of(children.begin(), children.end(),
                         [&](int c) { return sup_.alive(c) || sup_.output_open(c); });
    };
    for (int c : children) sup_.kill_group(c, SIGTERM);
    Deadline kill_at = Clock::now() + kStopGrace;
    Deadline give_up = Deadline::max();
    while (pending()) {
      if (sup_.take_signal() != 0) kill_at = Clock::now();  // asked twice: no more grace
      if (give_up == Deadline::max() && Clock::now() >= kill_at) {
        for (int c : children) {
          if (sup_.alive(c)) log::get("launcher")->debug("{}: SIGKILL after grace", sup_.name(c));
          sup_.kill_group(c, SIGKILL);
        }
        give_up = Clock::now() + kReapTimeout;
      }
      if (Clock::now() >= give_up) break;
      sup_.step(give_up == Deadline::max() ? kill_at : give_up);
    }
    for (const ChildExit& e : sup_.take_exits()) {
      log::get("launcher")
          ->debug("{} {} during shutdown", sup_.name(e.child), describe_wait_status(e.status));
    }
  }

  std::vector<int> all_children() const {
    std::vector<int> all = ranks_;
    for (int c : {daemon_, coordinator_}) {
      if (c >= 0) all.push_back(c);
    }
    return all;
  }

  int fail(const std::string& message) {
    say(message);
    return kExitFailed;
  }

  Options o_;
  Supervisor sup_;
  Deadline deadline_ = Deadline::max();  // --timeout-s
  int replacements_left_;                // --replace-failed
  std::string tmpdir_;
  std::string coordinator_addr_;
  std::vector<std::string> server_env_;  // NAME=VALUE for the coordinator and daemon started here
  std::string daemon_socket_;
  int coordinator_ = -1;
  int daemon_ = -1;
  std::vector<int> ranks_;
  std::pair<int, std::string> waiting_for_{-1, ""};  // server started, what it should do
};

}  // namespace
}  // namespace gradsync::launcher

int main(int argc, char** argv) {
  using namespace gradsync::launcher;
  ParseOutcome parsed = parse_options(argc, argv);
  if (!parsed.options) {
    (void)!::write(parsed.exit_code == 0 ? STDOUT_FILENO : STDERR_FILENO, parsed.message.data(),
                   parsed.message.size());
    return parsed.exit_code;
  }
  if (!parsed.options->log_level.empty()) gradsync::log::set_level(parsed.options->log_level);
  signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the launcher while ranks run
  return Launcher(std::move(*parsed.options)).run();
}
