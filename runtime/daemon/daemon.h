// gradsyncd: the node agent (design §1). Serves local trainers on a Unix socket, joins their
// jobs at the coordinator with one call per node, owns the jobs' shared memory, and runs
// the TCP proxy to peer daemons.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/grpc_security.h"
#include "common/log.h"
#include "common/metrics_server.h"
#include "daemon/connection_pool.h"
#include "daemon/coordinator_link.h"
#include "daemon/daemon_metrics.h"
#include "daemon/local_job.h"
#include "topology/node_info.h"

namespace gradsync {
namespace verbs {
struct IbvApi;
}
class VerbsNode;

struct DaemonConfig {
  std::string coordinator = "127.0.0.1:29500";
  std::string socket_path = "/run/gradsync/gradsyncd.sock";
  std::string node_name;         // default: hostname
  std::string data_listen;       // proxy listen host; default 127.0.0.1 when the coordinator is on
                                 // loopback (one machine), else "::" (dual stack), else 0.0.0.0
  std::string ifname;            // interface whose address peers use (GRADSYNC_SOCKET_IFNAME)
  uint16_t data_port = 0;        // 0: any free port
  std::string data_host;         // advertised to peers; default chosen from the coordinator address
  uint32_t slots = kDefaultSlots;
  uint32_t slot_bytes = kDefaultSlotBytes;
  // Parallel rings; 0: chosen at start from the cores (daemon/ring_count.h). Nodes given a
  // count must agree; a job of nodes that chose uses the smallest choice.
  uint32_t rings = 0;
  std::string ready_file;        // written once serving
  // A topology file declaring this node's GPUs, links and NICs (GRADSYNC_TOPO_FILE, tests);
  // empty: discovered (NVML, CUDA, sysfs). Sent to the coordinator at registration.
  std::string topo_file;
  std::string transport;         // auto|tcp|verbs (GRADSYNC_TRANSPORT)
  // Over TCP, hand each rank the connected sockets of its cross-node channels (both nodes
  // must); false: the proxy pumps them (--proxy-tcp, GRADSYNC_PROXY_TCP=1).
  bool rank_sockets = true;
  std::string verbs_device;      // RDMA device to use; default the first (GRADSYNC_IB_HCA)
  uint8_t verbs_port = 1;        // its port
  int gid_index = -1;            // RoCE GID index; -1 picks one (GRADSYNC_IB_GID_INDEX)
  // The verbs function table; null loads libibverbs.so.1. Tests pass verbs::emulated_ibv().
  const verbs::IbvApi* ibv = nullptr;
  std::chrono::milliseconds register_timeout{30'000};
  // Connections served at once on each of the trainer socket and the data port; more are
  // closed at once and logged (--max-connections, GRADSYNC_MAX_CONNECTIONS).
  uint32_t max_connections = 512;
  // Flight recorder entries per rank (--trace-entries, GRADSYNC_TRACE_ENTRIES; 0: none).
  uint32_t recorder_entries = kDefaultRecorderEntries;
  // Where flight recorder dumps go (--log-dir, GRADSYNC_LOG_DIR, systemd's $LOGS_DIRECTORY);
  // empty: the trainer socket's directory.
  std::string log_dir;
  // Serve Prometheus /metrics on HOST:PORT (--metrics-listen); empty: off.
  std::string metrics_listen;
  TlsOptions tls;  // how to reach the coordinator (--tls-ca, --tls-cert, --tls-key, --insecure)
  // What this node proves to the coordinator without mTLS (--cluster-secret-file,
  // $GRADSYNC_CLUSTER_SECRET); empty with mTLS, and for an in-process coordinator that checks none.
  std::string cluster_secret;
};

class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();

  Status start();
  // Stops accepting and leaves the coordinator. Connection threads are left to end with their
  // connections: the process exits right after (see main.cc), and the kernel closes what they
  // held; the destructor waits for them.
  void stop();

  std::string data_endpoint() const { return endpoint_; }
  // "tcp" or "verbs": what this node offers its peers for cross-node channels.
  const std::string& transport() const { return transport_; }

