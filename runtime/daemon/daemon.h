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

#include "daemon/coordinator_link.h"
#include "daemon/local_job.h"
#include "topology/node_info.h"

namespace gradsync {

struct DaemonConfig {
  std::string coordinator = "127.0.0.1:29500";
  std::string socket_path = "/run/gradsync/gradsyncd.sock";
  std::string node_name;         // default: hostname
  std::string data_listen;       // proxy listen host; default "::" (dual stack), else 0.0.0.0
  std::string ifname;            // interface whose address peers use (GRADSYNC_SOCKET_IFNAME)
  uint16_t data_port = 0;        // 0: any free port
  std::string data_host;         // advertised to peers; default chosen from the coordinator address
  uint32_t slots = kDefaultSlots;
  uint32_t slot_bytes = kDefaultSlotBytes;
  uint32_t rings = 1;            // parallel rings; must match on every node of a job
  std::string ready_file;        // written once serving
  std::string transport;         // auto|tcp|verbs (GRADSYNC_TRANSPORT)
  std::chrono::milliseconds register_timeout{30'000};
};

class Daemon {
 public:
  explicit Daemon(DaemonConfig config);
  ~Daemon();

  Status start();
  // Stops accepting and leaves the coordinator. Connection threads are detached: the process
  // exits right after (see main.cc), and the kernel closes what they held.
  void stop();

  std::string data_endpoint() const { return endpoint_; }

 private:
  Result<std::string> choose_data_host(const topology::NodeInfo& topo, std::string* why) const;
  // Accepts on `listener` until stop(), serving each connection on its own thread.
  void accept_loop(int listener, void (Daemon::*serve)(Fd));
  void serve_trainer(Fd sock);
  void serve_peer(Fd sock);
  void spawn(std::function<void()> fn);

  Result<std::shared_ptr<LocalJob>> join(const v1::JoinRequest& req, uint32_t pid);
  Status connect_job(const std::shared_ptr<LocalJob>& job, std::chrono::milliseconds timeout);
  void member_gone(const std::shared_ptr<LocalJob>& job, uint32_t rank);
  void teardown(const std::shared_ptr<LocalJob>& job);
  // Aborts the job locally (first reason wins) and, if `tell`, at the coordinator too.
  void abort(const std::shared_ptr<LocalJob>& job, int failed_rank, const std::string& reason,
             bool tell);
  void on_event(const v1::Event& ev);
  PumpFailure pump_failure(const std::shared_ptr<LocalJob>& job);

  DaemonConfig cfg_;
  std::string hostname_;
  std::string endpoint_;  // data_host:port
  std::unique_ptr<CoordinatorLink> link_;
  Fd trainer_listener_;
  Fd peer_listener_;
  Fd stop_event_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::shared_ptr<LocalJob>> jobs_;
  bool stopping_ = false;

  std::thread trainer_acceptor_;
  std::thread peer_acceptor_;
};

}  // namespace gradsync
