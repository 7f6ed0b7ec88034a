#include "daemon/daemon_metrics.h"

#include "collectives/collective.h"
#include "common/prometheus_text.h"

namespace gradsync {
namespace {

const char* kSizeLabels[kStatSizes] = {"1KiB", "64KiB", "1MiB", "16MiB", "256MiB", "more"};

std::string path_label(const RankCounters& r) {
  return r.stats.path_known ? to_string(r.stats.path) : "unknown";
}

// The transport of a rank whose collectives stay on the node is the shared memory's.
std::string transport_label(const RankCounters& r) {
  return r.stats.path_known && r.stats.path == RecordPath::kLocal ? "shm" : r.transport;
}

void add_rank(prom::Text& t, const RankCounters& r) {
  const prom::Labels base = {{"job", r.job}, {"generation", std::to_string(r.generation)}, {"rank", std::to_string(r.rank)}};
  for (int k = 0; k < kStatKinds; ++k) {
    uint64_t calls = 0, bytes = 0;
    for (int z = 0; z < kStatSizes; ++z) {
      calls += r.stats.calls[k][z];
      bytes += r.stats.bytes[k][z];
    }
    if (calls == 0) continue;
    prom::Labels l = base;
    l.emplace_back("op", to_string(CollectiveKind(k + 1)));
    l.emplace_back("path", path_label(r));
    l.emplace_back("transport", transport_label(r));
    t.sample("gradsync_collectives_total", l, double(calls));
    t.sample("gradsync_collective_bytes_total", l, double(bytes));
    for (int z = 0; z < kStatSizes; ++z) {
      if (r.stats.calls[k][z] == 0) continue;
      prom::Labels h = l;
      h.emplace_back("size", kSizeLabels[z]);
      std::vector<uint64_t> counts(std::begin(r.stats.latency[k][z]), std::end(r.stats.latency[k][z]));
      t.histogram("gradsync_collective_seconds", h,
                  std::vector<double>(std::begin(kStatLatencyBounds), std::end(kStatLatencyBounds)), counts,
                  double(r.stats.latency_ns[k][z]) / 1e9);
    }
  }
  for (int c = 0; c < kStatCodes; ++c) {
    if (r.stats.failures[c] == 0) continue;
    prom::Labels l = base;
    l.emplace_back("code", code_name(Code(c)));
    t.sample("gradsync_collective_failures_total", l, double(r.stats.failures[c]));
  }
}

}  // namespace

void DaemonMetrics::error(const std::string& kind, const std::string& peer) {
  std::lock_guard lock(mu_);
  ++errors_[{kind, peer}];
}

void DaemonMetrics::retire(std::vector<RankCounters> ranks) {
  if (ranks.empty()) return;
  std::lock_guard lock(mu_);
  retired_.push_back(std::move(ranks));
  while (retired_.size() > kRetainedJobs) retired_.pop_front();
}

std::shared_ptr<std::atomic<uint64_t>> DaemonMetrics::pumped(const std::string& peer_daemon, bool sent) {
  std::lock_guard lock(mu_);
  auto& c = pumped_[{peer_daemon, sent}];
  if (!c) c = std::make_shared<std::atomic<uint64_t>>(0);
  return c;
}

std::string DaemonMetrics::render(const std::vector<RankCounters>& live, const std::vector<JobGauge>& jobs) const {
  prom::Text t;
  t.family("gradsync_collectives_total", "counter",
           "Collectives the application called and completed, by job, rank, op, data path and transport.");
  t.family("gradsync_collective_bytes_total", "counter", "Payload bytes of those collectives (count x element size).");
  t.family("gradsync_collective_seconds", "histogram",
           "Start-to-end time of those collectives, by op, path and payload size bucket (upper bound).");
  t.family("gradsync_collective_failures_total", "counter", "Collectives that failed, by status code.");
  t.family("gradsyncd_errors_total", "counter", "Errors this daemon saw, by kind and the peer concerned.");
  t.family("gradsyncd_jobs", "gauge", "Jobs on this node, by state.");
  t.family("gradsyncd_channels", "gauge", "Channels with an end on this node, by job, kind and transport.");
  t.family("gradsyncd_pumped_bytes_total", "counter",
           "Payload bytes this daemon's proxy moved to (sent) and from (received) each peer daemon.");
  std::lock_guard lock(mu_);
  for (const auto& r : live) add_rank(t, r);
  for (const auto& job : retired_) {
    for (const auto& r : job) add_rank(t, r);
  }
  for (const auto& [key, n] : errors_) t.sample("gradsyncd_errors_total", {{"kind", key.first}, {"peer", key.second}}, double(n));
  std::map<std::string, int> states;
  for (const char* s : {"collecting", "joining", "ready", "failed", "aborted"}) states[s] = 0;
  for (const auto& j : jobs) ++states[j.state];
  for (const auto& [state, n] : states) t.sample("gradsyncd_jobs", {{"state", state}}, n);
  for (const auto& j : jobs) {
    if (j.incoming + j.staging == 0) continue;
    t.sample("gradsyncd_channels", {{"job", j.job}, {"kind", "incoming"}, {"transport", j.transport}}, j.incoming);
    t.sample("gradsyncd_channels", {{"job", j.job}, {"kind", "staging"}, {"transport", j.transport}}, j.staging);
  }
  for (const auto& [key, c] : pumped_) {
    t.sample("gradsyncd_pumped_bytes_total", {{"peer_daemon", key.first}, {"direction", key.second ? "sent" : "received"}},
             double(c->load(std::memory_order_relaxed)));
  }
  return t.str();
}

}  // namespace gradsync