 private:
  Result<std::string> choose_data_host(const topology::NodeInfo& topo, std::string* why) const;
  // Accepts on `listener` until stop(), serving the connections on `pool`'s threads (at most
  // cfg_.max_connections); over that, refuses and warns through `cap_log`. `what` names the
  // listener in logs.
  void accept_loop(int listener, ConnectionPool& pool, log::RateLimit& cap_log, const char* what);
  void serve_trainer(Fd sock);
  void serve_peer(Fd sock);
  // Warnings a stranger can trigger at will: at most one a second per kind.
  void warn_limited(log::RateLimit& limit, const std::string& message);

  Result<std::shared_ptr<LocalJob>> join(const v1::JoinRequest& req, uint32_t pid);
  Status connect_job(const std::shared_ptr<LocalJob>& job, std::chrono::milliseconds timeout);
  Status await_rank_sockets(const std::shared_ptr<LocalJob>& job);
  void member_gone(const std::shared_ptr<LocalJob>& job, uint32_t rank);
  void teardown(const std::shared_ptr<LocalJob>& job);
  // Aborts the job locally (first reason wins) and, if `tell`, at the coordinator too.
  void abort(const std::shared_ptr<LocalJob>& job, int failed_rank, const std::string& reason,
             bool tell);
  void on_event(const v1::Event& ev);
  // The coordinator forgot this node (CoordinatorLink::set_on_forgotten) for `cause`: it has
  // aborted the node's running jobs, or lost them in a restart, so their local ranks are
  // aborted here too.
  void forgotten(const std::string& node_id, const std::string& cause);
  // No coordinator has been reachable for `outage`, longer than the lease
  // (CoordinatorLink::set_on_unreachable). A coordinator that is down or changing leaders
  // leaves the jobs running (their data path needs none); a node cut off from the network must
  // end its ranks, which otherwise wait for their op timeout. Told apart by the peer daemons of
  // the running jobs: a job one of whose peer daemons does not answer either is aborted here.
  void coordinator_unreachable(std::chrono::milliseconds outage, const std::string& address, const std::string& why);
  // Reads the job's local flight recorders and writes them to the log directory; returns the
  // path ("" when there was nothing to write). Takes mu_.
  std::string dump_traces(const std::shared_ptr<LocalJob>& job, const std::string& why);
  // Answers the coordinator's TRACE_REQUESTED event.
  void report_traces(const v1::Event& ev);
  std::string log_dir() const;
  // Aborts the job when one of its pumps to or from `peer_daemon` fails.
  PumpFailure pump_failure(const std::shared_ptr<LocalJob>& job, const std::string& peer_daemon);
  // The counters of the job's local ranks (from their recorder regions); call under mu_.
  std::vector<RankCounters> rank_counters(const LocalJob& job) const;
  std::string render_metrics();  // /metrics; takes mu_

  DaemonConfig cfg_;
  std::string hostname_;
  std::string endpoint_;  // data_host:port
  std::string data_host_;  // the host part of endpoint_ (for the ranks' own listeners)
  std::string transport_ = "tcp";
  std::string transport_why_;
  bool rings_chosen_ = false;  // cfg_.rings came from default_ring_count
  std::shared_ptr<VerbsNode> verbs_;  // set when transport_ is "verbs"
  // Per GPU of the node, its rail's RDMA device or "" (topology/rail_devices.h); with verbs_.
  std::vector<std::string> rail_devices_;
  std::unique_ptr<CoordinatorLink> link_;
  Fd trainer_listener_;
  Fd peer_listener_;
  Fd stop_event_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::shared_ptr<LocalJob>> jobs_;
  bool stopping_ = false;
  log::RateLimit trainer_cap_log_, peer_cap_log_, trainer_log_, peer_log_;

  DaemonMetrics metrics_;
  std::unique_ptr<MetricsServer> metrics_server_;

  // Connection threads of the trainer socket and of the data port (cfg_.max_connections each).
  ConnectionPool trainer_pool_;
  ConnectionPool peer_pool_;
  std::thread trainer_acceptor_;
  std::thread peer_acceptor_;
};

}  // namespace gradsync
