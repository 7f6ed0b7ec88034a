// gradsync-coordinator: rendezvous, membership and failure detection for gradsync jobs.
// Exit status: 0 after a SIGTERM/SIGINT shutdown, 1 if it cannot serve, 2 on bad usage.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <absl/synchronization/mutex.h>

#include "common/call_auth.h"
#include "common/log.h"
#include "coordinator/election.h"
#include "coordinator/etcd_store.h"
#include "coordinator/service.h"
#include "coordinator/standby_server.h"

namespace {

constexpr const char* kUsage =
    "usage: gradsync-coordinator [options]\n"
    "\n"
    "  --listen HOST:PORT      address to serve on (default 0.0.0.0:29500; port 0 = any free)\n"
    "  --port-file PATH        write the bound port number to PATH once listening\n"
    "  --lease-ms N            a node with no heartbeat for N ms is lost (default 5000)\n"
    "  --join-timeout-ms N     JoinJob wait when the request gives none (default 60000)\n"
    "  --metrics-listen HOST:PORT  serve Prometheus /metrics there (default off; port 0: any\n"
    "                          free port, logged)\n"
    "  --store etcd://HOST:PORT[/PREFIX]\n"
    "                          keep nodes and jobs in etcd (v3 API; key prefix default\n"
    "                          /gradsync) and elect one leader among the coordinators given\n"
    "                          the same store; the others stand by (default: memory only)\n"
    "  --advertise HOST:PORT   with --store: the address daemons reach this coordinator at\n"
    "                          (default: --listen's, with this host's name for 0.0.0.0)\n"
    "  --election-ttl-s N      with --store: the leader's etcd lease in seconds; a standby\n"
    "                          takes over at most this long after the leader dies (default 2)\n"
    "  --log-level LEVEL       trace|debug|info|warn|error|off (default info, or\n"
    "                          $GRADSYNC_LOG_LEVEL)\n"
    "  --help                  print this and exit\n"
    "TLS (plaintext is refused off loopback unless --insecure):\n";

constexpr uint64_t kMaxMs = 0xffffffffu;  // the protocol carries milliseconds as uint32

struct Flags {
  std::string listen = "0.0.0.0:29500";
  std::string port_file;
  uint64_t lease_ms = 5000;
  uint64_t join_timeout_ms = 60000;
  std::string log_level;
  std::string metrics_listen;
  std::string store;
  std::string advertise;
  uint64_t election_ttl_s = 2;
  gradsync::TlsOptions tls;
  gradsync::AuthOptions auth;
};

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "gradsync-coordinator: %s\n\n%s", msg.c_str(), kUsage);
  return 2;
}

bool parse_ms(const std::string& text, uint64_t& out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end && out >= 1 && out <= kMaxMs;
}

// Returns -1 to go on, or the exit status.
int parse_flags(int argc, char** argv, Flags& f) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::fputs(gradsync::TlsOptions::usage(), stdout);
      std::fputs("Credentials (coordinator/authz.h):\n", stdout);
      std::fputs(gradsync::AuthOptions::usage(), stdout);
      return 0;
    }
    std::string tls_error;
    if (!has_value && (f.tls.take_flag(argc, argv, &i, &tls_error) || f.auth.take_flag(argc, argv, &i, &tls_error))) {
      if (!tls_error.empty()) return usage_error(tls_error);
      continue;
    }
    const bool known = arg == "--listen" || arg == "--port-file" || arg == "--lease-ms" ||
                       arg == "--join-timeout-ms" || arg == "--log-level" || arg == "--metrics-listen" ||
                       arg == "--store" || arg == "--advertise" || arg == "--election-ttl-s";
    if (!known) return usage_error("unknown flag '" + arg + "'");
    if (!has_value) {
      if (i + 1 >= argc) return usage_error(arg + " needs a value");
      value = argv[++i];
    }
    if (arg == "--listen") {
      if (value.rfind(':') == std::string::npos) {
        return usage_error("--listen wants HOST:PORT, got '" + value + "'");
      }
      f.listen = value;
    } else if (arg == "--metrics-listen") {
      f.metrics_listen = value;
    } else if (arg == "--port-file") {
      f.port_file = value;
    } else if (arg == "--lease-ms") {
      if (!parse_ms(value, f.lease_ms))
        return usage_error("--lease-ms wants 1.." + std::to_string(kMaxMs));
    } else if (arg == "--join-timeout-ms") {
      if (!parse_ms(value, f.join_timeout_ms)) {
        return usage_error("--join-timeout-ms wants 1.." + std::to_string(kMaxMs));
      }
    } else if (arg == "--store") {
      if (auto url = gradsync::coordinator::EtcdUrl::parse(value); !url.ok()) return usage_error(url.status().message());
      f.store = value;
    } else if (arg == "--advertise") {
      if (value.rfind(':') == std::string::npos) return usage_error("--advertise wants HOST:PORT, got '" + value + "'");
      f.advertise = value;
    } else if (arg == "--election-ttl-s") {
      if (!parse_ms(value, f.election_ttl_s) || f.election_ttl_s > 3600) return usage_error("--election-ttl-s wants 1..3600");
    } else if (arg == "--log-level") {
      static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      bool ok = false;
      for (const char* l : kLevels) ok = ok || value == l;
      if (!ok) return usage_error("unknown --log-level '" + value + "'");
      f.log_level = value;
    }
  }
  return -1;
}

// Launchers poll for this file, so it must never be seen half-written: write, then rename.
bool write_port_file(const std::string& path, int port) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << '\n';
    out.flush();
    if (!out) return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

