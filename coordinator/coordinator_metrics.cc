#include "coordinator/coordinator_metrics.h"

#include <string_view>

#include "common/prometheus_text.h"

namespace gradsync::coordinator {
namespace {

const std::vector<double> kJoinBounds = {0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300};

const char* code_text(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    default: return "OTHER";
  }
}

// Counts each RPC once, when its status is sent.
class RpcCounter : public grpc::experimental::Interceptor {
 public:
  RpcCounter(CoordinatorMetrics* metrics, const char* method) : metrics_(metrics), method_(method ? method : "?") {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_->rpc(method_, methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  CoordinatorMetrics* metrics_;
  std::string method_;
};

class RpcCounterFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcCounterFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    // Not the event streams: an interceptor takes part in every message of its call, and a
    // stream carries a heartbeat every lease/3; the service counts their ends itself.
    if (info->method() && std::string_view(info->method()) == kWatchEventsMethod) return nullptr;
    return new RpcCounter(metrics_, info->method());
  }

 private:
  CoordinatorMetrics* metrics_;
};

}  // namespace

void CoordinatorMetrics::rpc(const std::string& method, grpc::StatusCode code) {
  // "/gradsync.v1.Coordinator/JoinJob" -> "JoinJob"
  const std::string name = method.substr(method.rfind('/') + 1);
  std::lock_guard lock(mu_);
  ++rpcs_[{name, code_text(code)}];
}

void CoordinatorMetrics::join(double seconds, bool ok) {
  size_t b = 0;
  while (b < kJoinBounds.size() && seconds > kJoinBounds[b]) ++b;
  std::lock_guard lock(mu_);
  ++join_counts_[ok][b];
  join_sum_[ok] += seconds;
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> CoordinatorMetrics::interceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(std::make_unique<RpcCounterFactory>(this));
  return out;
}

std::string CoordinatorMetrics::render(size_t nodes, const LeaseFigures& leases,
                                       const std::vector<v1::JobSummary>& jobs) const {
  prom::Text t;
  t.family("gradsync_coordinator_nodes", "gauge", "Registered nodes (daemons holding a lease).");
  t.sample("gradsync_coordinator_nodes", {}, double(nodes));
  t.family("gradsync_coordinator_jobs", "gauge", "Jobs by the state of their current generation.");
  std::map<std::string, int> states = {{"forming", 0}, {"active", 0}, {"aborted", 0}, {"finished", 0}};
  for (const auto& j : jobs) ++states[j.state()];
  for (const auto& [state, n] : states) t.sample("gradsync_coordinator_jobs", {{"state", state}}, n);
  t.family("gradsync_coordinator_job_generation", "gauge", "The current generation of each job, with its state.");
  t.family("gradsync_coordinator_job_ranks", "gauge", "Ranks joined and the world size of each job's generation.");
  for (const auto& j : jobs) {
    t.sample("gradsync_coordinator_job_generation", {{"job", j.job_id()}, {"state", j.state()}}, double(j.generation()));
    t.sample("gradsync_coordinator_job_ranks", {{"job", j.job_id()}, {"of", "joined"}}, j.joined());
    t.sample("gradsync_coordinator_job_ranks", {{"job", j.job_id()}, {"of", "world"}}, j.world_size());
  }
  t.family("gradsync_coordinator_lease_expiries_total", "counter", "Nodes lost because their lease expired.");
  t.sample("gradsync_coordinator_lease_expiries_total", {}, double(leases.expired));
  t.family("gradsync_coordinator_read_behind_seconds", "gauge",
           "How much later than their stream's best the coordinator reads heartbeats (median of the last window).");
  t.sample("gradsync_coordinator_read_behind_seconds", {}, leases.behind_s);
  t.family("gradsync_coordinator_lease_extension_seconds_total", "counter",
           "Time added to every lease because the coordinator itself was stalled or behind with its reads.");
  t.sample("gradsync_coordinator_lease_extension_seconds_total", {}, leases.extended_s);
  std::lock_guard lock(mu_);
  t.family("gradsync_coordinator_join_seconds", "histogram",
           "JoinJob calls from arrival to answer (a node waits there for the job's other nodes), by outcome.");
  for (int ok = 1; ok >= 0; --ok) {
    std::vector<uint64_t> counts(std::begin(join_counts_[ok]), std::end(join_counts_[ok]));
    t.histogram("gradsync_coordinator_join_seconds", {{"outcome", ok ? "ok" : "error"}}, kJoinBounds, counts,
                join_sum_[ok]);
  }
  t.family("gradsync_coordinator_rpcs_total", "counter", "RPCs served, by method and status code (errors: not OK).");
  for (const auto& [key, n] : rpcs_) {
    t.sample("gradsync_coordinator_rpcs_total", {{"method", key.first}, {"code", key.second}}, double(n));
  }
  return t.str();
}

}  // namespace gradsync::coordinator
