// gradsyncd: the per-node daemon. See daemon.h and docs/operations.md.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/call_auth.h"
#include "common/log.h"
#include "common/socket_path.h"
#include "collectives/topology.h"
#include "daemon/daemon.h"
#include "daemon/ring_count.h"

namespace {

void usage(FILE* out) {
  std::fprintf(out,
               "usage: gradsyncd [options]\n"
               "  --coordinator HOST:PORT   coordinator address (default 127.0.0.1:29500, or $GRADSYNC_COORDINATOR);\n"
               "                            several, comma-separated, for coordinators elected through etcd\n"
               "  --socket PATH             trainer socket (default $GRADSYNC_DAEMON, else\n"
               "                            /run/gradsync/gradsyncd.sock as root or where writable,\n"
               "                            else $XDG_RUNTIME_DIR/gradsync/, else /tmp/gradsync-UID/)\n"
               "  --node-name NAME          name of this node (default: hostname)\n"
               "  --data-listen HOST        proxy listen address (default :: and 0.0.0.0)\n"
               "  --ifname NAME             advertise this interface's address ($GRADSYNC_SOCKET_IFNAME)\n"
               "  --data-port N             proxy port (default 0: any free port)\n"
               "  --data-host HOST          address peers use to reach the proxy (default: derived)\n"
               "  --slots N                 slots per channel (default 8)\n"
               "  --slot-bytes N            bytes per slot (default 1048576)\n"
               "  --rings N                 parallel rings per job, 1..16 ($GRADSYNC_NRINGS; default: the cpus / 2,\n"
               "                            at most 8 with the default slots, 1 on 2 cpus; logged at start)\n"
               "  --transport T             auto|tcp|verbs between nodes ($GRADSYNC_TRANSPORT; default auto)\n"
               "  --proxy-tcp               over TCP, pump the channels in this daemon instead of handing\n"
               "                            the connected sockets to the ranks ($GRADSYNC_PROXY_TCP=1)\n"
               "  --ib-hca NAME             RDMA device for verbs channels ($GRADSYNC_IB_HCA; default the first)\n"
               "  --ib-port N               its port (default 1)\n"
               "  --gid-index N             RoCE GID index ($GRADSYNC_IB_GID_INDEX; default: IPv4-mapped v2)\n"
               "  --max-connections N       connections served at once per listener (default 512,\n"
               "                            $GRADSYNC_MAX_CONNECTIONS); more are closed and logged\n"
               "  --ready-file PATH         written with the proxy endpoint once serving\n"
               "  --topo-file PATH          declare this node's GPUs, links and NICs ($GRADSYNC_TOPO_FILE;\n"
               "                            tests: default discovered through NVML, CUDA and sysfs)\n"
               "  --trace-entries N         flight recorder: the last N collectives per rank (default 2000,\n"
               "                            $GRADSYNC_TRACE_ENTRIES; 0: none)\n"
               "  --log-dir DIR             where flight recorder dumps go ($GRADSYNC_LOG_DIR, else systemd's\n"
               "                            $LOGS_DIRECTORY, else the trainer socket's directory)\n"
               "  --metrics-listen HOST:PORT  serve Prometheus /metrics there (default off; port 0: any free\n"
               "                            port, logged)\n"
               "  --log-level LEVEL         trace|debug|info|warn|error (default info)\n"
               "TLS to the coordinator (plaintext is refused off loopback unless --insecure):\n%s"
               "Credentials (--cluster-secret-file, or $GRADSYNC_CLUSTER_SECRET; not with mTLS):\n%s",
               gradsync::TlsOptions::usage(), gradsync::AuthOptions::usage());
}

}  // namespace

