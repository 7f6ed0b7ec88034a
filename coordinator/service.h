// The coordinator's gRPC server: the gradsync.v1.Coordinator service over one JobTable.
//
// Thread model: gRPC's callback API for the unary calls, no thread per call. One mutex guards
// the table, the per-node event queues and the pending joins; heartbeats take only the lease
// table's own mutex (coordinator/leases.h), so they never queue behind a join or a peer table.
// A pending JoinJob is a reactor finished when its generation completes or fails (or withdrawn
// when the call is cancelled). A node's event stream (WatchEvents) is one bidirectional call on
// gRPC's asynchronous API, spread over up to kStreamQueues completion queues with a thread
// each, taken into use as the streams grow (service_internal.h says why): it writes when an
// event is queued and reads the node's heartbeats, one small message each lease/3 on the open
// stream, authorised once when the stream is named (the unary Heartbeat remains for clients
// without a stream). One ticker expires leases (a heap) and join deadlines every `tick`, and
// wakes nothing else, so an idle node costs a message read every lease/3 and nothing more.
// Nothing busy-waits.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/grpc_security.h"
#include "coordinator/authz.h"
#include "coordinator/job_table.h"
#include "coordinator/store.h"
#include "gradsync/status.h"

namespace grpc {
class Server;
class ServerBuilder;
}

namespace gradsync {
class MetricsServer;
}

namespace gradsync::coordinator {

struct CoordinatorOptions {
  Millis lease{5000};                  // a node with no heartbeat for this long is lost
  Millis default_join_timeout{60000};  // for JoinJob requests with timeout_ms = 0
  Millis tick{100};                    // lease/deadline check period; bounds detection delay
  // Event streams per completion queue before the next of the 8 is taken into use
  // (service_internal.h, kStreamQueues); tests lower it to use several with a few nodes.
  size_t streams_per_queue = 2048;
  TlsOptions tls;                      // plaintext only on loopback or with tls.insecure
  // Who may call what (authz.h); with tls.require_client_cert a verified certificate is a
  // node's credential.
  AuthzOptions authz;
  std::string metrics_listen;          // Prometheus /metrics on HOST:PORT; empty: off
  // Where nodes and jobs are kept across restarts (coordinator/store.h): the coordinator
  // loads its records at start() and writes every change. Null: in memory only (standalone).
  std::shared_ptr<Store> store;
};

// The HTTP/2 keepalive policy of a coordinator's server, the leader's and a standby's alike:
// its own pings find half-open connections, and gradsyncd's (every second, to find a
// partition: daemon/coordinator_link.h) are admitted.
void set_keepalive_policy(grpc::ServerBuilder& builder);

class CoordinatorService;  // the gRPC handlers, in service_internal.h

class CoordinatorServer {
 public:
  explicit CoordinatorServer(CoordinatorOptions options = {});
  ~CoordinatorServer();  // shutdown() + wait()
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // Binds `listen_addr` ("HOST:PORT"; port 0 picks a free port) and starts serving.
  Status start(const std::string& listen_addr);
  // The bound port; 0 before a successful start().
  int port() const { return port_; }
  // The /metrics port (--metrics-listen), 0 when off.
  int metrics_port() const;
  // Ends blocked calls (UNAVAILABLE), stops the server and the ticker. Idempotent; any thread.
  void shutdown();
  // Blocks until the server has shut down.
  void wait();
  // With a store: waits until every change so far is written to it (false after `timeout`).
  bool flush_store(Millis timeout);

 private:
  CoordinatorOptions options_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsServer> metrics_;
  int port_ = 0;
  std::mutex mu_;  // guards the start/shutdown sequence
  bool shut_down_ = false;
};

}  // namespace gradsync::coordinator