// --store: stand by until elected through etcd, then load the store and serve. Losing the
// leadership ends the process (exit 3) rather than risk two leaders: restart it and it stands
// by. A stop signal resigns, so a standby takes over at its next poll instead of after the TTL.
int run_elected(const Flags& flags, gradsync::coordinator::CoordinatorOptions options, sigset_t stop_signals) {
  namespace gc = gradsync::coordinator;
  auto log = gradsync::log::get("coordinator");
  auto url = gc::EtcdUrl::parse(flags.store).value();
  const size_t colon = flags.listen.rfind(':');
  if (flags.listen.substr(colon + 1) == "0") return usage_error("--store needs a fixed --listen port (not 0)");
  std::string me = flags.advertise;
  if (me.empty()) {
    std::string host = flags.listen.substr(0, colon);
    if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
      char name[256] = {};
      ::gethostname(name, sizeof(name) - 1);
      host = name;
    }
    me = host + flags.listen.substr(colon);
  }
  auto etcd = std::make_shared<gc::EtcdClient>(url.address);
  gc::LeaderElection election(etcd, {url.prefix + "/election/leader", me, int64_t(flags.election_ttl_s)});
  gc::StandbyServer standby(me, url.address);
  if (gradsync::Status s = standby.start(flags.listen, options.tls); !s.ok()) {
    log->error("{}", s.to_string());
    return 1;
  }
  std::mutex mu;
  std::unique_ptr<gc::CoordinatorServer> server;
  int exit_code = 0;
  std::thread role([&] {
    gradsync::Status s = election.campaign([&](const std::string& leader) { standby.set_leader(leader); });
    if (!s.ok()) return;  // stopped by a signal
    standby.shutdown();
    options.store = std::make_shared<gc::EtcdStore>(etcd, url.prefix, election.fence());
    auto started = std::make_unique<gc::CoordinatorServer>(options);
    if (gradsync::Status st = started->start(flags.listen); !st.ok()) {
      log->error("elected, but cannot serve: {}", st.to_string());
      election.resign();
      std::lock_guard lock(mu);
      exit_code = 1;
      ::kill(::getpid(), SIGTERM);
      return;
    }
    election.hold([&](const std::string& why) {
      log->critical("{}: another coordinator may lead now; exiting (restart this one and it stands by)", why);
      gradsync::log::get("coordinator")->flush();
      std::_Exit(3);
    });
    log->info("serving as the leader at {} (store: etcd at {} under {})", me, url.address, url.prefix);
    if (!flags.port_file.empty() && !write_port_file(flags.port_file, started->port())) {
      log->error("cannot write the port file '{}': {}", flags.port_file, std::strerror(errno));
    }
    std::lock_guard lock(mu);
    server = std::move(started);
  });
  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  log->info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  election.stop();
  role.join();
  std::lock_guard lock(mu);
  if (server) {
    server->shutdown();
    server->wait();
    server->flush_store(std::chrono::seconds(1));
    election.resign();
  }
  standby.shutdown();
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (int rc = parse_flags(argc, argv, flags); rc >= 0) return rc;
  if (!flags.log_level.empty()) gradsync::log::set_level(flags.log_level);
  auto log = gradsync::log::get("coordinator");
  // Debian's abseil is built with its mutex deadlock detection on: every lock of gRPC's
  // internal mutexes updated a global lock graph, about 12% of the coordinator's CPU with
  // 16,384 nodes registering (perf). Our own locks are std::mutex, not checked by it anyway.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Block the stop signals before any thread exists, so every gRPC thread inherits the mask
  // and only sigwait() below sees them: no work happens in a signal handler.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  gradsync::coordinator::CoordinatorOptions options;
  options.lease = gradsync::coordinator::Millis(flags.lease_ms);
  options.default_join_timeout = gradsync::coordinator::Millis(flags.join_timeout_ms);
  options.tls = flags.tls;
  options.metrics_listen = flags.metrics_listen;
  options.tls.add_env();
  // Who may call what (coordinator/authz.h): nodes need the cluster secret unless mTLS names
  // them; operators need the operator token. A coordinator that would check nothing does not start.
  auto cluster_secret = flags.auth.cluster_secret();
  auto operator_token = flags.auth.operator_token();
  for (const auto* r : {&cluster_secret, &operator_token}) {
    if (!r->ok()) {
      log->error("{}", r->status().message());
      return 2;
    }
  }
  options.authz.cluster_secret = *cluster_secret;
  options.authz.operator_token = *operator_token;
  if (options.authz.cluster_secret.empty() && !options.tls.require_client_cert) {
    log->error("no node credential: give the cluster secret every gradsyncd presents (--cluster-secret-file F "
               "or $GRADSYNC_CLUSTER_SECRET), or --require-client-cert (mTLS); gradsyncrun --standalone makes one");
    return 2;
  }
  if (options.authz.operator_token.empty()) {
    log->warn("no operator credential (--operator-token-file or $GRADSYNC_OPERATOR_TOKEN): gradsyncctl jobs, "
              "describe and abort are refused");
  }
  if (flags.store.empty()) {
    gradsync::coordinator::CoordinatorServer server(options);
    if (gradsync::Status s = server.start(flags.listen); !s.ok()) {
      log->error("{}", s.to_string());
      return 1;
    }
    if (!flags.port_file.empty() && !write_port_file(flags.port_file, server.port())) {
      log->error("cannot write the port file '{}': {}", flags.port_file, std::strerror(errno));
      server.shutdown();
      server.wait();
      return 1;
    }
    int sig = 0;
    while (sigwait(&stop_signals, &sig) != 0) {
    }
    log->info("received {}, shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    server.shutdown();
    server.wait();
    return 0;
  }
  return run_elected(flags, options, stop_signals);
}