int main(int argc, char** argv) {
  gradsync::DaemonConfig cfg;
  gradsync::AuthOptions auth;
  cfg.socket_path = gradsync::server_daemon_socket();  // --socket overrides (common/socket_path.h)
  if (const char* c = std::getenv("GRADSYNC_COORDINATOR"); c && *c) cfg.coordinator = c;
  if (const char* i = std::getenv("GRADSYNC_SOCKET_IFNAME"); i && *i) cfg.ifname = i;
  if (const char* t = std::getenv("GRADSYNC_TRANSPORT"); t && *t) cfg.transport = t;
  if (const char* p = std::getenv("GRADSYNC_PROXY_TCP"); p && *p && std::string(p) != "0") cfg.rank_sockets = false;
  if (const char* h = std::getenv("GRADSYNC_IB_HCA"); h && *h) cfg.verbs_device = h;
  if (const char* t = std::getenv("GRADSYNC_TOPO_FILE"); t && *t) cfg.topo_file = t;
  if (const char* g = std::getenv("GRADSYNC_IB_GID_INDEX"); g && *g) cfg.gid_index = std::clamp(std::atoi(g), -1, 255);
  if (const char* b = std::getenv("GRADSYNC_SLOT_BYTES"); b && *b) cfg.slot_bytes = static_cast<uint32_t>(std::clamp(std::atol(b), 4096L, 256L << 20));
  if (const char* n = std::getenv("GRADSYNC_SLOTS"); n && *n) cfg.slots = static_cast<uint32_t>(std::clamp(std::atoi(n), 2, int(gradsync::kMaxSlots)));
  if (const char* r = std::getenv("GRADSYNC_NRINGS"); r && *r) {
    auto rings = gradsync::parse_ring_count(r, "GRADSYNC_NRINGS");
    if (!rings.ok()) {
      std::fprintf(stderr, "gradsyncd: %s\n", rings.status().message().c_str());
      return 2;
    }
    cfg.rings = *rings;
  }
  if (const char* t = std::getenv("GRADSYNC_TRACE_ENTRIES"); t && *t) {
    cfg.recorder_entries = static_cast<uint32_t>(std::clamp(std::atol(t), 0L, long(gradsync::kMaxRecorderEntries)));
  }
  if (const char* d = std::getenv("LOGS_DIRECTORY"); d && *d) cfg.log_dir = std::string(d).substr(0, std::string(d).find(':'));
  if (const char* d = std::getenv("GRADSYNC_LOG_DIR"); d && *d) cfg.log_dir = d;
  if (const char* m = std::getenv("GRADSYNC_MAX_CONNECTIONS"); m && *m) cfg.max_connections = static_cast<uint32_t>(std::clamp(std::atol(m), 4L, 65536L));
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gradsyncd: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    auto number = [&](long lo, long hi) -> long {
      std::string v = value();
      char* end = nullptr;
      long x = std::strtol(v.c_str(), &end, 10);
      if (!end || *end != '\0' || x < lo || x > hi) {
        std::fprintf(stderr, "gradsyncd: %s expects a number in [%ld, %ld], got '%s'\n", a.c_str(), lo, hi, v.c_str());
        std::exit(2);
      }
      return x;
    };
    std::string tls_error;
    if (cfg.tls.take_flag(argc, argv, &i, &tls_error) || auth.take_flag(argc, argv, &i, &tls_error)) {
      if (!tls_error.empty()) {
        std::fprintf(stderr, "gradsyncd: %s\n", tls_error.c_str());
        return 2;
      }
      continue;
    }
    if (a == "--coordinator") cfg.coordinator = value();
    else if (a == "--socket") cfg.socket_path = value();
    else if (a == "--node-name") cfg.node_name = value();
    else if (a == "--data-listen") cfg.data_listen = value();
    else if (a == "--data-port") cfg.data_port = static_cast<uint16_t>(number(0, 65535));
    else if (a == "--data-host") cfg.data_host = value();
    else if (a == "--ifname") cfg.ifname = value();
    else if (a == "--transport") cfg.transport = value();
    else if (a == "--proxy-tcp") cfg.rank_sockets = false;
    else if (a == "--ib-hca") cfg.verbs_device = value();
    else if (a == "--ib-port") cfg.verbs_port = static_cast<uint8_t>(number(1, 255));
    else if (a == "--gid-index") cfg.gid_index = static_cast<int>(number(-1, 255));
    else if (a == "--slots") cfg.slots = static_cast<uint32_t>(number(2, gradsync::kMaxSlots));
    else if (a == "--slot-bytes") cfg.slot_bytes = static_cast<uint32_t>(number(4096, 256 << 20));
    else if (a == "--rings") {
      auto rings = gradsync::parse_ring_count(value(), "--rings");
      if (!rings.ok()) {
        std::fprintf(stderr, "gradsyncd: %s\n", rings.status().message().c_str());
        return 2;
      }
      cfg.rings = *rings;
    }
    else if (a == "--ready-file") cfg.ready_file = value();
    else if (a == "--topo-file") cfg.topo_file = value();
    else if (a == "--max-connections") cfg.max_connections = static_cast<uint32_t>(number(4, 65536));
    else if (a == "--trace-entries") cfg.recorder_entries = static_cast<uint32_t>(number(0, gradsync::kMaxRecorderEntries));
    else if (a == "--log-dir") cfg.log_dir = value();
    else if (a == "--metrics-listen") cfg.metrics_listen = value();
    else if (a == "--log-level") gradsync::log::set_level(value());
    else if (a == "--help" || a == "-h") { usage(stdout); return 0; }
    else {
      std::fprintf(stderr, "gradsyncd: unknown option %s\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  cfg.tls.add_env();
  if (auto secret = auth.cluster_secret(); secret.ok()) {
    cfg.cluster_secret = *secret;
  } else {
    std::fprintf(stderr, "gradsyncd: %s\n", secret.status().message().c_str());
    return 2;
  }
  if (cfg.slot_bytes % 64 != 0) {
    std::fprintf(stderr, "gradsyncd: --slot-bytes must be a multiple of 64\n");
    return 2;
  }
  // Signals are taken synchronously by this thread, so shutdown runs in normal context.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto log = gradsync::log::get("daemon");
  gradsync::Daemon daemon(cfg);
  // Registration may retry for a while (an unreachable coordinator): a signal meanwhile ends
  // the process at once instead of waiting for start() to give up.
  std::atomic<bool> starting{true};
  std::thread early_signal([&] {
    const timespec slice{0, 100'000'000};  // 100 ms: how late a signal during start-up is seen
    while (starting.load()) {
      if (sigtimedwait(&set, nullptr, &slice) > 0) {
        log->warn("signal during start-up: exiting");
        std::_Exit(1);
      }
    }
  });
  gradsync::Status s = daemon.start();
  starting.store(false);
  early_signal.join();
  if (!s.ok()) {
    log->critical("cannot start: {}", s.to_string());
    return 1;
  }
  int sig = 0;
  sigwait(&set, &sig);
  log->info("signal {}: shutting down", strsignal(sig));
  daemon.stop();
  std::fflush(nullptr);
  // Trainer connection threads are detached; leave without running destructors under them.
  std::_Exit(0);
}
