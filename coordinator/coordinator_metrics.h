// The coordinator's /metrics (Prometheus text 0.0.4): nodes, jobs by state, each job's
// generation, lease expiries and how late heartbeats are read, join latency, and RPC counts and errors by method and code.
// A small hook for the service: it counts what the handlers tell it (join latency) and what
// a gRPC server interceptor sees (every RPC's method and status); rendering reads the table
// through the service, under the service's lock.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "coordinator.pb.h"

namespace gradsync::coordinator {

// The event streams' method: the interceptor leaves it out, the service counts it.
inline constexpr const char* kWatchEventsMethod = "/gradsync.v1.Coordinator/WatchEvents";

class CoordinatorMetrics {
 public:
  // One finished RPC (the interceptor, or the service for kWatchEventsMethod); method
  // "/gradsync.v1.Coordinator/JoinJob".
  void rpc(const std::string& method, grpc::StatusCode code);
  // A JoinJob call from arrival to its answer, successful or not.
  void join(double seconds, bool ok);

  // What the lease table tells (coordinator/leases.h), passed in by the service.
  struct LeaseFigures {
    uint64_t expired = 0;        // nodes lost to an expired lease
    double behind_s = 0;         // how late the coordinator reads heartbeats now
    double extended_s = 0;       // added to every lease for the coordinator's own delays, in all
  };
  // The text; the table's part is passed in by the service.
  std::string render(size_t nodes, const LeaseFigures& leases, const std::vector<v1::JobSummary>& jobs) const;

  // Installs the interceptor on a server being built.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors();

 private:
  static constexpr int kJoinBuckets = 10;  // seconds up to 0.01 .. 300 (9 bounds), then more
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, uint64_t> rpcs_;  // (method, code)
  uint64_t join_counts_[2][kJoinBuckets] = {};                      // [ok][bucket]
  double join_sum_[2] = {};
};

}  // namespace gradsync::coordinator
